"""The Cython backend: kernels compiled from csrc/ into fastattn._cykernels.

Register-blocked SIMD kernels (AVX-512 / AVX2 / baseline copies chosen at import by CPUID)
under OpenMP; no BLAS, so no BLAS thread pool to fight with. Missing in a pure-Python install
or when the compile failed: fa.backends()["cython"] then says why.
"""
from __future__ import annotations

import os

from .. import _process
from ._compiled import CompiledBackend


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
    # Below ~1 MiB of K/V (GPT-2-small decode up to ~170 keys) one thread finishes before a
    # woken pool thread has started: measured in bench/results/latency.md (MHA decode rows).
    serial_decode_bytes = 1 << 20
    # a KV cache read in place: forward and decode read it (csrc/forward.pxi attend_rows)
    unsupported_backward_options = {
        "kv_strides": "cython's backward reads k/v C-contiguous only",
        "seqlens": "cython's backward does not take per-sequence key counts",
        "block_table": "cython's backward does not read a paged cache"}

    def _load(self) -> None:
        self._k = k = _import_kernels()
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
        return {"openmp": bool(k.OPENMP_ENABLED), "simd": k.simd(), "max_threads": k.max_threads()}
