/* Paged decode attention for the CPU, float32.
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
 *   cache  [num_blocks, block_size, KVH, D] contiguous
 *   block_tables [B, bt_stride] int32, context_lens [B] int32, query_start_loc [B + 1] int32
 *   out    [T, H, D] contiguous
 * A query at position p = context_len - 1 sees keys k with k <= p and, when window > 0,
 * p - k < window.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    const float *q;
    const float *k_cache;
    const float *v_cache;
    float *out;
    const int32_t *block_tables;
    const int32_t *context_lens;
    const int32_t *query_start_loc;
    int64_t q_row_stride;
    int64_t bt_stride;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale;
    int num_threads, thread_index;
} job_t;

/* Inlined once per common head size, so that the inner loops have constant trip counts and
 * unroll into straight vector code. */
static inline __attribute__((always_inline)) void attend_seq_d(const job_t *j, int seq, const int D) {
    const int H = j->num_heads, G = H / j->num_kv_heads, BS = j->block_size;
    const int KVH = j->num_kv_heads;
    const int row = j->query_start_loc[seq];
    const int ctx = j->context_lens[seq];
    /* state for every head: a block (all kv heads of block_size tokens) is read once, in order */
    float qs[H][D], acc[H][D], scores[H][BS], m[H], l[H];

    for (int h = 0; h < H; h++) {
        const float *src = j->q + (int64_t)row * j->q_row_stride + (int64_t)h * D;
        for (int d = 0; d < D; d++) {
            qs[h][d] = src[d] * j->scale;
            acc[h][d] = 0.0f;
        }
        m[h] = -FLT_MAX;  /* not -inf: built with -ffast-math, which assumes finite values */
        l[h] = 0.0f;
    }
    const int start = (j->window > 0 && ctx > j->window) ? ctx - j->window : 0;
    const int32_t *table = j->block_tables + (int64_t)seq * j->bt_stride;
    for (int blk = start / BS; blk * BS < ctx; blk++) {
        const int64_t base = (int64_t)table[blk] * BS * KVH * D;
        const float *kb = j->k_cache + base, *vb = j->v_cache + base;
        const int t0 = start > blk * BS ? start - blk * BS : 0;
        const int t1 = ctx < (blk + 1) * BS ? ctx - blk * BS : BS;
        for (int t = t0; t < t1; t++) {
            for (int kvh = 0; kvh < KVH; kvh++) {
                const float *kr = kb + ((int64_t)t * KVH + kvh) * D;
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
            for (int kvh = 0; kvh < KVH; kvh++) {
                const float *vr = vb + ((int64_t)t * KVH + kvh) * D;
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

static void attend_seq(const job_t *j, int seq) {
    switch (j->head_dim) {
        case 64: attend_seq_d(j, seq, 64); break;
        case 128: attend_seq_d(j, seq, 128); break;
        default: attend_seq_d(j, seq, j->head_dim);
    }
}

static void *run_share(void *arg) {
    const job_t *j = (const job_t *)arg;
    /* interleaved sequences: neighbours in a batch tend to have similar lengths */
    for (int seq = j->thread_index; seq < j->num_seqs; seq += j->num_threads) {
        if (j->query_start_loc[seq + 1] - j->query_start_loc[seq] != 1 || j->context_lens[seq] <= 0) continue;
        attend_seq(j, seq);
    }
    return 0;
}

#define MAX_THREADS 256

/* Returns 0, or -1 when threads could not be started (nothing is computed then). */
int kvpilot_paged_decode_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                             const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                             int head_dim, int block_size, float scale, int window, float *out, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > num_seqs) num_threads = num_seqs > 0 ? num_seqs : 1;
    job_t jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    for (int i = 0; i < num_threads; i++) {
        jobs[i] = (job_t){q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, q_row_stride,
                          bt_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size, window, scale,
                          num_threads, i};
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
