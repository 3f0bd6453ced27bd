/* GGUF-quantized linear layers on the CPU: weights stay in their ggml blocks (kernels/gguf_reference.py has the
 * layouts), activations stay float32 or bfloat16, every product and sum is float32.
 *
 * Entry points:
 *   kvpilot_gguf_dequant: rows of a weight -> float32 or bfloat16 rows (the large-M path dequantizes tiles for
 *                         torch's GEMM with it, embeddings their gathered rows);
 *   kvpilot_gguf_gemm:    y = residual + x . W^T + bias for the few rows of a decode step, reading each weight
 *                         block once per call and dequantizing it in registers (kvpilot_gguf_gemm_packed: the
 *                         same, its arguments in one array for a cheap call from Python).
 *
 * Why it is built this way. A decode step streams every weight once, from L3 at best (a small model fits
 * there), so the kernels are bound by the vector instructions spent per weight byte: widening 4-bit codes to
 * float32 and scaling them costs more than the multiply-adds. Measured on an AVX-512 + AVX512-BF16 host at one x
 * row (576x1536): one core runs ~14 GB/s of Q4_1 blocks and ~22 GB/s of Q8_0 from L2, two cores ~24 GB/s of
 * Q4_1 streamed from L3 (with the prefetching below; half that without). bench/gguf_gemv.py measures the calls
 * from Python.
 *
 * - The register path (AVX-512): per 32 weights, one load and widening of the codes and two conversions to
 *   float32 and multiply-adds (w = scale * q + offset; the 4-bit formats instead look the weight up in a
 *   16-entry table d * i + m built once per block: vpermps reads only the low 4 bits of each index, so a nibble
 *   needs neither a mask nor a conversion), then two multiply-adds per x row. fp16 scales come from a lookup
 *   table (a load) rather than a conversion and a shuffle on the ports the kernel is bound by. Q8_0 up to
 *   GG_Q8_MAX_ROWS x rows defers its scale instead: q . x per block, times d once per block and row.
 * - The dot path (AVX512-BF16 + VBMI, bfloat16 x, a few x rows, the K-quants): their codes (up to 6 bits) are
 *   small integers, exact in bfloat16, so one table lookup (vpermw / vpermt2w, the code is the index) turns 32
 *   of them into bfloat16 and one vdpbf16ps multiplies them by 32 activations, each product exact, summed in
 *   float32. The affine part comes after the dot product: w = a * q + b gives sum(w * x) = a * (q . x) +
 *   b * sum(x), with sum(x) per sub-block computed once per call, so the offset (dmin * min, Q6_K's -32)
 *   costs one multiply-add per sub-block, not one per element. (Float32 x would need three bfloat16 parts for
 *   exact products, and vdpbf16ps costs two FMAs' issue slots on this host: the register path wins there,
 *   and for the 32-element formats its nibble tables are as cheap as vpermw.)
 * - The decode-row path (AVX-512, one x row, the 32-element formats): the register path's arithmetic, but four
 *   weight rows at a time with their blocks interleaved. One row's two accumulators are chains of K / 32
 *   multiply-adds, latency-bound at SmolLM2's K = 576; four rows give eight independent chains, share the x
 *   loads, and reduce and store together; the tile's weight lines are prefetched a few per block step rather than
 *   in bursts per row. Measured (one core, weight in L2, Q4_1 960x576): 1.5x the register path's rate.
 * - The generic path (AVX2 and plain-C builds): a few weight rows at a time dequantized into an L1 buffer by
 *   loops the compiler vectorizes, then register-tiled multiply-adds with up to four x rows.
 *
 * The AVX-512 paths share the output rows among the OpenMP threads in chunks, each thread starting on its own
 * contiguous range (one stream of the weight) and then taking the chunks another has not started (run_rows);
 * the others split them in contiguous ranges. Each output element is one thread's, summed in one order, so the
 * thread count never changes a result; and a float32 x row gets the same result alone as in a batch of up to
 * GG_MB rows (the decode-row path repeats the arithmetic of the paths those batches take).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

/* the AVX-512 kernels use F, BW, VL and DQ (every AVX-512 CPU since Skylake-SP); others take the AVX2 paths */
#if USE_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GG_AVX512 1
#else
#define GG_AVX512 0
#endif
#if GG_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define GG_DOT 1
#else
#define GG_DOT 0
#endif

/* GGML type ids */
enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14 };

/* elements and bytes of one block of type t; 0 for a type this file does not implement */
static int gg_shape(int t, int *elems, int *bytes) {
    switch (t) {
        case GG_Q4_0: *elems = 32, *bytes = 18; return 1;
        case GG_Q4_1: *elems = 32, *bytes = 20; return 1;
        case GG_Q5_0: *elems = 32, *bytes = 22; return 1;
        case GG_Q5_1: *elems = 32, *bytes = 24; return 1;
        case GG_Q8_0: *elems = 32, *bytes = 34; return 1;
        case GG_Q4_K: *elems = 256, *bytes = 144; return 1;
        case GG_Q5_K: *elems = 256, *bytes = 176; return 1;
        case GG_Q6_K: *elems = 256, *bytes = 210; return 1;
        default: return 0;
    }
}

static inline float gg_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (e == 0) {  /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = e == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((e + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint32_t gg_u32(const uint8_t *p) {  /* x86 is little-endian, as the file format */
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* fp16 -> float32 for every bit pattern, built on the first GEMM call: a block's scale is then one load (a
 * broadcast from memory) instead of a conversion and a shuffle on the vector ports the kernels are bound by.
 * 256 KiB, of which a model's scales touch a few lines. */
static float gg_f16_table[65536];
static pthread_once_t gg_f16_once = PTHREAD_ONCE_INIT;

static void gg_f16_fill(void) {
    for (int i = 0; i < 65536; i++) {
        const uint8_t b[2] = {(uint8_t)(i & 0xff), (uint8_t)(i >> 8)};
        gg_f16_table[i] = gg_f16(b);
    }
}

static inline float gg_f16t(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return gg_f16_table[h];
}

/* ------------------------------------------------------------------ dequantizing one block (plain loops) */

static inline void dq_q4_0(const uint8_t *b, float *y) {
    const float d = gg_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static inline void dq_q4_1(const uint8_t *b, float *y) {
    const float d = gg_f16(b), m = gg_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 15) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static inline void dq_q5_0(const uint8_t *b, float *y) {
    const float d = gg_f16(b);
    const uint32_t qh = gg_u32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 15) | (int)((qh >> j) & 1u) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

static inline void dq_q5_1(const uint8_t *b, float *y) {
    const float d = gg_f16(b), m = gg_f16(b + 2);
    const uint32_t qh = gg_u32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 15) | (int)((qh >> j) & 1u) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

static inline void dq_q8_0(const uint8_t *b, float *y) {
    const float d = gg_f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* Q4_K/Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes q */
static inline void k_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline void dq_q4_k(const uint8_t *b, float *y) {
    const float d = gg_f16(b), dmin = gg_f16(b + 2);
    const uint8_t *qs = b + 16;
    for (int i = 0; i < 4; i++) {
        int s0, m0, s1, m1;
        k_scale_min(b + 4, 2 * i, &s0, &m0);
        k_scale_min(b + 4, 2 * i + 1, &s1, &m1);
        const float d0 = d * (float)s0, n0 = dmin * (float)m0, d1 = d * (float)s1, n1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            y[64 * i + l] = d0 * (float)(qs[32 * i + l] & 15) - n0;
            y[64 * i + 32 + l] = d1 * (float)(qs[32 * i + l] >> 4) - n1;
        }
    }
}

static inline void dq_q5_k(const uint8_t *b, float *y) {
    const float d = gg_f16(b), dmin = gg_f16(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int i = 0; i < 4; i++) {
        int s0, m0, s1, m1;
        k_scale_min(b + 4, 2 * i, &s0, &m0);
        k_scale_min(b + 4, 2 * i + 1, &s1, &m1);
        const float d0 = d * (float)s0, n0 = dmin * (float)m0, d1 = d * (float)s1, n1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            const int lo = (qs[32 * i + l] & 15) | ((qh[l] >> (2 * i)) & 1) << 4;
            const int hi = (qs[32 * i + l] >> 4) | ((qh[l] >> (2 * i + 1)) & 1) << 4;
            y[64 * i + l] = d0 * (float)lo - n0;
            y[64 * i + 32 + l] = d1 * (float)hi - n1;
        }
    }
}

static inline void dq_q6_k(const uint8_t *b, float *y) {
    const float d = gg_f16(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        float *o = y + 128 * h;
        float ds[8];
        for (int j = 0; j < 8; j++) ds[j] = d * (float)sc[8 * h + j];
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            o[l] = ds[is] * (float)(((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
            o[l + 32] = ds[is + 2] * (float)(((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
            o[l + 64] = ds[is + 4] * (float)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
            o[l + 96] = ds[is + 6] * (float)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
        }
    }
}

#if !GG_AVX512  /* AVX-512 builds dequantize with the register path's unpacking */
/* nb consecutive blocks of a row -> floats; one copy per type so the block's loops are inlined */
typedef void (*gg_row_fn)(const uint8_t *row, float *y, int nb);
#define GG_ROW(name, EL, BY)                                                                 \
    static void dq_row_##name(const uint8_t *r, float *y, int nb) {                          \
        for (int i = 0; i < nb; i++) dq_##name(r + (int64_t)i * (BY), y + (int64_t)i * (EL)); \
    }
GG_ROW(q4_0, 32, 18)
GG_ROW(q4_1, 32, 20)
GG_ROW(q5_0, 32, 22)
GG_ROW(q5_1, 32, 24)
GG_ROW(q8_0, 32, 34)
GG_ROW(q4_k, 256, 144)
GG_ROW(q5_k, 256, 176)
GG_ROW(q6_k, 256, 210)
#undef GG_ROW

static gg_row_fn gg_row(int t) {
    switch (t) {
        case GG_Q4_0: return dq_row_q4_0;
        case GG_Q4_1: return dq_row_q4_1;
        case GG_Q5_0: return dq_row_q5_0;
        case GG_Q5_1: return dq_row_q5_1;
        case GG_Q8_0: return dq_row_q8_0;
        case GG_Q4_K: return dq_row_q4_k;
        case GG_Q5_K: return dq_row_q5_k;
        case GG_Q6_K: return dq_row_q6_k;
        default: return NULL;
    }
}

static inline void round_bf16(const float *src, uint16_t *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

#endif

/* floats of widened bfloat16 x kept on the stack (more: malloc) */
#ifndef GG_X_STACK
#define GG_X_STACK 4096
#endif

/* Weight bytes per thread below which a call uses fewer threads: waking another costs more than it saves. */
#ifndef GG_MIN_BYTES_PER_THREAD
#define GG_MIN_BYTES_PER_THREAD (48 * 1024)
#endif

static int gg_threads(int num_threads, int64_t bytes, int64_t rows) {
    int64_t nt = bytes / GG_MIN_BYTES_PER_THREAD;
    if (nt > num_threads) nt = num_threads;
    if (nt > rows) nt = rows;
    return nt < 1 ? 1 : (int)nt;
}

/* ------------------------------------------------------------------------------------------ the GEMM */

typedef struct {
    int qtype, el, by, N, K, M;
    const uint8_t *w;
    int64_t ws;
    const float *x;  /* float32 x rows (the register and generic paths: bfloat16 x widened once) */
    int64_t xs;
    int io_bf16;  /* bias, residual and y are bfloat16 (else float32) */
    const void *bias, *res;
    int64_t rs;
    void *y;
    int64_t ys;
} gg_gemm;

static inline void gg_store(const gg_gemm *g, int n, int m, float v) {
    const int64_t es = g->io_bf16 ? 2 : 4;
    if (g->bias) v += load_io(g->bias, n, g->io_bf16);
    if (g->res) v += load_io((const char *)g->res + (int64_t)m * g->rs * es, n, g->io_bf16);
    store_io((char *)g->y + (int64_t)m * g->ys * es, n, v, g->io_bf16);
}

/* While a row is multiplied, the bytes GG_PREFETCH_BYTES past its start (the rows that follow: a weight's rows
 * are one sequential stream) are prefetched into L1. A decode step's weights come from L3 or memory, and with
 * the hardware prefetcher alone the kernels ran at half their rate on weights in L2; this recovers most of it.
 * -D to tune (0: off). */
#ifndef GG_PREFETCH_BYTES
#define GG_PREFETCH_BYTES 4096
#endif

/* always inlined: as a function of its own gcc finds it free of side effects (a prefetch is none) and drops
 * the calls */
static inline __attribute__((always_inline)) void prefetch_row(const gg_gemm *g, int n) {
    if (GG_PREFETCH_BYTES <= 0) return;
    const int64_t bytes = (int64_t)(g->K / g->el) * g->by;
    const char *r = (const char *)g->w + (int64_t)n * g->ws, *end = (const char *)g->w + (int64_t)g->N * g->ws;
    for (const char *p = r + GG_PREFETCH_BYTES; p < r + GG_PREFETCH_BYTES + bytes && p < end; p += 64)
        __builtin_prefetch(p, 0, 3);
}

/* The tile kernels' prefetch: a tile reads its rows' blocks side by side, so instead of each row's lines at
 * once (a burst of prefetches, then none) the lines GG_PREFETCH_BYTES past the tile's start go two per step of
 * the block loop: 128 bytes per step, more than the step reads (4 rows' blocks of at most 24 bytes; Q8_0's
 * steps of two blocks of 34 bytes take five lines). Lines past the weight are left alone. */
static inline __attribute__((always_inline)) void prefetch_lines(const char *p, const int lines, const char *end) {
    if (GG_PREFETCH_BYTES <= 0) return;
    for (int i = 0; i < lines; i++)
        if (p + 64 * i < end) __builtin_prefetch(p + 64 * i, 0, 3);
}

/* x rows per register tile (the generic, dot and Q8_0 kernels); the generic path's weight rows dequantized together */
enum { GG_MB = 4, GG_R = 4 };

#if !GG_AVX512

/* out[r][m] = wb[r] . x[m] over K for r < GG_R, m < mb (a constant at each call site) */
static inline __attribute__((always_inline)) void dot_tile(const float *wb, int K, const float *x, int64_t xs,
                                                           const int mb, float out[GG_R][GG_MB]) {
#if USE_AVX2
    __m256 acc[GG_R][GG_MB];
    for (int r = 0; r < GG_R; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 xv[GG_MB];
        for (int m = 0; m < mb; m++) xv[m] = _mm256_loadu_ps(x + m * xs + k);
        for (int r = 0; r < GG_R; r++) {
            const __m256 wv = _mm256_loadu_ps(wb + (int64_t)r * K + k);
            for (int m = 0; m < mb; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    for (int r = 0; r < GG_R; r++)
        for (int m = 0; m < mb; m++) out[r][m] = hsum8(acc[r][m]);
#else
    for (int r = 0; r < GG_R; r++)
        for (int m = 0; m < mb; m++) {
            const float *wr = wb + (int64_t)r * K, *xr = x + m * xs;
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += wr[k] * xr[k];
            out[r][m] = s;
        }
#endif
}

static void dot_tile_n(const float *wb, int K, const float *x, int64_t xs, int mb, float out[GG_R][GG_MB]) {
    switch (mb) {
        case 1: dot_tile(wb, K, x, xs, 1, out); break;
        case 2: dot_tile(wb, K, x, xs, 2, out); break;
        case 3: dot_tile(wb, K, x, xs, 3, out); break;
        default: dot_tile(wb, K, x, xs, 4, out); break;
    }
}

/* rows [lo, hi) of the output by the generic path; wb: GG_R * K floats of scratch */
static void gemm_generic(const gg_gemm *g, int lo, int hi, float *wb) {
    const gg_row_fn fn = gg_row(g->qtype);
    const int nb = g->K / g->el;
    for (int n0 = lo; n0 < hi; n0 += GG_R) {
        const int r = hi - n0 < GG_R ? hi - n0 : GG_R;
        for (int i = 0; i < r; i++) fn(g->w + (int64_t)(n0 + i) * g->ws, wb + (int64_t)i * g->K, nb);
        for (int m0 = 0; m0 < g->M; m0 += GG_MB) {
            const int mb = g->M - m0 < GG_MB ? g->M - m0 : GG_MB;
            float out[GG_R][GG_MB];
            dot_tile_n(wb, g->K, g->x + (int64_t)m0 * g->xs, g->xs, mb, out);  /* rows >= r: stale, dropped */
            for (int i = 0; i < r; i++)
                for (int m = 0; m < mb; m++) gg_store(g, n0 + i, m0 + m, out[i][m]);
        }
    }
}

#endif

#if GG_AVX512
/* ------------------------------------------------------------------------- the register path (AVX-512) */

/* Up to GG_REG_MB x rows per pass over a weight row: 2 accumulators each (16 of the 32 registers). */
enum { GG_REG_MB = 8 };

/* 32 dequantized weights (w0: elements 0-15, w1: 16-31) times the mb float32 x rows at x */
static inline __attribute__((always_inline)) void fma_rows(__m512 w0, __m512 w1, const float *x, int64_t xs,
                                                           const int mb, __m512 (*acc)[2]) {
    for (int m = 0; m < mb; m++) {
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * xs), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * xs + 16), acc[m][1]);
    }
}

/* bfloat16 of 16 floats, rounded to nearest even (finite values) */
static inline __m256i to_bf16(__m512 v) {
#if GG_DOT
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
#endif
}

/* What reg_row does with each 32 dequantized weights at element k: with x rows (mb > 0) multiply them in; with
 * none (mb == 0, the dequantizer) store them at dst + k, float32 or bfloat16. */
static inline __attribute__((always_inline)) void emit(__m512 w0, __m512 w1, int k, const float *x, int64_t xs,
                                                       const int mb, __m512 (*acc)[2], void *dst, const int bf16) {
    if (mb) {
        fma_rows(w0, w1, x + k, xs, mb, acc);
    } else if (bf16) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + k), to_bf16(w0));
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + k + 16), to_bf16(w1));
    } else {
        _mm512_storeu_ps((float *)dst + k, w0);
        _mm512_storeu_ps((float *)dst + k + 16, w1);
    }
}

static inline __m512 cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }

/* Q4_K/Q5_K: a super-block's 8 scales and 8 mins (see k_scale_min) as float32: sm[j] = d * scale j,
 * sm[8 + j] = -dmin * min j */
static inline __attribute__((always_inline)) void k_scales(const uint8_t *p, float *sm) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(p + 4));
    const __m128i sel1 = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m128i sel2 = _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7);
    const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i mask = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m512i v1 = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(raw, sel1));  /* the byte with the low bits */
    const __m512i v2 = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(raw, sel2));  /* sub-blocks 4-7: the top 2 bits */
    const __m512i smi = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(v1, shift), mask),
                                        _mm512_srli_epi32(_mm512_and_si512(v2, _mm512_set1_epi32(0xC0)), 2));
    const __m512 mul = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(gg_f16t(p)), _mm512_set1_ps(-gg_f16t(p + 2)));
    _mm512_storeu_ps(sm, _mm512_mul_ps(_mm512_cvtepi32_ps(smi), mul));
}

/* The 32 weights of a Q4_0/Q4_1/Q5_0/Q5_1 block at p: elements 0-15 in w0, 16-31 in w1 (iota: 0, 1, ..., 15). */
static inline __attribute__((always_inline)) void blk32(const int t, const uint8_t *p, const __m512 iota, __m512 *w0,
                                                        __m512 *w1) {
    const int QS = t == GG_Q4_0 ? 2 : t == GG_Q4_1 ? 4 : t == GG_Q5_0 ? 6 : 8, QH = t == GG_Q5_0 ? 2 : 4;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + QS)));
    const float d = gg_f16t(p);
    if (t == GG_Q4_0 || t == GG_Q4_1) {
        /* the block's 16 possible weights d * i + c (c = m, or -8d) in one register; vpermps reads only the low 4
         * bits of each index, so the low nibble needs no mask, and no code is converted to float. Q4_0's as
         * (i - 8) * d: the same rounding of the same exact value as a fused d * i - 8d, one operation less. */
        const __m512 tab = t == GG_Q4_1 ? _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(gg_f16t(p + 2)))
                                        : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), _mm512_set1_ps(d));
        *w0 = _mm512_permutexvar_ps(v, tab);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);
        return;
    }
    /* w = d * q + c: c = m, or -16d (exact), so that the fused form rounds (q - 16) * d once */
    const __m512 vd = _mm512_set1_ps(d);
    const __m512 vc = t == GG_Q5_1 ? _mm512_set1_ps(gg_f16t(p + 2)) : _mm512_set1_ps(-16.0f * d);
    const __m512i c15 = _mm512_set1_epi32(15), c16 = _mm512_set1_epi32(16);
    __m512i lo = _mm512_and_si512(v, c15), hi = _mm512_srli_epi32(v, 4);
    const uint32_t qh = gg_u32(p + QH);  /* the fifth bits */
    lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFF), lo, c16);
    hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, c16);
    *w0 = _mm512_fmadd_ps(cvt(lo), vd, vc);
    *w1 = _mm512_fmadd_ps(cvt(hi), vd, vc);
}

/* One weight row times mb x rows, every block dequantized once into registers (float32, the reference's
 * formulas up to one fused rounding) and multiplied into each row's accumulators; with mb == 0 the row is
 * stored at dst instead (float32, or bfloat16 with bf16). */
static inline __attribute__((always_inline)) void reg_row(const int t, const uint8_t *row, int K, const float *x,
                                                          int64_t xs, const int mb, float *out, void *dst,
                                                          const int bf16) {
    __m512 acc[GG_REG_MB][2];
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const __m512i c15 = _mm512_set1_epi32(15), c16 = _mm512_set1_epi32(16);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (t == GG_Q8_0) {
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *p = row + (int64_t)b * 34;
            const __m512 d = _mm512_set1_ps(gg_f16t(p));
            const __m512 w0 = _mm512_mul_ps(cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))), d);
            const __m512 w1 = _mm512_mul_ps(cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))), d);
            emit(w0, w1, 32 * b, x, xs, mb, acc, dst, bf16);
        }
    } else if (t == GG_Q4_0 || t == GG_Q4_1 || t == GG_Q5_0 || t == GG_Q5_1) {
        const int BY = t == GG_Q4_0 ? 18 : t == GG_Q4_1 ? 20 : t == GG_Q5_0 ? 22 : 24;
        for (int b = 0; b < K / 32; b++) {
            __m512 w0, w1;
            blk32(t, row + (int64_t)b * BY, iota, &w0, &w1);
            emit(w0, w1, 32 * b, x, xs, mb, acc, dst, bf16);
        }
    } else if (t == GG_Q4_K || t == GG_Q5_K) {
        const int BY = t == GG_Q4_K ? 144 : 176, QS = t == GG_Q4_K ? 16 : 48;
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *p = row + (int64_t)sb * BY;
            float sm[16];
            k_scales(p, sm);
            for (int i = 0; i < 4; i++) {
                const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + QS + 32 * i)));
                const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + QS + 32 * i + 16)));
                for (int h = 0; h < 2; h++) {  /* sub-block 2i + h: the low nibbles, then the high ones */
                    const int s = 2 * i + h;
                    if (t == GG_Q4_K) {  /* a table of the sub-block's 16 weights, as for Q4_0/Q4_1 */
                        const __m512 tab = _mm512_fmadd_ps(iota, _mm512_set1_ps(sm[s]), _mm512_set1_ps(sm[8 + s]));
                        const __m512i i0 = h ? _mm512_srli_epi32(v0, 4) : v0, i1 = h ? _mm512_srli_epi32(v1, 4) : v1;
                        emit(_mm512_permutexvar_ps(i0, tab), _mm512_permutexvar_ps(i1, tab), 256 * sb + 32 * s, x, xs,
                             mb, acc, dst, bf16);
                        continue;
                    }
                    __m512i q0 = h ? _mm512_srli_epi32(v0, 4) : _mm512_and_si512(v0, c15);
                    __m512i q1 = h ? _mm512_srli_epi32(v1, 4) : _mm512_and_si512(v1, c15);
                    {  /* bit s of qh[l] is element l's fifth bit */
                        const __m128i bit = _mm_set1_epi8((char)(1 << s));
                        q0 = _mm512_mask_or_epi32(q0, _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(p + 16)), bit), q0, c16);
                        q1 = _mm512_mask_or_epi32(q1, _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(p + 32)), bit), q1, c16);
                    }
                    const __m512 sc = _mm512_set1_ps(sm[s]), mn = _mm512_set1_ps(sm[8 + s]);
                    emit(_mm512_fmadd_ps(cvt(q0), sc, mn), _mm512_fmadd_ps(cvt(q1), sc, mn), 256 * sb + 32 * s, x, xs,
                         mb, acc, dst, bf16);
                }
            }
        }
    } else {  /* Q6_K */
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *p = row + (int64_t)sb * 210;
            float sf[16];  /* d * scale of each 16 elements */
            _mm512_storeu_ps(sf, _mm512_mul_ps(cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))),
                                               _mm512_set1_ps(gg_f16t(p + 208))));
            for (int h = 0; h < 2; h++) {
                /* elements 128h + 32j + 16c + l (l < 16): low 4 bits in ql[64h + 32(j % 2) + 16c + l] (nibble
                 * j / 2), high 2 bits (qh[32h + 16c + l] >> 2j) & 3; each byte widened once for its 2-4 uses */
                __m512 w[4][2];
                for (int c = 0; c < 2; c++) {
                    const __m512i a0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 64 * h + 16 * c)));
                    const __m512i a1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 64 * h + 32 + 16 * c)));
                    const __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 128 + 32 * h + 16 * c)));
                    for (int j = 0; j < 4; j++) {
                        const __m512i a = j % 2 ? a1 : a0;
                        const __m512i low = j < 2 ? a : _mm512_srli_epi32(a, 4);
                        /* (low & 15) | (hb << (4 - 2j)) & 0x30: ternary-logic 0xE4 = c ? a : b with c = 15 */
                        const __m512i hs = j == 0 ? _mm512_slli_epi32(hb, 4) : j == 1 ? _mm512_slli_epi32(hb, 2)
                                         : j == 2 ? hb : _mm512_srli_epi32(hb, 2);
                        const __m512i q = _mm512_and_si512(_mm512_ternarylogic_epi32(low, hs, c15, 0xE4),
                                                           _mm512_set1_epi32(63));
                        const float sc = sf[8 * h + 2 * j + c];
                        w[j][c] = _mm512_fmadd_ps(cvt(q), _mm512_set1_ps(sc), _mm512_set1_ps(-32.0f * sc));
                    }
                }
                for (int j = 0; j < 4; j++) emit(w[j][0], w[j][1], 256 * sb + 128 * h + 32 * j, x, xs, mb, acc, dst, bf16);
            }
        }
    }
    for (int m = 0; m < mb; m++) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

#define GG_REG_CASES(T)                                                                                  \
    switch (mb) {                                                                                        \
        case 1: reg_row(T, row, g->K, x, g->xs, 1, out, NULL, 0); break;                                \
        case 2: reg_row(T, row, g->K, x, g->xs, 2, out, NULL, 0); break;                                \
        case 3: reg_row(T, row, g->K, x, g->xs, 3, out, NULL, 0); break;                                \
        case 4: reg_row(T, row, g->K, x, g->xs, 4, out, NULL, 0); break;                                \
        case 5: reg_row(T, row, g->K, x, g->xs, 5, out, NULL, 0); break;                                \
        case 6: reg_row(T, row, g->K, x, g->xs, 6, out, NULL, 0); break;                                \
        case 7: reg_row(T, row, g->K, x, g->xs, 7, out, NULL, 0); break;                                \
        default: reg_row(T, row, g->K, x, g->xs, 8, out, NULL, 0); break;                               \
    }

#define GG_REG_ROWS(name, T)                                                                             \
    static void name(const gg_gemm *g, int lo, int hi) {                                                 \
        for (int n = lo; n < hi; n++) {                                                                  \
            const uint8_t *row = g->w + (int64_t)n * g->ws;                                              \
            prefetch_row(g, n);                                                                      \
            for (int m0 = 0; m0 < g->M; m0 += GG_REG_MB) {                                               \
                const int mb = g->M - m0 < GG_REG_MB ? g->M - m0 : GG_REG_MB;                            \
                const float *x = g->x + (int64_t)m0 * g->xs;                                             \
                float out[GG_REG_MB];                                                                    \
                GG_REG_CASES(T)                                                                          \
                for (int m = 0; m < mb; m++) gg_store(g, n, m0 + m, out[m]);                             \
            }                                                                                            \
        }                                                                                                \
    }
GG_REG_ROWS(reg_rows_q4_0, GG_Q4_0)
GG_REG_ROWS(reg_rows_q4_1, GG_Q4_1)
GG_REG_ROWS(reg_rows_q5_0, GG_Q5_0)
GG_REG_ROWS(reg_rows_q5_1, GG_Q5_1)
GG_REG_ROWS(reg_rows_q8_0, GG_Q8_0)
GG_REG_ROWS(reg_rows_q4_k, GG_Q4_K)
GG_REG_ROWS(reg_rows_q5_k, GG_Q5_K)
GG_REG_ROWS(reg_rows_q6_k, GG_Q6_K)
#undef GG_REG_ROWS
#undef GG_REG_CASES

/* the dequantizer's rows: each row of w (ws bytes apart) to out (os elements apart) */
#define GG_DEQ_ROWS(name, T)                                                                             \
    static void name(const uint8_t *w, int64_t ws, int lo, int hi, int K, void *out, int64_t os, int bf16) { \
        for (int r = lo; r < hi; r++) {                                                                  \
            void *dst = bf16 ? (void *)((uint16_t *)out + (int64_t)r * os) : (void *)((float *)out + (int64_t)r * os); \
            if (bf16) reg_row(T, w + (int64_t)r * ws, K, NULL, 0, 0, NULL, dst, 1);                      \
            else reg_row(T, w + (int64_t)r * ws, K, NULL, 0, 0, NULL, dst, 0);                           \
        }                                                                                                \
    }
GG_DEQ_ROWS(deq_rows_q4_0, GG_Q4_0)
GG_DEQ_ROWS(deq_rows_q4_1, GG_Q4_1)
GG_DEQ_ROWS(deq_rows_q5_0, GG_Q5_0)
GG_DEQ_ROWS(deq_rows_q5_1, GG_Q5_1)
GG_DEQ_ROWS(deq_rows_q8_0, GG_Q8_0)
GG_DEQ_ROWS(deq_rows_q4_k, GG_Q4_K)
GG_DEQ_ROWS(deq_rows_q5_k, GG_Q5_K)
GG_DEQ_ROWS(deq_rows_q6_k, GG_Q6_K)
#undef GG_DEQ_ROWS

typedef void (*gg_deq_fn)(const uint8_t *, int64_t, int, int, int, void *, int64_t, int);

static gg_deq_fn gg_deq_rows(int t) {
    switch (t) {
        case GG_Q4_0: return deq_rows_q4_0;
        case GG_Q4_1: return deq_rows_q4_1;
        case GG_Q5_0: return deq_rows_q5_0;
        case GG_Q5_1: return deq_rows_q5_1;
        case GG_Q8_0: return deq_rows_q8_0;
        case GG_Q4_K: return deq_rows_q4_k;
        case GG_Q5_K: return deq_rows_q5_k;
        case GG_Q6_K: return deq_rows_q6_k;
        default: return NULL;
    }
}

typedef void (*gg_reg_fn)(const gg_gemm *, int, int);

static gg_reg_fn gg_reg_rows(int t) {
    switch (t) {
        case GG_Q4_0: return reg_rows_q4_0;
        case GG_Q4_1: return reg_rows_q4_1;
        case GG_Q5_0: return reg_rows_q5_0;
        case GG_Q5_1: return reg_rows_q5_1;
        case GG_Q8_0: return reg_rows_q8_0;
        case GG_Q4_K: return reg_rows_q4_k;
        case GG_Q5_K: return reg_rows_q5_k;
        case GG_Q6_K: return reg_rows_q6_k;
        default: return NULL;
    }
}
#endif

#if GG_AVX512
/* Q8_0 for up to GG_MB float32 x rows: per block its 32 codes widened to float32 (two vectors), their products
 * with each x row summed, and that sum scaled by d: one multiply-add per block and row instead of one per
 * element. Blocks alternate between two accumulators so that the adds of consecutive blocks overlap. */
static inline __attribute__((always_inline)) void q8_rows(const gg_gemm *g, int lo, int hi, int m0, const int mb) {
    const int nb = g->K / 32;
    const int64_t xs = g->xs;
    for (int n = lo; n < hi; n++) {
        const uint8_t *row = g->w + (int64_t)n * g->ws;
        const float *x = g->x + (int64_t)m0 * xs;
        if (m0 == 0) prefetch_row(g, n);
        __m512 acc[GG_MB][2];
        for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            const uint8_t *p = row + (int64_t)b * 34;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
            const __m512 c2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 36))));
            const __m512 c3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 52))));
            const __m512 d0 = _mm512_set1_ps(gg_f16t(p)), d1 = _mm512_set1_ps(gg_f16t(p + 34));
            for (int m = 0; m < mb; m++) {
                const float *xm = x + m * xs + 32 * b;
                const __m512 t0 = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xm + 16), _mm512_mul_ps(c0, _mm512_loadu_ps(xm)));
                const __m512 t1 = _mm512_fmadd_ps(c3, _mm512_loadu_ps(xm + 48), _mm512_mul_ps(c2, _mm512_loadu_ps(xm + 32)));
                acc[m][0] = _mm512_fmadd_ps(t0, d0, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(t1, d1, acc[m][1]);
            }
        }
        if (b < nb) {
            const uint8_t *p = row + (int64_t)b * 34;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
            const __m512 d0 = _mm512_set1_ps(gg_f16t(p));
            for (int m = 0; m < mb; m++) {
                const float *xm = x + m * xs + 32 * b;
                const __m512 t0 = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xm + 16), _mm512_mul_ps(c0, _mm512_loadu_ps(xm)));
                acc[m][0] = _mm512_fmadd_ps(t0, d0, acc[m][0]);
            }
        }
        for (int m = 0; m < mb; m++) gg_store(g, n, m0 + m, _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])));
    }
}

static void gemm_q8(const gg_gemm *g, int lo, int hi) {
    for (int n0 = lo; n0 < hi; n0 += 32)  /* tiles of rows that stay in L1 while each group of x rows passes */
        for (int m0 = 0; m0 < g->M; m0 += GG_MB) {
            const int n1 = hi - n0 < 32 ? hi : n0 + 32;
            switch (g->M - m0 < GG_MB ? g->M - m0 : GG_MB) {
                case 1: q8_rows(g, n0, n1, m0, 1); break;
                case 2: q8_rows(g, n0, n1, m0, 2); break;
                case 3: q8_rows(g, n0, n1, m0, 3); break;
                default: q8_rows(g, n0, n1, m0, 4); break;
            }
        }
}

/* The decode-row path: one x row against the 32-element formats, GG_V_ROWS weight rows at a time with their
 * blocks interleaved. Each row's arithmetic is that of the path a batch of x rows takes (reg_row's for Q4_0,
 * Q4_1, Q5_0, Q5_1: the same block values, two accumulators and reduction tree; q8_rows' for Q8_0), so a row's
 * result does not depend on the path; what the tile adds is independent multiply-add chains (one row's chains
 * of K / 32 or K / 64 multiply-adds are latency-bound at small K), x loaded once for all of them, one reduction
 * and store, and prefetches spread over the block loop. A tail tile repeats the range's last row (its result
 * dropped). Measured on one core, weight in L2, against the register path: 1.5x (Q4_1 960x576), 1.65x (Q4_0),
 * 1.1x (Q5_0/Q5_1), 1.3x (Q8_0 576x576); 8 rows per tile ran no faster than 4. */
enum { GG_V_ROWS = 4 };

/* y[n + i] (i < 4, n + i < hi) = the sum of s_i's lanes (plus bias, residual), each summed in
 * _mm512_reduce_add_ps's tree, as the other kernels do: 512 -> 256 -> 128 bits, then lanes j + (j ^ 2), then
 * j + (j ^ 1); the four rows' steps share their shuffles */
static inline __attribute__((always_inline)) void store4(const gg_gemm *g, int n, int hi, __m512 s0, __m512 s1,
                                                         __m512 s2, __m512 s3) {
    /* h01: row 0's 8 partial sums in quarters 0 and 1, row 1's in 2 and 3 */
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x44), _mm512_shuffle_f32x4(s0, s1, 0xEE));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(s2, s3, 0x44), _mm512_shuffle_f32x4(s2, s3, 0xEE));
    /* quarter r: row r's 4 partial sums */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
    const __m512 e = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));
    const __m512 f = _mm512_add_ps(e, _mm512_permute_ps(e, 0xB1));
    const __m128 sums = _mm512_castps512_ps128(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), f));
    if (n + 4 <= hi && !g->bias && !g->res && !g->io_bf16) {
        _mm_storeu_ps((float *)g->y + n, sums);
    } else {
        float o[4];
        _mm_storeu_ps(o, sums);
        for (int i = 0; i < 4 && n + i < hi; i++) gg_store(g, n + i, 0, o[i]);
    }
}

static inline __attribute__((always_inline)) void gemv4_tile(const int t, const gg_gemm *g, int n, int hi) {
    const int BY = t == GG_Q4_0 ? 18 : t == GG_Q4_1 ? 20 : t == GG_Q5_0 ? 22 : 24, nb = g->K / 32;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const float *x = g->x;
    const uint8_t *r[GG_V_ROWS];
    for (int i = 0; i < GG_V_ROWS; i++) r[i] = g->w + (int64_t)(n + i < hi ? n + i : hi - 1) * g->ws;
    __m512 a0[GG_V_ROWS], a1[GG_V_ROWS];
    for (int i = 0; i < GG_V_ROWS; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const char *pf = (const char *)r[0] + GG_PREFETCH_BYTES, *end = (const char *)g->w + (int64_t)g->N * g->ws;
    for (int b = 0; b < nb; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        prefetch_lines(pf + 128 * b, 2, end);
        for (int i = 0; i < GG_V_ROWS; i++) {
            __m512 w0, w1;
            blk32(t, r[i] + (int64_t)b * BY, iota, &w0, &w1);
            a0[i] = _mm512_fmadd_ps(w0, x0, a0[i]);
            a1[i] = _mm512_fmadd_ps(w1, x1, a1[i]);
        }
    }
    store4(g, n, hi, _mm512_add_ps(a0[0], a1[0]), _mm512_add_ps(a0[1], a1[1]), _mm512_add_ps(a0[2], a1[2]),
           _mm512_add_ps(a0[3], a1[3]));
}

/* Q8_0: q8_rows' arithmetic (mb == 1) for a tile of rows: per pair of blocks the codes times x, scaled by each
 * block's d into one of two accumulators */
static void gemv_q8_0(const gg_gemm *g, int lo, int hi) {
    const int nb = g->K / 32;
    const float *x = g->x;
    for (int n = lo; n < hi; n += GG_V_ROWS) {
        const uint8_t *r[GG_V_ROWS];
        for (int i = 0; i < GG_V_ROWS; i++) r[i] = g->w + (int64_t)(n + i < hi ? n + i : hi - 1) * g->ws;
        __m512 a0[GG_V_ROWS], a1[GG_V_ROWS];
        for (int i = 0; i < GG_V_ROWS; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        const char *pf = (const char *)r[0] + GG_PREFETCH_BYTES, *end = (const char *)g->w + (int64_t)g->N * g->ws;
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            const __m512 x2 = _mm512_loadu_ps(x + 32 * b + 32), x3 = _mm512_loadu_ps(x + 32 * b + 48);
            prefetch_lines(pf + 160 * b, 5, end);  /* 320 bytes per step of two blocks */
            for (int i = 0; i < GG_V_ROWS; i++) {
                const uint8_t *p = r[i] + (int64_t)b * 34;
                const __m512 c0 = cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
                const __m512 c1 = cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
                const __m512 c2 = cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 36))));
                const __m512 c3 = cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 52))));
                const __m512 t0 = _mm512_fmadd_ps(c1, x1, _mm512_mul_ps(c0, x0));
                const __m512 t1 = _mm512_fmadd_ps(c3, x3, _mm512_mul_ps(c2, x2));
                a0[i] = _mm512_fmadd_ps(t0, _mm512_set1_ps(gg_f16t(p)), a0[i]);
                a1[i] = _mm512_fmadd_ps(t1, _mm512_set1_ps(gg_f16t(p + 34)), a1[i]);
            }
        }
        if (b < nb) {
            const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            for (int i = 0; i < GG_V_ROWS; i++) {
                const uint8_t *p = r[i] + (int64_t)b * 34;
                const __m512 c0 = cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
                const __m512 c1 = cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
                const __m512 t0 = _mm512_fmadd_ps(c1, x1, _mm512_mul_ps(c0, x0));
                a0[i] = _mm512_fmadd_ps(t0, _mm512_set1_ps(gg_f16t(p)), a0[i]);
            }
        }
        store4(g, n, hi, _mm512_add_ps(a0[0], a1[0]), _mm512_add_ps(a0[1], a1[1]), _mm512_add_ps(a0[2], a1[2]),
               _mm512_add_ps(a0[3], a1[3]));
    }
}

#define GG_GEMV(name, T)                                                                                 \
    static void name(const gg_gemm *g, int lo, int hi) {                                                 \
        for (int n = lo; n < hi; n += GG_V_ROWS) {                                                       \
            gemv4_tile(T, g, n, hi);                                                                     \
        }                                                                                                \
    }
GG_GEMV(gemv_q4_0, GG_Q4_0)
GG_GEMV(gemv_q4_1, GG_Q4_1)
GG_GEMV(gemv_q5_0, GG_Q5_0)
GG_GEMV(gemv_q5_1, GG_Q5_1)
#undef GG_GEMV

#endif

#if GG_DOT
/* ------------------------------------------------------------------------------- the bfloat16 dot path */

/* What the dot kernels read besides the weight: bfloat16 x rows (in place), per block the sums of x the offsets
 * multiply (computed once per call), and the code-to-bfloat16 tables (built once per call, not per row). */
typedef struct {
    const uint16_t *x;  /* [M] rows, xs elements apart */
    int64_t xs;
    const float *sums;  /* [M][S] */
    int S;
    uint16_t lut[32], lut16[32];  /* bfloat16 of i & 15 and of (i & 15) + 16: nibble tables (5 index bits) */
    uint16_t t64[64];             /* bfloat16 of i < 64: Q6_K's table */
} gg_xb;

/* per super-block the sums the offsets multiply: Q4_K/Q5_K the 8 sub-block sums, Q6_K -32 times the 16 sums */
static void prep_sums(int t, const float *x, int K, float *s) {
    const int g = t == GG_Q6_K ? 16 : 32;
    const float c = t == GG_Q6_K ? -32.0f : 1.0f;
    for (int b = 0; b < K / g; b++) {
        float sum = 0.0f;
        for (int j = 0; j < g; j++) sum += x[g * b + j];
        s[b] = c * sum;
    }
}

static void prep_tables(gg_xb *xb) {
    for (int i = 0; i < 64; i++) xb->t64[i] = f32_to_bf16((float)i);
    for (int i = 0; i < 32; i++) xb->lut[i] = xb->t64[i & 15], xb->lut16[i] = xb->t64[(i & 15) + 16];
}

/* t + v . x, 32 bfloat16 products summed pairwise into float32 lanes */
#define GG_DOT1(t, v, xp) ((t) = _mm512_dpbf16_ps((t), (__m512bh)(v), (__m512bh)_mm512_loadu_si512(xp)))

/* Q4_K/Q5_K, one weight row against mb x rows: per super-block 4 runs of 32 code bytes, each two sub-blocks of
 * 32 (low nibbles, high nibbles; Q5_K's fifth bits pick the +16 table) */
static inline __attribute__((always_inline)) void dot_k45_row(const int t, const uint8_t *row, int nsb,
                                                              const gg_xb *xb, int m0, const int mb, float *out) {
    const int QS = t == GG_Q4_K ? 16 : 48;
    const __m512i lut = _mm512_loadu_si512(xb->lut), lut16 = _mm512_loadu_si512(xb->lut16);
    __m512 acc[GG_MB];
    __m256 off[GG_MB];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps(), off[m] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *p = row + (int64_t)sb * (t == GG_Q4_K ? 144 : 176);
        float sm[16];  /* d * scale (8), -dmin * min (8) */
        k_scales(p, sm);
        const __m256 negmin = _mm256_loadu_ps(sm + 8);
        for (int m = 0; m < mb; m++)  /* the mins' share: -dmin * min * sum(x), once per sub-block */
            off[m] = _mm256_fmadd_ps(negmin, _mm256_loadu_ps(xb->sums + (int64_t)(m0 + m) * xb->S + 8 * sb), off[m]);
        const __m256i qh = t == GG_Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + QS + 32 * i)));
            const __m512i wh = _mm512_srli_epi16(w, 4);
            __m512i lo = _mm512_permutexvar_epi16(w, lut), hi = _mm512_permutexvar_epi16(wh, lut);
            if (t == GG_Q5_K) {
                lo = _mm512_mask_permutexvar_epi16(lo, _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * i)))),
                                                   w, lut16);
                hi = _mm512_mask_permutexvar_epi16(hi, _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(2 << (2 * i)))),
                                                   wh, lut16);
            }
            const __m512 slo = _mm512_set1_ps(sm[2 * i]), shi = _mm512_set1_ps(sm[2 * i + 1]);
            for (int m = 0; m < mb; m++) {
                const uint16_t *xp = xb->x + (int64_t)(m0 + m) * xb->xs + (int64_t)sb * 256 + 64 * i;
                __m512 tl = _mm512_setzero_ps(), th = _mm512_setzero_ps();
                GG_DOT1(tl, lo, xp);
                GG_DOT1(th, hi, xp + 32);
                acc[m] = _mm512_fmadd_ps(tl, slo, acc[m]);
                acc[m] = _mm512_fmadd_ps(th, shi, acc[m]);
            }
        }
    }
    for (int m = 0; m < mb; m++) out[m] = _mm512_reduce_add_ps(acc[m]) + hsum8(off[m]);
}

/* Q6_K, one weight row against mb x rows: per half of a super-block, 64 ql and 32 qh bytes give four runs of 32
 * six-bit codes (vpermt2w: a 64-entry table, 6 index bits); each run spans two 16-element sub-blocks, so its
 * scale vector is two halves */
static inline __attribute__((always_inline)) void dot_q6k_row(const uint8_t *row, int nsb, const gg_xb *xb, int m0,
                                                              const int mb, float *out) {
    const __m512i t_lo = _mm512_loadu_si512(xb->t64), t_hi = _mm512_loadu_si512(xb->t64 + 32);
    const __m512i c15 = _mm512_set1_epi16(15);
    __m512 acc[GG_MB], off[GG_MB];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps(), off[m] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *p = row + (int64_t)sb * 210;
        const __m512 scf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))),
                                         _mm512_set1_ps(gg_f16t(p + 208)));
        for (int m = 0; m < mb; m++)  /* the -32 offsets' share: -32 * d * scale * sum(x), once per sub-block */
            off[m] = _mm512_fmadd_ps(scf, _mm512_loadu_ps(xb->sums + (int64_t)(m0 + m) * xb->S + 16 * sb), off[m]);
        for (int h = 0; h < 2; h++) {
            const __m512i A = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 64 * h)));
            const __m512i B = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 64 * h + 32)));
            const __m512i H = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h)));
            /* (a & 15) | (b & ~15): ternary-logic 0xE4 = c ? a : b with c = 15; bits above 5 are not read */
            __m512i e[4];
            e[0] = _mm512_ternarylogic_epi32(A, _mm512_slli_epi16(H, 4), c15, 0xE4);
            e[1] = _mm512_ternarylogic_epi32(B, _mm512_slli_epi16(H, 2), c15, 0xE4);
            e[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(A, 4), H, c15, 0xE4);
            e[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(B, 4), _mm512_srli_epi16(H, 2), c15, 0xE4);
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_permutex2var_epi16(t_lo, e[j], t_hi);
                const int g = 8 * h + 2 * j;  /* its sub-blocks g and g + 1 */
                const __m512 sv = _mm512_permutexvar_ps(
                    _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(g), _mm512_set1_epi32(g + 1)), scf);
                for (int m = 0; m < mb; m++) {
                    const uint16_t *xp = xb->x + (int64_t)(m0 + m) * xb->xs + (int64_t)sb * 256 + 128 * h + 32 * j;
                    __m512 tv = _mm512_setzero_ps();
                    GG_DOT1(tv, v, xp);
                    acc[m] = _mm512_fmadd_ps(tv, sv, acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < mb; m++) out[m] = _mm512_reduce_add_ps(acc[m]) + _mm512_reduce_add_ps(off[m]);
}

/* Rows [lo, hi) against every x row: tiles of GG_DOT_TILE weight rows (in L1/L2 while each group of up to GG_MB
 * x rows passes over them), each (type, mb) its own copy of the kernel. */
enum { GG_DOT_TILE = 32 };

#define GG_DOT_ROWS(name, call)                                                                          \
    static void name(const gg_gemm *g, const gg_xb *xb, int lo, int hi) {                                \
        const int nsb = g->K / 256;                                                                      \
        for (int n0 = lo; n0 < hi; n0 += GG_DOT_TILE) {                                                  \
            const int n1 = hi - n0 < GG_DOT_TILE ? hi : n0 + GG_DOT_TILE;                                \
            for (int m0 = 0; m0 < g->M; m0 += GG_MB) {                                                   \
                const int mb = g->M - m0 < GG_MB ? g->M - m0 : GG_MB;                                    \
                for (int n = n0; n < n1; n++) {                                                          \
                    const uint8_t *row = g->w + (int64_t)n * g->ws;                                      \
                    float out[GG_MB];                                                                    \
                    if (m0 == 0) prefetch_row(g, n);                                                 \
                    switch (mb) {                                                                        \
                        case 1: call(1); break;                                                          \
                        case 2: call(2); break;                                                          \
                        case 3: call(3); break;                                                          \
                        default: call(4); break;                                                         \
                    }                                                                                    \
                    for (int m = 0; m < mb; m++) gg_store(g, n, m0 + m, out[m]);                         \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

#define Q4K(mb_) dot_k45_row(GG_Q4_K, row, nsb, xb, m0, mb_, out)
#define Q5K(mb_) dot_k45_row(GG_Q5_K, row, nsb, xb, m0, mb_, out)
#define Q6K(mb_) dot_q6k_row(row, nsb, xb, m0, mb_, out)
GG_DOT_ROWS(dot_rows_q4_k, Q4K)
GG_DOT_ROWS(dot_rows_q5_k, Q5K)
GG_DOT_ROWS(dot_rows_q6_k, Q6K)
#undef Q4K
#undef Q5K
#undef Q6K
#undef GG_DOT_ROWS

typedef void (*gg_dot_fn)(const gg_gemm *, const gg_xb *, int, int);

static gg_dot_fn gg_dot_rows(int t) {
    switch (t) {
        case GG_Q4_K: return dot_rows_q4_k;
        case GG_Q5_K: return dot_rows_q5_k;
        case GG_Q6_K: return dot_rows_q6_k;
        default: return NULL;
    }
}
#endif /* GG_DOT */

/* Which kernel takes how many x rows (measured on one core, -D on the compile line to move them): bfloat16 x
 * goes to the dot path up to GG_DOT_MAX_ROWS_K45 (Q4_K, Q5_K) / GG_DOT_MAX_ROWS_Q6K rows, where it beats
 * widening x for the register path (for the 32-element formats it never does: the register path's nibble
 * tables are as cheap as vpermw); one row of the 32-element formats to the decode-row path (gemv_*); Q8_0 to
 * its deferred-scale kernel up to GG_Q8_MAX_ROWS; the rest to the register path (the generic one without
 * AVX-512). */
#ifndef GG_DOT_MAX_ROWS_K45
#define GG_DOT_MAX_ROWS_K45 2
#endif
#ifndef GG_DOT_MAX_ROWS_Q6K
#define GG_DOT_MAX_ROWS_Q6K 8
#endif
#ifndef GG_Q8_MAX_ROWS
#define GG_Q8_MAX_ROWS 4
#endif

#if GG_AVX512
typedef void (*gg_rows_fn)(const gg_gemm *, int, int);

/* How the output rows are shared among the threads. Each thread starts on its own contiguous range (one stream of
 * the weight), in chunks of about GG_CHUNK_BYTES of weight; a thread that has finished its range takes the
 * chunks another has not started, from that range's far end. So a thread that starts late (woken from sleep,
 * or descheduled on a busy host) finds less work left, though the call still waits for it at the region's end.
 * Measured on a shared 2-vCPU host, SmolLM2's decode step: the same median call time as fixed ranges, a lower
 * fastest one where the worker had fallen asleep between calls. Which thread multiplies a row never changes
 * its arithmetic. -DGG_STEAL=0: fixed contiguous ranges. */
#ifndef GG_STEAL
#define GG_STEAL 1
#endif
#ifndef GG_CHUNK_BYTES
#define GG_CHUNK_BYTES (16 * 1024)
#endif
enum { GG_MAX_SPANS = 64 };
typedef struct {
    int64_t v;  /* the chunks [lo, hi) not started: lo | hi << 32 */
    char pad[56];
} gg_span;

/* the next chunk of span s from its front (its owner) or its back (another thread); 0 when none is left */
static inline int span_take(gg_span *s, int back, int *c) {
    int64_t cur = __atomic_load_n(&s->v, __ATOMIC_RELAXED);
    for (;;) {
        const int lo = (int)(uint32_t)cur, hi = (int)(cur >> 32);
        if (lo >= hi) return 0;
        const int64_t nv = back ? (int64_t)lo | (int64_t)(hi - 1) << 32 : (int64_t)(lo + 1) | (int64_t)hi << 32;
        if (__atomic_compare_exchange_n(&s->v, &cur, nv, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *c = back ? hi - 1 : lo;
            return 1;
        }
    }
}

/* fn over the output rows [0, N) by nt threads, in ranges that start at multiples of granule rows */
static void run_rows(gg_rows_fn fn, const gg_gemm *g, int nt, int granule) {
#ifdef _OPENMP
    if (nt > 1 && GG_STEAL) {
        const int64_t row_bytes = (int64_t)(g->K / g->el) * g->by;
        int64_t rows = GG_CHUNK_BYTES / row_bytes / granule * granule;
        if (rows < granule) rows = granule;
        const int chunk = (int)rows, nc = (int)((g->N + rows - 1) / rows), ns = nt < GG_MAX_SPANS ? nt : GG_MAX_SPANS;
        gg_span sp[GG_MAX_SPANS] __attribute__((aligned(64)));
        for (int t = 0; t < ns; t++) sp[t].v = (int64_t)nc * t / ns | ((int64_t)nc * (t + 1) / ns) << 32;
        #pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num();
            int c;
            for (int k = 0; k < ns; k++) {  /* its own span from the front, then the others' from their ends */
                gg_span *s = &sp[(t + k) % ns];
                if (t >= ns && k == 0) continue;
                while (span_take(s, k > 0, &c)) fn(g, c * chunk, g->N - c * chunk > chunk ? (c + 1) * chunk : g->N);
            }
        }
        return;
    }
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int units = (g->N + granule - 1) / granule;
        const int lo = (int)((int64_t)units * t / T) * granule, hi = (int)((int64_t)units * (t + 1) / T) * granule;
        fn(g, lo, hi < g->N ? hi : g->N);
    }
#else
    (void)nt, (void)granule;
    fn(g, 0, g->N);
#endif
}
#endif

#if GG_DOT
/* the dot path (bfloat16 x): x's block sums, then the rows */
static int gemm_dot(gg_gemm *g, gg_dot_fn dot, const void *x, int64_t xs, int nt) {
    const int qtype = g->qtype, K = g->K, M = g->M;
    const int S = qtype == GG_Q6_K ? K / 16 : K / 32;
    float *sums = malloc((size_t)M * S * sizeof(float));
    float *wide = malloc((size_t)K * sizeof(float));
    if (!sums || !wide) {
        free(sums);
        free(wide);
        return -2;
    }
    for (int m = 0; m < M; m++) {
        widen_bf16(wide, (const uint16_t *)x + (int64_t)m * xs, K);
        prep_sums(qtype, wide, K, sums + (int64_t)m * S);
    }
    gg_xb xb = {.x = (const uint16_t *)x, .xs = xs, .sums = sums, .S = S};
    prep_tables(&xb);
#ifdef _OPENMP
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        dot(g, &xb, (int)((int64_t)g->N * t / T), (int)((int64_t)g->N * (t + 1) / T));
    }
#else
    dot(g, &xb, 0, g->N);
#endif
    free(sums);
    free(wide);
    return 0;
}
#endif

#if !GG_AVX512
/* the generic path: each thread dequantizes GG_R rows at a time into its own buffer */
static int gemm_generic_run(const gg_gemm *g, int nt) {
    int rc = 0;
#ifdef _OPENMP
    #pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
        (void)nt;
#endif
        float *wb = calloc((size_t)GG_R * g->K, sizeof(float));
        if (!wb) {
#ifdef _OPENMP
            #pragma omp atomic write
#endif
            rc = -2;
        } else {
            gemm_generic(g, (int)((int64_t)g->N * t / T), (int)((int64_t)g->N * (t + 1) / T), wb);
            free(wb);
        }
    }
    return rc;
}
#endif

/* y [M, N] (rows ys elements apart) = res [M, N] (rows rs apart; NULL: none) + x [M, K] (rows xs apart) . W^T
 * + bias [N] (NULL: none), W [N, K] in blocks of type qtype, rows ws bytes apart. x, bias, res and y are float32,
 * or bfloat16 with bf16 set. Returns 0; -1 for an unsupported type or K; -2 when scratch memory ran out. */
int kvpilot_gguf_gemm(int qtype, const uint8_t *w, int64_t ws, int N, int K, const void *x, int64_t xs, int M,
                      const void *bias, const void *res, int64_t rs, void *y, int64_t ys, int bf16, int num_threads) {
    int el, by;
    if (!gg_shape(qtype, &el, &by) || K <= 0 || K % el) return -1;
    if (M <= 0 || N <= 0) return 0;
    pthread_once(&gg_f16_once, gg_f16_fill);
    gg_gemm g = {qtype, el, by, N, K, M, w, ws, NULL, 0, bf16, bias, res, rs, y, ys};
    const int nt = gg_threads(num_threads, (int64_t)N * (K / el) * by, N);
#if GG_DOT
    const gg_dot_fn dot = gg_dot_rows(qtype);
    if (dot && bf16 && M <= (qtype == GG_Q6_K ? GG_DOT_MAX_ROWS_Q6K : GG_DOT_MAX_ROWS_K45))
        return gemm_dot(&g, dot, x, xs, nt);
#endif
    /* bfloat16 x: the other paths multiply float32, so x is widened once (a decode step's few rows on the stack) */
    float xbuf[GG_X_STACK];
    float *xw = NULL;
    if (bf16) {
        xw = (int64_t)M * K <= GG_X_STACK ? xbuf : malloc((size_t)M * K * sizeof(float));
        if (!xw) return -2;
        for (int m = 0; m < M; m++) widen_bf16(xw + (int64_t)m * K, (const uint16_t *)x + (int64_t)m * xs, K);
        g.x = xw, g.xs = K;
    } else {
        g.x = (const float *)x, g.xs = xs;
    }
    int rc = 0;
#if GG_AVX512
    const gg_rows_fn gemv = qtype == GG_Q4_0 ? gemv_q4_0 : qtype == GG_Q4_1 ? gemv_q4_1 : qtype == GG_Q5_0 ? gemv_q5_0
                          : qtype == GG_Q5_1 ? gemv_q5_1 : qtype == GG_Q8_0 ? gemv_q8_0 : NULL;
    if (M == 1 && gemv)
        run_rows(gemv, &g, nt, GG_V_ROWS);
    else if (qtype == GG_Q8_0 && M <= GG_Q8_MAX_ROWS)
        run_rows(gemm_q8, &g, nt, 32);
    else
        run_rows(gg_reg_rows(qtype), &g, nt, 1);
#else
    rc = gemm_generic_run(&g, nt);
#endif
    if (xw != xbuf) free(xw);
    return rc;
}

/* The gemm's arguments packed in one int64 array (in its order; pointers as integers): a call from Python
 * through ctypes then converts one argument instead of 15, a few microseconds of a decode step's ~200 calls. */
int kvpilot_gguf_gemm_packed(const int64_t *a) {
    return kvpilot_gguf_gemm((int)a[0], (const uint8_t *)(intptr_t)a[1], a[2], (int)a[3], (int)a[4],
                             (const void *)(intptr_t)a[5], a[6], (int)a[7], (const void *)(intptr_t)a[8],
                             (const void *)(intptr_t)a[9], a[10], (void *)(intptr_t)a[11], a[12], (int)a[13],
                             (int)a[14]);
}

/* w [rows] rows of ws bytes (blocks of type qtype along cols) -> out [rows, cols], rows os elements apart,
 * float32 or (bf16) bfloat16 rounded to nearest even. Returns 0, or -1 for an unsupported type or cols. */
int kvpilot_gguf_dequant(int qtype, const uint8_t *w, int64_t ws, int rows, int cols, void *out, int64_t os,
                         int bf16, int num_threads) {
    int el, by;
    if (!gg_shape(qtype, &el, &by) || cols <= 0 || cols % el) return -1;
    const int nt = gg_threads(num_threads, (int64_t)rows * cols * 4, rows);
    (void)nt;
#if GG_AVX512
    /* the register path's unpacking, storing where the GEMM multiplies */
    pthread_once(&gg_f16_once, gg_f16_fill);
    const gg_deq_fn fn = gg_deq_rows(qtype);
#ifdef _OPENMP
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        fn(w, ws, (int)((int64_t)rows * t / T), (int)((int64_t)rows * (t + 1) / T), cols, out, os, bf16);
    }
#else
    fn(w, ws, 0, rows, cols, out, os, bf16);
#endif
#else
    const gg_row_fn fn = gg_row(qtype);
    const int nb = cols / el;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
    for (int r = 0; r < rows; r++) {
        const uint8_t *src = w + (int64_t)r * ws;
        if (!bf16) {
            fn(src, (float *)out + (int64_t)r * os, nb);
            continue;
        }
        /* through an L1 buffer of one K-quant super-block (8 blocks of the others) at a time */
        float tmp[256];
        uint16_t *dst = (uint16_t *)out + (int64_t)r * os;
        const int per = 256 / el;
        for (int b = 0; b < nb; b += per) {
            const int n = nb - b < per ? nb - b : per;
            fn(src + (int64_t)b * by, tmp, n);
            round_bf16(tmp, dst + (int64_t)b * el, n * el);
        }
    }
#endif
    return 0;
}

/* 1 where this build multiplies with the bfloat16 dot path (for the tests and the benchmark's report) */
int kvpilot_gguf_dot_path(void) { return GG_DOT; }
