"""The Cython backend: kernels compiled from csrc/ into fastattn._cykernels.

Register-blocked SIMD kernels (AVX-512 / AVX2 / baseline copies chosen at import by CPUID)
under OpenMP; no BLAS, so no BLAS thread pool to fight with. Missing in a pure-Python install
or when the compile failed: fa.backends()["cython"] then says why.
"""
from __future__ import annotations

import os

import numpy as np

from .. import _config, _process
from ._base import Backend
from ._kernel_args import forward_inputs, forward_outputs

# Few queries against a long cache: the decode kernel reads each K/V block once for all query
# rows of a KV group and splits the keys over threads (flash-decoding).
DECODE_MAX_ROWS = 16


def _import_kernels():
    """Import the extension with libgomp waiting passively unless the user chose otherwise.

    libgomp reads OMP_WAIT_POLICY once, when it loads. Its default spins ~15 ms at every
    barrier; on a busy machine the spinning thread holds the core the late thread needs
    (measured: a 2.7 ms call took a median 16 ms; passive: 3.0 ms, ~10 us more when idle).
    The variable is set only for this import and removed right after.
    """
    set_here = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    if set_here:
        os.environ["OMP_WAIT_POLICY"] = "passive"
    try:
        from .. import _cykernels
    finally:
        if set_here:
            os.environ.pop("OMP_WAIT_POLICY", None)
    return _cykernels


class CythonBackend(Backend):
    name = "cython"
    ops = ("forward", "backward", "softmax")

    def _load(self) -> None:
        self._k = _import_kernels()
        if _process.forked():
            # imported first in a fork() child: the parent may have used the same libgomp
            # (source builds share the system's), so stay off the pool, as the extension's own
            # fork hook does when it was imported before the fork
            self._k._after_fork_in_child()

    def details(self) -> dict:
        k = self._k
        return {"openmp": bool(k.OPENMP_ENABLED), "simd": k.simd(), "max_threads": k.max_threads()}

    def forward(self, p):
        out, lse = forward_outputs(p)
        L = p.q.shape[2]
        kernel = self._k.decode if L * p.group <= DECODE_MAX_ROWS * 4 and L <= DECODE_MAX_ROWS else self._k.forward
        _process.note_pool_used()
        kernel(*forward_inputs(p), out, lse, _config.num_threads())
        return out, lse

    def backward(self, p, dout, out, lse):
        """FlashAttention-2 backward kernel (csrc/backward.pxi): P recomputed from lse; returns
        (dq, dk, dv) shaped like the canonical q, k, v."""
        dq, dk, dv = np.empty_like(p.q), np.empty_like(p.k), np.empty_like(p.v)
        self._k.backward(*forward_inputs(p), dout, out, lse, dq, dk, dv, _config.num_threads())
        return dq, dk, dv

    def softmax_rows(self, x, keep):
        _process.note_pool_used()
        out = np.empty_like(x)
        if keep is None:
            self._k.softmax_rows(x, 0, np.zeros((1, 1), np.uint8), out, _config.num_threads())
        else:
            self._k.softmax_rows(x, 1, keep.view(np.uint8), out, _config.num_threads())
        return out
