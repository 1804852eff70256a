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
 * Between jobs a helper may first spin for a short while (up to the spin budget, yielding its
 * core on every turn, so a runnable thread of another library gets it), then sleeps on a
 * condition variable.  Why spin at all: waking a sleeping thread on a VM is an interrupt to a
 * halted vCPU, ~25-50 us before the helper runs, longer than a small decode takes.  Why only
 * sometimes: a spinning helper takes time slices from the caller's next BLAS call.  So
 * helpers spin after a job only when calls come in a tight loop (this job was published
 * within the budget after the one before ended: a decode loop, the latency bench); in a
 * NumPy model whose matmuls between attention calls take longer than the budget they sleep
 * at once.
 * A small job (wake = 0: a decode of less than a few MiB) does not wake sleeping helpers
 * unless the loop is tight: the caller does it alone, or with helpers that are spinning.
 * Which threads run a job never changes its result (items are claimed, not assigned).
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

static inline int fa_pool_run(int nt, fa_body fn, void *ctx, int wake)
{
    (void)nt; (void)wake;
    fn(ctx);
    return 1;
}
static inline int fa_pool_run_all(int nt, fa_body fn, void *ctx)
{
    (void)nt; (void)fn; (void)ctx;
    return 0;
}
static inline int fa_pool_helpers(void) { return 0; }
static inline int64_t fa_pool_set_spin_ns(int64_t ns) { (void)ns; return 0; }
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
    pthread_mutex_t mu;                /* guards n_helpers; the helpers sleep on cv */
    pthread_cond_t cv;
    pthread_mutex_t run;               /* held by the thread whose job is published */
    uint64_t word;                     /* (generation << 32) | CLOSED | helpers entered */
    int left;                          /* helpers that entered the current job and left */
    int n_helpers;                     /* helper threads started */
    int want;                          /* helpers the current job may take */
    int64_t last_end_ns;               /* when the job before ended */
    int64_t spin_after;                /* how long helpers spin after the current job, ns */
    fa_body fn;                        /* the current job; valid while a helper is inside */
    void *ctx;
} fa_pool_t;

static fa_pool_t fa_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                            PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0, NULL, NULL};
static pthread_once_t fa_pool_once = PTHREAD_ONCE_INIT;

/* The spin budget, in ns (fa_pool_set_spin_ns; 0: helpers always sleep at once): how long a
 * helper stays awake after a job of a tight loop, and the longest gap between two jobs that
 * still counts as a tight loop (bench/results/pool_spin.md). */
#ifndef FA_POOL_SPIN_NS
#define FA_POOL_SPIN_NS 100000
#endif
static int64_t fa_pool_spin_ns = FA_POOL_SPIN_NS;

/* set the budget to ns (ns < 0: leave it); returns the budget before */
static inline int64_t fa_pool_set_spin_ns(int64_t ns)
{
    if (ns < 0)
        return __atomic_load_n(&fa_pool_spin_ns, __ATOMIC_RELAXED);
    return __atomic_exchange_n(&fa_pool_spin_ns, ns, __ATOMIC_RELAXED);
}

static inline uint32_t fa_pool_gen(void)
{
    return (uint32_t)(__atomic_load_n(&fa_pool.word, __ATOMIC_ACQUIRE) >> 32);
}

static inline int64_t fa_pool_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Wait for a job newer than `seen` and return its generation: spin for up to the budget,
 * giving the core away on every turn, then sleep until fa_pool_run broadcasts. */
static uint32_t fa_pool_wait_next(uint32_t seen)
{
    const int64_t budget = __atomic_load_n(&fa_pool.spin_after, __ATOMIC_RELAXED);
    if (budget > 0) {
        const int64_t end = fa_pool_now_ns() + budget;
        uint32_t g = seen;
        for (int turn = 1;; turn++) {
            g = fa_pool_gen();
            if (g != seen || ((turn & 7) == 0 && fa_pool_now_ns() > end))
                break;
            sched_yield();
        }
        if (g != seen)
            return g;
    }
    pthread_mutex_lock(&fa_pool.mu);
    while (fa_pool_gen() == seen)      /* the caller publishes the word before it takes mu */
        pthread_cond_wait(&fa_pool.cv, &fa_pool.mu);
    const uint32_t g = fa_pool_gen();
    pthread_mutex_unlock(&fa_pool.mu);
    return g;
}

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
    /* a job published before this thread started may still be open: try it first */
    uint32_t seen = fa_pool_gen();
    for (;;) {
        if (seen && fa_pool_enter(seen)) {
            /* fn and ctx were written before the generation was published (release) and
             * stay valid until the caller sees this helper leave */
            fa_pool.fn(fa_pool.ctx);
            __atomic_fetch_add(&fa_pool.left, 1, __ATOMIC_RELEASE);
        }
        seen = fa_pool_wait_next(seen);
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
    fa_pool.n_helpers = 0;
    fa_pool.want = 0;
    fa_pool.left = 0;
    fa_pool.last_end_ns = 0;
    fa_pool.spin_after = 0;
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

/* one turn of the caller's wait for helpers: pause for 64 turns, then give the core away
 * (it may be the one a helper needs) */
static inline void fa_pool_backoff(int *spins)
{
    if (++*spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
}

/* fa_pool_run (all = 0) and fa_pool_run_all (all = 1) */
static int fa_pool_run_(int nt, fa_body fn, void *ctx, int wake, int all)
{
    if (nt <= 1 && !all) {
        fn(ctx);
        return 1;
    }
    pthread_once(&fa_pool_once, fa_pool_init_once);
    if (pthread_mutex_trylock(&fa_pool.run) != 0) {   /* another thread's job is running */
        if (all)
            return 0;
        fn(ctx);
        return 1;
    }
    fa_pool_grow(nt - 1);
    if (all && fa_pool.n_helpers < nt - 1) {          /* the system refused threads */
        pthread_mutex_unlock(&fa_pool.run);
        return 0;
    }
    uint32_t gen = (uint32_t)(__atomic_load_n(&fa_pool.word, __ATOMIC_RELAXED) >> 32) + 1;
    if (gen == 0)
        gen = 1;                       /* 0 means "no job yet" to a starting helper */
    fa_pool.fn = fn;
    fa_pool.ctx = ctx;
    fa_pool.want = nt - 1;
    const int64_t now = fa_pool_now_ns();
    const int64_t budget = __atomic_load_n(&fa_pool_spin_ns, __ATOMIC_RELAXED);
    const int tight = now - fa_pool.last_end_ns <= budget;
    __atomic_store_n(&fa_pool.spin_after, tight ? budget : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&fa_pool.left, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&fa_pool.word, (uint64_t)gen << 32, __ATOMIC_RELEASE);
    if (wake || tight) {               /* (spinning helpers see the word without this) */
        pthread_mutex_lock(&fa_pool.mu);   /* no system call if none sleeps */
        pthread_cond_broadcast(&fa_pool.cv);
        pthread_mutex_unlock(&fa_pool.mu);
    }

    fn(ctx);

    /* all: every one of the nt - 1 helpers enters before the job closes (each is idle: the
     * caller holds `run`, and the wake-up above reached the sleeping ones) */
    for (int spins = 0; all && (int)(__atomic_load_n(&fa_pool.word, __ATOMIC_ACQUIRE)
                                     & FA_POOL_COUNT) < nt - 1; )
        fa_pool_backoff(&spins);
    /* close: from here no helper enters; wait for those inside (each holds at most one
     * item; yield the core meanwhile, it may be the one they need) */
    uint64_t w = __atomic_fetch_or(&fa_pool.word, FA_POOL_CLOSED, __ATOMIC_ACQ_REL);
    int entered = (int)(w & FA_POOL_COUNT);
    int spins = 0;
    while (__atomic_load_n(&fa_pool.left, __ATOMIC_ACQUIRE) < entered)
        fa_pool_backoff(&spins);
    fa_pool.last_end_ns = fa_pool_now_ns();
    pthread_mutex_unlock(&fa_pool.run);
    return 1 + entered;
}

/* Run fn(ctx) on the calling thread and on up to nt - 1 helpers that are free before the
 * caller's own fn returns (wake = 0: only helpers already awake, unless the calls come in a
 * tight loop).  Returns when every fn that started has returned, with their writes
 * visible.  Returns the number of threads that ran fn (>= 1). */
static int fa_pool_run(int nt, fa_body fn, void *ctx, int wake)
{
    return fa_pool_run_(nt, fn, ctx, wake, 0);
}

/* Run fn(ctx) on exactly nt threads at once: the caller and nt - 1 helpers, each once, for
 * bodies that wait for each other (OpenBLAS's threaded GEMM: fa_blaspool.h).  Returns nt
 * when they ran, 0 when the pool could not give nt - 1 helpers (another thread's job is
 * running, or the system refused threads): then fn did not run at all. */
static int fa_pool_run_all(int nt, fa_body fn, void *ctx)
{
    return fa_pool_run_(nt, fn, ctx, 1, 1);
}
#endif
#endif
