/*
 * fa_omp.h -- OpenMP shim.  setup.py adds -fopenmp only when a probe program compiles and
 * links with it; without it the Cython `with parallel` blocks run once, on the calling thread
 * (the loops below then take every item), and the module reports OPENMP_ENABLED = False
 * instead of failing to build.
 *
 * It also holds the work sharing of the decode, forward, backward and softmax kernels: items
 * claimed from a shared counter, and a bounded wait at the end, instead of a `prange`.  Why:
 * fastattn loads libgomp with OMP_WAIT_POLICY=passive (fastattn/_process.py), so a thread that
 * reaches one of OpenMP's barriers before the others goes to sleep in the kernel at once, and
 * waking it costs tens of microseconds on a VM; a prange inside `with parallel` has two
 * barriers (the end of its loop and the end of the region).  With these helpers the threads
 * leave the loop without a barrier, wait for each other a bounded time awake (fa_share_join),
 * and so usually reach the region's own barrier together, where nobody sleeps.  That barrier
 * still orders the items' writes before the code after the region.  The wait yields the core
 * on every round (sched_yield), so a busy machine's other work runs meanwhile.
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

#if defined(_MSC_VER)
#ifndef NOMINMAX
#define NOMINMAX
#endif
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#define FA_YIELD() SwitchToThread()
#else
#include <sched.h>
#define FA_YIELD() sched_yield()
#endif

typedef struct {
    ptrdiff_t next;      /* the next unclaimed item */
    int done;            /* threads that have finished their items */
} fa_share;

static inline void fa_share_init(fa_share *s) { s->next = 0; s->done = 0; }

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

static inline int fa_share_done_count(fa_share *s)
{
#if defined(_MSC_VER)
    return (int)_InterlockedCompareExchange((volatile long *)&s->done, 0, 0);
#else
    return __atomic_load_n(&s->done, __ATOMIC_ACQUIRE);
#endif
}

/* Called by every thread of the region once its items are done: waits awake, up to max_wait_s
 * seconds (about one item: the most a dynamic schedule leaves between threads), until all have
 * arrived.  The region's first thread waits a moment longer, so that it is usually the last to
 * reach the barrier that follows: the one that arrives last does not sleep. */
static inline void fa_share_join(fa_share *s, double max_wait_s)
{
#ifdef _OPENMP
    int nt = omp_get_num_threads();
    if (nt < 2)
        return;
#if defined(_MSC_VER)
    _InterlockedIncrement((volatile long *)&s->done);
#else
    __atomic_fetch_add(&s->done, 1, __ATOMIC_RELEASE);
#endif
    double t0 = omp_get_wtime();
    while (fa_share_done_count(s) < nt) {
        FA_YIELD();
        if (omp_get_wtime() - t0 > max_wait_s)
            return;
    }
    if (omp_get_thread_num() == 0) {
        double t1 = omp_get_wtime();
        while (omp_get_wtime() - t1 < 1e-6)
            ;
    }
#else
    (void)s;
    (void)max_wait_s;
#endif
}
#endif
