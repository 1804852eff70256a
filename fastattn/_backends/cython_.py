"""The Cython backend: kernels compiled from csrc/ into fastattn._cykernels.

Register-blocked SIMD kernels (AVX-512 / AVX2 / baseline copies chosen at import by CPUID)
on the extension's own thread pool (csrc/fa_pool.h: the caller works at once, helpers join
when free, nobody waits for a thread that has not started); no BLAS. Missing in a pure-Python install
or when the compile failed: fa.backends()["cython"] then says why.
"""
from __future__ import annotations

import os

from .. import _process
from ._compiled import CompiledBackend
from ._kernel_args import KernelArgs


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_kernels():
    """Import the extension, its libgomp waiting passively (see _process.passive_openmp_wait)."""
    try:
        with _process.passive_openmp_wait():
            from .. import _cykernels
    except ImportError as exc:
        if os.path.isdir(os.path.join(os.path.dirname(_PACKAGE_DIR), "csrc")):
            raise ImportError(
                f"{exc}; this fastattn is the source tree at {_PACKAGE_DIR} (imported from the "
                "current directory?), where the extension is not built: run from another "
                "directory to use the installed package, or build it here with "
                "`python setup.py build_ext --inplace`") from exc
        raise
    return _cykernels


class CythonBackend(CompiledBackend):
    name = "cython"
    # Decode reading less than this of K/V runs on the calling thread: a second thread saves
    # less than handing it work costs.  Above it the call goes to the kernels' pool
    # (csrc/fa_pool.h), but below 4 MiB it wakes no sleeping helper (csrc/decode.pxi,
    # DEC_WAKE_BYTES: one arrives ~25-50 us after the wake on a VM, when the caller is nearly
    # done): the caller runs it alone, or with a helper still awake from the call before
    # (helpers spin between the jobs of a tight loop).  Back to back, 12 heads d = 64, Xeon
    # guest (bench/results/pool_spin.md): S = 32 (192 KB) two threads 1.00 of one thread's
    # time, S = 64 (384 KB) 0.93, S = 128 0.80-0.87, S = 512 0.35-0.39.  Which threads run
    # a call never changes its bits: the items depend on n_threads only, chosen here.
    serial_decode_bytes = 256 << 10
    # float16, bfloat16 and int8 caches: forward and decode read them (csrc/fa_kvconv.h)
    kv_kinds = (1, 2, 3)
    # a KV cache read in place: forward and decode read it (csrc/forward.pxi attend_rows)
    unsupported_backward_options = {
        "kv_strides": "cython's backward reads k/v C-contiguous only",
        "seqlens": "cython's backward does not take per-sequence key counts",
        "block_table": "cython's backward does not read a paged cache"}

    def _load(self) -> None:
        self._k = k = _import_kernels()
        if tuple(k.RECORD_FIELDS) != KernelArgs._fields:
            # the extension reads the record by position (csrc/problem.pxi): an extension
            # built from other sources than this package's would read the wrong fields
            raise ImportError("fastattn._cykernels was built for another kernel record "
                              f"(its fields {k.RECORD_FIELDS}, this package's "
                              f"{KernelArgs._fields}): rebuild it")
        self._forward_kernel = k.forward
        self._decode_kernel = k.decode
        self._backward_kernel = k.backward
        self._softmax_kernel = k.softmax_rows
        if _process.forked():
            # imported first in a fork() child: the parent may have used the same libgomp
            # (source builds share the system's), so stay off the pool, as the extension's own
            # fork hook does when it was imported before the fork
            self._k._after_fork_in_child()

    def details(self) -> dict:
        k = self._k
        # the low-precision-cache decode's copy for head dims multiples of 16 (multiples of 8
        # only: the AVX2 copy; others, or None: the tile path converts a key block at a time)
        return {"pool": bool(k.POOL_ENABLED), "openmp": bool(k.OPENMP_ENABLED),
                "simd": k.simd(), "lowp_decode": k.decode_lowp_copy(16),
                "max_threads": k.max_threads()}
