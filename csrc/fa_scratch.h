/*
 * fa_scratch.h -- per-thread scratch that survives between calls.
 *
 * Each kernel call needs ~0.1-1 MB of scratch per thread.  malloc of that size is an mmap,
 * first-touch page faults and an munmap (a TLB-shootdown IPI, expensive in a VM) on every
 * call -- measurable on millisecond-sized problems.  OpenMP pool threads and Python threads
 * persist, so each keeps one buffer (grown when a bigger problem arrives) in thread-local
 * storage, freed by the pthread key destructor when the thread exits.
 */
#ifndef FA_SCRATCH_H
#define FA_SCRATCH_H
#include <stdlib.h>

#if defined(_WIN32)
/* no pthreads: plain malloc/free per call */
static void *fa_scratch_get(size_t bytes) { return malloc(bytes); }
static void fa_scratch_release(void *p) { free(p); }
#else
#include <pthread.h>
typedef struct { void *p; size_t cap; } fa_scratch_t;
static pthread_key_t fa_scratch_key;
static pthread_once_t fa_scratch_once = PTHREAD_ONCE_INIT;
static int fa_scratch_key_ok = 0;

static void fa_scratch_destroy(void *v)
{
    fa_scratch_t *t = (fa_scratch_t *)v;
    free(t->p);
    free(t);
}
static void fa_scratch_init(void)
{
    fa_scratch_key_ok = pthread_key_create(&fa_scratch_key, fa_scratch_destroy) == 0;
}
/* Returns a buffer of >= bytes owned by the calling thread (NULL on allocation failure).
 * Valid until this thread's next fa_scratch_get; fa_scratch_release is a no-op. */
static void *fa_scratch_get(size_t bytes)
{
    pthread_once(&fa_scratch_once, fa_scratch_init);
    if (!fa_scratch_key_ok) return malloc(bytes);
    fa_scratch_t *t = (fa_scratch_t *)pthread_getspecific(fa_scratch_key);
    if (!t) {
        t = (fa_scratch_t *)calloc(1, sizeof *t);
        if (!t) return NULL;
        if (pthread_setspecific(fa_scratch_key, t) != 0) { free(t); return malloc(bytes); }
    }
    if (t->cap < bytes) {
        free(t->p);
        t->p = malloc(bytes);
        t->cap = t->p ? bytes : 0;
    }
    return t->p;
}
static void fa_scratch_release(void *p)
{
    if (!fa_scratch_key_ok) free(p);
}
#endif
#endif
