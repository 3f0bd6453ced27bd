/* y = x · wᵀ (+ bias) (+ residual) for the few rows of a decode step, float32, over a weight packed in panels.
 *
 * Why this exists: with 1-16 rows the product is bound by reading the weight once, and oneDNN's
 * packed GEMM reads it well below the host's streaming rate. A plain row-major weight does not stream
 * well either: a kernel that walks a tile of weight rows along K reads a few short streams at once
 * (a 576-float row is 36 cache lines), too short for the hardware prefetcher to train on: well under
 * half the rate of a plain sum over the same bytes.
 *
 * So the weight is repacked once, at load, into panels of PANEL output columns: panel p holds columns
 * [p * PANEL, (p + 1) * PANEL) as K consecutive runs of PANEL floats ([panels][K][PANEL], the last panel
 * zero-padded). One panel is then one sequential stream, and the product is an outer-product kernel:
 * for each k, PANEL weights times the broadcast x[m][k] of each of up to PANEL_MB rows, accumulated in
 * registers (no horizontal sums). That is about twice the row-major kernel's speed at 1-8 rows; on
 * AVX-512 it leads oneDNN's packed GEMM up to 512 rows and is level from 768 (hence the row limit), and
 * the AVX2 build (3-row tile, against oneDNN held to AVX2) leads it only up to 64 rows, where it stops.
 * Step profiles: bench/results/profile_*.md.
 *
 * Threads split the panels into contiguous shares, so that each streams one range of the weight. More
 * rows than PANEL_MB go in groups over the same panel, which the first group has brought into L2.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"
#include "panel_kernel.h"

#ifndef PANEL_GEMM_MAX_ROWS  /* -D on the compile line: for measuring where the crossover lies */
#if PANEL_MB > 3
#define PANEL_GEMM_MAX_ROWS 512
#else
#define PANEL_GEMM_MAX_ROWS 64
#endif
#endif

int kvpilot_panel_width(void) { return PANEL; }

/* The most rows for which this build's kernel is the better choice (more go to the library GEMM). */
int kvpilot_panel_gemm_max_rows(void) { return PANEL_GEMM_MAX_ROWS; }

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

/* x [M, K] rows xs floats apart; wp from kvpilot_pack_panels_f32 of a [N, K] weight; bias [N] or NULL;
 * res [M, N] rows rs floats apart, added to the product (a residual), or NULL; y [M, N] rows ys floats apart. */
void kvpilot_panel_gemm_f32(const float *x, int64_t xs, const float *wp, const float *bias, const float *res,
                            int64_t rs, float *y, int64_t ys, int M, int N, int K, int num_threads) {
    const int panels = (N + PANEL - 1) / PANEL;
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
        if (lo < hi) panel_gemm_share(x, xs, wp, bias, res, rs, y, ys, M, N, K, lo, hi);
    }
#else
    (void)num_threads;
    panel_gemm_share(x, xs, wp, bias, res, rs, y, ys, M, N, K, 0, panels);
#endif
}
