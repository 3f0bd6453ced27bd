/* Paged decode attention for the CPU: float32 or bfloat16 queries and output, float32, float16 or bfloat16
 * KV cache.
 *
 * Why this exists: the torch reference has to gather every sequence's K/V blocks into a dense
 * tensor before SDPA can run, so each decode step moves the whole KV context through memory
 * three times (read, write, read again). This kernel reads each sequence's blocks once, in
 * order, straight from the cache, with an online softmax per head. The query heads that share a
 * kv head are served together, so a key row loaded from memory is used by all of them.
 *
 * Only rows of sequences that have exactly one query token this step (decodes) are computed;
 * the caller handles prefill chunks. Layouts match kvpilot.kernels:
 *   query  [T, H, D]  rows `q_row_stride` elements apart, heads D elements apart; float32, or bfloat16 bits
 *          in uint16_t when io_bf16 is set (widened on the way in; the output is then rounded once)
 *   cache  [num_blocks, block_size, KVH, D] contiguous, float (kvpilot_paged_decode_f32) or
 *          _Float16 (kvpilot_paged_decode_f16kv, only where the compiler has _Float16) or bfloat16 bits
 *          in uint16_t (kvpilot_paged_decode_bf16kv)
 *   block_tables [B, bt_stride] int32, context_lens [B] int32, query_start_loc [B + 1] int32
 *   out    [T, H, D] contiguous, the query's type
 * A query at position p = context_len - 1 sees keys k with k <= p and, when window > 0,
 * p - k < window. With soft_cap > 0 each score s = scale * q.k becomes soft_cap * tanh(s / soft_cap) (Gemma 2);
 * with sinks (float32 [H], else NULL) head h's softmax has one more logit sinks[h] with no value (gpt-oss).
 *
 * Two bodies: the plain loops (attend_seq_d, every cache type and head size, inlined per type) and,
 * for 16-bit caches on AVX2 builds (float16 also needs F16C), the vector path (attend_seq_16). A float32
 * cache streams at close to the memory rate through the plain loops; a 16-bit cache halves the bytes, but
 * through the plain loops it ran no faster, limited by their arithmetic, hence the vector path. 16-bit
 * rows are widened to float32 as they are read and the arithmetic stays float32.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

/* Where the next block's rows are asked for: L2 (gcc locality 2, prefetcht1), not L1. A block's K and V
 * rows plus the next block's are 48 KiB at block size 16, more than L1 holds, so rows fetched into L1
 * evicted the ones in use; into L2, decode attention over scattered blocks ran about 1.7x as fast (history
 * in CHANGELOG.md). -D on the compile line to try others. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif

typedef struct {
    const void *q;        /* float or bfloat16 bits, as io_bf16 says; so is out */
    const void *k_cache;  /* float, _Float16 or bfloat16 bits, as kv_type says */
    const void *v_cache;
    void *out;
    const int32_t *block_tables;
    const int32_t *context_lens;
    const int32_t *query_start_loc;
    int64_t q_row_stride;
    int64_t bt_stride;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale;
    int num_threads, thread_index;
    int kv_type, io_bf16;
    const float *sinks;  /* [num_heads] sink logits, or NULL */
    float soft_cap;      /* > 0: cap the scores */
} job_t;

#if HAVE_F16
/* gcc 12 does not vectorize _Float16 -> float on AVX2 (one scalar vcvtph2ps per element), so
 * with F16C the conversion is written out, 8 halves at a time. */
static inline __attribute__((always_inline)) void widen_f16(float *dst, const _Float16 *src, const int n) {
    int i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = (float)src[i];
}
#endif

/* Row `index` (in elements) of a cache, as D floats: the row itself in a float cache, or its
 * 16-bit values widened into buf. Inlined with a constant KV, so the type test folds away. */
static inline __attribute__((always_inline)) const float *kv_row(const void *cache, int64_t index, const int D,
                                                                const int KV, float *buf) {
    if (KV == KV_BF16) {
        widen_bf16(buf, (const uint16_t *)cache + index, D);
        return buf;
    }
#if HAVE_F16
    if (KV == KV_F16) {
        widen_f16(buf, (const _Float16 *)cache + index, D);
        return buf;
    }
#endif
    (void)D, (void)KV, (void)buf;
    return (const float *)cache + index;
}

/* Ask for `elems` cache elements from `index` on (one token's rows of a block) ahead of their use. */
static inline __attribute__((always_inline)) void prefetch_rows(const void *cache, int64_t index, int elems,
                                                               const int KV) {
    const int64_t elem_bytes = KV == KV_F32 ? (int64_t)sizeof(float) : 2;
    const char *p = (const char *)cache + index * elem_bytes;
    for (int64_t off = 0; off < elems * elem_bytes; off += 64) __builtin_prefetch(p + off, 0, PREFETCH_LOCALITY);
}

/* The first key a decode row of sequence `seq` sees: 0, or the start of its sliding window. */
static inline int first_key(const job_t *j, int seq) {
    const int ctx = j->context_lens[seq];
    return (j->window > 0 && ctx > j->window) ? ctx - j->window : 0;
}

/* Element index of the block a thread reads after block `blk` of sequence `seq` (the next one of `seq`, else
 * the first `next_seq` reads), or -1 when there is none: where the prefetches go while `blk` is in use. */
static inline int64_t next_block(const job_t *j, int seq, int blk, int next_seq) {
    const int BS = j->block_size;
    const int64_t block_elems = (int64_t)BS * j->num_kv_heads * j->head_dim;
    if ((blk + 1) * BS < j->context_lens[seq])
        return j->block_tables[(int64_t)seq * j->bt_stride + blk + 1] * block_elems;
    if (next_seq >= j->num_seqs || j->context_lens[next_seq] <= 0) return -1;
    return j->block_tables[(int64_t)next_seq * j->bt_stride + first_key(j, next_seq) / BS] * block_elems;
}

/* A decode row's per-head state: the scaled queries, zero outputs, the online softmax's max and sum. */
static inline __attribute__((always_inline)) void start_heads(const job_t *j, int row, const int H, const int D,
                                                              float (*qs)[D], float (*acc)[D], float *m, float *l) {
    for (int h = 0; h < H; h++) {
        const int64_t src = (int64_t)row * j->q_row_stride + (int64_t)h * D;
        for (int d = 0; d < D; d++) {
            qs[h][d] = load_io(j->q, src + d, j->io_bf16) * j->scale;
            acc[h][d] = 0.0f;
        }
        softmax_start(j->sinks, h, &m[h], &l[h]);
    }
}

/* The row's output: each head's accumulated rows over its softmax sum. */
static inline __attribute__((always_inline)) void finish_heads(const job_t *j, int row, const int H, const int D,
                                                               float (*acc)[D], const float *l) {
    for (int h = 0; h < H; h++) {
        const int64_t dst = ((int64_t)row * H + h) * D;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int d = 0; d < D; d++) store_io(j->out, dst + d, acc[h][d] * inv, j->io_bf16);
    }
}

/* Inlined once per common head size and cache type, so that the inner loops have constant trip
 * counts and unroll into straight vector code. */
static inline __attribute__((always_inline)) void attend_seq_d(const job_t *j, int seq, int next_seq,
                                                               const int D, const int KV) {
    const int H = j->num_heads, G = H / j->num_kv_heads, BS = j->block_size;
    const int KVH = j->num_kv_heads;
    const int row = j->query_start_loc[seq];
    const int ctx = j->context_lens[seq];
    /* state for every head: a block (all kv heads of block_size tokens) is read once, in order */
    float qs[H][D], acc[H][D], scores[H][BS], m[H], l[H], row_buf[D];

    start_heads(j, row, H, D, qs, acc, m, l);
    const int start = first_key(j, seq);
    const int32_t *table = j->block_tables + (int64_t)seq * j->bt_stride;
    for (int blk = start / BS; blk * BS < ctx; blk++) {
        const int64_t base = (int64_t)table[blk] * BS * KVH * D;
        const int t0 = start > blk * BS ? start - blk * BS : 0;
        const int t1 = ctx < (blk + 1) * BS ? ctx - blk * BS : BS;
        /* Blocks lie anywhere in the cache, so the hardware prefetcher cannot run ahead across
         * them and each new block would start with a stall on memory: while block blk is used,
         * ask for the next one (this sequence's, else the first of the next sequence this thread
         * serves), row by row: token t of this block fetches rows t of the next. */
        const int64_t next = next_block(j, seq, blk, next_seq);
        for (int t = t0; t < t1; t++) {
            if (next >= 0) prefetch_rows(j->k_cache, next + (int64_t)t * KVH * D, KVH * D, KV);
            for (int kvh = 0; kvh < KVH; kvh++) {
                const float *kr = kv_row(j->k_cache, base + ((int64_t)t * KVH + kvh) * D, D, KV, row_buf);
                for (int h = kvh * G; h < (kvh + 1) * G; h++) {  /* the G query heads of this kv head */
                    float s = 0.0f;
                    for (int d = 0; d < D; d++) s += qs[h][d] * kr[d];
                    scores[h][t] = s;
                }
            }
        }
        if (j->soft_cap > 0.0f)
            for (int h = 0; h < H; h++) soft_cap_scores(scores[h], t0, t1, j->soft_cap);
        for (int h = 0; h < H; h++) {
            float block_max = -FLT_MAX;
            for (int t = t0; t < t1; t++) block_max = scores[h][t] > block_max ? scores[h][t] : block_max;
            const float new_max = block_max > m[h] ? block_max : m[h];
            const float correction = expf(m[h] - new_max);  /* 0 on the first block */
            l[h] *= correction;
            for (int d = 0; d < D; d++) acc[h][d] *= correction;
            for (int t = t0; t < t1; t++) {
                const float p = expf(scores[h][t] - new_max);
                scores[h][t] = p;
                l[h] += p;
            }
            m[h] = new_max;
        }
        for (int t = t0; t < t1; t++) {
            if (next >= 0) prefetch_rows(j->v_cache, next + (int64_t)t * KVH * D, KVH * D, KV);
            for (int kvh = 0; kvh < KVH; kvh++) {
                const float *vr = kv_row(j->v_cache, base + ((int64_t)t * KVH + kvh) * D, D, KV, row_buf);
                for (int h = kvh * G; h < (kvh + 1) * G; h++) {
                    const float p = scores[h][t];
                    for (int d = 0; d < D; d++) acc[h][d] += p * vr[d];
                }
            }
        }
    }
    finish_heads(j, row, H, D, acc, l);
}

static inline __attribute__((always_inline)) void attend_seq_kv(const job_t *j, int seq, int next_seq,
                                                                const int KV) {
    switch (j->head_dim) {
        case 64: attend_seq_d(j, seq, next_seq, 64, KV); break;
        case 128: attend_seq_d(j, seq, next_seq, 128, KV); break;
        default: attend_seq_d(j, seq, next_seq, j->head_dim, KV);
    }
}

static void attend_seq(const job_t *j, int seq, int next_seq) {
    if (HAVE_F16 && j->kv_type == KV_F16) attend_seq_kv(j, seq, next_seq, KV_F16);
    else if (j->kv_type == KV_BF16) attend_seq_kv(j, seq, next_seq, KV_BF16);
    else attend_seq_kv(j, seq, next_seq, KV_F32);
}

#if USE_AVX2
/* float16 rows are widened by F16C's conversion, where the build has it and _Float16 */
#if defined(__F16C__) && HAVE_F16
#define HAVE_VEC_F16 1
#else
#define HAVE_VEC_F16 0
#endif
/* The vector path for 16-bit caches. The plain loops spend most of their time outside the arithmetic
 * (a libm expf per score, a horizontal sum per key and head, output rows stored and reloaded for every
 * key, a row widened once per kv head it is read for), so a float16 cache read no faster than a float32
 * one. Here each block's rows are widened once, in memory order, into a float tile; the keys' scores
 * come VW at a time from one transpose-and-add reduction, the softmax weights from the AVX2 exp 8 at a
 * time, and the weighted V rows accumulate in registers for up to PV_HEADS heads at once: about 1.6x the
 * plain loops on a float16 cache. A float32 cache keeps the plain loops (through the tile it ran slower).
 * V rows are widened in registers as the weighted sum reads them, and a bfloat16 model's scores (bfloat16
 * queries over a bfloat16 cache) come from the dot-product instruction where the CPU has it (key_scores_bf16),
 * with no K tile at all. In a whole run this kernel is bound by memory, not arithmetic (decode attention
 * in bench/results/profile_run_w96.md and profile_run_w96_bf16.md). */
#if defined(__AVX512F__)
enum { VW = 16 };
typedef __m512 vec_t;
#define VEC_LOAD(p) _mm512_loadu_ps(p)
#define VEC_STORE(p, v) _mm512_storeu_ps(p, v)
#define VEC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VEC_MUL(a, b) _mm512_mul_ps(a, b)
#define VEC_SET1(x) _mm512_set1_ps(x)
#define VEC_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VEC_LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
enum { VW = 8 };
typedef __m256 vec_t;
#define VEC_LOAD(p) _mm256_loadu_ps(p)
#define VEC_STORE(p, v) _mm256_storeu_ps(p, v)
#define VEC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VEC_MUL(a, b) _mm256_mul_ps(a, b)
#define VEC_SET1(x) _mm256_set1_ps(x)
#define VEC_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VEC_LOAD_BF16(p) load_bf16x8(p)
#endif
enum { NV_MAX = 128 / VW, PV_HEADS = 4 };

/* Scores of VW consecutive keys (rows `stride` floats apart) against one query head q[0..NV): each key's
 * products are summed lane-wise into one vector, and the VW vectors are then reduced together, a
 * transpose and add at a time, into one vector of the VW sums in key order (a third of the instructions
 * of a horizontal sum per key). */
#if defined(__AVX512F__)
/* p[t] holds key t's lane-wise partial sums: one vector of the 16 keys' sums, in key order */
static inline __attribute__((always_inline)) vec_t reduce_keys(const vec_t *p) {
    vec_t a[8], b[4], c[2];
    /* within each 128-bit lane: pairs of keys, then fours (as 64-bit pairs) */
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* lane L of b[i] holds lane L's partial sums of keys 4i..4i+3: add the four lanes up */
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __attribute__((always_inline)) vec_t key_scores(const vec_t *q, const int NV, const float *k,
                                                               int64_t stride) {
    vec_t p[16];
    for (int t = 0; t < 16; t++) {
        const float *r = k + t * stride;
        p[t] = _mm512_mul_ps(q[0], _mm512_loadu_ps(r));
        for (int v = 1; v < NV; v++) p[t] = _mm512_fmadd_ps(q[v], _mm512_loadu_ps(r + v * 16), p[t]);
    }
    return reduce_keys(p);
}

#if defined(__AVX512BF16__)
#define HAVE_DP_BF16 1
/* The same scores straight from a bfloat16 cache for a bfloat16 query (q2: its D values, NP = D / 32
 * vectors of pairs): the dot-product instruction multiplies pairs of bfloat16 values exactly and adds
 * them in float32, so no key row is widened first and there are half the instructions of the FMAs. */
static inline __attribute__((always_inline)) vec_t key_scores_bf16(const __m512bh *q2, const int NP,
                                                                    const uint16_t *k, int64_t stride) {
    vec_t p[16];
    for (int t = 0; t < 16; t++) {
        const uint16_t *r = k + t * stride;
        p[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(r), q2[0]);
        for (int v = 1; v < NP; v++) p[t] = _mm512_dpbf16_ps(p[t], (__m512bh)_mm512_loadu_si512(r + v * 32), q2[v]);
    }
    return reduce_keys(p);
}
#endif
#else
static inline __attribute__((always_inline)) vec_t key_scores(const vec_t *q, const int NV, const float *k,
                                                               int64_t stride) {
    vec_t p[8];
    for (int t = 0; t < 8; t++) {
        const float *r = k + t * stride;
        p[t] = _mm256_mul_ps(q[0], _mm256_loadu_ps(r));
        for (int v = 1; v < NV; v++) p[t] = _mm256_fmadd_ps(q[v], _mm256_loadu_ps(r + v * 8), p[t]);
    }
    /* two rounds of hadd leave keys 0-3 in the low 128-bit half and their upper-half partials in the high */
    const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif
#ifndef HAVE_DP_BF16
#define HAVE_DP_BF16 0
#endif

/* Limits of the vector path's stack tiles (floats); larger shapes take the plain loops. */
enum { VEC_MAX_TILE = 16 * 1024, VEC_MAX_HEAD_ROWS = 64 * 128 };

/* VW elements of a 16-bit cache row as floats (KV a constant where inlined) */
static inline __attribute__((always_inline)) vec_t load_widened(const uint16_t *p, const int KV) {
#if HAVE_VEC_F16
    if (KV == KV_F16) return VEC_LOAD_F16(p);
#endif
    (void)KV;
    return VEC_LOAD_BF16(p);
}

/* acc[h] = acc[h] * correction[h] + the sum over t in [t0, t1) of w[h][t] * V[t], for n heads (a
 * constant at each call), V's 16-bit rows read from the cache and widened in registers: each V row is
 * loaded once for all of them, and their n * NV accumulators are independent FMA chains (one head's alone
 * would wait on FMA latency at NV = 4). */
static inline __attribute__((always_inline)) void weighted_rows(float *acc, const float *w, int wstride,
                                                                const float *correction, const int n, const int NV,
                                                                const uint16_t *vrows, int64_t tstride, int t0,
                                                                int t1, const int KV) {
    const int D = NV * VW;
    vec_t o[PV_HEADS][NV_MAX];
    for (int h = 0; h < n; h++) {
        const vec_t c = VEC_SET1(correction[h]);
        for (int v = 0; v < NV; v++) o[h][v] = VEC_MUL(VEC_LOAD(acc + h * D + v * VW), c);
    }
    for (int t = t0; t < t1; t++) {
        const uint16_t *vr = vrows + t * tstride;
        for (int v = 0; v < NV; v++) {
            const vec_t x = load_widened(vr + v * VW, KV);
            for (int h = 0; h < n; h++) o[h][v] = VEC_FMA(VEC_SET1(w[h * wstride + t]), x, o[h][v]);
        }
    }
    for (int h = 0; h < n; h++)
        for (int v = 0; v < NV; v++) VEC_STORE(acc + h * D + v * VW, o[h][v]);
}

static inline int vec_path_fits(const job_t *j) {
    return (j->kv_type == KV_BF16 || (HAVE_VEC_F16 && j->kv_type == KV_F16))
           && (j->head_dim == 64 || j->head_dim == 128) && j->block_size % VW == 0
           && j->block_size * j->num_kv_heads * j->head_dim <= VEC_MAX_TILE
           && j->num_heads * j->head_dim <= VEC_MAX_HEAD_ROWS;
}

/* DP (a constant where inlined): a bfloat16 query over a bfloat16 cache, scored by the dot-product
 * instruction from the cache's rows (key_scores_bf16); otherwise a block's K rows are widened once into a
 * float tile and scored by FMAs. V rows are always read from the cache and widened in registers. */
static inline __attribute__((always_inline)) void attend_seq_16(const job_t *j, int seq, int next_seq,
                                                                const int D, const int KV, const int DP) {
    const int NV = D / VW;
    const int KVH = j->num_kv_heads, G = j->num_heads / KVH, BS = j->block_size, NH = j->num_heads;
    const int W = KVH * D;  /* elements in one token's rows */
    const int row = j->query_start_loc[seq];
    const int ctx = j->context_lens[seq];
    float qs[NH][D], acc[NH][D], scores[NH][BS], correction[NH], m[NH], l[NH], kbuf[DP ? 1 : BS][W];
#if HAVE_DP_BF16
    __m512bh q2[DP ? NH : 1][DP ? D / 32 : 1];  /* the query heads as bfloat16 pairs, unscaled */
    if (DP)
        for (int h = 0; h < NH; h++)
            for (int v = 0; v < D / 32; v++)
                q2[h][v] = (__m512bh)_mm512_loadu_si512((const uint16_t *)j->q + (int64_t)row * j->q_row_stride
                                                        + (int64_t)h * D + v * 32);
#endif

    start_heads(j, row, NH, D, qs, acc, m, l);
    const int start = first_key(j, seq);
    const int32_t *table = j->block_tables + (int64_t)seq * j->bt_stride;
    for (int blk = start / BS; blk * BS < ctx; blk++) {
        const int64_t base = (int64_t)table[blk] * BS * W;
        const int t0 = start > blk * BS ? start - blk * BS : 0;
        const int t1 = ctx < (blk + 1) * BS ? ctx - blk * BS : BS;
        /* blocks lie anywhere in the cache: while this one is read, ask for the next one (this sequence's,
         * else the first of the next sequence this thread serves), token t's rows beside t's */
        const int64_t next = next_block(j, seq, blk, next_seq);
        const uint16_t *kh = (const uint16_t *)j->k_cache + base, *vh = (const uint16_t *)j->v_cache + base;
        if (next >= 0)  /* the K rows now, the V rows once the scores are done */
            for (int t = t0; t < t1; t++) prefetch_rows(j->k_cache, next + (int64_t)t * W, W, KV);
        /* every key of the block is scored, VW at a time; the scores of rows outside [t0, t1) (a partial
         * block) are never read */
        if (DP) {
#if HAVE_DP_BF16
            for (int h = 0; h < NH; h++) {
                const vec_t scale = VEC_SET1(j->scale);
                for (int t = 0; t < BS; t += VW)
                    VEC_STORE(&scores[h][t], VEC_MUL(key_scores_bf16(q2[h], D / 32, kh + t * W + h / G * D, W), scale));
            }
#endif
        } else {
            for (int t = 0; t < BS; t++)  /* in memory order, every row once; rows outside [t0, t1) zeros */
                for (int e = 0; e < W; e += VW)
                    VEC_STORE(&kbuf[t][e], t >= t0 && t < t1 ? load_widened(kh + t * W + e, KV) : VEC_SET1(0.0f));
            for (int h = 0; h < NH; h++) {
                vec_t q[NV_MAX];
                for (int v = 0; v < NV; v++) q[v] = VEC_LOAD(&qs[h][v * VW]);
                for (int t = 0; t < BS; t += VW) VEC_STORE(&scores[h][t], key_scores(q, NV, &kbuf[t][h / G * D], W));
            }
        }
        if (next >= 0)
            for (int t = t0; t < t1; t++) prefetch_rows(j->v_cache, next + (int64_t)t * W, W, KV);
        if (j->soft_cap > 0.0f)
            for (int h = 0; h < NH; h++) soft_cap_scores(scores[h], t0, t1, j->soft_cap);
        for (int h = 0; h < NH; h++) online_softmax(scores[h], BS, t0, t1, &m[h], &l[h], &correction[h]);
        for (int kv = 0; kv < KVH; kv++) {
            for (int g = 0; g < G; g += PV_HEADS) {
                const int h = kv * G + g;
                switch (G - g < PV_HEADS ? G - g : PV_HEADS) {
#define WEIGHTED_ROWS_CASE(n) \
    case n: weighted_rows(&acc[h][0], &scores[h][0], BS, &correction[h], n, NV, vh + kv * D, W, t0, t1, KV); break;
                    WEIGHTED_ROWS_CASE(1) WEIGHTED_ROWS_CASE(2) WEIGHTED_ROWS_CASE(3) WEIGHTED_ROWS_CASE(4)
#undef WEIGHTED_ROWS_CASE
                    default: break;
                }
            }
        }
    }
    finish_heads(j, row, NH, D, acc, l);
}

static void attend_seq_vec(const job_t *j, int seq, int next_seq) {
#if HAVE_VEC_F16
    if (j->kv_type == KV_F16) {
        if (j->head_dim == 64) attend_seq_16(j, seq, next_seq, 64, KV_F16, 0);
        else attend_seq_16(j, seq, next_seq, 128, KV_F16, 0);
        return;
    }
#endif
#if HAVE_DP_BF16
    if (j->io_bf16) {
        if (j->head_dim == 64) attend_seq_16(j, seq, next_seq, 64, KV_BF16, 1);
        else attend_seq_16(j, seq, next_seq, 128, KV_BF16, 1);
        return;
    }
#endif
    if (j->head_dim == 64) attend_seq_16(j, seq, next_seq, 64, KV_BF16, 0);
    else attend_seq_16(j, seq, next_seq, 128, KV_BF16, 0);
}
#define HAVE_VEC_PATH 1
#else
#define HAVE_VEC_PATH 0
#endif

static void *run_share(void *arg) {
    const job_t *j = (const job_t *)arg;
#if HAVE_VEC_PATH
    const int vec = vec_path_fits(j);
#endif
    /* interleaved sequences: neighbours in a batch tend to have similar lengths */
    for (int seq = j->thread_index; seq < j->num_seqs; seq += j->num_threads) {
        if (j->query_start_loc[seq + 1] - j->query_start_loc[seq] != 1 || j->context_lens[seq] <= 0) continue;
#if HAVE_VEC_PATH
        if (vec) {
            attend_seq_vec(j, seq, seq + j->num_threads);
            continue;
        }
#endif
        attend_seq(j, seq, seq + j->num_threads);
    }
    return 0;
}

#define MAX_THREADS 256

/* Returns 0, or -1 when threads could not be started (nothing is computed then). */
static int paged_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                        const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, int window, void *out, int num_threads,
                        int io_bf16, const float *sinks, float soft_cap, int kv_type) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > num_seqs) num_threads = num_seqs > 0 ? num_seqs : 1;
    job_t jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    for (int i = 0; i < num_threads; i++) {
        jobs[i] = (job_t){q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, q_row_stride,
                          bt_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size, window, scale,
                          num_threads, i, kv_type, io_bf16, sinks, soft_cap};
    }
#ifdef _OPENMP
    /* Built with -fopenmp this runs on the OpenMP pool torch already uses (the same libgomp.so.1):
     * fresh pthreads would compete for the cores with torch's workers, which spin after each op. */
    #pragma omp parallel num_threads(num_threads)
    {
        job_t mine = jobs[0];  /* the team may be smaller than asked: share by its real size */
        mine.num_threads = omp_get_num_threads();
        mine.thread_index = omp_get_thread_num();
        run_share(&mine);
    }
    (void)threads;
    return 0;
#endif
    int started = 0;
    for (int i = 1; i < num_threads; i++) {
        if (pthread_create(&threads[i], 0, run_share, &jobs[i]) != 0) break;
        started = i;
    }
    if (started != num_threads - 1) {
        for (int i = 1; i <= started; i++) pthread_join(threads[i], 0);
        return -1;
    }
    run_share(&jobs[0]);
    for (int i = 1; i < num_threads; i++) pthread_join(threads[i], 0);
    return 0;
}

/* The exported entry points, one per cache type (same arguments, in the order above; sinks NULL and soft_cap 0
 * for plain attention). */
#define DECODE_ARGS                                                                                         \
    q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, context_lens, query_start_loc, num_seqs,    \
        num_heads, num_kv_heads, head_dim, block_size, scale, window, out, num_threads, io_bf16, sinks, soft_cap

int kvpilot_paged_decode_f32(const void *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                             const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                             int head_dim, int block_size, float scale, int window, void *out, int num_threads,
                             int io_bf16, const float *sinks, float soft_cap) {
    return paged_decode(DECODE_ARGS, KV_F32);
}

#if HAVE_F16
int kvpilot_paged_decode_f16kv(const void *q, int64_t q_row_stride, const _Float16 *k_cache,
                               const _Float16 *v_cache, const int32_t *block_tables, int64_t bt_stride,
                               const int32_t *context_lens, const int32_t *query_start_loc, int num_seqs,
                               int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, void *out, int num_threads, int io_bf16, const float *sinks,
                               float soft_cap) {
    return paged_decode(DECODE_ARGS, KV_F16);
}
#endif

int kvpilot_paged_decode_bf16kv(const void *q, int64_t q_row_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *block_tables, int64_t bt_stride,
                                const int32_t *context_lens, const int32_t *query_start_loc, int num_seqs,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                int window, void *out, int num_threads, int io_bf16, const float *sinks,
                                float soft_cap) {
    return paged_decode(DECODE_ARGS, KV_BF16);
}
