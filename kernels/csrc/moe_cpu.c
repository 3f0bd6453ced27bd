/* The routed experts of a mixture-of-experts layer in one call: float32, weights packed in panels.
 *
 * Why one call: a decode step's MoE layer is a dozen small operations (the sort of the (token, slot) pairs
 * by expert, the gather of their rows, a GEMM per active expert and projection, the activation, the weighted
 * scatter-add), and through torch each costs more than its arithmetic; the expert GEMMs are bound by reading
 * the weights, which one long stream per thread does best. bench/results/moe_model.json.
 *
 * The layout is small_gemm_cpu.c's: each expert's [N, K] weight as panels of PANEL output columns, K
 * consecutive runs of PANEL floats ([E][ceil(N / PANEL)][K][PANEL]). The gate|up stack is [2I, H] (gate rows,
 * then up rows), the down stack [H, I].
 *
 * Threads split every expert's panels into contiguous shares, so that each streams one range of the weights:
 * (1) the gate|up product of each expert's rows, (2) SiLU(gate) * up over all pairs, (3) the down product,
 * where a thread owns a range of output columns and adds each pair's row, times its routing weight, into the
 * token's output row itself: no reduction between threads. Each token sums its experts in ascending order, as
 * the torch path's scatter-add does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"
#include "moe_gguf_args.h"
#include "panel_kernel.h"
#include "thread_scratch.h"

#define PTR_OF(v) ((void *)(intptr_t)(v))

void kvpilot_silu_mul_f32(const float *gu, int64_t gu_stride, int rows, int inter, float *out, int num_threads);

/* The (token, slot) pairs sorted by expert, a stable counting sort (token order within an expert): expert e's
 * pairs are order[start[e] .. start[e + 1]); next [E] is scratch. */
static void sort_by_expert(const int64_t *ids, int pairs, int E, int *start, int *next, int *order) {
    memset(start, 0, sizeof(int) * (size_t)(E + 1));
    for (int i = 0; i < pairs; i++) start[ids[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(next, start, sizeof(int) * (size_t)E);
    for (int i = 0; i < pairs; i++) order[next[ids[i]]++] = i;
}

/* Rows [lo, hi) of the sorted pairs' inputs gathered: dst row r = x's row of pair order[r]'s token (el bytes an
 * element, H elements a row, x's rows xs elements apart) */
static void gather_rows(char *dst, const char *x, int64_t xs, size_t el, int H, const int *order, int topk, int lo,
                        int hi) {
    for (int r = lo; r < hi; r++)
        memcpy(dst + el * (size_t)r * H, x + el * (size_t)(order[r] / topk) * xs, el * (size_t)H);
}

/* out[token][n] += (act[m] . w2[n] + bias[n]) * weight, for the M sorted pairs `pairs` of one expert and the
 * output columns of panels [p_lo, p_hi) */
static void panels_scatter(const float *act, int64_t as, int M, const int *pairs, const float *weights, int topk,
                           const float *wp, int K, int N, const float *bias, int p_lo, int p_hi, float *out,
                           int64_t os) {
    float tile[PANEL_MB * PANEL];
    for (int p = p_lo; p < p_hi; p++) {
        const float *panel = wp + (int64_t)p * K * PANEL;
        const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
        for (int m0 = 0; m0 < M; m0 += PANEL_MB) {
            const int mb = M - m0 < PANEL_MB ? M - m0 : PANEL_MB;
            panel_rows_n(act + (int64_t)m0 * as, as, mb, panel, K, tile, PANEL, NULL);
            for (int m = 0; m < mb; m++) {
                const int pair = pairs[m0 + m];
                const float w = weights[pair];
                float *dst = out + (int64_t)(pair / topk) * os + n0;
                for (int j = 0; j < nc; j++) dst[j] += (tile[m * PANEL + j] + (bias ? bias[n0 + j] : 0.0f)) * w;
            }
        }
    }
}

/* One MoE layer's routed experts: out [T, H] (rows os floats apart, overwritten) = for each token t, the sum over
 * its slots j of weights[t][j] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)) with e = ids[t][j].
 * x [T, H] rows xs floats apart; ids int64 [T, topk]; weights float32 [T, topk]; w13p the [E] gate|up stacks
 * [2I, H] and w2p the down stacks [H, I] as panels; biases [E, 2I] / [E, H] or NULL.
 * Returns 0; -1 for an expert id outside [0, E) (nothing written); -2 where scratch memory is not at hand. */
int kvpilot_moe_panels_f32(const float *x, int64_t xs, int T, int H, int I, int E, int topk, const int64_t *ids,
                           const float *weights, const float *w13p, const float *w13_bias, const float *w2p,
                           const float *w2_bias, float *out, int64_t os, int num_threads) {
    const int pairs = T * topk, I2 = 2 * I;
    const int p13 = (I2 + PANEL - 1) / PANEL, p2 = (H + PANEL - 1) / PANEL;
    const int64_t w13_size = (int64_t)p13 * H * PANEL, w2_size = (int64_t)p2 * I * PANEL;
    for (int i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] >= E) return -1;
    if (pairs == 0) return 0;
    const size_t ints = (size_t)(2 * E + 1) + (size_t)pairs;
    const size_t bytes = sizeof(float) * (size_t)pairs * (size_t)(H + I2 + I) + sizeof(int) * ints;
    char *mem = (char *)thread_scratch(bytes);
    if (!mem) return -2;
    float *scratch = (float *)mem;
    int *start = (int *)(mem + sizeof(float) * (size_t)pairs * (size_t)(H + I2 + I)), *next = start + E + 1;
    int *order = next + E;
    sort_by_expert(ids, pairs, E, start, next, order);
    float *xg = scratch, *gu = xg + (int64_t)pairs * H, *act = gu + (int64_t)pairs * I2;
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads(num_threads)
#endif
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        const int r_lo = (int)((int64_t)pairs * t / nt), r_hi = (int)((int64_t)pairs * (t + 1) / nt);
        gather_rows((char *)xg, (const char *)x, xs, sizeof(float), H, order, topk, r_lo, r_hi);
#ifdef _OPENMP
        #pragma omp barrier
#endif
        const int a_lo = (int)((int64_t)p13 * t / nt), a_hi = (int)((int64_t)p13 * (t + 1) / nt);
        for (int e = 0; e < E; e++) {
            const int lo = start[e], m = start[e + 1] - lo;
            if (m && a_lo < a_hi) {
                const float *bias = w13_bias ? w13_bias + (int64_t)e * I2 : NULL;
                panel_gemm_share(xg + (int64_t)lo * H, H, w13p + e * w13_size, bias, NULL, 0, gu + (int64_t)lo * I2,
                                 I2, m, I2, H, a_lo, a_hi);
            }
        }
#ifdef _OPENMP
        #pragma omp barrier
#endif
        if (r_lo < r_hi)
            kvpilot_silu_mul_f32(gu + (int64_t)r_lo * I2, I2, r_hi - r_lo, I, act + (int64_t)r_lo * I, 1);
        const int c_lo = (int)((int64_t)p2 * t / nt), c_hi = (int)((int64_t)p2 * (t + 1) / nt);
        const int n_lo = c_lo * PANEL, n_hi = c_hi * PANEL < H ? c_hi * PANEL : H;
        for (int tok = 0; tok < T && n_lo < n_hi; tok++)
            memset(out + (int64_t)tok * os + n_lo, 0, sizeof(float) * (size_t)(n_hi - n_lo));
#ifdef _OPENMP
        #pragma omp barrier
#endif
        for (int e = 0; e < E; e++) {
            const int lo = start[e], m = start[e + 1] - lo;
            if (m && c_lo < c_hi)
                panels_scatter(act + (int64_t)lo * I, I, m, order + lo, weights, topk, w2p + e * w2_size, I, H,
                               w2_bias ? w2_bias + (int64_t)e * H : NULL, c_lo, c_hi, out, os);
        }
    }
    return 0;
}

/* The router's choice per token, as kernels/moe.py's moe_route: logits [T, E] float32 (rows ls apart) to ids
 * int64 [T, k] and weights float32 [T, k]. topk_first 0: softmax over the E experts, the k largest (the lower
 * id first among equals), divided by their sum where renormalize; 1: the k largest logits, softmax over them.
 * Native so that a decode step's layer runs in one call (decode_layers_cpu.c); the Python layer calls it too,
 * so that both take the same bits. */
void kvpilot_moe_route_f32(const float *logits, int64_t ls, int T, int E, int k, int topk_first, int renormalize,
                           int64_t *ids, float *weights) {
    for (int t = 0; t < T; t++) {
        const float *l = logits + (int64_t)t * ls;
        int64_t *id = ids + (int64_t)t * k;
        float *w = weights + (int64_t)t * k;
        float mx = l[0], sum = 0.0f;
        for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        for (int e = 0; e < E; e++) sum += expf(fmaxf(l[e] - mx, -88.0f)); /* finite: -ffast-math */
        for (int j = 0; j < k; j++) { /* selection: k is a handful */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
        }
        if (topk_first) {
            float s = 0.0f;
            for (int j = 0; j < k; j++) s += (w[j] = expf(fmaxf(l[id[j]] - l[id[0]], -88.0f)));
            for (int j = 0; j < k; j++) w[j] /= s;
        } else {
            float s = 0.0f;
            for (int j = 0; j < k; j++) s += (w[j] = expf(fmaxf(l[id[j]] - mx, -88.0f)) / sum);
            if (renormalize)
                for (int j = 0; j < k; j++) w[j] /= s;
        }
    }
}

/* ---------------------------------------------------------------------------------------- GGUF experts */

int kvpilot_gguf_gemm(int qtype, const uint8_t *w, int64_t ws, int N, int K, const void *x, int64_t xs, int M,
                      const void *bias, const void *res, int64_t rs, void *y, int64_t ys, int bf16, int num_threads);

int kvpilot_moe_gguf_args(void) { return MG_ARGS; }

/* [lo, hi) of n rows for thread t of nt, the inner boundaries at multiples of 16 rows (the GEMM's row tiles) */
static void row_share(int n, int t, int nt, int *lo, int *hi) {
    *lo = t == 0 ? 0 : (int)((int64_t)n * t / nt) & ~15;
    *hi = t == nt - 1 ? n : (int)((int64_t)n * (t + 1) / nt) & ~15;
}

/* A MoE layer's routed SiLU experts on their GGUF blocks, as kernels/gguf_moe.py's fused_moe_gguf computes them:
 * per expert with tokens the GGUF GEMM of its rows by its gate, up and down blocks (float32 products and sums,
 * stored in the rows' dtype), SiLU(gate) * up in float32 rounded to the rows' dtype, and each token's weighted
 * sum over its experts in float32 (in ascending expert order), rounded once. x and out are float32 rows, or
 * bfloat16 with MG_BF16; each projection's blocks [E][rows][row bytes] (expert stride _ES, row stride _RS bytes).
 * Threads split each GEMM's output rows. Returns 0; -1 for an expert id outside [0, E); -2 without scratch
 * memory; -3 where the GGUF GEMM refuses a type or shape. */
int kvpilot_moe_gguf_packed(const int64_t *a) {
    const int T = (int)a[MG_T], H = (int)a[MG_H], I = (int)a[MG_I], E = (int)a[MG_E], topk = (int)a[MG_TOPK];
    const int bf16 = (int)a[MG_BF16], pairs = T * topk, I2 = 2 * I;
    const size_t el = bf16 ? 2 : 4;
    const int64_t *ids = PTR_OF(a[MG_IDS]);
    const float *weights = PTR_OF(a[MG_WEIGHTS]);
    const char *x = PTR_OF(a[MG_X]);
    char *out = PTR_OF(a[MG_OUT]);
    const int64_t xs = a[MG_XS], os = a[MG_OS];
    for (int i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] >= E) return -1;
    if (pairs == 0) return 0;
    /* rows in the activations' dtype: gathered x, gate|up, SiLU * up, down; then the float32 sums and the sort */
    const size_t rows_bytes = el * (size_t)pairs * (size_t)(H + I2 + I + H), acc_bytes = 4 * (size_t)T * H;
    char *mem = (char *)thread_scratch(rows_bytes + acc_bytes + sizeof(int) * ((size_t)(2 * E + 1) + (size_t)pairs));
    if (!mem) return -2;
    char *xg = mem, *gu = xg + el * (size_t)pairs * H, *act = gu + el * (size_t)pairs * I2;
    char *y = act + el * (size_t)pairs * I;
    float *acc = (float *)(mem + rows_bytes);
    int *start = (int *)(mem + rows_bytes + acc_bytes), *next = start + E + 1, *order = next + E;
    sort_by_expert(ids, pairs, E, start, next, order);
    int num_threads = (int)a[MG_THREADS], failed = 0;
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads(num_threads) reduction(| : failed)
#endif
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        const int r_lo = (int)((int64_t)pairs * t / nt), r_hi = (int)((int64_t)pairs * (t + 1) / nt);
        gather_rows(xg, x, xs, el, H, order, topk, r_lo, r_hi);
#ifdef _OPENMP
        #pragma omp barrier
#endif
        int lo, hi;
        row_share(I, t, nt, &lo, &hi);
        for (int e = 0; e < E && lo < hi; e++) {
            const int p0 = start[e], m = start[e + 1] - p0;
            if (!m) continue;
            const char *xe = xg + el * (size_t)p0 * H;
            char *ge = gu + el * (size_t)p0 * I2;
            failed |= kvpilot_gguf_gemm((int)a[MG_GATE_TYPE], (const uint8_t *)PTR_OF(a[MG_GATE]) + e * a[MG_GATE_ES]
                                        + lo * a[MG_GATE_RS], a[MG_GATE_RS], hi - lo, H, xe, H, m, NULL, NULL, 0,
                                        ge + el * lo, I2, bf16, 1) != 0;
            failed |= kvpilot_gguf_gemm((int)a[MG_UP_TYPE], (const uint8_t *)PTR_OF(a[MG_UP]) + e * a[MG_UP_ES]
                                        + lo * a[MG_UP_RS], a[MG_UP_RS], hi - lo, H, xe, H, m, NULL, NULL, 0,
                                        ge + el * (I + lo), I2, bf16, 1) != 0;
        }
#ifdef _OPENMP
        #pragma omp barrier
#endif
        for (int r = r_lo; r < r_hi; r++) {
            const char *g = gu + el * (size_t)r * I2;
            char *o = act + el * (size_t)r * I;
            for (int j = 0; j < I; j++) {
                const float gate = load_io(g, j, bf16), up = load_io(g, I + j, bf16);
                store_io(o, j, gate / (1.0f + expf(fminf(-gate, 88.0f))) * up, bf16);
            }
        }
        row_share(H, t, nt, &lo, &hi);
        for (int tok = 0; tok < T && lo < hi; tok++) memset(acc + (int64_t)tok * H + lo, 0, 4 * (size_t)(hi - lo));
#ifdef _OPENMP
        #pragma omp barrier
#endif
        for (int e = 0; e < E && lo < hi; e++) {
            const int p0 = start[e], m = start[e + 1] - p0;
            if (!m) continue;
            char *ye = y + el * (size_t)p0 * H;
            failed |= kvpilot_gguf_gemm((int)a[MG_DOWN_TYPE], (const uint8_t *)PTR_OF(a[MG_DOWN]) + e * a[MG_DOWN_ES]
                                        + lo * a[MG_DOWN_RS], a[MG_DOWN_RS], hi - lo, I, act + el * (size_t)p0 * I, I,
                                        m, NULL, NULL, 0, ye + el * lo, H, bf16, 1) != 0;
            for (int r = 0; r < m; r++) {
                const int pair = order[p0 + r];
                const float w = weights[pair];
                float *dst = acc + (int64_t)(pair / topk) * H;
                const char *src = ye + el * (size_t)r * H;
                for (int n = lo; n < hi; n++) dst[n] += load_io(src, n, bf16) * w;
            }
        }
        for (int tok = 0; tok < T && lo < hi; tok++)
            for (int n = lo; n < hi; n++) store_io(out + el * (size_t)tok * os, n, acc[(int64_t)tok * H + n], bf16);
    }
    return failed ? -3 : 0;
}
