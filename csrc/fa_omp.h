/*
 * fa_omp.h -- the OpenMP shim and the kernels' work counter.
 *
 * The kernels no longer run OpenMP regions (their threads are csrc/fa_pool.h's); OpenMP is
 * only asked for the default thread count (omp_get_max_threads, which follows OMP_NUM_THREADS
 * and the CPU affinity).  Without -fopenmp that is 1.
 *
 * fa_share is the counter the caller and the pool's helpers claim items from (dynamic
 * schedule, chunks of one): whoever is running takes the next item, so a thread that starts
 * late or runs on a contended core leaves little behind.
 */
#ifndef FA_OMP_H
#define FA_OMP_H
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#define FA_OPENMP_ENABLED 1
static inline int fa_omp_max_threads(void) { return omp_get_max_threads(); }
#else
#define FA_OPENMP_ENABLED 0
static inline int fa_omp_max_threads(void) { return 1; }
#endif

typedef struct {
    ptrdiff_t next;      /* the next unclaimed item */
} fa_share;

static inline void fa_share_init(fa_share *s) { s->next = 0; }

/* claim the next item (dynamic schedule, chunks of one) */
static inline ptrdiff_t fa_share_next(fa_share *s)
{
#if defined(_MSC_VER) && defined(_WIN64)
    return (ptrdiff_t)_InterlockedExchangeAdd64((volatile __int64 *)&s->next, 1);
#elif defined(_MSC_VER)
    return (ptrdiff_t)_InterlockedExchangeAdd((volatile long *)&s->next, 1);
#else
    return __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
#endif
}
#endif
