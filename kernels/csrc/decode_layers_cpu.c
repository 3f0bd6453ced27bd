/* A decode step's decoder layers in one call: for each layer, the same native kernels that the Python layer
 * calls one by one (RMSNorm, the GGUF GEMMs, RoPE, the KV store, paged decode attention, SiLU-and-multiply), in
 * the same order and with the same arguments, so the result is bit-identical to the layer-by-layer path.
 *
 * Why: at one token a step, SmolLM2's 30 layers make ~300 kernel calls of 5-60 us; through Python each costs
 * a few microseconds of argument handling on top, a third of the step (bench/results/single_stream.json).
 *
 * The Python side (daemon/engine/models/native_decode.py) writes one record per layer (its weights, norms,
 * caches and shapes) once, and one record per step (rows, buffers, positions' RoPE factors, block tables). */

#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"
#include "moe_gguf_args.h"

int kvpilot_gguf_gemm(int qtype, const uint8_t *w, int64_t ws, int N, int K, const void *x, int64_t xs, int M,
                      const void *bias, const void *res, int64_t rs, void *y, int64_t ys, int bf16, int num_threads);
void kvpilot_rms_norm_f32(const float *x, int64_t x_stride, int rows, int dim, const float *weight, float eps,
                          float *out, int num_threads);
void kvpilot_rms_norm_bf16(const uint16_t *x, int64_t x_stride, int rows, int dim, const uint16_t *weight,
                           float eps, uint16_t *out, int num_threads);
void kvpilot_rms_norm_bf16_f32w(const uint16_t *x, int64_t x_stride, int rows, int dim, const float *weight,
                                float eps, uint16_t *out, int num_threads);
void kvpilot_gelu_tanh_mul_f32(const float *gu, int64_t gu_stride, int rows, int inter, float *out,
                               int num_threads);
void kvpilot_gelu_tanh_mul_bf16(const uint16_t *gu, int64_t gu_stride, int rows, int inter, uint16_t *out,
                                int num_threads);
void kvpilot_silu_mul_f32(const float *gu, int64_t gu_stride, int rows, int inter, float *out, int num_threads);
void kvpilot_silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, int rows, int inter, uint16_t *out,
                           int num_threads);
void kvpilot_rope_f32(float *x, int64_t x_stride, int rows, int heads, int half, const float *cis, int num_threads);
void kvpilot_rope_bf16(uint16_t *x, int64_t x_stride, int rows, int heads, int half, const float *cis,
                       int num_threads);
int kvpilot_store_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                         float *k_cache, float *v_cache, const int64_t *slots, int tokens, int row, int64_t num_slots);
int kvpilot_store_kv_copy16(const uint16_t *key, int64_t key_stride, const uint16_t *value, int64_t value_stride,
                            uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int tokens, int row,
                            int64_t num_slots);
void kvpilot_panel_gemm_f32(const float *x, int64_t xs, const float *wp, const float *bias, const float *res,
                            int64_t rs, float *y, int64_t ys, int M, int N, int K, int num_threads);
int kvpilot_paged_decode_f32(const void *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                             const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                             int head_dim, int block_size, float scale, int window, void *out, int num_threads,
                             int io_bf16, const float *sinks, float soft_cap);
int kvpilot_paged_decode_bf16kv(const void *q, int64_t q_row_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *block_tables, int64_t bt_stride,
                                const int32_t *context_lens, const int32_t *query_start_loc, int num_seqs,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                int window, void *out, int num_threads, int io_bf16, const float *sinks,
                                float soft_cap);

/* One layer's record (int64 slots; pointers as integers, floats as the bits of a double). A GEMM is
 * GEMM_SLOTS slots: its bias (0: none), its number of segments, then per segment (GGML type, blocks, bytes
 * per row, first output row, rows): a merged q|k|v may hold runs of different types (Q4_K_M). A float32
 * weight's panels (kvpilot_pack_panels_f32) are one segment of count PANELS: (panels, output rows). */
enum {
    L_IN_NORM, L_MLP_NORM, L_EPS, L_K_CACHE, L_V_CACHE, L_HEADS, L_KV_HEADS, L_HEAD_DIM, L_BLOCK_SIZE, L_SCALE,
    L_WINDOW, L_ROPE, L_INTER, L_HIDDEN, L_NUM_SLOTS,
    L_Q_NORM, L_K_NORM,                /* per-head q/k norms (Qwen3, Gemma 3), 0: none */
    L_POST_ATTN_NORM, L_POST_MLP_NORM, /* Gemma's sandwich: norms of the attention's and the MLP's outputs */
    L_NORM_F32, /* 1: float32 norm weights under bfloat16 rows (Gemma's, scaled before the rounding) */
    L_GELU,     /* 1: GeGLU with tanh GELU (Gemma), 0: SwiGLU */
    L_SOFT_CAP, /* attention logits' tanh soft-cap (Gemma 2), 0: none */
    L_MOE,      /* a MoE record; its router (float32 panels) is the gate|up GEMM, no down GEMM. 0: a dense MLP */
    L_GEMMS = 24,
};
/* A MoE layer's record: what the routing and the experts' kernel (float32 panels or GGUF blocks) take besides the
 * rows */
enum { M_EXPERTS, M_TOPK, M_TOPK_FIRST, M_RENORMALIZE, M_INTER, M_W13, M_W13_BIAS, M_W2, M_W2_BIAS,
       M_GGUF, /* GGUF experts: kvpilot_moe_gguf_packed's arguments, the blocks filled in (0: float32 panels) */
       M_SLOTS };
enum { MAX_SEGMENTS = 4, GEMM_SLOTS = 2 + 5 * MAX_SEGMENTS, PANELS = -1 };
enum { G_QKV, G_O, G_GATE_UP, G_DOWN, LAYER_SLOTS = L_GEMMS + 4 * GEMM_SLOTS };

/* The step's record: rows, the buffers (x holds the hidden states in and out), the RoPE factors per table,
 * the attention metadata, and how to run. */
enum {
    S_ROWS, S_X, S_H, S_NORMED, S_QKV, S_ATTN, S_GATE_UP, S_ACT, S_CIS, S_SLOTS, S_BLOCK_TABLES, S_BT_STRIDE,
    S_CONTEXT_LENS, S_QSL, S_SEQS, S_BF16, S_THREADS, S_QK,
    S_MOE_LOGITS, S_MOE_IDS, S_MOE_WEIGHTS, S_MOE_OUT, /* a MoE layer's router logits, choices and output rows */
    S_SLOTS_COUNT,
};

void kvpilot_moe_route_f32(const float *logits, int64_t ls, int T, int E, int k, int topk_first, int renormalize,
                           int64_t *ids, float *weights);
int kvpilot_moe_panels_f32(const float *x, int64_t xs, int T, int H, int I, int E, int topk, const int64_t *ids,
                           const float *weights, const float *w13p, const float *w13_bias, const float *w2p,
                           const float *w2_bias, float *out, int64_t os, int num_threads);

int kvpilot_moe_gguf_packed(const int64_t *a);

int kvpilot_decode_layer_slots(void) { return LAYER_SLOTS; }
int kvpilot_decode_step_slots(void) { return S_SLOTS_COUNT; }
int kvpilot_decode_max_segments(void) { return MAX_SEGMENTS; }

static double as_double(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

#define PTR(v) ((void *)(intptr_t)(v))

/* y = res + x . W^T + bias over the GEMM's segments (each writes its own output columns). */
static int gemm(const int64_t *g, const char *x, int64_t xs, int M, int K, const char *res, int64_t rs, char *y,
                int64_t ys, int bf16, int nt) {
    const size_t elem = bf16 ? 2 : 4;
    const char *bias = PTR(g[0]);
    const int nseg = (int)g[1];
    if (nseg == PANELS) {
        kvpilot_panel_gemm_f32((const float *)x, xs, PTR(g[2]), (const float *)bias, (const float *)res, rs,
                               (float *)y, ys, M, (int)g[3], K, nt);
        return 0;
    }
    for (int s = 0; s < nseg; s++) {
        const int64_t *seg = g + 2 + 5 * s;
        const int64_t row = seg[3];
        const int rc = kvpilot_gguf_gemm((int)seg[0], PTR(seg[1]), seg[2], (int)seg[4], K, x, xs, M,
                                         bias ? bias + row * elem : NULL, res ? res + row * elem : NULL, rs,
                                         y + row * elem, ys, bf16, nt);
        if (rc) return rc;
    }
    return 0;
}

/* out [rows, dim] (contiguous) = RMSNorm of x's rows (xs elements apart) scaled by w: bf16 rows with bf16
 * weights (f32w 0) or float32 ones (f32w 1), or float32 rows */
static void rms_norm(const char *x, int64_t xs, int rows, int dim, const int64_t w, float eps, char *out, int bf16,
                     int f32w, int nt) {
    if (bf16 && f32w)
        kvpilot_rms_norm_bf16_f32w((const uint16_t *)x, xs, rows, dim, PTR(w), eps, (uint16_t *)out, nt);
    else if (bf16)
        kvpilot_rms_norm_bf16((const uint16_t *)x, xs, rows, dim, PTR(w), eps, (uint16_t *)out, nt);
    else
        kvpilot_rms_norm_f32((const float *)x, xs, rows, dim, PTR(w), eps, (float *)out, nt);
}

/* out = a + the RMSNorm of t's rows (Gemma's sandwich: the residual added after a norm; out may be t), a
 * bfloat16 sum rounded as torch rounds it: once, from the float32 sum */
static void add_normed(char *out, const char *a, const char *t, int M, int H, int64_t w, float eps, int bf16,
                       int f32w, char *scratch, int nt) {
    rms_norm(t, H, M, H, w, eps, scratch, bf16, f32w, nt);
    const int64_t n = (int64_t)M * H;
    if (bf16) {
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)scratch;
        uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    } else {
        const float *x = (const float *)a, *y = (const float *)scratch;
        float *o = (float *)out;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
    }
}

/* A MoE layer's routed experts for the normed rows, into the step's MoE output rows (in the rows' dtype): the
 * router GEMM, the routing and the experts, as models/moe.py's MoEBlock calls them. 0, or what failed as gemm's
 * codes, -3 the experts' kernel. */
static int moe_mlp(const int64_t *mr, const int64_t *router, const char *normed, int M, int H, const int64_t *step,
                   int bf16, int nt) {
    const int E = (int)mr[M_EXPERTS], k = (int)mr[M_TOPK];
    float *logits = PTR(step[S_MOE_LOGITS]), *weights = PTR(step[S_MOE_WEIGHTS]);
    int64_t *ids = PTR(step[S_MOE_IDS]);
    /* the router runs in float32 on panels: bfloat16 rows widened first (into the output rows, free until the
     * experts write them), as MoEBlock widens them */
    const char *rx = normed;
    if (bf16) {
        float *wide = PTR(step[S_MOE_OUT]);
        for (int64_t j = 0; j < (int64_t)M * H; j++) wide[j] = bf16_to_f32(((const uint16_t *)normed)[j]);
        rx = (const char *)wide;
    }
    const int rc = gemm(router, rx, H, M, H, NULL, 0, (char *)logits, E, 0, nt);
    if (rc) return rc;
    kvpilot_moe_route_f32(logits, E, M, E, k, (int)mr[M_TOPK_FIRST], (int)mr[M_RENORMALIZE], ids, weights);
    if (mr[M_GGUF]) { /* the step's rows and routing into a copy of the layer's argument record */
        int64_t args[MG_ARGS];
        memcpy(args, PTR(mr[M_GGUF]), sizeof args);
        args[MG_X] = (int64_t)(intptr_t)normed, args[MG_XS] = H, args[MG_T] = M, args[MG_TOPK] = k;
        args[MG_IDS] = (int64_t)(intptr_t)ids, args[MG_WEIGHTS] = (int64_t)(intptr_t)weights;
        args[MG_OUT] = step[S_MOE_OUT], args[MG_OS] = H, args[MG_THREADS] = nt;
        return kvpilot_moe_gguf_packed(args) ? -3 : 0;
    }
    return kvpilot_moe_panels_f32((const float *)normed, H, M, H, (int)mr[M_INTER], E, k, ids, weights,
                                  PTR(mr[M_W13]), PTR(mr[M_W13_BIAS]), PTR(mr[M_W2]), PTR(mr[M_W2_BIAS]),
                                  PTR(step[S_MOE_OUT]), H, nt) ? -3 : 0;
}

/* Runs n layers on the step's rows. Returns 0, or 1000 * (layer + 1) + what failed: 1 a GEMM's type or
 * shape, 2 its scratch memory, 3 the MoE experts' kernel, 100 + |code| the attention, 200 + |code| the KV store. */
int kvpilot_decode_layers(const int64_t *layers, int n, const int64_t *step) {
    const int M = (int)step[S_ROWS], bf16 = (int)step[S_BF16], nt = (int)step[S_THREADS];
    const size_t elem = bf16 ? 2 : 4;
    char *x = PTR(step[S_X]), *h = PTR(step[S_H]), *normed = PTR(step[S_NORMED]), *qkv = PTR(step[S_QKV]);
    char *attn = PTR(step[S_ATTN]), *gu = PTR(step[S_GATE_UP]), *act = PTR(step[S_ACT]);
    const int64_t *cis = PTR(step[S_CIS]);
    char *qk_buf = PTR(step[S_QK]);
    for (int i = 0; i < n; i++) {
        const int64_t *L = layers + (int64_t)i * LAYER_SLOTS;
        const int H = (int)L[L_HIDDEN], nh = (int)L[L_HEADS], nkv = (int)L[L_KV_HEADS], hd = (int)L[L_HEAD_DIM];
        const int inter = (int)L[L_INTER], qkv_n = (nh + 2 * nkv) * hd;
        const float eps = (float)as_double(L[L_EPS]), cap = (float)as_double(L[L_SOFT_CAP]);
        const int f32w = (int)L[L_NORM_F32];
        int rc;
        rms_norm(x, H, M, H, L[L_IN_NORM], eps, normed, bf16, f32w, nt);
        if ((rc = gemm(L + L_GEMMS + G_QKV * GEMM_SLOTS, normed, H, M, H, NULL, 0, qkv, qkv_n, bf16, nt)))
            return 1000 * (i + 1) - rc;
        /* q|k rows: qkv's own, or each head RMS-normed into the q|k buffer first (as the layer's _qk_rows) */
        char *qk = qkv;
        int64_t qk_n = qkv_n;
        if (L[L_Q_NORM]) {
            qk = qk_buf, qk_n = (int64_t)(nh + nkv) * hd;
            for (int m = 0; m < M; m++) {
                const char *row = qkv + (size_t)m * qkv_n * elem;
                char *dst = qk + (size_t)m * qk_n * elem;
                rms_norm(row, hd, nh, hd, L[L_Q_NORM], eps, dst, bf16, f32w, nt);
                rms_norm(row + (size_t)nh * hd * elem, hd, nkv, hd, L[L_K_NORM], eps, dst + (size_t)nh * hd * elem,
                         bf16, f32w, nt);
            }
        }
        /* q and k heads rotated together, in place */
        const float *c = PTR(cis[L[L_ROPE]]);
        if (bf16)
            kvpilot_rope_bf16((uint16_t *)qk, qk_n, M, nh + nkv, hd / 2, c, nt);
        else
            kvpilot_rope_f32((float *)qk, qk_n, M, nh + nkv, hd / 2, c, nt);
        char *k = qk + (size_t)nh * hd * elem, *v = qkv + (size_t)(nh + nkv) * hd * elem;
        rc = bf16 ? kvpilot_store_kv_copy16((const uint16_t *)k, qk_n, (const uint16_t *)v, qkv_n,
                                            PTR(L[L_K_CACHE]), PTR(L[L_V_CACHE]), PTR(step[S_SLOTS]), M, nkv * hd,
                                            L[L_NUM_SLOTS])
                  : kvpilot_store_kv_f32((const float *)k, qk_n, (const float *)v, qkv_n, PTR(L[L_K_CACHE]),
                                         PTR(L[L_V_CACHE]), PTR(step[S_SLOTS]), M, nkv * hd, L[L_NUM_SLOTS]);
        if (rc) return 1000 * (i + 1) + 200 + (rc < 0 ? -rc : rc);
        const int32_t *bt = PTR(step[S_BLOCK_TABLES]), *ctx = PTR(step[S_CONTEXT_LENS]), *qsl = PTR(step[S_QSL]);
        const int seqs = (int)step[S_SEQS], bs = (int)L[L_BLOCK_SIZE], window = (int)L[L_WINDOW];
        const float scale = (float)as_double(L[L_SCALE]);
        rc = bf16 ? kvpilot_paged_decode_bf16kv(qk, qk_n, PTR(L[L_K_CACHE]), PTR(L[L_V_CACHE]), bt, step[S_BT_STRIDE],
                                                ctx, qsl, seqs, nh, nkv, hd, bs, scale, window, attn, nt, 1, NULL, cap)
                  : kvpilot_paged_decode_f32(qk, qk_n, PTR(L[L_K_CACHE]), PTR(L[L_V_CACHE]), bt, step[S_BT_STRIDE],
                                             ctx, qsl, seqs, nh, nkv, hd, bs, scale, window, attn, nt, 0, NULL, cap);
        if (rc) return 1000 * (i + 1) + 100 + (rc < 0 ? -rc : rc);
        /* h = x + o(attn) (pre-norm: the GEMM adds the residual; sandwich: x + the norm of o(attn)), then
         * x = h + down(act(gate, up)) of the normed h, its output normed the same way in a sandwich */
        const int64_t *o_proj = L + L_GEMMS + G_O * GEMM_SLOTS, *down = L + L_GEMMS + G_DOWN * GEMM_SLOTS;
        const int sandwich = L[L_POST_ATTN_NORM] != 0;
        if ((rc = gemm(o_proj, attn, nh * hd, M, nh * hd, sandwich ? NULL : x, H, h, H, bf16, nt)))
            return 1000 * (i + 1) - rc;
        if (sandwich) add_normed(h, x, h, M, H, L[L_POST_ATTN_NORM], eps, bf16, f32w, normed, nt);
        rms_norm(h, H, M, H, L[L_MLP_NORM], eps, normed, bf16, f32w, nt);
        if (L[L_MOE]) { /* x = h + the experts' rows (normed in a sandwich), a bfloat16 sum rounded once */
            if ((rc = moe_mlp(PTR(L[L_MOE]), L + L_GEMMS + G_GATE_UP * GEMM_SLOTS, normed, M, H, step, bf16, nt)))
                return 1000 * (i + 1) - rc;
            const char *y = PTR(step[S_MOE_OUT]);
            if (L[L_POST_MLP_NORM])
                add_normed(x, h, y, M, H, L[L_POST_MLP_NORM], eps, bf16, f32w, normed, nt);
            else
                for (int64_t j = 0; j < (int64_t)M * H; j++)
                    store_io(x, j, load_io(h, j, bf16) + load_io(y, j, bf16), bf16);
            continue;
        }
        if ((rc = gemm(L + L_GEMMS + G_GATE_UP * GEMM_SLOTS, normed, H, M, H, NULL, 0, gu, 2 * inter, bf16, nt)))
            return 1000 * (i + 1) - rc;
        if (L[L_GELU] && bf16)
            kvpilot_gelu_tanh_mul_bf16((const uint16_t *)gu, 2 * inter, M, inter, (uint16_t *)act, nt);
        else if (L[L_GELU])
            kvpilot_gelu_tanh_mul_f32((const float *)gu, 2 * inter, M, inter, (float *)act, nt);
        else if (bf16)
            kvpilot_silu_mul_bf16((const uint16_t *)gu, 2 * inter, M, inter, (uint16_t *)act, nt);
        else
            kvpilot_silu_mul_f32((const float *)gu, 2 * inter, M, inter, (float *)act, nt);
        if ((rc = gemm(down, act, inter, M, inter, L[L_POST_MLP_NORM] ? NULL : h, H, x, H, bf16, nt)))
            return 1000 * (i + 1) - rc;
        if (L[L_POST_MLP_NORM]) add_normed(x, h, x, M, H, L[L_POST_MLP_NORM], eps, bf16, f32w, normed, nt);
    }
    return 0;
}
