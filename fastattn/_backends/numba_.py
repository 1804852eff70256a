"""The Numba backend: @njit kernels in fastattn._numba, compiled on first use and cached.

Imported lazily (numba's import costs ~0.5 s). float32 tiles go through the kernels' own
register-blocked micro-kernels; float64 tiles through scipy's BLAS, kept single-threaded
inside the parallel region (see fastattn/_numba/_blas.py, _BlasGuard).
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from .. import _process
from ._compiled import DECODE_MAX_ROWS, CompiledBackend, use_decode

_KERNEL_MODULES = tuple("fastattn._numba." + m for m in (
    "_intrinsics", "_exp", "_hash", "_blas", "_record", "_scores", "_tiles", "_gemm", "_kv",
    "_bwd_ops", "_transpose", "forward", "decode", "softmax", "backward"))


def _import_kernels():
    import numba

    # Every float64 tile's GEMM is numba's BLAS binding, which is scipy's cython_blas: without
    # scipy the kernels import fine and the first call fails (ModuleNotFoundError), so probe it
    # here and let the backend be unavailable with the reason instead.
    try:
        import scipy.linalg.cython_blas  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"numba's kernels need scipy (its BLAS), which failed to import: {exc}; "
                          "pip install 'fastattn[numba]' installs both") from exc

    # The default layer order can pick "workqueue", which aborts the process when two Python
    # threads run parallel kernels at once; "threadsafe" picks omp or tbb. Only if the user
    # did not choose, and before the first parallel compile.
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "threadsafe"
    try:
        from .._numba import backward, decode, forward, softmax
    except RuntimeError as exc:
        # cache=True in a read-only install with no writable cache location: numba refuses to
        # decorate ("cannot cache function ... no locator available"). Cache in a private
        # temporary directory instead (compiled code is not kept across processes then).
        if "cannot cache" not in str(exc):
            raise
        for name in _KERNEL_MODULES:
            sys.modules.pop(name, None)
        numba.config.CACHE_DIR = tempfile.mkdtemp(prefix="fastattn-numba-cache-")
        atexit.register(shutil.rmtree, numba.config.CACHE_DIR, ignore_errors=True)
        from .._numba import backward, decode, forward, softmax
    # Start the thread pool now, so that the OpenMP layer's libgomp loads with passive waiting.
    # Left to spin, numba's workers burned ~7.5 ms of CPU after every call, and with one other
    # busy process on this 2-core machine B=4 H=8 L=S=256 took a median 7.9 ms instead of 6.7.
    with _process.passive_openmp_wait():
        numba.get_num_threads()
    return forward, decode, softmax, backward


class NumbaBackend(CompiledBackend):
    name = "numba"
    # a KV cache read in place: forward and decode read it (fastattn/_numba/_kv.py), the
    # backward does not
    unsupported_backward_options = {
        "kv_strides": "numba's backward reads k/v C-contiguous only",
        "seqlens": "numba's backward does not take per-sequence key counts",
        "block_table": "numba's backward does not read a paged cache"}

    def _load(self) -> None:
        forward, decode, softmax, backward = _import_kernels()
        self._forward_kernel = forward.forward
        self._decode_kernel = decode.decode
        self._backward_kernel = backward.backward
        self._softmax_kernel = softmax.softmax_rows
        # Decode reading fewer K/V bytes than this runs with one thread while numba's OpenMP
        # pool waits passively (fastattn's default): a parallel region wakes a sleeping worker
        # and its end waits for that worker, 30-50 us a region on this VM, and the worker may
        # not get a core at all while another process runs. MHA decode 12 heads d64 float32,
        # Zen 4 guest, since the kernel runs one region a call (it ran three), two threads'
        # time / one thread's, interleaved in one process (medians of 7 batches): host quiet,
        # 768 keys (4.7 MB) 1.00, 1024 (6.3 MB) 0.86-0.90, 2048 0.72; another tenant busy
        # (load ~1 on the 2 cores), 768 keys 0.98-1.10, 1024 1.14-1.57, 1280 1.27-1.54, 1536
        # 0.78, 2048 0.80. The bound stays where the second thread wins either way. A spinning
        # pool (the user's OMP_WAIT_POLICY, torch's libgomp loaded first) keeps both.
        if _process.openmp_passive() is not False:
            self.serial_decode_bytes = 8 << 20

    # float16, bfloat16 and int8 caches: the decode reads them (a key block at a time converted,
    # fastattn/_numba/_kvconv.py); the tiled forward (prefill, more query rows) does not
    kv_kinds = (1, 2, 3)

    def not_supported_reasons(self, problem, op):
        reasons = super().not_supported_reasons(problem, op)
        if getattr(problem, "kv_kind", 0) and not use_decode(problem):
            reasons.append("numba reads a float16/bfloat16/int8 KV cache in its decode only "
                           f"(up to {DECODE_MAX_ROWS} query rows per head), not in the tiled "
                           "forward")
        if _process.forked_after_pool_use():
            # numba's kernels always enter the OpenMP pool, which libgomp cannot run in a child
            # forked after the parent used it (the child would be terminated or hang)
            reasons.append("this process was forked after an OpenMP thread pool ran in the parent, "
                           "and numba's pool is not fork-safe (use multiprocessing's spawn, or "
                           "another backend)")
        return reasons

    def details(self) -> dict:
        import numba

        from .._numba._intrinsics import HAVE_F16C

        # the layer numba runs the kernels on: "threadsafe" resolves to TBB when libtbb.so.12
        # loads (the `tbb` wheel), else OpenMP, at the first parallel call
        try:
            layer = numba.threading_layer()
        except ValueError:                # no parallel kernel has run in this process yet
            layer = f"{numba.config.THREADING_LAYER} (tbb if installed, else omp: chosen at " \
                    "the first call)"
        # how its decode reads a float16/bfloat16/int8 cache (decode.py's _block_qk/_block_pv)
        lowp = "in_place" if HAVE_F16C else "in_place (float16: tiles, no F16C)"
        return {"numba": numba.__version__, "threading_layer": layer, "lowp_decode": lowp,
                "serial_decode_bytes": self.serial_decode_bytes}
