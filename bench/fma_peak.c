/* The host's fp32 FMA peak: independent chains of fused multiply-adds at the widest vectors this build
 * has (AVX-512, else AVX2 + FMA, else scalar), on OMP_NUM_THREADS threads. No memory traffic: the
 * ceiling no GEMM can pass, where a library sgemm only shows what that library reaches (torch's on
 * AMD hosts stays well below it). Prints GFLOP/s. Used by bench/peers.py. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SPLAT(x) _mm512_set1_ps(x)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SPLAT(x) _mm256_set1_ps(x)
#else
typedef float vec;
#define LANES 1
#define FMA(a, b, c) ((a) * (b) + (c))
#define SPLAT(x) (x)
#endif

enum { CHAINS = 10 };  /* independent chains: more than FMA latency x pipes on current cores */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 50000000L;
    int threads = 1;
    float sink = 0.0f;
    const double t0 = now();
#ifdef _OPENMP
#pragma omp parallel reduction(+ : sink)
#endif
    {
        const vec b = SPLAT(0.999999f), c = SPLAT(1e-7f);
        /* named, not an array: an array's chains were kept in memory, a load and a store per FMA */
        vec a0 = SPLAT(0.f), a1 = SPLAT(1.f), a2 = SPLAT(2.f), a3 = SPLAT(3.f), a4 = SPLAT(4.f);
        vec a5 = SPLAT(5.f), a6 = SPLAT(6.f), a7 = SPLAT(7.f), a8 = SPLAT(8.f), a9 = SPLAT(9.f);
        for (long it = 0; it < iters; it++) {
            a0 = FMA(a0, b, c), a1 = FMA(a1, b, c), a2 = FMA(a2, b, c), a3 = FMA(a3, b, c), a4 = FMA(a4, b, c);
            a5 = FMA(a5, b, c), a6 = FMA(a6, b, c), a7 = FMA(a7, b, c), a8 = FMA(a8, b, c), a9 = FMA(a9, b, c);
            /* every chain stays in a register and every FMA in the loop */
            __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7),
                             "+x"(a8), "+x"(a9));
        }
        const vec sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9;
        float lane[LANES];
        __builtin_memcpy(lane, &sum, sizeof lane);
        sink += lane[0];
#ifdef _OPENMP
#pragma omp single
        threads = omp_get_num_threads();
#endif
    }
    const double seconds = now() - t0;
    printf("%.1f\n", (double)threads * iters * CHAINS * LANES * 2 / seconds / 1e9);
    return sink == 12345.0f;  /* uses the result, so nothing is dropped */
}
