/*
 * fa_blaspool.h -- OpenBLAS's parallel work run on fastattn's pool (fastattn.share_blas_threads).
 *
 * Why: a NumPy model calls `x @ W` and then attention in every layer.  After each call
 * OpenBLAS's pthreads workers busy-wait (8 nops and a TSC read per turn, no yield) for
 * 2**28 ticks, ~0.1 s, so the attention call that follows shares a core with a thread that
 * never gives it up: up to 2x its own time (bench/results/numpy_loop.md).  OpenBLAS >= 0.3.27
 * lets a program replace its threading backend (openblas_set_threads_callback_function):
 * exec_blas then hands each parallel region to the callback as an array of jobs.  Run on
 * the pool the kernels use (fa_pool.h), a BLAS call and the attention call after it share
 * one set of threads: nothing spins on a core the other needs, and the helpers that a BLAS
 * call woke are still awake (the pool's tight-loop spin, which yields) when attention starts.
 *
 * The contract (OpenBLAS driver/others/blas_server.c, exec_blas): callback(sync, dojob,
 * numjobs, elsize, jobdata, dojob_data) must run dojob(i, jobdata + i * elsize, dojob_data)
 * for i < numjobs and return when all have returned.  The jobs of a threaded GEMM wait for
 * each other's packed panels, so they must all run AT ONCE, each on its own thread: two on
 * one thread would deadlock.  Hence fa_pool_run_all (exactly numjobs threads), and where the
 * pool cannot give them (another Python thread's attention call holds it), threads made for
 * this call.  The job index doubles as OpenBLAS's thread number, which selects a per-thread
 * buffer inside OpenBLAS: so calls from different Python threads go through one at a time
 * (fa_blas_mu), never two sets of jobs with the same numbers at once.
 */
#ifndef FA_BLASPOOL_H
#define FA_BLASPOOL_H
#include <stddef.h>
#include "fa_pool.h"

typedef void (*fa_blas_dojob)(int thread_num, void *jobdata, int dojob_data);

#if FA_POOL_ENABLED
#include <pthread.h>

typedef struct {
    fa_blas_dojob dojob;
    char *jobdata;
    size_t elsize;
    int dojob_data;
    int n;
    int next;                          /* the next job index to claim */
} fa_blas_batch;

static pthread_mutex_t fa_blas_mu = PTHREAD_MUTEX_INITIALIZER;
static long fa_blas_calls = 0;         /* parallel regions run here (under fa_blas_mu) */
static long fa_blas_own_threads = 0;   /* ... of which on threads made for the call */

/* one job per thread: each of the n threads claims a different index */
static void fa_blas_body(void *ctx)
{
    fa_blas_batch *b = (fa_blas_batch *)ctx;
    const int i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
    if (i < b->n)
        b->dojob(i, b->jobdata + (size_t)i * b->elsize, b->dojob_data);
}

static void *fa_blas_thread(void *ctx)
{
    fa_blas_body(ctx);
    return NULL;
}

/* The fallback: jobs 1.. on threads made for this call, job 0 on the caller.  Jobs whose
 * thread the system refused run on the caller at the end (a GEMM's jobs would wait for them:
 * thread creation failing is the one case not covered). */
static void fa_blas_run_threads(fa_blas_batch *b)
{
    pthread_t t[64];
    int started = 0;
    for (int i = 1; i < b->n && i <= 64; i++) {
        if (pthread_create(&t[started], NULL, fa_blas_thread, b) != 0)
            break;
        started++;
    }
    fa_blas_body(b);
    for (int i = 0; i < started; i++)
        pthread_join(t[i], NULL);
    while (__atomic_load_n(&b->next, __ATOMIC_RELAXED) < b->n)
        fa_blas_body(b);
}

/* the callback given to openblas_set_threads_callback_function (exec_blas passes sync = 1:
 * it waits here for the region's end, which is what this does in every case) */
static void fa_blas_threads_cb(int sync, fa_blas_dojob dojob, int numjobs, size_t elsize,
                               void *jobdata, int dojob_data)
{
    (void)sync;
    if (numjobs <= 0)
        return;
    fa_blas_batch b = {dojob, (char *)jobdata, elsize, dojob_data, numjobs, 0};
    pthread_mutex_lock(&fa_blas_mu);
    fa_blas_calls++;
    if (numjobs == 1)
        fa_blas_body(&b);
    else if (fa_pool_run_all(numjobs, fa_blas_body, &b) != numjobs) {
        fa_blas_own_threads++;
        fa_blas_run_threads(&b);
    }
    pthread_mutex_unlock(&fa_blas_mu);
}

/* fork: a child has one thread; fa_blas_mu may have been held by another */
static void fa_blas_after_fork_child(void) { pthread_mutex_init(&fa_blas_mu, NULL); }
static pthread_once_t fa_blas_once = PTHREAD_ONCE_INIT;
static void fa_blas_init_once(void) { pthread_atfork(NULL, NULL, fa_blas_after_fork_child); }

/* the callback's address, for openblas_set_threads_callback_function */
static inline void *fa_blas_callback_address(void)
{
    pthread_once(&fa_blas_once, fa_blas_init_once);
    return (void *)&fa_blas_threads_cb;
}
static inline long fa_blas_count(int own) { return own ? fa_blas_own_threads : fa_blas_calls; }

#else
static inline void *fa_blas_callback_address(void) { return NULL; }
static inline long fa_blas_count(int own) { (void)own; return 0; }
#endif
#endif /* FA_BLASPOOL_H */
