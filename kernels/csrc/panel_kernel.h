/* The register-tiled product the GEMM-shaped kernels share (small_gemm_cpu.c, paged_prefill_cpu.c):
 * up to PANEL_MB rows of x times one panel of PANEL columns, stored K consecutive runs of PANEL floats.
 *
 * For each k, PANEL weights are loaded once and multiplied by the broadcast x[m][k] of every row, all
 * accumulated in registers (no horizontal sums): on AVX-512 12 rows x 2 zmm = 24 of 32 registers, on
 * AVX2 3 rows x 4 ymm = 12 of 16, and a plain loop elsewhere. Include after cpu_simd.h.
 */
#ifndef KVPILOT_PANEL_KERNEL_H
#define KVPILOT_PANEL_KERNEL_H

#include <stdint.h>

#include "cpu_simd.h"

enum { PANEL = 32 };

/* How many k steps ahead the tile loop prefetches its panel: the weights are read once, from memory, and the
 * hardware prefetcher alone left a decode step's GEMMs at 0.7-0.85x of this rate (64 steps: 8 KB ahead;
 * bench/results/moe_cpu_prefetch.json). 0 turns it off (-DPANEL_PREFETCH=0). */
#ifndef PANEL_PREFETCH
#define PANEL_PREFETCH 64
#endif

/* macros, not an enum: the row-count switches below are preprocessed by them */
#if USE_AVX2 && defined(__AVX512F__)
#define PANEL_MB 12
#else
#define PANEL_MB 3
#endif

/* out[m * os + j] = (scale ? out[m * os + j] * scale[m] : 0) + sum_{k < K} x[m * xs + k] * wp[k * PANEL + j]
 * for m < mb <= PANEL_MB and j < PANEL. `mb` is a constant at each call site (see panel_rows_n), so the
 * compiler drops the unused rows' registers and branches. */
#if USE_AVX2 && defined(__AVX512F__)
/* The AVX-512 tile's accumulators: out's rows scaled, or zeros; and their store back */
static inline __attribute__((always_inline)) void panel_acc_start(__m512 (*acc)[2], const int mb, const float *out,
                                                                  int64_t os, const float *scale) {
    for (int m = 0; m < mb; m++) {
        if (scale) {
            const __m512 c = _mm512_set1_ps(scale[m]);
            acc[m][0] = _mm512_mul_ps(_mm512_loadu_ps(out + m * os), c);
            acc[m][1] = _mm512_mul_ps(_mm512_loadu_ps(out + m * os + 16), c);
        } else {
            acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        }
    }
}

static inline __attribute__((always_inline)) void panel_acc_store(__m512 (*acc)[2], const int mb, float *out,
                                                                  int64_t os) {
    for (int m = 0; m < mb; m++) {
        _mm512_storeu_ps(out + m * os, acc[m][0]);
        _mm512_storeu_ps(out + m * os + 16, acc[m][1]);
    }
}

static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t xs, const int mb,
                                                             const float *wp, int K, float *out, int64_t os,
                                                             const float *scale) {
    __m512 acc[PANEL_MB][2];
    panel_acc_start(acc, mb, out, os, scale);
    for (int k = 0; k < K; k++) {
#if PANEL_PREFETCH
        _mm_prefetch((const char *)(wp + (int64_t)(k + PANEL_PREFETCH) * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + (int64_t)(k + PANEL_PREFETCH) * PANEL + 16), _MM_HINT_T0);
#endif
        const __m512 w0 = _mm512_loadu_ps(wp + (int64_t)k * PANEL), w1 = _mm512_loadu_ps(wp + (int64_t)k * PANEL + 16);
        for (int m = 0; m < mb; m++) {
            const __m512 b = _mm512_set1_ps(x[(int64_t)m * xs + k]);
            acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
        }
    }
    panel_acc_store(acc, mb, out, os);
}
#elif USE_AVX2
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t xs, const int mb,
                                                             const float *wp, int K, float *out, int64_t os,
                                                             const float *scale) {
    __m256 acc[PANEL_MB][4];
    for (int m = 0; m < mb; m++) {
        const __m256 c = _mm256_set1_ps(scale ? scale[m] : 0.0f);
        for (int j = 0; j < 4; j++)
            acc[m][j] = scale ? _mm256_mul_ps(_mm256_loadu_ps(out + m * os + 8 * j), c) : _mm256_setzero_ps();
    }
    for (int k = 0; k < K; k++) {
        __m256 b[PANEL_MB];
#if PANEL_PREFETCH
        _mm_prefetch((const char *)(wp + (int64_t)(k + PANEL_PREFETCH) * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + (int64_t)(k + PANEL_PREFETCH) * PANEL + 16), _MM_HINT_T0);
#endif
        for (int m = 0; m < mb; m++) b[m] = _mm256_set1_ps(x[(int64_t)m * xs + k]);
        for (int j = 0; j < 4; j++) {
            const __m256 w = _mm256_loadu_ps(wp + (int64_t)k * PANEL + 8 * j);
            for (int m = 0; m < mb; m++) acc[m][j] = _mm256_fmadd_ps(b[m], w, acc[m][j]);
        }
    }
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + m * os + 8 * j, acc[m][j]);
}
#else
static inline void panel_rows(const float *x, int64_t xs, const int mb, const float *wp, int K, float *out,
                              int64_t os, const float *scale) {
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < PANEL; j++) out[m * os + j] = scale ? out[m * os + j] * scale[m] : 0.0f;
    for (int k = 0; k < K; k++)
        for (int m = 0; m < mb; m++) {
            const float b = x[(int64_t)m * xs + k];
            for (int j = 0; j < PANEL; j++) out[m * os + j] += b * wp[(int64_t)k * PANEL + j];
        }
}
#endif

/* panel_rows for any mb in [1, PANEL_MB]: one specialised copy per row count. */
static inline void panel_rows_n(const float *x, int64_t xs, int mb, const float *wp, int K, float *out, int64_t os,
                                const float *scale) {
    switch (mb) {
#define PANEL_ROWS_CASE(c) case c: panel_rows(x, xs, c, wp, K, out, os, scale); break;
        PANEL_ROWS_CASE(1) PANEL_ROWS_CASE(2) PANEL_ROWS_CASE(3)
#if PANEL_MB > 3
        PANEL_ROWS_CASE(4) PANEL_ROWS_CASE(5) PANEL_ROWS_CASE(6) PANEL_ROWS_CASE(7) PANEL_ROWS_CASE(8)
        PANEL_ROWS_CASE(9) PANEL_ROWS_CASE(10) PANEL_ROWS_CASE(11) PANEL_ROWS_CASE(12)
#endif
#undef PANEL_ROWS_CASE
        default: break;
    }
}


/* y [M, N] (rows ys apart) = x [M, K] (rows xs apart) . W^T (+ bias [N]) (+ res [M, N], rows rs apart) over the
 * columns of panels [p_lo, p_hi) of W's panels wp ([ceil(N / PANEL)][K][PANEL]): one thread's share of a
 * panel GEMM (small_gemm_cpu.c, moe_cpu.c). Rows beyond PANEL_MB go in groups over the same panel, which the
 * first group has brought into L2. */
static inline void panel_gemm_share(const float *x, int64_t xs, const float *wp, const float *bias, const float *res,
                                    int64_t rs, float *y, int64_t ys, int M, int N, int K, int p_lo, int p_hi) {
    float out[PANEL_MB * PANEL];
    for (int p = p_lo; p < p_hi; p++) {
        const float *panel = wp + (int64_t)p * K * PANEL;
        const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
        for (int m0 = 0; m0 < M; m0 += PANEL_MB) {
            const int mb = M - m0 < PANEL_MB ? M - m0 : PANEL_MB;
            panel_rows_n(x + (int64_t)m0 * xs, xs, mb, panel, K, out, PANEL, NULL);
            for (int m = 0; m < mb; m++) {
                float *dst = y + (int64_t)(m0 + m) * ys + n0;
                const float *acc = out + m * PANEL;
                /* the residual is added on the tile while it is in L1; the compiler unswitches the tests */
                const float *r = res ? res + (int64_t)(m0 + m) * rs + n0 : NULL;
                for (int j = 0; j < nc; j++) {
                    float v = acc[j];
                    if (bias) v += bias[n0 + j];
                    if (r) v += r[j];
                    dst[j] = v;
                }
            }
        }
    }
}


#if USE_AVX2 && defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_PANEL_BF16 1
/* panel_rows over bfloat16 pairs, for the dot-product instruction: x2[m * xs2 + k] holds x[m][2k] and
 * x[m][2k+1] (low half first), and the panel is K2 runs of PANEL such pairs of its rows 2k and 2k+1, so one
 * instruction multiplies both pairs exactly and adds them to the float32 accumulator: half the instructions of
 * the float32 FMAs over the same K = 2 * K2. */
static inline __attribute__((always_inline)) void panel_rows_bf16(const uint32_t *x2, int64_t xs2, const int mb,
                                                                  const uint32_t *wp2, int K2, float *out,
                                                                  int64_t os, const float *scale) {
    __m512 acc[PANEL_MB][2];
    panel_acc_start(acc, mb, out, os, scale);
    for (int k = 0; k < K2; k++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp2 + (int64_t)k * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp2 + (int64_t)k * PANEL + 16);
        for (int m = 0; m < mb; m++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)x2[(int64_t)m * xs2 + k]);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, b);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, b);
        }
    }
    panel_acc_store(acc, mb, out, os);
}

static inline void panel_rows_bf16_n(const uint32_t *x2, int64_t xs2, int mb, const uint32_t *wp2, int K2,
                                     float *out, int64_t os, const float *scale) {
    switch (mb) {
#define PANEL_ROWS_CASE(c) case c: panel_rows_bf16(x2, xs2, c, wp2, K2, out, os, scale); break;
        PANEL_ROWS_CASE(1) PANEL_ROWS_CASE(2) PANEL_ROWS_CASE(3) PANEL_ROWS_CASE(4) PANEL_ROWS_CASE(5)
        PANEL_ROWS_CASE(6) PANEL_ROWS_CASE(7) PANEL_ROWS_CASE(8) PANEL_ROWS_CASE(9) PANEL_ROWS_CASE(10)
        PANEL_ROWS_CASE(11) PANEL_ROWS_CASE(12)
#undef PANEL_ROWS_CASE
        default: break;
    }
}
#else
#define HAVE_PANEL_BF16 0
#endif

#endif
