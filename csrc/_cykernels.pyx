# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, embedsignature=True
# distutils: language = c
"""fastattn compiled kernels (one extension module).

Kernel interface: docs/KERNELS.md.  The SIMD work lives in csrc/fa_kernels.h
(AVX-512 / AVX2 / baseline copies, chosen at import by CPUID); this module does the
blocking, threading (its own pool, csrc/fa_pool.h), masking decisions and bookkeeping.
"""

include "common.pxi"
include "problem.pxi"
include "softmax.pxi"
include "forward.pxi"
include "decode.pxi"
include "backward.pxi"

import os as _os

OPENMP_ENABLED = bool(FA_OPENMP_ENABLED)
POOL_ENABLED = bool(FA_POOL_ENABLED)        # csrc/fa_pool.h: the kernels' threads

_LEVELS = {"generic": 0, "avx2": 1, "avx512": 2}
_NAMES = {v: k for k, v in _LEVELS.items()}


def simd_levels():
    """SIMD copies this CPU can run, best last."""
    return [_NAMES[i] for i in range(fa_cpu_level() + 1)]


def set_simd(name=None):
    """Select the SIMD copy ("generic", "avx2", "avx512"; None = best).  Returns the level in
    use.  Global, not thread-safe: for tests and benchmarks."""
    want = -1 if name is None else _LEVELS[name]
    return _NAMES[fa_select(want)]


def simd():
    return fa_ops_name().decode()


def decode_lowp_copy(E, Ev=None):
    """The copy of the low-precision-cache decode kernel a call with head dims E, Ev would take
    at the selected SIMD level: "avx512" (fa_decode_lowp512.h), "avx2" (fa_decode_lowp.h) or
    None (the general path, which converts a key block at a time)."""
    return {2: "avx512", 1: "avx2"}.get(fa_decode_lowp_copy(E, E if Ev is None else Ev))


def quantize_kv_rows(const float[:, ::1] x, int8_t[:, ::1] codes, float[::1] scale):
    """codes, scale of the rows of x by fastattn/_kvdtypes.py's int8 rule (fa_kvconv.h:
    fa_kv_quantize_rows, the same bits as its NumPy code).  Returns False, writing nothing,
    if x holds a NaN or an Inf."""
    cdef ptrdiff_t n = x.shape[0], E = x.shape[1]
    if codes.shape[0] != n or codes.shape[1] != E or scale.shape[0] != n:
        raise ValueError("quantize_kv_rows: codes must be x's shape and scale (rows,)")
    if n == 0 or E == 0:
        return True
    cdef int bad
    with nogil:
        bad = fa_kv_quantize_rows(&x[0, 0], n, E, &codes[0, 0], &scale[0])
    return bad == 0


def max_threads():
    return fa_omp_max_threads()


def _after_fork_in_child():
    global fa_forked_child
    fa_forked_child = 1


if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_after_fork_in_child)

_env = _os.environ.get("FASTATTN_SIMD", "").strip().lower()
set_simd(_env if _env in _LEVELS else None)


# ---- OpenBLAS's parallel regions on the pool (csrc/fa_blaspool.h) ---------------------------

cdef extern from "fa_blaspool.h" nogil:
    void *fa_blas_callback_address()
    long fa_blas_count(int own)


def _blas_callback_address():
    """Address of the OpenBLAS threads callback that runs OpenBLAS's jobs on the pool
    (0 without the pool); fastattn/_blas_pools.py hands it to OpenBLAS."""
    return <size_t>fa_blas_callback_address()


def _blas_callback_counts():
    """(parallel regions run through the callback, of which on threads made for the call
    because the pool was busy)."""
    return fa_blas_count(0), fa_blas_count(1)


# ---- the pool, seen from the tests (csrc/fa_pool.h) ----------------------------------------

ctypedef struct PoolTestJob:
    int32_t *counts                     # times each item ran
    ptrdiff_t n_items
    double item_us                      # busy time per item, so that helpers get to join
    fa_share share


cdef void pool_test_body(void *ctx) noexcept nogil:
    cdef PoolTestJob *j = <PoolTestJob *>ctx
    cdef ptrdiff_t it = fa_share_next(&j.share)
    cdef volatile double x = 0.0
    cdef ptrdiff_t spin
    while it < j.n_items:
        j.counts[it] += 1               # items are claimed once each: no two threads share one
        for spin in range(<ptrdiff_t>(j.item_us * 300)):
            x = x + 1.0
        it = fa_share_next(&j.share)


def _pool_spin_us(double us=-1.0):
    """How long the pool's helpers stay awake after a job, in microseconds (csrc/fa_pool.h);
    with us >= 0, set it (0: they sleep at once).  Returns the value before.  For the bench's
    A/B runs; the default is measured in bench/results/pool_spin.md."""
    return fa_pool_set_spin_ns(<int64_t>(us * 1000.0) if us >= 0 else -1) / 1000.0


def _pool_selftest(int n_threads, Py_ssize_t n_items, double item_us=0.0, bint wake=True):
    """Run a job of n_items on the pool with up to n_threads threads (wake=False: as a small
    decode, without waking sleeping helpers unless calls come in a tight loop); returns (list
    of how often each item ran, how many threads ran the job's body)."""
    if n_items < 0 or n_threads < 1:
        raise ValueError(f"_pool_selftest: need n_threads >= 1 and n_items >= 0, got "
                         f"{n_threads}, {n_items}")
    cdef PoolTestJob job
    cdef int ran
    job.counts = <int32_t *>malloc(max(<Py_ssize_t>1, n_items) * sizeof(int32_t))
    if job.counts == NULL:
        raise MemoryError()
    memset(job.counts, 0, max(<Py_ssize_t>1, n_items) * sizeof(int32_t))
    job.n_items = n_items
    job.item_us = item_us
    fa_share_init(&job.share)
    with nogil:
        ran = fa_pool_run(resolve_threads(n_threads, max(<Py_ssize_t>1, n_items)),
                          pool_test_body, &job, wake)
    counts = [job.counts[i] for i in range(n_items)]
    free(job.counts)
    return counts, ran
