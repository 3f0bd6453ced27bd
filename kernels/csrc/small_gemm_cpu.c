/* y = x · wᵀ (+ bias) for the few rows of a decode step, float32, over a weight packed in panels.
 *
 * Why this exists: with 1-16 rows the product is bound by reading the weight once, and oneDNN's
 * packed GEMM reads it well below the host's streaming rate. A plain row-major weight does not stream
 * well either: a kernel that walks a tile of weight rows along K reads a few short streams at once
 * (a 576-float row is 36 cache lines), too short for the hardware prefetcher to train on. Measured on
 * 2 AVX-512 cores over 30 layers' weights and the LM head (538 MB): 22 GB/s at 1 row and 16 GB/s at 4
 * that way, where a plain sum over the same bytes streams 49 GB/s.
 *
 * So the weight is repacked once, at load, into panels of PANEL output columns: panel p holds columns
 * [p * PANEL, (p + 1) * PANEL) as K consecutive runs of PANEL floats ([panels][K][PANEL], the last panel
 * zero-padded). One panel is then one sequential stream, and the product is an outer-product kernel:
 * for each k, PANEL weights times the broadcast x[m][k] of each of up to MB rows, accumulated in
 * registers (no horizontal sums). Measured the same way: 12-19 ms per pass at 1-8 rows where the
 * row-major kernel took 25-39 ms; on AVX-512, 196-213 GFLOP/s at 64-512 rows over 30 layers' weights,
 * against oneDNN's packed GEMM at 145-198, and level with it from 768 rows (hence the row limit there).
 *
 * Threads split the panels into contiguous shares, so that each streams one range of the weight. More
 * rows than MB go in groups over the same panel, which the first group has brought into L2.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

enum { PANEL = 32 };

/* MB: x rows one pass over a panel serves (macros: the row-count switch below is preprocessed by it) */
#if USE_AVX2 && defined(__AVX512F__)
#define MB 12       /* 12 rows x 2 zmm accumulators = 24 of 32 registers */
#define MAX_ROWS 512
#else
#define MB 3        /* 3 rows x 4 ymm accumulators = 12 of 16 registers */
#define MAX_ROWS 16
#endif

int kvpilot_panel_width(void) { return PANEL; }

/* The most rows for which this build's kernel is the better choice (more go to the library GEMM). */
int kvpilot_panel_gemm_max_rows(void) { return MAX_ROWS; }

/* w [N, K] rows w_stride floats apart -> out [ceil(N / PANEL)][K][PANEL]. */
void kvpilot_pack_panels_f32(const float *w, int64_t w_stride, int N, int K, float *out, int num_threads) {
    const int panels = (N + PANEL - 1) / PANEL;
    (void)num_threads;
#ifdef _OPENMP
    #pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
#endif
    for (int p = 0; p < panels; p++) {
        float *dst = out + (int64_t)p * K * PANEL;
        for (int j = 0; j < PANEL; j++) {
            const int n = p * PANEL + j;
            const float *src = w + (int64_t)n * w_stride;
            for (int k = 0; k < K; k++) dst[(int64_t)k * PANEL + j] = n < N ? src[k] : 0.0f;
        }
    }
}

/* acc[m][0..PANEL) = sum_k x[m][k] * panel[k][0..PANEL) for mb <= MB rows. `mb` is a constant at each
 * call site below, so the compiler drops the unused rows' registers and branches. */
#if USE_AVX2 && defined(__AVX512F__)
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t xs, const int mb,
                                                             const float *wp, int K, float *out) {
    __m512 acc[MB][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const __m512 w0 = _mm512_loadu_ps(wp + (int64_t)k * PANEL), w1 = _mm512_loadu_ps(wp + (int64_t)k * PANEL + 16);
        for (int m = 0; m < mb; m++) {
            const __m512 b = _mm512_set1_ps(x[(int64_t)m * xs + k]);
            acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < mb; m++) {
        _mm512_storeu_ps(out + m * PANEL, acc[m][0]);
        _mm512_storeu_ps(out + m * PANEL + 16, acc[m][1]);
    }
}
#elif USE_AVX2
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t xs, const int mb,
                                                             const float *wp, int K, float *out) {
    __m256 acc[MB][4];
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 b[MB];
        for (int m = 0; m < mb; m++) b[m] = _mm256_set1_ps(x[(int64_t)m * xs + k]);
        for (int j = 0; j < 4; j++) {
            const __m256 w = _mm256_loadu_ps(wp + (int64_t)k * PANEL + 8 * j);
            for (int m = 0; m < mb; m++) acc[m][j] = _mm256_fmadd_ps(b[m], w, acc[m][j]);
        }
    }
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + m * PANEL + 8 * j, acc[m][j]);
}
#else
static inline void panel_rows(const float *x, int64_t xs, const int mb, const float *wp, int K, float *out) {
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < PANEL; j++) out[m * PANEL + j] = 0.0f;
    for (int k = 0; k < K; k++)
        for (int m = 0; m < mb; m++) {
            const float b = x[(int64_t)m * xs + k];
            for (int j = 0; j < PANEL; j++) out[m * PANEL + j] += b * wp[(int64_t)k * PANEL + j];
        }
}
#endif

static void panel_share(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t ys,
                        int M, int N, int K, int p_lo, int p_hi) {
    float out[MB * PANEL];
    for (int p = p_lo; p < p_hi; p++) {
        const float *panel = wp + (int64_t)p * K * PANEL;
        const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            const float *xm = x + (int64_t)m0 * xs;
            switch (mb) {  /* one specialised copy per row count */
#define ROWS(c) case c: panel_rows(xm, xs, c, panel, K, out); break;
                ROWS(1) ROWS(2) ROWS(3)
#if MB > 3
                ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
#undef ROWS
                default: break;
            }
            for (int m = 0; m < mb; m++) {
                float *dst = y + (int64_t)(m0 + m) * ys + n0;
                if (bias) {
                    for (int j = 0; j < nc; j++) dst[j] = out[m * PANEL + j] + bias[n0 + j];
                } else {
                    memcpy(dst, out + m * PANEL, (size_t)nc * sizeof(float));
                }
            }
        }
    }
}

/* x [M, K] rows xs floats apart; wp from kvpilot_pack_panels_f32 of a [N, K] weight; bias [N] or NULL;
 * y [M, N] rows ys floats apart. */
void kvpilot_panel_gemm_f32(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t ys,
                            int M, int N, int K, int num_threads) {
    const int panels = (N + PANEL - 1) / PANEL;
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
        if (lo < hi) panel_share(x, xs, wp, bias, y, ys, M, N, K, lo, hi);
    }
#else
    (void)num_threads;
    panel_share(x, xs, wp, bias, y, ys, M, N, K, 0, panels);
#endif
}
