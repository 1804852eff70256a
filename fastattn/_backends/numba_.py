"""The Numba backend: @njit kernels in fastattn._numba, compiled on first use and cached.

Imported lazily (numba's import costs ~0.5 s). float32 tiles go through the kernels' own
register-blocked micro-kernels; float64 tiles through scipy's BLAS, kept single-threaded
inside the parallel region (see fastattn/_numba/_blas.py, _BlasGuard).
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from .. import _config, _process
from ._base import Backend
from ._kernel_args import forward_inputs, forward_outputs

DECODE_MAX_ROWS = 16
_KERNEL_MODULES = tuple("fastattn._numba." + m for m in (
    "_intrinsics", "_exp", "_hash", "_blas", "_tiles", "_gemm", "_bwd_ops", "forward", "decode",
    "softmax", "backward"))


def _import_kernels():
    import numba

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
        from .._numba import backward, decode, forward, softmax
    return forward, decode, softmax, backward


class NumbaBackend(Backend):
    name = "numba"
    ops = ("forward", "backward", "softmax")

    def _load(self) -> None:
        self._forward, self._decode, self._softmax, self._backward = _import_kernels()

    def not_supported_reasons(self, problem, op):
        reasons = super().not_supported_reasons(problem, op)
        if _process.forked_after_pool_use():
            # numba's kernels always enter the OpenMP pool, which libgomp cannot run in a child
            # forked after the parent used it (the child would be terminated or hang)
            reasons.append("this process was forked after an OpenMP thread pool ran in the parent, "
                           "and numba's pool is not fork-safe (use multiprocessing's spawn, or "
                           "another backend)")
        return reasons

    def details(self) -> dict:
        import numba

        layer = numba.config.THREADING_LAYER
        return {"numba": numba.__version__, "threading_layer": layer}

    def forward(self, p):
        out, lse = forward_outputs(p)
        L = p.q.shape[2]
        use_decode = L <= DECODE_MAX_ROWS and L * p.group <= DECODE_MAX_ROWS * 4
        kernel = self._decode.decode if use_decode else self._forward.forward
        _process.note_pool_used()
        kernel(*forward_inputs(p), out, lse, _config.num_threads())
        return out, lse

    def backward(self, p, dout, out, lse):
        """FlashAttention-2 backward (fastattn/_numba/backward.py); canonical (dq, dk, dv)."""
        dq, dk, dv = np.empty_like(p.q), np.empty_like(p.k), np.empty_like(p.v)
        _process.note_pool_used()
        self._backward.backward(*forward_inputs(p), dout, out, lse, dq, dk, dv,
                                _config.num_threads())
        return dq, dk, dv

    def softmax_rows(self, x, keep):
        _process.note_pool_used()
        out = np.empty_like(x)
        if keep is None:
            self._softmax.softmax_rows(x, 0, np.zeros((1, 1), np.uint8), out, _config.num_threads())
        else:
            self._softmax.softmax_rows(x, 1, keep.view(np.uint8), out, _config.num_threads())
        return out
