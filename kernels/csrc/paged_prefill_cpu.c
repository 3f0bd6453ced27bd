/* Paged prefill attention for the CPU: the rows of sequences with more than one query token this
 * step (prompt chunks), float32 queries and output, float32 or float16 KV cache.
 *
 * Why this exists: torch's SDPA needs each sequence's K/V gathered out of the paged cache into a
 * dense tensor first, and its flash kernel reaches only 15-40 GFLOP/s at the prompt lengths a
 * serving engine sees (64-512 tokens) on a 2-core AVX2 EPYC, against 150+ for a large GEMM. This
 * kernel is flash attention written for that CPU:
 *   - keys are taken in tiles of 16 positions, wherever their blocks lie in the cache; each tile is
 *     copied once per call into a transposed float32 scratch (K as [D][16], V as [16][D]), so the
 *     inner loops read contiguous vectors and a float16 cache is widened once, not once per query;
 *   - the G query heads that share a kv head are served by one task as G*QT rows (QT positions),
 *     so every key tile loaded is used by all of them;
 *   - scores come from a 4-row x 16-key register tile and the output from a 2-row x 32-dim one
 *     (AVX2 + FMA; plain loops elsewhere), with an online softmax per row in between;
 *   - causal tiles past a task's last position are never visited.
 * Work is split over the OpenMP team torch already uses: first the key tiles, then the
 * (sequence, kv head, query tile) tasks, most expensive first. Without OpenMP it runs on one thread.
 *
 * Layouts match kvpilot.kernels (see paged_decode_cpu.c). A query row of sequence s at index i
 * of its q_len rows sits at position p = context_len - q_len + i and sees keys k with k <= p and,
 * when window > 0, p - k < window. Sequences with q_len <= 1 are left to the decode kernel.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

enum { KV_F32 = 0, KV_F16 = 1 };
enum { KT = 16 };  /* keys per tile */
/* Query positions per task: G*QT rows share each key tile. Long chunks take wider tasks: a task
 * streams all the keys it sees through the cache, and from ~512 of them they no longer stay in L2. */
enum { QT = 32, QT_LONG = 64, LONG_CHUNK = 512 };
enum { MAX_ROWS = 16 * QT_LONG };  /* up to 16 query heads per kv head */

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    float *out;
    const int32_t *block_tables, *context_lens, *query_start_loc;
    int64_t q_row_stride, bt_stride;
    int num_heads, num_kv_heads, head_dim, block_size, window;
    float scale;
    int kv_type;
} prefill_t;

/* One prompt chunk: where its key tiles sit in the scratch. */
typedef struct {
    int seq, q_start, q_len, ctx;
    int first_tile;   /* tiles are aligned to absolute positions: tile t covers keys [16t, 16t + 16) */
    int num_tiles;
    int64_t scratch;  /* float offset of this sequence's tiles (all kv heads) */
} chunk_t;

typedef struct {
    int chunk, kvh, q0, q1;  /* query indices [q0, q1) of the chunk */
    double cost;
} task_t;

static inline int first_visible_key(const prefill_t *p, int pos) {
    return (p->window > 0 && pos - p->window + 1 > 0) ? pos - p->window + 1 : 0;
}

/* Copy key tile `tile` of chunk `c` (one kv head) into the scratch: K transposed, V as rows;
 * positions past the context are zero (their scores are masked, their weights are 0). */
static void load_tile(const prefill_t *p, const chunk_t *c, int kvh, int tile, float *kt, float *vt) {
    const int D = p->head_dim, KVH = p->num_kv_heads, BS = p->block_size;
    const int32_t *table = p->block_tables + (int64_t)c->seq * p->bt_stride;
    for (int j = 0; j < KT; j++) {
        const int pos = tile * KT + j;
        float *vrow = vt + (int64_t)j * D;
        if (pos >= c->ctx) {
            for (int d = 0; d < D; d++) kt[(int64_t)d * KT + j] = 0.0f, vrow[d] = 0.0f;
            continue;
        }
        const int64_t index = ((int64_t)table[pos / BS] * BS + pos % BS) * KVH * D + (int64_t)kvh * D;
#if HAVE_F16
        if (p->kv_type == KV_F16) {
            const _Float16 *kr = (const _Float16 *)p->k_cache + index, *vr = (const _Float16 *)p->v_cache + index;
            int d = 0;
#ifdef __F16C__
            for (; d + 8 <= D; d += 8) {
                float tmp[8];
                _mm256_storeu_ps(tmp, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kr + d))));
                for (int e = 0; e < 8; e++) kt[(int64_t)(d + e) * KT + j] = tmp[e];
                _mm256_storeu_ps(vrow + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vr + d))));
            }
#endif
            for (; d < D; d++) kt[(int64_t)d * KT + j] = (float)kr[d], vrow[d] = (float)vr[d];
            continue;
        }
#endif
        const float *kr = (const float *)p->k_cache + index, *vr = (const float *)p->v_cache + index;
        for (int d = 0; d < D; d++) kt[(int64_t)d * KT + j] = kr[d];
        memcpy(vrow, vr, sizeof(float) * (size_t)D);
    }
}

/* s[r][0..15] = qs[r] . key j, for rows [r0, r0 + n) (n <= 4). */
static inline void score_rows(const float *qs, int D, const float *kt, float *s, int n) {
#if USE_AVX2
    if (n == 4) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
               a31 = a00;
        const float *q0 = qs, *q1 = qs + D, *q2 = qs + 2 * D, *q3 = qs + 3 * D;
        for (int d = 0; d < D; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + d * KT), k1 = _mm256_loadu_ps(kt + d * KT + 8);
            __m256 b = _mm256_broadcast_ss(q0 + d);
            a00 = _mm256_fmadd_ps(b, k0, a00), a01 = _mm256_fmadd_ps(b, k1, a01);
            b = _mm256_broadcast_ss(q1 + d);
            a10 = _mm256_fmadd_ps(b, k0, a10), a11 = _mm256_fmadd_ps(b, k1, a11);
            b = _mm256_broadcast_ss(q2 + d);
            a20 = _mm256_fmadd_ps(b, k0, a20), a21 = _mm256_fmadd_ps(b, k1, a21);
            b = _mm256_broadcast_ss(q3 + d);
            a30 = _mm256_fmadd_ps(b, k0, a30), a31 = _mm256_fmadd_ps(b, k1, a31);
        }
        _mm256_storeu_ps(s, a00), _mm256_storeu_ps(s + 8, a01);
        _mm256_storeu_ps(s + KT, a10), _mm256_storeu_ps(s + KT + 8, a11);
        _mm256_storeu_ps(s + 2 * KT, a20), _mm256_storeu_ps(s + 2 * KT + 8, a21);
        _mm256_storeu_ps(s + 3 * KT, a30), _mm256_storeu_ps(s + 3 * KT + 8, a31);
        return;
    }
#endif
    for (int r = 0; r < n; r++) {
        float acc[KT] = {0};
        for (int d = 0; d < D; d++) {
            const float qv = qs[r * D + d];
            for (int j = 0; j < KT; j++) acc[j] += qv * kt[d * KT + j];
        }
        for (int j = 0; j < KT; j++) s[r * KT + j] = acc[j];
    }
}

/* o[r] = o[r] * corr[r] + sum_j w[r][j] * v[j], for rows [0, n) (n <= 2) and all D dims. */
static inline void accumulate_rows(float *o, int D, const float *w, const float *corr, const float *vt, int n) {
#if USE_AVX2
    if (n == 2 && D % 32 == 0) {
        for (int d0 = 0; d0 < D; d0 += 32) {
            float *o0 = o + d0, *o1 = o + D + d0;
            const __m256 c0 = _mm256_set1_ps(corr[0]), c1 = _mm256_set1_ps(corr[1]);
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(o0), c0), x1 = _mm256_mul_ps(_mm256_loadu_ps(o0 + 8), c0);
            __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(o0 + 16), c0), x3 = _mm256_mul_ps(_mm256_loadu_ps(o0 + 24), c0);
            __m256 y0 = _mm256_mul_ps(_mm256_loadu_ps(o1), c1), y1 = _mm256_mul_ps(_mm256_loadu_ps(o1 + 8), c1);
            __m256 y2 = _mm256_mul_ps(_mm256_loadu_ps(o1 + 16), c1), y3 = _mm256_mul_ps(_mm256_loadu_ps(o1 + 24), c1);
            for (int j = 0; j < KT; j++) {
                const float *v = vt + j * D + d0;
                const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                             v3 = _mm256_loadu_ps(v + 24);
                __m256 b = _mm256_broadcast_ss(w + j);
                x0 = _mm256_fmadd_ps(b, v0, x0), x1 = _mm256_fmadd_ps(b, v1, x1);
                x2 = _mm256_fmadd_ps(b, v2, x2), x3 = _mm256_fmadd_ps(b, v3, x3);
                b = _mm256_broadcast_ss(w + KT + j);
                y0 = _mm256_fmadd_ps(b, v0, y0), y1 = _mm256_fmadd_ps(b, v1, y1);
                y2 = _mm256_fmadd_ps(b, v2, y2), y3 = _mm256_fmadd_ps(b, v3, y3);
            }
            _mm256_storeu_ps(o0, x0), _mm256_storeu_ps(o0 + 8, x1), _mm256_storeu_ps(o0 + 16, x2);
            _mm256_storeu_ps(o0 + 24, x3);
            _mm256_storeu_ps(o1, y0), _mm256_storeu_ps(o1 + 8, y1), _mm256_storeu_ps(o1 + 16, y2);
            _mm256_storeu_ps(o1 + 24, y3);
        }
        return;
    }
#endif
    for (int r = 0; r < n; r++) {
        float *orow = o + (int64_t)r * D;
        for (int d = 0; d < D; d++) orow[d] *= corr[r];
        for (int j = 0; j < KT; j++) {
            const float wj = w[r * KT + j];
            if (wj == 0.0f) continue;
            const float *v = vt + j * D;
            for (int d = 0; d < D; d++) orow[d] += wj * v[d];
        }
    }
}


/* One row's online-softmax step over a tile: scores s[0..15] become weights (0 outside [jlo, jhi)),
 * the running max m and sum l are updated and corr is what the row's output must be scaled by. */
static inline void softmax_row(float *s, int jlo, int jhi, float *m, float *l, float *corr) {
#if USE_AVX2
    const __m256 idx0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), idx1 = _mm256_add_ps(idx0, _mm256_set1_ps(8));
    const __m256 lo = _mm256_set1_ps((float)jlo - 0.5f), hi = _mm256_set1_ps((float)jhi - 0.5f);
    const __m256 in0 = _mm256_and_ps(_mm256_cmp_ps(idx0, lo, _CMP_GT_OQ), _mm256_cmp_ps(idx0, hi, _CMP_LT_OQ));
    const __m256 in1 = _mm256_and_ps(_mm256_cmp_ps(idx1, lo, _CMP_GT_OQ), _mm256_cmp_ps(idx1, hi, _CMP_LT_OQ));
    const __m256 floor = _mm256_set1_ps(-FLT_MAX);
    const __m256 s0 = _mm256_blendv_ps(floor, _mm256_loadu_ps(s), in0);
    const __m256 s1 = _mm256_blendv_ps(floor, _mm256_loadu_ps(s + 8), in1);
    const float tile_max = hmax8(_mm256_max_ps(s0, s1));
    const float new_max = tile_max > *m ? tile_max : *m;
    const __m256 mx = _mm256_set1_ps(new_max);
    const __m256 w0 = _mm256_and_ps(exp_avx2(_mm256_sub_ps(s0, mx)), in0);
    const __m256 w1 = _mm256_and_ps(exp_avx2(_mm256_sub_ps(s1, mx)), in1);
    _mm256_storeu_ps(s, w0), _mm256_storeu_ps(s + 8, w1);
    const float sum = hsum8(_mm256_add_ps(w0, w1));
#else
    float tile_max = -FLT_MAX;
    for (int j = jlo; j < jhi; j++) tile_max = s[j] > tile_max ? s[j] : tile_max;
    const float new_max = tile_max > *m ? tile_max : *m;
    float sum = 0.0f;
    for (int j = 0; j < KT; j++) {
        const float w = (j >= jlo && j < jhi) ? expf(s[j] - new_max) : 0.0f;
        s[j] = w;
        sum += w;
    }
#endif
    *corr = expf(*m - new_max);  /* 0 on a row's first tile */
    *l = *l * *corr + sum;
    *m = new_max;
}

static void run_task(const prefill_t *p, const chunk_t *c, const task_t *t, const float *scratch) {
    const int D = p->head_dim, H = p->num_heads, KVH = p->num_kv_heads, G = H / KVH;
    const int rows = (t->q1 - t->q0) * G;
    float *q = (float *)aligned_alloc(64, sizeof(float) * ((size_t)rows * D + (size_t)rows * D + (size_t)rows * KT));
    if (!q) return;
    float *o = q + (int64_t)rows * D, *s = o + (int64_t)rows * D;
    float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
    int pos[MAX_ROWS], lo[MAX_ROWS];
    /* row r = (query i, group member g): positions never decrease with r */
    for (int r = 0; r < rows; r++) {
        const int i = t->q0 + r / G, h = t->kvh * G + r % G;
        const float *src = p->q + (int64_t)(c->q_start + i) * p->q_row_stride + (int64_t)h * D;
        for (int d = 0; d < D; d++) q[(int64_t)r * D + d] = src[d] * p->scale, o[(int64_t)r * D + d] = 0.0f;
        pos[r] = c->ctx - c->q_len + i;
        lo[r] = first_visible_key(p, pos[r]);
        m[r] = -FLT_MAX;  /* finite: built with -ffast-math */
        l[r] = 0.0f;
    }
    const int tile_elems = KT * D;
    const int first = lo[0] / KT, last = pos[rows - 1] / KT;
    for (int tile = first; tile <= last; tile++) {
        const int64_t base = c->scratch + ((int64_t)t->kvh * c->num_tiles + (tile - c->first_tile)) * 2 * tile_elems;
        const float *kt = scratch + base, *vt = kt + tile_elems;
        const int k0 = tile * KT;
        int r0 = 0;
        while (r0 < rows && pos[r0] < k0) r0++;  /* rows before the tile see none of it */
        int r1 = rows;
        while (r1 > r0 && lo[r1 - 1] >= k0 + KT) r1--;  /* rows whose window starts past the tile */
        if (r0 >= r1) continue;
        for (int r = r0; r < r1; r += 4) score_rows(q + (int64_t)r * D, D, kt, s + (int64_t)r * KT, r1 - r < 4 ? r1 - r : 4);
        for (int r = r0; r < r1; r++) {
            /* keys [jlo, jhi) of the tile are visible to row r: at least one, see r0/r1 */
            const int jlo = lo[r] > k0 ? lo[r] - k0 : 0;
            const int jhi = pos[r] - k0 + 1 < KT ? pos[r] - k0 + 1 : KT;
            softmax_row(s + (int64_t)r * KT, jlo, jhi, &m[r], &l[r], &corr[r]);
        }
        for (int r = r0; r < r1; r += 2) {
            const int n = r1 - r < 2 ? r1 - r : 2;
            accumulate_rows(o + (int64_t)r * D, D, s + (int64_t)r * KT, corr + r, vt, n);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int i = t->q0 + r / G, h = t->kvh * G + r % G;
        float *dst = p->out + ((int64_t)(c->q_start + i) * H + h) * D;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; d++) dst[d] = o[(int64_t)r * D + d] * inv;
    }
    free(q);
}

static int by_cost_desc(const void *a, const void *b) {
    const double x = ((const task_t *)a)->cost, y = ((const task_t *)b)->cost;
    return (x < y) - (x > y);
}

/* Returns 0, -1 when memory ran out (nothing computed), -2 for a shape this kernel does not take. */
static int paged_prefill(const prefill_t *p, int num_seqs, int num_threads) {
    const int H = p->num_heads, KVH = p->num_kv_heads, D = p->head_dim;
    if (KVH <= 0 || H % KVH || H / KVH > 16 || D <= 0 || p->block_size <= 0) return -2;
    const int G = H / KVH;
    int num_chunks = 0, num_tasks = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int ql = p->query_start_loc[s + 1] - p->query_start_loc[s];
        const int qt = ql >= LONG_CHUNK ? QT_LONG : QT;
        if (ql > 1 && p->context_lens[s] >= ql) num_chunks++, num_tasks += KVH * ((ql + qt - 1) / qt);
    }
    if (num_chunks == 0) return 0;
    chunk_t *chunks = (chunk_t *)malloc(sizeof(chunk_t) * (size_t)num_chunks);
    task_t *tasks = (task_t *)malloc(sizeof(task_t) * (size_t)num_tasks);
    int64_t scratch_floats = 0, num_tiles = 0;
    int ci = 0, ti = 0;
    for (int s = 0; s < num_seqs && chunks && tasks; s++) {
        const int ql = p->query_start_loc[s + 1] - p->query_start_loc[s], ctx = p->context_lens[s];
        if (!(ql > 1 && ctx >= ql)) continue;
        chunk_t *c = &chunks[ci];
        c->seq = s, c->q_start = p->query_start_loc[s], c->q_len = ql, c->ctx = ctx;
        c->first_tile = first_visible_key(p, ctx - ql) / KT;
        c->num_tiles = (ctx + KT - 1) / KT - c->first_tile;
        c->scratch = scratch_floats;
        scratch_floats += (int64_t)KVH * c->num_tiles * 2 * KT * D;
        num_tiles += (int64_t)KVH * c->num_tiles;
        for (int kvh = 0; kvh < KVH; kvh++) {
            const int qt = ql >= LONG_CHUNK ? QT_LONG : QT;
            for (int q0 = 0; q0 < ql; q0 += qt) {
                const int q1 = q0 + qt < ql ? q0 + qt : ql;
                const int p_last = ctx - ql + q1 - 1, lo = first_visible_key(p, ctx - ql + q0);
                tasks[ti++] = (task_t){ci, kvh, q0, q1, (double)(q1 - q0) * G * (p_last - lo + 1)};
            }
        }
        ci++;
    }
    float *scratch = chunks && tasks ? (float *)aligned_alloc(64, sizeof(float) * (size_t)scratch_floats + 64) : 0;
    if (!scratch) {
        free(chunks), free(tasks);
        return -1;
    }
    qsort(tasks, (size_t)num_tasks, sizeof(task_t), by_cost_desc);
#ifdef _OPENMP
    #pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
#endif
    {
        /* phase 1: every key tile once; (chunk, kv head, tile) flattened in scratch order */
#ifdef _OPENMP
        #pragma omp for schedule(static)
#endif
        for (int64_t flat = 0; flat < num_tiles; flat++) {
            int64_t rest = flat;
            int c = 0;
            while (rest >= (int64_t)KVH * chunks[c].num_tiles) rest -= (int64_t)KVH * chunks[c].num_tiles, c++;
            const int kvh = (int)(rest / chunks[c].num_tiles), tile = (int)(rest % chunks[c].num_tiles);
            float *kt = scratch + chunks[c].scratch + rest * 2 * KT * D;
            load_tile(p, &chunks[c], kvh, chunks[c].first_tile + tile, kt, kt + KT * D);
        }
        /* phase 2 (after the implicit barrier): the tasks, longest first */
#ifdef _OPENMP
        #pragma omp for schedule(dynamic, 1)
#endif
        for (int k = 0; k < num_tasks; k++) run_task(p, &chunks[tasks[k].chunk], &tasks[k], scratch);
    }
    free(scratch), free(chunks), free(tasks);
    return 0;
}

#define PREFILL_PARAMS                                                                                       \
    int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,            \
        int64_t bt_stride, const int32_t *context_lens, const int32_t *query_start_loc, int num_seqs,         \
        int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window, float *out, \
        int num_threads

static int prefill_entry(const float *q, PREFILL_PARAMS, int kv_type) {
    const prefill_t p = {q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, q_row_stride,
                         bt_stride, num_heads, num_kv_heads, head_dim, block_size, window, scale, kv_type};
    return paged_prefill(&p, num_seqs, num_threads);
}

/* Same arguments as kvpilot_paged_decode_*; fills the rows of sequences with more than one query token. */
int kvpilot_paged_prefill_f32(const float *q, PREFILL_PARAMS) {
    return prefill_entry(q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, context_lens,
                         query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window,
                         out, num_threads, KV_F32);
}

#if HAVE_F16
int kvpilot_paged_prefill_f16kv(const float *q, PREFILL_PARAMS) {
    return prefill_entry(q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, context_lens,
                         query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window,
                         out, num_threads, KV_F16);
}
#endif
