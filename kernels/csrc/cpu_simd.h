/* What the native CPU kernels share: which instruction sets this build may use, the AVX2
 * helpers (a vectorized exp and horizontal reductions) and the attention kernels' online-softmax step.
 * Every kernel has a plain-C path for builds
 * without AVX2 + FMA (tested with -mno-avx2 -mno-fma). */
#ifndef KVPILOT_CPU_SIMD_H
#define KVPILOT_CPU_SIMD_H

#if defined(__AVX2__) && defined(__FMA__)
#define USE_AVX2 1
#else
#define USE_AVX2 0
#endif
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if USE_AVX2 || defined(__F16C__)
#include <immintrin.h>
#endif
/* gcc defines __FLT16_MAX__ where it has _Float16 (x86 from gcc 12); without it only float32 caches are built */
#ifdef __FLT16_MAX__
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

/* The KV caches' element types. bfloat16 is the top half of a float32, so widening it is a 16-bit shift
 * (exact), with no conversion instruction and no _Float16 needed. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even (finite values) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* The attention kernels' queries and outputs are float32 rows, or bfloat16 ones (a bfloat16 model's: read
 * widened, exactly, and written rounded once from the float32 accumulators). */
static inline float load_io(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline void store_io(void *row, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)row)[i] = f32_to_bf16(x);
    else ((float *)row)[i] = x;
}

#if USE_AVX2
/* 8 bfloat16 values from p, widened to float32 */
static inline __attribute__((always_inline)) __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

static inline __attribute__((always_inline)) void widen_bf16(float *dst, const uint16_t *src, const int n) {
    int i = 0;
#if USE_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
#endif
    for (; i < n; i++) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, sizeof bits);
    }
}

#if USE_AVX2
/* e^x for x in [-87, 88] (clamped there; e^-87 ~ 1.6e-38 stands for 0): 2^n * e^r with |r| <= ln2/2,
 * a degree-6 Taylor polynomial on r (relative error ~1e-7, what float32 holds), scaled by building
 * 2^n's exponent bits. */
static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  /* ln2 split in two for accuracy */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 e = _mm256_set1_ps(1.0f / 720.0f);
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 120.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 24.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 6.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

/* One row's online-softmax step over n scores (n a multiple of 8; the prefill kernel's key tiles, the decode
 * kernel's blocks): s[jlo..jhi) become weights e^(s - new max), every other entry of s[0..n) becomes 0; the
 * running max m and sum l move on and corr is what the row's earlier output must be scaled by (0 on its
 * first step: m starts at -FLT_MAX). */
static inline void online_softmax(float *s, const int n, int jlo, int jhi, float *m, float *l, float *corr) {
#if USE_AVX2
    const int nv = (jhi + 7) / 8;  /* vectors holding a visible key; the rest become 0 */
    const __m256 floor = _mm256_set1_ps(-FLT_MAX);
    __m256 vmax = floor;
    if (jlo == 0 && jhi == n) {  /* the common case: every score is visible */
        for (int v = 0; v < n / 8; v++) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + 8 * v));
        const float new_max = fmaxf(hmax8(vmax), *m);
        const __m256 mx = _mm256_set1_ps(new_max);
        __m256 sum = _mm256_setzero_ps();
        for (int v = 0; v < n / 8; v++) {
            const __m256 w = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * v), mx));
            _mm256_storeu_ps(s + 8 * v, w);
            sum = _mm256_add_ps(sum, w);
        }
        *corr = expf(*m - new_max);  /* 0 on a row's first tile */
        *l = *l * *corr + hsum8(sum);
        *m = new_max;
        return;
    }
    const __m256 idx0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lo = _mm256_set1_ps((float)jlo - 0.5f), hi = _mm256_set1_ps((float)jhi - 0.5f);
    for (int v = 0; v < nv; v++) {
        const __m256 idx = _mm256_add_ps(idx0, _mm256_set1_ps((float)(8 * v)));
        const __m256 in = _mm256_and_ps(_mm256_cmp_ps(idx, lo, _CMP_GT_OQ), _mm256_cmp_ps(idx, hi, _CMP_LT_OQ));
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(floor, _mm256_loadu_ps(s + 8 * v), in));
    }
    const float new_max = fmaxf(hmax8(vmax), *m);
    const __m256 mx = _mm256_set1_ps(new_max);
    __m256 sum = _mm256_setzero_ps();
    for (int v = 0; v < nv; v++) {
        const __m256 idx = _mm256_add_ps(idx0, _mm256_set1_ps((float)(8 * v)));
        const __m256 in = _mm256_and_ps(_mm256_cmp_ps(idx, lo, _CMP_GT_OQ), _mm256_cmp_ps(idx, hi, _CMP_LT_OQ));
        const __m256 w = _mm256_and_ps(exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * v), mx)), in);
        _mm256_storeu_ps(s + 8 * v, w);
        sum = _mm256_add_ps(sum, w);
    }
    for (int v = nv; v < n / 8; v++) _mm256_storeu_ps(s + 8 * v, _mm256_setzero_ps());
    const float total = hsum8(sum);
#else
    float tile_max = -FLT_MAX;
    for (int j = jlo; j < jhi; j++) tile_max = s[j] > tile_max ? s[j] : tile_max;
    const float new_max = tile_max > *m ? tile_max : *m;
    float total = 0.0f;
    for (int j = 0; j < n; j++) {
        const float w = (j >= jlo && j < jhi) ? expf(s[j] - new_max) : 0.0f;
        s[j] = w;
        total += w;
    }
#endif
    *corr = expf(*m - new_max);  /* 0 on a row's first tile */
    *l = *l * *corr + total;
    *m = new_max;
}

/* Gemma 2's attention logit soft-capping on the scores s[lo..hi): s = cap * tanh(s / cap). Called only when a
 * cap is set, so the uncapped kernels pay one untaken branch per tile; tanhf from libm (glibc's vector variant
 * where gcc vectorizes the loop) keeps it exact to float32. */
static inline void soft_cap_scores(float *s, int lo, int hi, float cap) {
    const float inv = 1.0f / cap;
    for (int j = lo; j < hi; j++) s[j] = cap * tanhf(s[j] * inv);
}

/* gpt-oss's attention sinks: a head's sink logit joins its softmax as one more score with no value row. The
 * online softmax starts from it, max = sink and sum = e^(sink - sink) = 1, instead of from nothing (max
 * -FLT_MAX, sum 0); with no sinks (NULL) that plain start. */
static inline void softmax_start(const float *sinks, int head, float *m, float *l) {
    *m = sinks ? sinks[head] : -FLT_MAX;  /* not -inf: built with -ffast-math, which assumes finite values */
    *l = sinks ? 1.0f : 0.0f;
}

#endif
