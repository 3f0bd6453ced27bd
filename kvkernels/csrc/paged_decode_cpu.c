/* Paged decode attention for the CPU: float32 queries and output, float32 or float16 KV cache.
 *
 * Why this exists: the torch reference has to gather every sequence's K/V blocks into a dense
 * tensor before SDPA can run, so each decode step moves the whole KV context through memory
 * three times (read, write, read again). This kernel reads each sequence's blocks once, in
 * order, straight from the cache, with an online softmax per head. The query heads that share a
 * kv head are served together, so a key row loaded from memory is used by all of them.
 *
 * Only rows of sequences that have exactly one query token this step (decodes) are computed;
 * the caller handles prefill chunks. Layouts match kvpilot.kernels:
 *   query  [T, H, D]  rows `q_row_stride` floats apart, heads D floats apart
 *   cache  [num_blocks, block_size, KVH, D] contiguous, float (kvpilot_paged_decode_f32) or
 *          _Float16 (kvpilot_paged_decode_f16kv, only where the compiler has _Float16)
 *   block_tables [B, bt_stride] int32, context_lens [B] int32, query_start_loc [B + 1] int32
 *   out    [T, H, D] contiguous
 * A query at position p = context_len - 1 sees keys k with k <= p and, when window > 0,
 * p - k < window.
 *
 * Both cache types share one body: attend_seq_d takes the type as a constant parameter and is
 * inlined per type. Decode reads every context token's K and V once per step and is memory
 * bound, so a float16 cache (half the bytes) is the faster one; its rows are widened to float32
 * as they are read (F16C: 8 halves per vcvtph2ps) and the arithmetic stays float32.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

enum { KV_F32 = 0, KV_F16 = 1 };  /* element type of the caches */
/* Where the next block's rows are asked for: L2 (gcc locality 2, prefetcht1), not L1. A block's K and V
 * rows plus the next block's are 48 KiB at block size 16, more than L1 holds, so rows fetched into L1
 * evicted the ones in use. Measured cold over 30 layers (96 sequences, contexts 16-528, blocks scattered),
 * 2 threads: 57-65 ms into L2 against 95-113 ms into L1 (11-12 GB/s, now 19-21; a plain sum streams
 * 28.5 GB/s here), on the AVX-512 and the AVX2 build alike. -D on the compile line to measure others. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif

typedef struct {
    const float *q;
    const void *k_cache;  /* float or _Float16, as kv_type says */
    const void *v_cache;
    float *out;
    const int32_t *block_tables;
    const int32_t *context_lens;
    const int32_t *query_start_loc;
    int64_t q_row_stride;
    int64_t bt_stride;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale;
    int num_threads, thread_index;
    int kv_type;
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
 * float16 values widened into buf. Inlined with a constant KV, so the type test folds away. */
static inline __attribute__((always_inline)) const float *kv_row(const void *cache, int64_t index, const int D,
                                                                const int KV, float *buf) {
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
    const int64_t elem_bytes = KV == KV_F16 ? 2 : (int64_t)sizeof(float);
    const char *p = (const char *)cache + index * elem_bytes;
    for (int64_t off = 0; off < elems * elem_bytes; off += 64) __builtin_prefetch(p + off, 0, PREFETCH_LOCALITY);
}

/* The first key a decode row of sequence `seq` sees: 0, or the start of its sliding window. */
static inline int first_key(const job_t *j, int seq) {
    const int ctx = j->context_lens[seq];
    return (j->window > 0 && ctx > j->window) ? ctx - j->window : 0;
}

/* Element index of the first block sequence `seq` reads, or -1 when there is none to read. */
static inline int64_t first_block(const job_t *j, int seq) {
    if (seq >= j->num_seqs || j->context_lens[seq] <= 0) return -1;
    const int64_t block_elems = (int64_t)j->block_size * j->num_kv_heads * j->head_dim;
    return j->block_tables[(int64_t)seq * j->bt_stride + first_key(j, seq) / j->block_size] * block_elems;
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

    for (int h = 0; h < H; h++) {
        const float *src = j->q + (int64_t)row * j->q_row_stride + (int64_t)h * D;
        for (int d = 0; d < D; d++) {
            qs[h][d] = src[d] * j->scale;
            acc[h][d] = 0.0f;
        }
        m[h] = -FLT_MAX;  /* not -inf: built with -ffast-math, which assumes finite values */
        l[h] = 0.0f;
    }
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
        const int64_t next = (blk + 1) * BS < ctx ? (int64_t)table[blk + 1] * BS * KVH * D : first_block(j, next_seq);
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
    for (int h = 0; h < H; h++) {
        float *dst = j->out + ((int64_t)row * H + h) * D;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int d = 0; d < D; d++) dst[d] = acc[h][d] * inv;
    }
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
    else attend_seq_kv(j, seq, next_seq, KV_F32);
}

static void *run_share(void *arg) {
    const job_t *j = (const job_t *)arg;
    /* interleaved sequences: neighbours in a batch tend to have similar lengths */
    for (int seq = j->thread_index; seq < j->num_seqs; seq += j->num_threads) {
        if (j->query_start_loc[seq + 1] - j->query_start_loc[seq] != 1 || j->context_lens[seq] <= 0) continue;
        attend_seq(j, seq, seq + j->num_threads);
    }
    return 0;
}

#define MAX_THREADS 256

/* Returns 0, or -1 when threads could not be started (nothing is computed then). */
static int paged_decode(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                        const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, int window, float *out, int num_threads,
                        int kv_type) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > num_seqs) num_threads = num_seqs > 0 ? num_seqs : 1;
    job_t jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    for (int i = 0; i < num_threads; i++) {
        jobs[i] = (job_t){q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, q_row_stride,
                          bt_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size, window, scale,
                          num_threads, i, kv_type};
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

/* The exported entry points, one per cache type (same arguments, in the order above). */
#define DECODE_ARGS                                                                                         \
    q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, context_lens, query_start_loc, num_seqs,    \
        num_heads, num_kv_heads, head_dim, block_size, scale, window, out, num_threads

int kvpilot_paged_decode_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                             const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                             int head_dim, int block_size, float scale, int window, float *out, int num_threads) {
    return paged_decode(DECODE_ARGS, KV_F32);
}

#if HAVE_F16
int kvpilot_paged_decode_f16kv(const float *q, int64_t q_row_stride, const _Float16 *k_cache,
                               const _Float16 *v_cache, const int32_t *block_tables, int64_t bt_stride,
                               const int32_t *context_lens, const int32_t *query_start_loc, int num_seqs,
                               int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, float *out, int num_threads) {
    return paged_decode(DECODE_ARGS, KV_F16);
}
#endif
