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


def l2_bytes_per_core(default: int = 1 << 20,
                      base: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of cpu0's L2 cache from Linux's sysfs, or `default` where it cannot be read."""
    try:
        for entry in sorted(os.listdir(base)):
            d = os.path.join(base, entry)
            with open(os.path.join(d, "level")) as f:
                if f.read().strip() != "2":
                    continue
            with open(os.path.join(d, "size")) as f:
                size = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default


class CythonBackend(CompiledBackend):
    name = "cython"
    # Below ~1 MiB of K/V (GPT-2-small decode up to ~170 keys) one thread finishes before a
    # woken pool thread has started: measured in bench/results/latency.md (MHA decode rows,
    # Zen 4, 1 MiB L2 per core).  Not above one core's L2, though: on a Zen 3 guest (512 KiB
    # L2) the 786 KB of S = 128 then came from L3 on one thread, and two threads, each with
    # its half in its own L2, took 0.75-0.8x torch's time against 0.8-0.86x on one.
    serial_decode_bytes = min(1 << 20, l2_bytes_per_core())
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
