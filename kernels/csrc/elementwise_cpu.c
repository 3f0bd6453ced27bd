/* The model's elementwise steps for float32 and bfloat16 on the CPU: SiLU(gate) * up, GELU(gate) * up, RMSNorm
 * and RoPE (at the end of this file).
 *
 * Why this exists: in torch each is several ops with temporaries (SiLU of a strided view, then a
 * multiply into a new tensor; RMSNorm a composite op whose fixed cost is paid 61 times per decode step).
 * Here each is one pass over its rows, split among the OpenMP threads torch uses (step profiles:
 * bench/results/profile_*.md).
 *
 * silu_mul: gu [rows, 2 * inter] rows gu_stride floats apart (gate = the first inter columns, up =
 *           the rest); out [rows, inter] contiguous.
 * gelu_tanh_mul: Gemma's GeGLU, GELU(gate) * up with GELU's tanh approximation, in silu_mul's layout.
 *           0.5 x (1 + tanh(u)) is computed as x / (1 + e^(-2u)), the same function (1 + tanh(u) =
 *           2 / (1 + e^(-2u))), u = sqrt(2 / pi) (x + 0.044715 x^3): one exp, and no cancellation where
 *           tanh(u) nears -1 (torch's form loses the digits of 1 + tanh(u) there, below x ~ -3, and gives 0
 *           below x ~ -5.1; this one keeps the tiny value).
 * rms_norm: x [rows, dim] rows x_stride floats apart; out [rows, dim] contiguous;
 *           out = x / sqrt(mean(x^2) + eps) * weight; the squares are summed in float32 lanes and the
 *           lanes in float64.
 * The _bf16 variants take and give bfloat16 (uint16_t bits), compute in float32 and round as HF's bfloat16
 * modules do, op by op (round to nearest even): rms_norm rounds the normalized row, then its product with
 * the weight; silu_mul (gelu_tanh_mul) rounds SiLU(gate) (GELU(gate)), then its product with up, as torch's
 * bfloat16 ops do (each computes in float32 and rounds its result).
 * rms_norm_bf16_f32w: bfloat16 rows scaled by a float32 weight (Gemma's folded 1 + w, OLMo 2's): normalized
 * and scaled in float32 and rounded once, as torch's rms_norm(x.float(), ..., weight).to(bfloat16) does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"


static void silu_mul_row(const float *g, const float *u, float *o, int n) {
    int i = 0;
#if USE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* The exported row loop of a gated activation: out [rows, inter] from gate|up rows gu_stride elements apart,
 * one row per iteration, threaded from two rows on. */
#ifdef _OPENMP
#define ACT_MUL_ROWS(T, row_fn)                                                                             \
    if (num_threads < 1) num_threads = 1;                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)")                     \
    for (int r = 0; r < rows; r++) {                                                                        \
        const T *g = gu + (int64_t)r * gu_stride;                                                           \
        row_fn(g, g + inter, out + (int64_t)r * inter, inter);                                              \
    }
#else
#define ACT_MUL_ROWS(T, row_fn)                                                                             \
    (void)num_threads;                                                                                      \
    for (int r = 0; r < rows; r++) {                                                                        \
        const T *g = gu + (int64_t)r * gu_stride;                                                           \
        row_fn(g, g + inter, out + (int64_t)r * inter, inter);                                              \
    }
#endif

void kvpilot_silu_mul_f32(const float *gu, int64_t gu_stride, int rows, int inter, float *out, int num_threads) {
    ACT_MUL_ROWS(float, silu_mul_row)
}

/* GELU's tanh form as x * sigmoid(2u): -2u = x (GELU_C1 + GELU_C2 x^2), C1 = -2 sqrt(2 / pi), C2 = C1 * 0.044715 */
#define GELU_C1 (-1.5957691216057308f)
#define GELU_C2 (-0.07135481627260025f)

/* the exponent held at 88 as exp_avx2 holds it: -ffast-math assumes finite values, and an overflowed e^(-2u)
 * (gate below ~ -10.4) came out of the vectorized x / (1 + inf) as NaN */
static inline float gelu_tanh(float x) { return x / (1.0f + expf(fminf(x * (GELU_C1 + GELU_C2 * x * x), 88.0f))); }

/* GeGLU's AVX-512 loops (16 lanes; the AVX2 and scalar loops take the rest of a row). Built on AVX-512 CPUs
 * only, where the GeGLU (one exp and one division an element) is compute-bound at prefill sizes */
#if USE_AVX2 && defined(__AVX512F__)
#define ELEM_AVX512 1
/* exp_avx2's e^x, 16 lanes: the same clamp, reduction and polynomial, so that both give the same bits */
static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 e = _mm512_set1_ps(1.0f / 720.0f);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

static inline __m512 gelu_tanh_avx512(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(GELU_C2),
                                                      _mm512_set1_ps(GELU_C1)));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_avx512(t)));
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* v rounded to bfloat16 (to nearest even): the 16 bfloat16 bits (widen_bf16_bits_x16 widens them back) */
static inline __m256i bf16_bits_x16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16));
#endif
}

static inline __m512 widen_bf16_bits_x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
#define ELEM_AVX512 0
#endif

#if USE_AVX2
static inline __m256 gelu_tanh_avx2(__m256 x) {  /* exp_avx2's clamp keeps e^(-2u) finite: no inf / inf */
    const __m256 t = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(GELU_C2),
                                                      _mm256_set1_ps(GELU_C1)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_avx2(t)));
}
#endif

static void gelu_tanh_mul_row(const float *g, const float *u, float *o, int n) {
    int i = 0;
#if ELEM_AVX512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(gelu_tanh_avx512(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
#if USE_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu_tanh_avx2(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
#endif
    for (; i < n; i++) o[i] = gelu_tanh(g[i]) * u[i];
}

void kvpilot_gelu_tanh_mul_f32(const float *gu, int64_t gu_stride, int rows, int inter, float *out, int num_threads) {
    ACT_MUL_ROWS(float, gelu_tanh_mul_row)
}

/* 1 / sqrt(mean(x^2) + eps): the squares summed in float32 lanes, the lanes in float64 */
static float inv_rms(const float *x, int n, float eps) {
    int i = 0;
    double ss = 0.0;
#if USE_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0), a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
    for (int l = 0; l < 8; l++) ss += lanes[l];
#endif
    for (; i < n; i++) ss += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(ss / n + eps));
}

static void rms_norm_row(const float *x, const float *w, float eps, float *o, int n) {
    const float inv = inv_rms(x, n, eps);
    int i = 0;
#if USE_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i)));
#endif
    for (; i < n; i++) o[i] = x[i] * inv * w[i];
}

/* The exported row loop of an RMSNorm: each row of x (x_stride elements apart) into out's contiguous rows;
 * a row is dim values, so below ~32 rows a thread team costs more than it saves. */
#ifdef _OPENMP
#define RMS_NORM_ROWS(row_fn)                                                                               \
    if (num_threads < 1) num_threads = 1;                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows >= 32)")                   \
    for (int r = 0; r < rows; r++) row_fn(x + (int64_t)r * x_stride, weight, eps, out + (int64_t)r * dim, dim);
#else
#define RMS_NORM_ROWS(row_fn)                                                                               \
    (void)num_threads;                                                                                      \
    for (int r = 0; r < rows; r++) row_fn(x + (int64_t)r * x_stride, weight, eps, out + (int64_t)r * dim, dim);
#endif

void kvpilot_rms_norm_f32(const float *x, int64_t x_stride, int rows, int dim, const float *weight, float eps,
                          float *out, int num_threads) {
    RMS_NORM_ROWS(rms_norm_row)
}

/* ---- bfloat16 rows ---- */

#if USE_AVX2
static inline __m256 round_bf16x8(__m256 v) {  /* v rounded to bfloat16, still as float32 */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void store_bf16x8(uint16_t *p, __m256 rounded) {  /* the top halves of already rounded values */
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#endif

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int n) {
    int i = 0;
#if USE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = load_bf16x8(g + i);
        const __m256 silu = round_bf16x8(_mm256_div_ps(x, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(zero, x)))));
        store_bf16x8(o + i, round_bf16x8(_mm256_mul_ps(silu, load_bf16x8(u + i))));
    }
#endif
    for (; i < n; i++) {
        const float x = bf16_to_f32(g[i]);
        o[i] = f32_to_bf16(round_bf16(x / (1.0f + expf(-x))) * bf16_to_f32(u[i]));
    }
}

void kvpilot_silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, int rows, int inter, uint16_t *out,
                           int num_threads) {
    ACT_MUL_ROWS(uint16_t, silu_mul_row_bf16)
}

static void gelu_tanh_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int n) {
    int i = 0;
#if ELEM_AVX512
    for (; i + 16 <= n; i += 16) {
        const __m512 gelu = widen_bf16_bits_x16(bf16_bits_x16(gelu_tanh_avx512(load_bf16x16(g + i))));
        _mm256_storeu_si256((__m256i *)(o + i), bf16_bits_x16(_mm512_mul_ps(gelu, load_bf16x16(u + i))));
    }
#endif
#if USE_AVX2
    for (; i + 8 <= n; i += 8) {
        const __m256 gelu = round_bf16x8(gelu_tanh_avx2(load_bf16x8(g + i)));
        store_bf16x8(o + i, round_bf16x8(_mm256_mul_ps(gelu, load_bf16x8(u + i))));
    }
#endif
    for (; i < n; i++) o[i] = f32_to_bf16(round_bf16(gelu_tanh(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
}

void kvpilot_gelu_tanh_mul_bf16(const uint16_t *gu, int64_t gu_stride, int rows, int inter, uint16_t *out,
                                int num_threads) {
    ACT_MUL_ROWS(uint16_t, gelu_tanh_mul_row_bf16)
}

static void rms_norm_row_bf16(const uint16_t *x, const uint16_t *w, float eps, uint16_t *o, int n) {
    float row[n];  /* the row widened once (exact); a hidden size of floats fits any thread's stack */
    widen_bf16(row, x, n);
    const float inv = inv_rms(row, n, eps);
    int i = 0;
#if USE_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8) {
        const __m256 normed = round_bf16x8(_mm256_mul_ps(_mm256_loadu_ps(row + i), vinv));
        store_bf16x8(o + i, round_bf16x8(_mm256_mul_ps(normed, load_bf16x8(w + i))));
    }
#endif
    for (; i < n; i++) o[i] = f32_to_bf16(round_bf16(row[i] * inv) * bf16_to_f32(w[i]));
}

void kvpilot_rms_norm_bf16(const uint16_t *x, int64_t x_stride, int rows, int dim, const uint16_t *weight,
                           float eps, uint16_t *out, int num_threads) {
    RMS_NORM_ROWS(rms_norm_row_bf16)
}

/* bfloat16 rows, float32 weight: (x * inv) * w in float32, rounded once */
static void rms_norm_row_bf16_f32w(const uint16_t *x, const float *w, float eps, uint16_t *o, int n) {
    float row[n];  /* the row widened once (exact), as rms_norm_row_bf16 does */
    widen_bf16(row, x, n);
    const float inv = inv_rms(row, n, eps);
    int i = 0;
#if USE_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
        store_bf16x8(o + i, round_bf16x8(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + i), vinv),
                                                       _mm256_loadu_ps(w + i))));
#endif
    for (; i < n; i++) o[i] = f32_to_bf16(row[i] * inv * w[i]);
}

void kvpilot_rms_norm_bf16_f32w(const uint16_t *x, int64_t x_stride, int rows, int dim, const float *weight,
                                float eps, uint16_t *out, int num_threads) {
    RMS_NORM_ROWS(rms_norm_row_bf16_f32w)
}

/* ---- RoPE on interleaved pairs ----
 * rope: x [rows, heads * 2 * half] rows x_stride elements apart, each head's dims stored as (x_2j, x_2j+1)
 *       pairs (see llama.interleave_rope_rows); cis [rows, half] (cos, sin) float pairs, row r's rotation.
 *       Each pair becomes the complex product (x_2j + i x_2j+1)(cos + i sin), in place. The bfloat16 variant
 *       rotates in float32 and rounds once. Why: in torch this was a complex multiply over a float copy of
 *       q and k and, for bfloat16, two casts around it: four ops and three temporaries per layer. */
#if USE_AVX2
static inline __m256 rotate_pairs(__m256 v, __m256 cs) {  /* 4 pairs by 4 (cos, sin) */
    const __m256 c = _mm256_moveldup_ps(cs), s = _mm256_movehdup_ps(cs);
    const __m256 swapped = _mm256_permute_ps(v, 0xB1);  /* (x_2j+1, x_2j) */
    return _mm256_fmaddsub_ps(v, c, _mm256_mul_ps(swapped, s));  /* even lanes subtract, odd lanes add */
}
#endif

static inline void rotate_pair(float *x0, float *x1, const float *cs) {
    const float a = *x0, b = *x1;
    *x0 = a * cs[0] - b * cs[1];
    *x1 = b * cs[0] + a * cs[1];
}

static void rope_row_f32(float *x, int heads, int half, const float *cis) {
    for (int h = 0; h < heads; h++) {
        float *p = x + (int64_t)h * 2 * half;
        int j = 0;
#if USE_AVX2
        for (; j + 4 <= half; j += 4) _mm256_storeu_ps(p + 2 * j, rotate_pairs(_mm256_loadu_ps(p + 2 * j),
                                                                                _mm256_loadu_ps(cis + 2 * j)));
#endif
        for (; j < half; j++) rotate_pair(p + 2 * j, p + 2 * j + 1, cis + 2 * j);
    }
}

static void rope_row_bf16(uint16_t *x, int heads, int half, const float *cis) {
    for (int h = 0; h < heads; h++) {
        uint16_t *p = x + (int64_t)h * 2 * half;
        int j = 0;
#if USE_AVX2
        for (; j + 4 <= half; j += 4)
            store_bf16x8(p + 2 * j, round_bf16x8(rotate_pairs(load_bf16x8(p + 2 * j), _mm256_loadu_ps(cis + 2 * j))));
#endif
        for (; j < half; j++) {
            float a = bf16_to_f32(p[2 * j]), b = bf16_to_f32(p[2 * j + 1]);
            rotate_pair(&a, &b, cis + 2 * j);
            p[2 * j] = f32_to_bf16(a), p[2 * j + 1] = f32_to_bf16(b);
        }
    }
}

void kvpilot_rope_f32(float *x, int64_t x_stride, int rows, int heads, int half, const float *cis, int num_threads) {
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 32)
#endif
    for (int r = 0; r < rows; r++) rope_row_f32(x + (int64_t)r * x_stride, heads, half, cis + (int64_t)r * 2 * half);
}

void kvpilot_rope_bf16(uint16_t *x, int64_t x_stride, int rows, int heads, int half, const float *cis,
                       int num_threads) {
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 32)
#endif
    for (int r = 0; r < rows; r++) rope_row_bf16(x + (int64_t)r * x_stride, heads, half, cis + (int64_t)r * 2 * half);
}
