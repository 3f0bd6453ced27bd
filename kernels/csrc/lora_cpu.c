/* Batched LoRA on the CPU (the punica/SGMV design, kernels/lora.py): for each segment of rows [s, e) with an
 * adapter slot, y[s:e] += (x[s:e] . A[slot]^T) . B[slot]^T, every segment of a layer in one call.
 *
 * Why it is built this way. A decode step calls this once per LoRA'd projection (~120 calls for a 30-layer
 * model), each with a few rows per adapter: the work per call is small (T x R x (in + out) multiply-adds, R
 * ~16), so what counts is a call costing a few microseconds, not two library GEMMs per segment.
 *
 * - shrink, t = x . A^T ([rows, R]): A[slot] is [R, in], so each t element is a dot product along `in`, which is
 *   long: a register tile of SH_MB rows x SH_RB ranks accumulates vectors along `in` and reduces them once (on
 *   AVX-512 the tile's 16 vectors together). With bfloat16 on AVX512-BF16 CPUs the products are of bfloat16
 *   pairs (vdpbf16ps: exact products, float32 sums).
 * - t is rounded to the model dtype, as the torch reference's shrink GEMM rounds it (bfloat16: once, to nearest
 *   even).
 * - expand, y += t . B^T: B[slot] is [out, R], a dot product along R, which is short. So panels of PANEL output
 *   columns of B are transposed into [R][PANEL] (16x16 in-register transposes on AVX-512) once per segment, and
 *   the outer-product tile of panel_kernel.h multiplies the segment's rows, PANEL_MB at a time, by each panel,
 *   summing in float32 (float32 y: starting from y's values; bfloat16 y: the sum added in float32 and rounded
 *   once). bfloat16 with even R transposes rank pairs (32 bits each) for panel_rows_bf16. A segment of a few
 *   rows uses each transposed 16x16 block straight from registers (the same sums: a row's result does not depend
 *   on its segment's length, so a request gives the same bits alone and batched).
 *
 * The threads split the ranks of the shrink and the panels of the expand (contiguous shares: each reads its
 * part of A and B once), with a barrier between; small calls run on one thread, as waking another costs more
 * than it saves. Each output element is summed by one thread in one order: results do not depend on the thread
 * count. Segments longer than max_rows are skipped (the caller runs those through torch's GEMM). The AVX2 and
 * plain-C builds (CPUs without AVX-512) share the tiles but transpose with scalar loops and have no dot form.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"
#include "panel_kernel.h"
#include "thread_scratch.h"

#if USE_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define LORA_512 1
#else
#define LORA_512 0
#endif
#if LORA_512 && HAVE_PANEL_BF16
#define LORA_DOT 1
#else
#define LORA_DOT 0
#endif

/* AVX-512: segments of up to FUSED_ROWS (<= 4) rows expand without storing panels (expand_rows_fused, the same
 * results); one row only where B's rows are under 16 32-bit elements (bfloat16 pairs at R = 16), as a 16x16
 * transpose is then half empty. Measured over SmolLM2's shapes at R = 16 and 64: ~1.5x faster than the panels
 * for one row (~1.9x at R = 64), ~1.2x for 2-3, level at 4. */
#ifndef FUSED_ROWS
#define FUSED_ROWS 3
#endif
_Static_assert(FUSED_ROWS >= 0 && FUSED_ROWS <= 4, "expand_rows_fused_n instantiates up to 4 rows");
/* multiply-adds below which a call stays on one thread (-D on the compile line to measure): with SmolLM2's
 * shapes at R = 16 a second thread gains ~15% from 4 rows (~100k) and loses ~50% at one row (~25k) */
#ifndef LORA_MIN_PARALLEL_MACS
#define LORA_MIN_PARALLEL_MACS (64 * 1024)
#endif

/* how the operands are read: float32, bfloat16 widened to float32, bfloat16 pairs (vdpbf16ps) */
enum { LK_F32 = 0, LK_BF16 = 1, LK_DOT = 2 };

typedef struct {
    void *y;
    const void *x, *a, *b;
    int64_t ys, xs;
    int K, N, R, kind, expand_pairs, bf16;
    const int64_t *starts, *slots;
    int nseg;
    int64_t max_rows;
    float *t;       /* [T][R]: t of every row the call owns (float32 paths) */
    uint16_t *tb;   /* [T][R]: the same in bfloat16 (pairs path) */
    uint32_t *panels;  /* the [R][PANEL] panels of B[slot] (each thread's share in its own place) */
} lora_job;

static inline int owns(const lora_job *j, int i) {
    const int64_t len = j->starts[i + 1] - j->starts[i];
    return j->slots[i] >= 0 && len > 0 && len <= j->max_rows;
}

/* ---------------------------------------------------------------------------------- shrink (dot products) */

#if LORA_512
/* s[j] = the sum of v[j]'s elements, j < 16: pairwise adds after unpacks within 128-bit lanes, then across lanes
 * (30 shuffles for 16 sums, against 64 for transposing a 16x16 tile) */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) {
    __m512 w[8], z[4];
    for (int i = 0; i < 8; i++)  /* lane L: partials of v[2i] at 0 and 2, of v[2i+1] at 1 and 3 */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* lane L: the lane sums of v[4i .. 4i+3] */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x44), _mm512_shuffle_f32x4(z[0], z[1], 0xEE));
    const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x44), _mm512_shuffle_f32x4(z[2], z[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
#endif

enum { SH_RB = 4 };
#if LORA_512
typedef __m512 vf;
enum { VW = 16 };
#define SH_MB 4  /* a macro: the row-count switch below is preprocessed by it */
static inline __attribute__((always_inline)) vf vload(const void *p, int64_t i, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))),
                              16));
    return _mm512_loadu_ps((const float *)p + i);
}
#define vzero() _mm512_setzero_ps()
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif USE_AVX2
typedef __m256 vf;
enum { VW = 8 };
#define SH_MB 2  /* 2 x 4 accumulators: AVX2 has 16 registers */
static inline __attribute__((always_inline)) vf vload(const void *p, int64_t i, const int bf16) {
    return bf16 ? load_bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}
#define vzero() _mm256_setzero_ps()
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vsum(v) hsum8(v)
#else
typedef float vf;
enum { VW = 1 };
#define SH_MB 2
#define vload(p, i, bf16) load_io(p, i, bf16)
#define vzero() 0.0f
#define vfma(a, b, c) ((a) * (b) + (c))
#define vsum(v) (v)
#endif

/* out[m * SH_RB + r] = the sum of acc[m][r]'s lanes for m < mb, r < rb, in an order that is the same for every
 * element. AVX-512: the 4 x 4 tile is 16 vectors, summed together by reduce16 (a horizontal sum each costs
 * several times more). */
static inline __attribute__((always_inline)) void sum_tile(vf (*acc)[SH_RB], const int mb, const int rb,
                                                           float *out) {
#if LORA_512
    /* every tile, however small: a row's sums then do not depend on the tile it was in */
    __m512 all[16];
    for (int q = 0; q < 16; q++) all[q] = _mm512_setzero_ps();
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rb; r++) all[m * SH_RB + r] = acc[m][r];
    _mm512_storeu_ps(out, reduce16(all));
#else
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rb; r++) out[m * SH_RB + r] = vsum(acc[m][r]);
#endif
}

/* sums[m * SH_RB + r] = x[m] . a[r] over K for m < mb, r < rb (x rows xs elements apart, a rows K apart); mb,
 * rb and bf16 are constants at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void shrink_tile(const void *x, int64_t xs, const int mb,
                                                              const void *a, const int rb, int K, const int bf16,
                                                              float *sums) {
    vf acc[SH_MB][SH_RB];
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rb; r++) acc[m][r] = vzero();
    int k = 0;
    for (; k + VW <= K; k += VW) {
        vf xv[SH_MB];
        for (int m = 0; m < mb; m++) xv[m] = vload(x, m * xs + k, bf16);
        for (int r = 0; r < rb; r++) {
            const vf av = vload(a, (int64_t)r * K + k, bf16);
            for (int m = 0; m < mb; m++) acc[m][r] = vfma(xv[m], av, acc[m][r]);
        }
    }
    float whole[SH_MB * SH_RB];
    sum_tile(acc, mb, rb, whole);
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rb; r++) {
            float s = whole[m * SH_RB + r];
            for (int j = k; j < K; j++) s += load_io(x, m * xs + j, bf16) * load_io(a, (int64_t)r * K + j, bf16);
            sums[m * SH_RB + r] = s;
        }
}

#if LORA_DOT
/* shrink_tile for bfloat16 x and A by 32-element vectors of bfloat16 pairs (the tail loaded masked, zeros past
 * K) */
static inline __attribute__((always_inline)) void shrink_tile_dot(const uint16_t *x, int64_t xs, const int mb,
                                                                  const uint16_t *a, const int rb, int K,
                                                                  float *sums) {
    __m512 acc[SH_MB][SH_RB];
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rb; r++) acc[m][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh xv[SH_MB];
        for (int m = 0; m < mb; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + k);
        for (int r = 0; r < rb; r++) {
            const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + (int64_t)r * K + k);
            for (int m = 0; m < mb; m++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], av);
        }
    }
    float whole[SH_MB * SH_RB];
    sum_tile(acc, mb, rb, whole);
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rb; r++) sums[m * SH_RB + r] = whole[m * SH_RB + r];
}
#endif

static void shrink_block(const void *x, int64_t xs, int mb, const void *a, int rb, int K, int kind, float *sums) {
#if LORA_DOT
#define SH_DOT(M, RB) if (kind == LK_DOT) { shrink_tile_dot(x, xs, M, a, RB, K, sums); break; }
#else
#define SH_DOT(M, RB)
#endif
#define SH_CALL(M, RB) SH_DOT(M, RB) if (kind == LK_BF16) shrink_tile(x, xs, M, a, RB, K, 1, sums); \
    else shrink_tile(x, xs, M, a, RB, K, 0, sums);
#define SH_ROWS(M) case M: if (rb == SH_RB) { SH_CALL(M, SH_RB) } else { SH_CALL(M, 1) } break;
    switch (mb) {
        SH_ROWS(1) SH_ROWS(2)
#if SH_MB > 2
        SH_ROWS(3) SH_ROWS(4)
#endif
        default: break;
    }
#undef SH_ROWS
#undef SH_CALL
#undef SH_DOT
}

/* ------------------------------------------------------------------------------ expand (transposed panels) */

#if LORA_512
/* r[i] (16 rows of 16 32-bit elements) transposed in place: unpacks within 128-bit lanes, then a 4x4 transpose
 * of the lanes */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* r[4i + c], lane L: element c + 4L of rows 4i..4i+3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; c++) {  /* element c + 4L of every row: lane L of r[c], r[4 + c], r[8 + c], r[12 + c] */
        const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif

#if LORA_512
/* dst[c] += add[c] for c < nc (<= 16), float32 or bfloat16 (rounded once) */
static inline __attribute__((always_inline)) void add_into(void *dst, int nc, __m512 add, int bf16) {
    const __mmask16 mask = (__mmask16)((1u << nc) - 1u);
    if (!bf16) {
        _mm512_mask_storeu_ps(dst, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), add));
        return;
    }
    const __m512i old = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, dst));
    const __m512i bits = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(old, 16)), add));
    /* round to nearest even, as f32_to_bf16 */
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(rounded));
}

/* y rows [m0, m0 + mb) (mb <= FUSED_ROWS, a constant at each call site) += t . B^T over the outputs
 * [n_lo, n_hi): the panel path's products summed in its order (bit for bit the same results: a row's does not
 * depend on how many rows its segment has), with each 16x16 block of the panel transposed in registers and used
 * at once instead of stored, and none of the tiles' fixed costs: the cheaper form for a segment of a few rows. */
static inline __attribute__((always_inline)) void expand_rows_fused(const lora_job *j, int64_t m0, const int mb,
                                                                   int64_t slot, int n_lo, int n_hi) {
    const int R = j->R, N = j->N, C = j->expand_pairs ? R / 2 : R;  /* 32-bit elements of a row of B */
    const int es = j->bf16 ? 2 : 4, full = N / PANEL * PANEL;  /* outputs below `full` lie in full panels */
    for (int n0 = n_lo; n0 < n_hi; n0 += 16) {
        const int nc = n_hi - n0 < 16 ? n_hi - n0 : 16;
        const __mmask16 cols = (__mmask16)((1u << nc) - 1u);
        /* as expand_tile: a float32 tile of a full panel starts from y, any other from 0 and is added at the end */
        const int from_y = !j->bf16 && n0 < full;
        __m512 acc[4];
        for (int m = 0; m < mb; m++)
            acc[m] = from_y ? _mm512_maskz_loadu_ps(cols, (const float *)j->y + (m0 + m) * j->ys + n0)
                            : _mm512_setzero_ps();
        for (int c0 = 0; c0 < C; c0 += 16) {
            const int cc = C - c0 < 16 ? C - c0 : 16;
            const __mmask16 mask = (__mmask16)((1u << cc) - 1u);
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t row = (slot * N + n0 + i) * C + c0;
                if (i >= nc)
                    r[i] = _mm512_setzero_ps();
                else if (j->bf16 && !j->expand_pairs)  /* widened, as panel_of_bf16 */
                    r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)j->b + row)), 16));
                else
                    r[i] = _mm512_maskz_loadu_ps(mask, (const uint32_t *)j->b + row);
            }
            transpose16(r);  /* r[c]: element c0 + c of the 16 rows of B, a row of the panel */
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++) {
                if (c >= cc) break;
                for (int m = 0; m < mb; m++) {
#if HAVE_PANEL_BF16
                    if (j->expand_pairs) {
                        const uint32_t pair = ((const uint32_t *)(j->tb + (m0 + m) * R))[c0 + c];
                        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)r[c], (__m512bh)_mm512_set1_epi32((int)pair));
                        continue;
                    }
#endif
                    acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(j->t[(m0 + m) * R + c0 + c]), r[c], acc[m]);
                }
            }
        }
        for (int m = 0; m < mb; m++) {
            char *dst = (char *)j->y + ((m0 + m) * j->ys + n0) * es;
            if (from_y) _mm512_mask_storeu_ps(dst, cols, acc[m]);
            else add_into(dst, nc, acc[m], j->bf16);
        }
    }
}

static void expand_rows_fused_n(const lora_job *j, int64_t m0, int mb, int64_t slot, int n_lo, int n_hi) {
    switch (mb) {
        case 1: expand_rows_fused(j, m0, 1, slot, n_lo, n_hi); break;
        case 2: expand_rows_fused(j, m0, 2, slot, n_lo, n_hi); break;
        case 3: expand_rows_fused(j, m0, 3, slot, n_lo, n_hi); break;
        case 4: expand_rows_fused(j, m0, 4, slot, n_lo, n_hi); break;
        default: break;
    }
}
#endif

/* Rows n < nc (<= PANEL) of b, a matrix of C 32-bit elements a row (float32 B, or bfloat16 B as rank pairs),
 * into panel [C][PANEL]; columns from nc on are zero. */
static void panel_of_u32(const uint32_t *b, int C, int nc, uint32_t *panel) {
#if LORA_512
    for (int h = 0; h < PANEL; h += 16) {
        const int rows = nc - h < 0 ? 0 : nc - h < 16 ? nc - h : 16;
        for (int c0 = 0; c0 < C; c0 += 16) {
            const int cc = C - c0 < 16 ? C - c0 : 16;
            const __mmask16 mask = (__mmask16)((1u << cc) - 1u);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < rows ? _mm512_maskz_loadu_ps(mask, b + (int64_t)(h + i) * C + c0) : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < cc; i++) _mm512_storeu_ps(panel + (int64_t)(c0 + i) * PANEL + h, r[i]);
        }
    }
#else
    for (int c = 0; c < C; c++)
        for (int j = 0; j < PANEL; j++) panel[(int64_t)c * PANEL + j] = j < nc ? b[(int64_t)j * C + c] : 0u;
#endif
}

/* bfloat16 B rows (R ranks each) widened into a float32 panel [R][PANEL] (builds without the pairs' path) */
static void panel_of_bf16(const uint16_t *b, int R, int nc, float *panel) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PANEL; j++)
            panel[(int64_t)r * PANEL + j] = j < nc ? bf16_to_f32(b[(int64_t)j * R + r]) : 0.0f;
}

/* ------------------------------------------------------------------------------------------------ the call */

/* t for the rank blocks [rb_lo, rb_hi) of every segment the call owns */
static void shrink_share(const lora_job *j, int rb_lo, int rb_hi) {
    const int K = j->K, R = j->R, es = j->bf16 ? 2 : 4;
    float sums[SH_MB * SH_RB];
    for (int i = 0; i < j->nseg; i++) {
        if (!owns(j, i)) continue;
        const char *a = (const char *)j->a + (int64_t)j->slots[i] * R * K * es;
        for (int64_t m0 = j->starts[i]; m0 < j->starts[i + 1]; m0 += SH_MB) {
            const int mb = j->starts[i + 1] - m0 < SH_MB ? (int)(j->starts[i + 1] - m0) : SH_MB;
            const char *x = (const char *)j->x + m0 * j->xs * es;
            for (int blk = rb_lo; blk < rb_hi; blk++) {
                const int r0 = blk * SH_RB, rb = R - r0 < SH_RB ? R - r0 : SH_RB;
                if (rb == SH_RB) {
                    shrink_block(x, j->xs, mb, a + (int64_t)r0 * K * es, SH_RB, K, j->kind, sums);
                } else {
                    for (int r = 0; r < rb; r++)  /* rank r's tile writes column r of sums */
                        shrink_block(x, j->xs, mb, a + (int64_t)(r0 + r) * K * es, 1, K, j->kind, sums + r);
                }
                for (int m = 0; m < mb; m++)
                    for (int r = 0; r < rb; r++) {
                        const float v = sums[m * SH_RB + r];
                        const int64_t at = (m0 + m) * R + r0 + r;
                        if (j->expand_pairs) j->tb[at] = f32_to_bf16(v);
                        else j->t[at] = j->bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
                    }
            }
        }
    }
}

/* y rows [m0, m0 + mb) += t . B^T over the panel of outputs [n0, n0 + nc) */
static void expand_tile(const lora_job *j, int64_t m0, int mb, const uint32_t *panel, int n0, int nc) {
    static const float ones[12] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
    _Static_assert(PANEL_MB <= 12, "ones holds a scale per tile row");
    const int R = j->R;
    float out[PANEL_MB * PANEL];
    if (!j->bf16 && nc == PANEL) {  /* float32 y: the tile starts from y's rows (times 1) and is stored back */
        panel_rows_n(j->t + m0 * R, R, mb, (const float *)panel, R, (float *)j->y + m0 * j->ys + n0, j->ys, ones);
        return;
    }
#if HAVE_PANEL_BF16
    if (j->expand_pairs)
        panel_rows_bf16_n((const uint32_t *)(j->tb + m0 * R), R / 2, mb, panel, R / 2, out, PANEL, NULL);
    else
#endif
        panel_rows_n(j->t + m0 * R, R, mb, (const float *)panel, R, out, PANEL, NULL);
    for (int m = 0; m < mb; m++) {
        const float *acc = out + m * PANEL;
#if LORA_512
        char *dst = (char *)j->y + ((m0 + m) * j->ys + n0) * (j->bf16 ? 2 : 4);
        add_into(dst, nc < 16 ? nc : 16, _mm512_loadu_ps(acc), j->bf16);
        if (nc > 16) add_into(dst + 16 * (j->bf16 ? 2 : 4), nc - 16, _mm512_loadu_ps(acc + 16), j->bf16);
#else
        if (j->bf16) {
            uint16_t *dst = (uint16_t *)j->y + (m0 + m) * j->ys + n0;
            for (int c = 0; c < nc; c++) dst[c] = f32_to_bf16(bf16_to_f32(dst[c]) + acc[c]);
        } else {
            float *dst = (float *)j->y + (m0 + m) * j->ys + n0;
            for (int c = 0; c < nc; c++) dst[c] += acc[c];
        }
#endif
    }
}

/* y += t . B^T for the panels [p_lo, p_hi) of every segment the call owns. A segment's panels are transposed
 * once into `panels` (R x PANEL each), then its rows go by groups of PANEL_MB across all of them: y's rows are
 * read and written once, in order. */
static void expand_share(const lora_job *j, int p_lo, int p_hi, uint32_t *panels) {
    const int R = j->R, N = j->N;
    const int64_t stride = (int64_t)R * PANEL;
    for (int i = 0; i < j->nseg; i++) {
        if (!owns(j, i)) continue;
        const int64_t slot = j->slots[i], s = j->starts[i], e = j->starts[i + 1];
#if LORA_512
        if (e - s <= ((j->expand_pairs ? R / 2 : R) < 16 ? 1 : FUSED_ROWS)) {
            expand_rows_fused_n(j, s, (int)(e - s), slot, p_lo * PANEL, p_hi * PANEL < N ? p_hi * PANEL : N);
            continue;
        }
#endif
        for (int p = p_lo; p < p_hi; p++) {
            const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
            uint32_t *panel = panels + (p - p_lo) * stride;
            if (!j->bf16) panel_of_u32((const uint32_t *)j->b + (slot * N + n0) * R, R, nc, panel);
            else if (j->expand_pairs)  /* bfloat16 rank pairs, 32 bits each */
                panel_of_u32((const uint32_t *)((const uint16_t *)j->b + (slot * N + n0) * R), R / 2, nc, panel);
            else
                panel_of_bf16((const uint16_t *)j->b + (slot * N + n0) * R, R, nc, (float *)panel);
        }
        for (int64_t m0 = s; m0 < e; m0 += PANEL_MB) {
            const int mb = e - m0 < PANEL_MB ? (int)(e - m0) : PANEL_MB;
            for (int p = p_lo; p < p_hi; p++) {
                const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
                expand_tile(j, m0, mb, panels + (p - p_lo) * stride, n0, nc);
            }
        }
    }
}

/* y [T, N] (rows ys elements apart) += per segment (x [T, K] rows xs apart) . A[slot]^T . B[slot]^T, A [S, R, K],
 * B [S, N, R], all float32 or all bfloat16; segs = starts [nseg + 1] then slots [nseg]. Returns 0, -1 when the
 * scratch cannot be allocated, -2 for a segment table that does not fit T rows and S slots. */
static int lora_shrink_expand(void *y, int64_t ys, const void *x, int64_t xs, const void *a, const void *b, int T,
                              int K, int N, int R, int S, const int64_t *segs, int nseg, int64_t max_rows, int bf16,
                              int num_threads) {
    const int64_t *starts = segs, *slots = segs + nseg + 1;
    if (nseg < 0 || starts[0] < 0 || starts[nseg] > T) return -2;
    int64_t rows = 0;
    for (int i = 0; i < nseg; i++) {
        if (starts[i + 1] < starts[i] || slots[i] >= S || slots[i] < -1) return -2;
        const int64_t len = starts[i + 1] - starts[i];
        if (slots[i] >= 0 && len <= max_rows) rows += len;
    }
    if (rows == 0 || R <= 0 || N <= 0) return 0;
    const int pairs = LORA_DOT && bf16 && R % 2 == 0;
    lora_job j = {y, x, a, b, ys, xs, K, N, R, bf16 ? (LORA_DOT ? LK_DOT : LK_BF16) : LK_F32, pairs, bf16, starts,
                  slots, nseg, max_rows, NULL, NULL, NULL};
    const int64_t macs = rows * R * ((int64_t)K + N);
    int nt = num_threads < 1 ? 1 : num_threads;
    if (macs < LORA_MIN_PARALLEL_MACS) nt = 1;
    const int rblocks = (R + SH_RB - 1) / SH_RB, panels = (N + PANEL - 1) / PANEL;
    if (nt > panels) nt = panels;
    /* t rows (float32 or bfloat16), then room for every panel (R x PANEL each, a thread fills those of its
     * share), 64-byte aligned */
    const size_t t_bytes = ((size_t)T * R * (pairs ? 2 : 4) + 63) & ~(size_t)63;
    const size_t panel_elems = (size_t)R * PANEL;
    char *buf = thread_scratch(t_bytes + (size_t)panels * panel_elems * 4);
    if (!buf) return -1;
    if (pairs) j.tb = (uint16_t *)buf;
    else j.t = (float *)buf;
    j.panels = (uint32_t *)(buf + t_bytes);
#ifdef _OPENMP
    if (nt > 1) {
        #pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num(), n = omp_get_num_threads();
            shrink_share(&j, rblocks * t / n, rblocks * (t + 1) / n);
            #pragma omp barrier
            const int p_lo = panels * t / n;
            expand_share(&j, p_lo, panels * (t + 1) / n, j.panels + p_lo * panel_elems);
        }
        return 0;
    }
#endif
    shrink_share(&j, 0, rblocks);
    expand_share(&j, 0, panels, j.panels);
    return 0;
}

/* the entry point: the 16 arguments above packed in one int64 array, in that order (kernels/lora.py fills it:
 * converting 16 ctypes arguments costs more than a small call's work) */
int kvpilot_lora_shrink_expand_packed(const int64_t *p) {
    return lora_shrink_expand((void *)(intptr_t)p[0], p[1], (const void *)(intptr_t)p[2], p[3],
                              (const void *)(intptr_t)p[4], (const void *)(intptr_t)p[5], (int)p[6], (int)p[7],
                              (int)p[8], (int)p[9], (int)p[10], (const int64_t *)(intptr_t)p[11], (int)p[12], p[13],
                              (int)p[14], (int)p[15]);
}
