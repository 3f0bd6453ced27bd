/* A calling thread's scratch memory that only grows, kept between calls (one per source file that includes
 * this): a kernel called per layer or per projection must not pay for malloc, and for the page faults of a
 * fresh mapping, on every call (lora_cpu.c, moe_cpu.c). */
#ifndef KVPILOT_THREAD_SCRATCH_H
#define KVPILOT_THREAD_SCRATCH_H

#include <stdlib.h>

static __thread void *thread_scratch_mem;
static __thread size_t thread_scratch_bytes;

/* At least `bytes` of this thread's scratch (its earlier contents not kept when it grows); NULL when out of
 * memory. */
static inline void *thread_scratch(size_t bytes) {
    if (bytes > thread_scratch_bytes) {
        free(thread_scratch_mem);
        thread_scratch_mem = malloc(bytes);
        thread_scratch_bytes = thread_scratch_mem ? bytes : 0;
    }
    return thread_scratch_mem;
}

#endif
