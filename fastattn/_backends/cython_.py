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
    # Decode reading less than 128 KiB of K/V runs on the calling thread: there (GPT-2-small
    # decode up to ~20 keys, a tiny call) a second thread saves less than its wake-up costs.
    # The bound was 1 MiB (one core's L2), from Zen 4 runs on a loaded host, where a woken
    # pool thread could wait for a core.  On a quiet Zen 4 guest without AVX-512 (1 MiB L2),
    # each bound in its own process interleaved with torch, two runs (time vs torch, 12 heads
    # d = 64): S = 128 (768 KB) 0.66 and 0.79 at 1 MiB, 0.53-0.67 in four runs at 128 KiB;
    # S = 64 0.82/0.97 -> 0.77-0.85; the latency preset's decode loops 0.56-0.65 -> 0.51-0.61
    # (views) and 0.51-0.61 -> 0.44-0.49 (window); 96 KB (S = 16) took 9 us on one thread and
    # 10-10.5 on two (a 64 KiB bound).  Not above one core's L2 on a machine whose L2 is
    # smaller.
    serial_decode_bytes = min(128 << 10, l2_bytes_per_core())
    # ... those measurements had torch in the process, whose libgomp spun between calls, so
    # the second thread was awake.  The kernels now run on their own pool (csrc/fa_pool.h),
    # whose helpers always sleep between calls, torch or not: a two-thread call first wakes
    # one, ~50 us on a VM.  The caller no longer waits for it (it starts at once and the
    # helper joins when it is up), but below a few MiB the helper arrives when the work is
    # nearly done.  Without torch, with the passive libgomp the pool replaced, 12 heads
    # d = 64, calls back to back in batches of 0.1 s, medians of 15: S = 128 (768 KB) took
    # 67-78 us on two threads against 23 on one, S = 1024 (6.3 MB) 127-133 against 142-145,
    # S = 2048 251 against 332 (bench/results/openmp_wait.md): so the bound is 4 MiB, about
    # where one thread's time is twice the wake-up.
    serial_decode_bytes = 4 << 20
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
