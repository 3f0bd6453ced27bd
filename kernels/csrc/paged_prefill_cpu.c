/* Paged prefill attention for the CPU: the rows of sequences with more than one query token this
 * step (prompt chunks), float32 or bfloat16 queries and output (see load_io), float32, float16 or bfloat16
 * KV cache.
 *
 * Why this exists: torch's SDPA needs each sequence's K/V gathered out of the paged cache into a
 * dense tensor first, and its flash kernel reaches only 15-40 GFLOP/s at the prompt lengths a
 * serving engine sees (64-512 tokens) on a 2-core AVX2 EPYC, against 150+ for a large GEMM. This
 * kernel is flash attention written for that CPU:
 *   - keys are taken in tiles of 64 positions, wherever their blocks lie in the cache; each tile is
 *     copied once per call into float32 panels (panel_kernel.h): K as two panels of 32 keys, V as
 *     panels of 32 head dims, so a 16-bit cache is widened once, not once per query;
 *   - the G query heads that share a kv head are served by one task as G*QT rows (QT positions),
 *     so every key tile loaded is used by all of them;
 *   - both products, scores = q . K and out += weights . V, are the panel GEMM's register tile (12 rows
 *     x 32 columns on AVX-512, 3 x 32 on AVX2, plain loops elsewhere), with an online softmax per row
 *     over the tile's 64 keys in between. Smaller tiles (16 keys, separate small AVX2 tiles) ran at
 *     about half the rate: the softmax's per-tile cost was paid 4x as often and their loads and
 *     broadcasts bounded the FMAs (bench/results/prefill_kernel_ab.json);
 *   - causal tiles past a task's last position are never visited, and in the diagonal tile a group of
 *     rows computes only the key panels (scores) and keys (output) its last row sees.
 * A bfloat16 model (bfloat16 queries over a bfloat16 cache) on a CPU with bfloat16 dot products (AVX512-BF16)
 * keeps its tiles in bfloat16, as pairs along each product's inner dimension (load_tile_pairs), and runs both
 * products on the dot-product instruction (panel_rows_bf16): each multiplies two pairs exactly and adds them in
 * float32, half the instructions of the float32 FMAs. The queries go in unscaled (exact) and the scores are
 * scaled; the softmax weights are rounded to bfloat16 for the product with V, as torch's bfloat16 SDPA rounds
 * them (the test checks the result is no further from the exact one than torch's). Faster than float32
 * arithmetic over the same cache, most at long prompts (bench/results/profile_run_w96_bf16.md).
 * Work is split over the OpenMP team torch already uses: first the key tiles, then the
 * (sequence, kv head, query tile) tasks, most expensive first. Without OpenMP it runs on one thread.
 *
 * Layouts match kvpilot.kernels (see paged_decode_cpu.c). A query row of sequence s at index i
 * of its q_len rows sits at position p = context_len - q_len + i and sees keys k with k <= p and,
 * when window > 0, p - k < window. Sequences with q_len <= 1 are left to the decode kernel. soft_cap and sinks
 * as in the decode kernel: capped scores before the online softmax, each row's softmax started from its head's
 * sink logit.
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
#include "panel_kernel.h"

enum { KT = 2 * PANEL };  /* keys per tile: two panels of the score product */
/* the shapes this kernel takes (cpu_native.paged_prefill sends others to SDPA) */
enum { MAX_GROUP = 16, MAX_HEAD_DIM = 512 };

/* a V tile's width: head dims padded to whole panels (the padding stays 0) */
static inline int padded_dim(int d) { return (d + PANEL - 1) / PANEL * PANEL; }

/* Query positions per task: G*QT rows share each key tile. Long chunks take wider tasks: a task
 * streams all the keys it sees through the cache, and from ~512 of them they no longer stay in L2. */
enum { QT = 32, QT_LONG = 64, LONG_CHUNK = 512 };
enum { MAX_ROWS = MAX_GROUP * QT_LONG };

typedef struct {
    const void *q;  /* float or bfloat16 bits, as io_bf16 says; so is out */
    const void *k_cache, *v_cache;
    void *out;
    const int32_t *block_tables, *context_lens, *query_start_loc;
    int64_t q_row_stride, bt_stride;
    int num_heads, num_kv_heads, head_dim, block_size, window;
    float scale;
    int kv_type, io_bf16;
    int pairs;  /* bfloat16 queries over a bfloat16 cache, on the dot-product instruction (see load_tile_pairs) */
    const float *sinks;  /* [num_heads] sink logits, or NULL */
    float soft_cap;      /* > 0: cap the scores */
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

/* Copy key tile `tile` of chunk `c` (one kv head) into the scratch as panels (see panel_kernel.h): K as
 * [KT / PANEL][D][PANEL] (keys are the columns of the score product), V as [DP / PANEL][KT][PANEL] (head
 * dims are the columns of the output product, zero-padded to DP). Positions past the context are zero
 * (their scores are masked, their weights are 0). */
static void load_tile(const prefill_t *p, const chunk_t *c, int kvh, int tile, float *kp, float *vp) {
    const int D = p->head_dim, DP = padded_dim(D), KVH = p->num_kv_heads, BS = p->block_size;
    const int32_t *table = p->block_tables + (int64_t)c->seq * p->bt_stride;
    float krow[MAX_HEAD_DIM], vrow[MAX_HEAD_DIM];
    for (int j = 0; j < KT; j++) {
        const int pos = tile * KT + j;
        float *kcol = kp + (int64_t)(j / PANEL) * D * PANEL + j % PANEL;
        if (pos >= c->ctx) {
            for (int d = 0; d < D; d++) kcol[(int64_t)d * PANEL] = 0.0f;
            for (int d0 = 0; d0 < DP; d0 += PANEL)
                memset(vp + (int64_t)d0 * KT + (int64_t)j * PANEL, 0, sizeof(float) * PANEL);
            continue;
        }
        const int64_t index = ((int64_t)table[pos / BS] * BS + pos % BS) * KVH * D + (int64_t)kvh * D;
        const float *kr = krow, *vr = vrow;
        if (p->kv_type == KV_BF16) {
            widen_bf16(krow, (const uint16_t *)p->k_cache + index, D);
            widen_bf16(vrow, (const uint16_t *)p->v_cache + index, D);
        } else
#if HAVE_F16
        if (p->kv_type == KV_F16) {
            const _Float16 *kh = (const _Float16 *)p->k_cache + index, *vh = (const _Float16 *)p->v_cache + index;
            int d = 0;
#ifdef __F16C__
            for (; d + 8 <= D; d += 8) {
                _mm256_storeu_ps(krow + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kh + d))));
                _mm256_storeu_ps(vrow + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vh + d))));
            }
#endif
            for (; d < D; d++) krow[d] = (float)kh[d], vrow[d] = (float)vh[d];
        } else
#endif
        {
            kr = (const float *)p->k_cache + index, vr = (const float *)p->v_cache + index;
        }
        for (int d = 0; d < D; d++) kcol[(int64_t)d * PANEL] = kr[d];
        for (int d0 = 0; d0 < DP; d0 += PANEL) {
            float *dst = vp + (int64_t)d0 * KT + (int64_t)j * PANEL;
            const int n = D - d0 < PANEL ? D - d0 : PANEL;
            memcpy(dst, vr + d0, sizeof(float) * (size_t)n);
            if (n < PANEL) memset(dst + n, 0, sizeof(float) * (size_t)(PANEL - n));
        }
    }
}

#if HAVE_PANEL_BF16
/* load_tile for the dot-product path (pairs): the same tile, kept in bfloat16 as pairs of the products' inner
 * dimension (panel_rows_bf16): K as [KT / PANEL][D / 2][PANEL] pairs (d, d + 1) of one key, V as
 * [DP / PANEL][KT / 2][PANEL] pairs (key 2i, key 2i + 1) of one head dim; in the same scratch, half its bytes. */
static void load_tile_pairs(const prefill_t *p, const chunk_t *c, int kvh, int tile, uint32_t *kp2, uint16_t *vp2) {
    const int D = p->head_dim, DP = padded_dim(D), KVH = p->num_kv_heads, BS = p->block_size, D2 = D / 2;
    const int32_t *table = p->block_tables + (int64_t)c->seq * p->bt_stride;
    memset(vp2, 0, sizeof(uint16_t) * (size_t)DP * KT);  /* the padding dims and the keys past the context */
    for (int j = 0; j < KT; j++) {
        const int pos = tile * KT + j;
        uint32_t *kcol = kp2 + (int64_t)(j / PANEL) * D2 * PANEL + j % PANEL;
        if (pos >= c->ctx) {
            for (int i = 0; i < D2; i++) kcol[(int64_t)i * PANEL] = 0;
            continue;
        }
        const int64_t index = ((int64_t)table[pos / BS] * BS + pos % BS) * KVH * D + (int64_t)kvh * D;
        const uint16_t *kr = (const uint16_t *)p->k_cache + index, *vr = (const uint16_t *)p->v_cache + index;
        for (int i = 0; i < D2; i++) {
            uint32_t pair;
            memcpy(&pair, kr + 2 * i, sizeof pair);
            kcol[(int64_t)i * PANEL] = pair;
        }
        /* head dim d of key j: panel d / PANEL, pair row j / 2, column d % PANEL, half j % 2 */
        uint16_t *vcol = vp2 + (int64_t)(j / 2) * PANEL * 2 + j % 2;
        for (int d = 0; d < D; d++) vcol[((int64_t)(d / PANEL) * (KT / 2) * PANEL + d % PANEL) * 2] = vr[d];
    }
}

/* n float32 weights (a multiple of 32) as n / 2 bfloat16 pairs, rounded to nearest even */
static inline void weights_to_pairs(const float *w, int n, uint32_t *pairs) {
    for (int i = 0; i < n; i += 32)
        _mm512_storeu_si512(pairs + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + i + 16),
                                                                        _mm512_loadu_ps(w + i)));
}
#endif

static void run_task(const prefill_t *p, const chunk_t *c, const task_t *t, const float *scratch) {
    const int D = p->head_dim, DP = padded_dim(D), H = p->num_heads, KVH = p->num_kv_heads, G = H / KVH;
    const int rows = (t->q1 - t->q0) * G;
    /* q: the scaled float32 rows, or (pairs) the rows' bfloat16 pairs unscaled, in the same space; w2: the
     * pairs path's softmax weights as bfloat16 pairs */
    float *q = rows > 0 ? (float *)aligned_alloc(64, sizeof(float) * ((size_t)rows * (D + DP + KT + KT / 2))) : NULL;
    if (!q) return;
    float *o = q + (int64_t)rows * D, *s = o + (int64_t)rows * DP;
    uint32_t *q2 = (uint32_t *)q, *w2 = (uint32_t *)(s + (int64_t)rows * KT);
    (void)w2;  /* used by the pairs path only */
    const int D2 = D / 2;
    float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
    int pos[MAX_ROWS], lo[MAX_ROWS];
    /* row r = (query i, group member g): positions never decrease with r */
    for (int r = 0; r < rows; r++) {
        const int i = t->q0 + r / G, h = t->kvh * G + r % G;
        const int64_t src = (int64_t)(c->q_start + i) * p->q_row_stride + (int64_t)h * D;
        if (p->pairs)
            memcpy(q2 + (int64_t)r * D2, (const uint16_t *)p->q + src, sizeof(uint32_t) * (size_t)D2);
        else
            for (int d = 0; d < D; d++) q[(int64_t)r * D + d] = load_io(p->q, src + d, p->io_bf16) * p->scale;
        for (int d = 0; d < DP; d++) o[(int64_t)r * DP + d] = 0.0f;
        pos[r] = c->ctx - c->q_len + i;
        lo[r] = first_visible_key(p, pos[r]);
        softmax_start(p->sinks, h, &m[r], &l[r]);
    }
    const int64_t tile_floats = (int64_t)KT * (D + DP);
    const int first = lo[0] / KT, last = pos[rows - 1] / KT;
    for (int tile = first; tile <= last; tile++) {
        const int64_t tile_index = (int64_t)t->kvh * c->num_tiles + (tile - c->first_tile);
        const float *kp = scratch + c->scratch + tile_index * tile_floats;
        const float *vp = kp + (int64_t)KT * D;
        const int k0 = tile * KT;
        int r0 = 0;
        while (r0 < rows && pos[r0] < k0) r0++;  /* rows before the tile see none of it */
        int r1 = rows;
        while (r1 > r0 && lo[r1 - 1] >= k0 + KT) r1--;  /* rows whose window starts past the tile */
        if (r0 >= r1) continue;
        /* keys [0, VISIBLE(r)) of the tile are at or before row r's position; a group of rows takes the
         * keys its last row sees */
#define VISIBLE(r) (pos[r] - k0 + 1 < KT ? pos[r] - k0 + 1 : KT)
        for (int r = r0; r < r1; r += PANEL_MB) {  /* scores: s[r][j] = q[r] . key j */
            const int mb = r1 - r < PANEL_MB ? r1 - r : PANEL_MB, panels = (VISIBLE(r + mb - 1) + PANEL - 1) / PANEL;
            for (int k = 0; k < panels; k++) {
#if HAVE_PANEL_BF16
                if (p->pairs) {
                    panel_rows_bf16_n(q2 + (int64_t)r * D2, D2, mb, (const uint32_t *)kp + (int64_t)k * D2 * PANEL, D2,
                                      s + (int64_t)r * KT + k * PANEL, KT, NULL);
                    continue;
                }
#endif
                panel_rows_n(q + (int64_t)r * D, D, mb, kp + (int64_t)k * D * PANEL, D, s + (int64_t)r * KT + k * PANEL,
                             KT, NULL);
            }
        }
        for (int r = r0; r < r1; r++) {
            /* keys [jlo, jhi) of the tile are visible to row r: at least one, see r0/r1 */
            const int jlo = lo[r] > k0 ? lo[r] - k0 : 0;
            float *row = s + (int64_t)r * KT;
            if (p->pairs)  /* the pairs path's queries are unscaled (exact in bfloat16): scale the scores */
                for (int j = 0; j < KT; j++) row[j] *= p->scale;
            if (p->soft_cap > 0.0f) soft_cap_scores(row, jlo, VISIBLE(r), p->soft_cap);
            online_softmax(row, KT, jlo, VISIBLE(r), &m[r], &l[r], &corr[r]);
#if HAVE_PANEL_BF16
            if (p->pairs) weights_to_pairs(row, KT, w2 + (int64_t)r * (KT / 2));
#endif
        }
        for (int r = r0; r < r1; r += PANEL_MB) {  /* o[r] = o[r] * corr[r] + sum_j w[r][j] * v[j] */
            const int mb = r1 - r < PANEL_MB ? r1 - r : PANEL_MB, keys = VISIBLE(r + mb - 1);
            for (int d0 = 0; d0 < DP; d0 += PANEL) {
#if HAVE_PANEL_BF16
                if (p->pairs) {  /* an odd last key's partner has weight 0 */
                    panel_rows_bf16_n(w2 + (int64_t)r * (KT / 2), KT / 2, mb, (const uint32_t *)vp + (int64_t)d0 * (KT / 2),
                                      (keys + 1) / 2, o + (int64_t)r * DP + d0, DP, corr + r);
                    continue;
                }
#endif
                panel_rows_n(s + (int64_t)r * KT, KT, mb, vp + (int64_t)d0 * KT, keys, o + (int64_t)r * DP + d0, DP,
                             corr + r);
            }
        }
#undef VISIBLE
    }
    for (int r = 0; r < rows; r++) {
        const int i = t->q0 + r / G, h = t->kvh * G + r % G;
        const int64_t dst = ((int64_t)(c->q_start + i) * H + h) * D;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; d++) store_io(p->out, dst + d, o[(int64_t)r * DP + d] * inv, p->io_bf16);
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
    if (KVH <= 0 || H % KVH || H / KVH > MAX_GROUP || D <= 0 || D > MAX_HEAD_DIM || p->block_size <= 0) return -2;
    const int64_t tile_floats = (int64_t)KT * (D + padded_dim(D));
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
        scratch_floats += (int64_t)KVH * c->num_tiles * tile_floats;
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
            float *kp = scratch + chunks[c].scratch + rest * tile_floats;
#if HAVE_PANEL_BF16
            if (p->pairs) {
                load_tile_pairs(p, &chunks[c], kvh, chunks[c].first_tile + tile, (uint32_t *)kp,
                                (uint16_t *)(kp + (int64_t)KT * D));
                continue;
            }
#endif
            load_tile(p, &chunks[c], kvh, chunks[c].first_tile + tile, kp, kp + (int64_t)KT * D);
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

/* The shape limits above, for the Python side to route other shapes to SDPA before calling. */
int kvpilot_prefill_max_group(void) { return MAX_GROUP; }
int kvpilot_prefill_max_head_dim(void) { return MAX_HEAD_DIM; }

#define PREFILL_PARAMS                                                                                       \
    int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,            \
        int64_t bt_stride, const int32_t *context_lens, const int32_t *query_start_loc, int num_seqs,         \
        int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window, void *out,  \
        int num_threads, int io_bf16, const float *sinks, float soft_cap

static int prefill_entry(const void *q, PREFILL_PARAMS, int kv_type) {
    const prefill_t p = {q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, q_row_stride,
                         bt_stride, num_heads, num_kv_heads, head_dim, block_size, window, scale, kv_type, io_bf16,
                         HAVE_PANEL_BF16 && io_bf16 && kv_type == KV_BF16 && head_dim % 2 == 0, sinks, soft_cap};
    return paged_prefill(&p, num_seqs, num_threads);
}

/* Same arguments as kvpilot_paged_decode_*; fills the rows of sequences with more than one query token. */
int kvpilot_paged_prefill_f32(const void *q, PREFILL_PARAMS) {
    return prefill_entry(q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, context_lens,
                         query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window,
                         out, num_threads, io_bf16, sinks, soft_cap, KV_F32);
}

#if HAVE_F16
int kvpilot_paged_prefill_f16kv(const void *q, PREFILL_PARAMS) {
    return prefill_entry(q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, context_lens,
                         query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window,
                         out, num_threads, io_bf16, sinks, soft_cap, KV_F16);
}
#endif

int kvpilot_paged_prefill_bf16kv(const void *q, PREFILL_PARAMS) {
    return prefill_entry(q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, context_lens,
                         query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window,
                         out, num_threads, io_bf16, sinks, soft_cap, KV_BF16);
}
