/* y = x · wᵀ for a few rows of x (decode steps), float32, over a plain row-major weight [N, K].
 *
 * Why this exists: with 1-16 rows the product is bound by reading the weight once, and oneDNN's
 * packed GEMM reads a 113 MB LM head at 8-14 GB/s on 2 AVX2 cores, where the host streams 20 GB/s.
 * Here each thread streams its own contiguous share of weight rows, once: a tile of NR rows is used
 * by all rows of x while it sits in L1 (2 x rows x NR weight rows of 8-lane accumulators). The tiles
 * follow each other in memory, so the hardware prefetcher keeps up (software prefetching one to four
 * tiles ahead measured no better).
 *
 * x [M, K] rows x_stride floats apart; w [N, K] rows w_stride floats apart; bias [N] or NULL;
 * y [M, N] rows y_stride floats apart. Threads split N.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

enum { NR = 6 };  /* weight rows per tile: 2 x rows x 6 = 12 accumulators, + 2 x + 1 w of 16 registers */

#if USE_AVX2
/* y[m][n0..n0+NR) for rows m and, when `two`, m+1 of x, over K (a multiple of 8). A single row is
 * computed twice rather than given a loop of its own: the weight stream, not the FMAs, is the cost. */
static inline void tile_2x6(const float *x0, const float *x1, const float *w, int64_t w_stride, int K, int two,
                            float out[2][NR]) {
    __m256 a[2][NR];
    for (int r = 0; r < 2; r++)
        for (int n = 0; n < NR; n++) a[r][n] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        const __m256 xa = _mm256_loadu_ps(x0 + k);
        const __m256 xb = two ? _mm256_loadu_ps(x1 + k) : xa;
        for (int n = 0; n < NR; n++) {
            const __m256 wv = _mm256_loadu_ps(w + n * w_stride + k);
            a[0][n] = _mm256_fmadd_ps(xa, wv, a[0][n]);
            a[1][n] = _mm256_fmadd_ps(xb, wv, a[1][n]);
        }
    }
    for (int n = 0; n < NR; n++) {
        out[0][n] = hsum8(a[0][n]);
        out[1][n] = hsum8(a[1][n]);
    }
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
            for (int m = 0; m < M; m += 2) {
                const int two = m + 1 < M;
                float out[2][NR];
                tile_2x6(x + (int64_t)m * x_stride, x + (int64_t)(m + two) * x_stride, wt, w_stride, K, two, out);
                for (int r = 0; r <= two; r++)
                    for (int j = 0; j < NR; j++)
                        y[(int64_t)(m + r) * y_stride + n + j] = out[r][j] + (bias ? bias[n + j] : 0.0f);
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
