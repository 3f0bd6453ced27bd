/* y = x · wᵀ for a few rows of x (decode steps), float32, over a plain row-major weight [N, K].
 *
 * Why this exists: with 1-16 rows the product is bound by reading the weight once, and oneDNN's
 * packed GEMM reads a 113 MB LM head at 8-14 GB/s on 2 AVX2 cores, where the host streams 20 GB/s.
 * Here each thread streams its own contiguous share of weight rows, once: a tile of NR rows is used
 * by all rows of x while it sits in L1 (2 x rows x NR weight rows of 8-lane accumulators), and the
 * tile AHEAD tiles on is prefetched spread over the current one (14% more bandwidth at 1 row than
 * the hardware prefetcher alone; prefetching it in one burst measured no better than none). Measured
 * over 30 layers' weights: 15 GB/s at 1 row, and each further row costs about what its FMAs do at
 * the host's peak, so from ~16 rows oneDNN's packed GEMM is as fast.
 *
 * x [M, K] rows x_stride floats apart; w [N, K] rows w_stride floats apart; bias [N] or NULL;
 * y [M, N] rows y_stride floats apart. Threads split N.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

enum {
    NR = 6,       /* weight rows per tile: 2 x rows x 6 = 12 accumulators, + 2 x + 1 w of 16 registers */
    MAX_ROWS = 16, /* x rows one pass over the weight serves (more are taken in groups of 16) */
    KC = 64,      /* with several pairs of x rows, K is walked in chunks of this many floats */
    AHEAD = 2,    /* tiles ahead of the current one whose rows are prefetched */
};

#if USE_AVX2
/* y[0..mc)[n0..n0+NR) for mc <= MAX_ROWS rows of x, over K (a multiple of 8).
 *
 * The rows go in pairs (an odd last row is computed twice rather than given a loop of its own). With
 * one pair the tile's weight rows are streamed through registers once. With more, K is walked in
 * chunks so that each chunk of the tile, fetched from memory by the first pair, is reused from L1 by
 * the others straight away: memory and arithmetic overlap instead of one full pass fetching and the
 * others computing. `ahead`, when set, is the tile AHEAD tiles on, fetched spread over this one. */
static inline void tile_rows(const float *x, int64_t x_stride, int mc, const float *w, int64_t w_stride, int K,
                             float out[MAX_ROWS][NR], const float *ahead) {
    const int pairs = (mc + 1) / 2;
    const int kc = pairs == 1 ? K : KC;
    __m256 acc[MAX_ROWS / 2][2][NR];
    for (int p = 0; p < pairs; p++)
        for (int r = 0; r < 2; r++)
            for (int n = 0; n < NR; n++) acc[p][r][n] = _mm256_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += kc) {
        const int k1 = k0 + kc < K ? k0 + kc : K;
        for (int p = 0; p < pairs; p++) {
            const float *x0 = x + (int64_t)(2 * p) * x_stride;
            const float *x1 = 2 * p + 1 < mc ? x0 + x_stride : x0;
            __m256 a[2][NR];
            for (int r = 0; r < 2; r++)
                for (int n = 0; n < NR; n++) a[r][n] = acc[p][r][n];
            for (int k = k0; k < k1; k += 8) {
                if (ahead && p == 0) {  /* 6 rows x 8 floats of this tile ~ 3 lines of the one ahead */
                    const char *q = (const char *)(ahead + (int64_t)NR * k);
                    __builtin_prefetch(q, 0, 3), __builtin_prefetch(q + 64, 0, 3), __builtin_prefetch(q + 128, 0, 3);
                }
                const __m256 xa = _mm256_loadu_ps(x0 + k);
                const __m256 xb = _mm256_loadu_ps(x1 + k);
                for (int n = 0; n < NR; n++) {
                    const __m256 wv = _mm256_loadu_ps(w + n * w_stride + k);
                    a[0][n] = _mm256_fmadd_ps(xa, wv, a[0][n]);
                    a[1][n] = _mm256_fmadd_ps(xb, wv, a[1][n]);
                }
            }
            for (int r = 0; r < 2; r++)
                for (int n = 0; n < NR; n++) acc[p][r][n] = a[r][n];
        }
    }
    for (int m = 0; m < mc; m++)
        for (int n = 0; n < NR; n++) out[m][n] = hsum8(acc[m / 2][m % 2][n]);
}
#endif

static inline float dot(const float *a, const float *b, int K) {
    float s = 0.0f;
    for (int k = 0; k < K; k++) s += a[k] * b[k];
    return s;
}

/* Weight rows [n_lo, n_hi) against every row of x. */
static void rows_share(const float *x, int64_t x_stride, const float *w, int64_t w_stride, const float *bias,
                       float *y, int64_t y_stride, int M, int n_lo, int n_hi, int K) {
    int n = n_lo;
#if USE_AVX2
    if (K % 8 == 0) {
        for (; n + NR <= n_hi; n += NR) {
            const float *wt = w + (int64_t)n * w_stride;
            /* the tiles of a share follow each other in memory when the weight rows are packed tight */
            const float *ahead = w_stride == K && n + (AHEAD + 1) * NR <= n_hi ? wt + (int64_t)AHEAD * NR * K : 0;
            for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
                const int mc = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
                float out[MAX_ROWS][NR];
                tile_rows(x + (int64_t)m0 * x_stride, x_stride, mc, wt, w_stride, K, out, m0 == 0 ? ahead : 0);
                for (int m = 0; m < mc; m++)
                    for (int j = 0; j < NR; j++)
                        y[(int64_t)(m0 + m) * y_stride + n + j] = out[m][j] + (bias ? bias[n + j] : 0.0f);
            }
        }
    }
#endif
    for (; n < n_hi; n++)
        for (int m = 0; m < M; m++)
            y[(int64_t)m * y_stride + n] =
                dot(x + (int64_t)m * x_stride, w + (int64_t)n * w_stride, K) + (bias ? bias[n] : 0.0f);
}

void kvpilot_small_gemm_f32(const float *x, int64_t x_stride, const float *w, int64_t w_stride, const float *bias,
                            float *y, int64_t y_stride, int M, int N, int K, int num_threads) {
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* contiguous shares of whole tiles, so that each thread streams one range of the weight */
        const int tiles = (N + NR - 1) / NR;
        const int lo = (int)((int64_t)tiles * t / nt) * NR, hi_t = (int)((int64_t)tiles * (t + 1) / nt) * NR;
        const int hi = hi_t < N ? hi_t : N;
        if (lo < hi) rows_share(x, x_stride, w, w_stride, bias, y, y_stride, M, lo, hi, K);
    }
#else
    (void)num_threads;
    rows_share(x, x_stride, w, w_stride, bias, y, y_stride, M, 0, N, K);
#endif
}
