/*
 * fa_pool.h -- the compiled kernels' own thread pool: the caller works, helpers join if free.
 *
 * Why not an OpenMP parallel region: a region ends in a barrier, so the caller waits for every
 * thread of the team to arrive, including one that has not even woken up yet, or that shares
 * its core with another library's spinning thread.  That is the usual state of a NumPy
 * model's loop: right after `x @ W` OpenBLAS's pthreads workers busy-wait for ~0.1 s on the
 * other cores (bench/results/numpy_loop.md), and an attention call made then took up to 2.2x
 * its own time, most of it waiting for a team thread the scheduler could not run.
 *
 * Here a call (fa_pool_run) publishes a job, wakes the helpers, and runs the job's body on the
 * calling thread at once.  The body claims items from a shared counter (fa_share in
 * fa_omp.h) until none is left.  When the caller's body returns, the job is closed: helpers
 * that have not entered it by then never will, and the caller waits only for the helpers
 * that are inside (each finishing the item it holds).  A helper that wakes late finds the job
 * closed and goes back to sleep; it never touches the caller's stack.
 *
 * One job at a time: a second thread calling while a job runs (Python threads releasing the
 * GIL) runs its body alone, on its own thread -- correct, not parallel.  After fork the pool
 * is emptied in the child (its threads do not exist there) and rebuilt on first use.
 * Without pthreads (Windows builds) or with max threads 1, the body runs on the caller only.
 *
 * The job word packs (generation << 32) | CLOSED | helpers entered, so entering is one
 * compare-and-swap that fails for a closed or older job, or one that has had nt - 1 helpers
 * already; once it is closed the count is final and the caller waits until as many left.
 */
#ifndef FA_POOL_H
#define FA_POOL_H
#include <stddef.h>
#include <stdint.h>

typedef void (*fa_body)(void *ctx);

#if defined(_WIN32)

static inline int fa_pool_run(int nt, fa_body fn, void *ctx) { (void)nt; fn(ctx); return 1; }
static inline int fa_pool_helpers(void) { return 0; }
#define FA_POOL_ENABLED 0

#else
#include <pthread.h>
#include <sched.h>
#include <time.h>
#define FA_POOL_ENABLED 1

#define FA_POOL_MAX 64                 /* helpers at most (threads beyond the caller) */
#define FA_POOL_CLOSED ((uint64_t)1 << 31)
#define FA_POOL_COUNT ((uint64_t)0x7fffffff)

typedef struct {
    pthread_mutex_t mu;                /* guards gen_wake, n_helpers; the helpers sleep on cv */
    pthread_cond_t cv;
    pthread_mutex_t run;               /* held by the thread whose job is published */
    uint64_t word;                     /* (generation << 32) | CLOSED | helpers entered */
    uint32_t gen_wake;                 /* the newest job's generation, for the sleepers */
    int left;                          /* helpers that entered the current job and left */
    int n_helpers;                     /* helper threads started */
    int want;                          /* helpers the current job may take */
    fa_body fn;                        /* the current job; valid while a helper is inside */
    void *ctx;
} fa_pool_t;

static fa_pool_t fa_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                            PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, NULL, NULL};
static pthread_once_t fa_pool_once = PTHREAD_ONCE_INIT;

/* enter job `gen` unless it is closed, superseded or has had all the helpers it may take */
static int fa_pool_enter(uint32_t gen)
{
    uint64_t w = __atomic_load_n(&fa_pool.word, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((uint32_t)(w >> 32) != gen || (w & FA_POOL_CLOSED)
                || (int)(w & FA_POOL_COUNT) >= fa_pool.want)
            return 0;
        if (__atomic_compare_exchange_n(&fa_pool.word, &w, w + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return 1;
    }
}

static void *fa_pool_helper(void *arg)
{
    (void)arg;
    uint32_t seen;
    pthread_mutex_lock(&fa_pool.mu);
    seen = fa_pool.gen_wake;           /* a job published before this thread started is */
    pthread_mutex_unlock(&fa_pool.mu); /* still open: try it first                         */
    if (seen && fa_pool_enter(seen)) {
        fa_pool.fn(fa_pool.ctx);
        __atomic_fetch_add(&fa_pool.left, 1, __ATOMIC_RELEASE);
    }
    for (;;) {
        pthread_mutex_lock(&fa_pool.mu);
        while (fa_pool.gen_wake == seen)
            pthread_cond_wait(&fa_pool.cv, &fa_pool.mu);
        seen = fa_pool.gen_wake;
        pthread_mutex_unlock(&fa_pool.mu);
        if (fa_pool_enter(seen)) {
            /* fn and ctx were written before the generation was published (release) and
             * stay valid until the caller sees this helper leave */
            fa_pool.fn(fa_pool.ctx);
            __atomic_fetch_add(&fa_pool.left, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

/* fork: the child has none of the helpers, and the locks may be held by threads that are
 * gone; start over empty (helpers are started again on first use) */
static void fa_pool_after_fork_child(void)
{
    pthread_mutex_init(&fa_pool.mu, NULL);
    pthread_cond_init(&fa_pool.cv, NULL);
    pthread_mutex_init(&fa_pool.run, NULL);
    fa_pool.word = 0;
    fa_pool.gen_wake = 0;
    fa_pool.n_helpers = 0;
    fa_pool.want = 0;
    fa_pool.left = 0;
}

static void fa_pool_init_once(void) { pthread_atfork(NULL, NULL, fa_pool_after_fork_child); }

/* start helpers until there are n (fewer if the system refuses); called holding `run` */
static void fa_pool_grow(int n)
{
    if (n > FA_POOL_MAX)
        n = FA_POOL_MAX;
    while (fa_pool.n_helpers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 4 << 20);   /* the kernels keep up to ~64 KiB on the stack */
        int rc = pthread_create(&t, &attr, fa_pool_helper, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pthread_mutex_lock(&fa_pool.mu);
        fa_pool.n_helpers++;
        pthread_mutex_unlock(&fa_pool.mu);
    }
}

static inline int fa_pool_helpers(void) { return fa_pool.n_helpers; }

/* Run fn(ctx) on the calling thread and on up to nt - 1 helpers that are free before the
 * caller's own fn returns.  Returns when every fn that started has returned, with their
 * writes visible.  Returns the number of threads that ran fn (>= 1). */
static int fa_pool_run(int nt, fa_body fn, void *ctx)
{
    if (nt <= 1) {
        fn(ctx);
        return 1;
    }
    pthread_once(&fa_pool_once, fa_pool_init_once);
    if (pthread_mutex_trylock(&fa_pool.run) != 0) {   /* another thread's job is running */
        fn(ctx);
        return 1;
    }
    fa_pool_grow(nt - 1);
    uint32_t gen = (uint32_t)(__atomic_load_n(&fa_pool.word, __ATOMIC_RELAXED) >> 32) + 1;
    if (gen == 0)
        gen = 1;                       /* 0 means "no job yet" to a starting helper */
    fa_pool.fn = fn;
    fa_pool.ctx = ctx;
    fa_pool.want = nt - 1;
    __atomic_store_n(&fa_pool.left, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&fa_pool.word, (uint64_t)gen << 32, __ATOMIC_RELEASE);
    pthread_mutex_lock(&fa_pool.mu);
    fa_pool.gen_wake = gen;
    pthread_cond_broadcast(&fa_pool.cv);
    pthread_mutex_unlock(&fa_pool.mu);

    fn(ctx);

    /* close: from here no helper enters; wait for those inside (each holds at most one
     * item; yield the core meanwhile, it may be the one they need) */
    uint64_t w = __atomic_fetch_or(&fa_pool.word, FA_POOL_CLOSED, __ATOMIC_ACQ_REL);
    int entered = (int)(w & FA_POOL_COUNT);
    int spins = 0;
    while (__atomic_load_n(&fa_pool.left, __ATOMIC_ACQUIRE) < entered) {
        if (++spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
    pthread_mutex_unlock(&fa_pool.run);
    return 1 + entered;
}
#endif
#endif
