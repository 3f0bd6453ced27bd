/* What the native CPU kernels share: which instruction sets this build may use, and the AVX2
 * helpers (a vectorized exp and horizontal reductions). Every kernel has a plain-C path for builds
 * without AVX2 + FMA (tested with -mno-avx2 -mno-fma). */
#ifndef KVPILOT_CPU_SIMD_H
#define KVPILOT_CPU_SIMD_H

#if defined(__AVX2__) && defined(__FMA__)
#define USE_AVX2 1
#else
#define USE_AVX2 0
#endif
#if USE_AVX2 || defined(__F16C__)
#include <immintrin.h>
#endif
/* gcc defines __FLT16_MAX__ where it has _Float16 (x86 from gcc 12); without it only float32 caches are built */
#ifdef __FLT16_MAX__
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

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

#endif
