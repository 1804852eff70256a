"""What the two compiled backends (cython, numba) share: the kernel calling convention.

Both expose the same four kernels taking the same record (fastattn/_backends/_kernel_args.py,
docs/KERNELS.md): forward, decode, backward and softmax_rows. A subclass's `_load` imports them
and sets the four attributes below; the record, the output allocation and the decode-or-forward
choice live here once.
"""
from __future__ import annotations

import numpy as np

from .. import _config, _process
from ._base import Backend
from ._kernel_args import forward_outputs, kernel_args

# Few queries against a long cache: the decode kernel reads each K/V block once for all query
# rows of a KV group and splits the keys over threads (flash-decoding). Up to this many query
# rows per head, and four times as many per KV group, decode is faster than the tiled forward.
DECODE_MAX_ROWS = 16


def use_decode(p) -> bool:
    L = p.q.shape[2]
    return L <= DECODE_MAX_ROWS and L * p.group <= DECODE_MAX_ROWS * 4


def band_keys(L: int, S: int, band) -> int:
    """How many of S keys the L rows of a band may attend (one range: the rows' first and
    one-past-last key)."""
    lo = band.q_offset - band.left
    hi = band.q_offset + L + band.right
    return max(0, min(S, hi) - max(0, lo))


def decode_bytes(p) -> int:
    """The K/V bytes a decode call reads: the keys inside its rows' band, per sequence (its
    seqlens), not the buffer -- a decode loop over a preallocated cache passes the whole buffer
    with window=(0, t), and a paged cache's k is the whole page pool."""
    L = p.q.shape[2]
    S = p.n_keys
    band = p.band
    if p.seqlens is None:
        keys = p.q.shape[0] * band_keys(L, S, band)
    else:
        lo = band.q_offset - band.left
        hi = band.q_offset + L + band.right
        if p.seqlens.size <= 64:                   # a decode step: NumPy's calls cost ~15 us
            keys = 0
            for n in p.seqlens.tolist():
                shift = n - S                      # a sequence's rows sit seqlens[b] - S later
                keys += max(0, min(n, hi + shift) - max(0, lo + shift))
        else:
            n = p.seqlens.astype(np.int64)
            shift = n - S
            keys = int(np.maximum(0, np.minimum(n, hi + shift) - np.maximum(0, lo + shift)).sum())
    return keys * p.k.shape[1] * (p.k.shape[3] + p.v.shape[3]) * p.k.itemsize


class CompiledBackend(Backend):
    ops = ("forward", "backward", "softmax")
    # options the backend's kernels do not implement yet: {Problem attribute: reason}
    unsupported_options: dict = {}
    # the same for the backward kernel only (its forward and decode read them)
    unsupported_backward_options: dict = {}
    # the low-precision caches (Problem.kv_kind, fastattn/_kvdtypes.py) the kernels read
    kv_kinds: tuple = ()

    # set by _load: kernel(args, out, lse), kernel(args, dout, out, lse, dq, dk, dv, dsinks),
    # softmax_rows(x, mask_kind, mask, out, n_threads)
    _forward_kernel = _decode_kernel = _backward_kernel = _softmax_kernel = None
    # Decode reading fewer K/V bytes than this runs on the calling thread (the record's
    # n_threads = 1): waking the pool costs more than the second thread saves. None: the
    # kernels choose (see decode_threads).
    serial_decode_bytes: int | None = None

    def decode_threads(self, p, n_threads: int) -> int:
        """Threads for a decode call: all of them, unless the K/V it reads are few."""
        if self.serial_decode_bytes is None or n_threads == 1:
            return n_threads
        return self.threads_for_decode_bytes(decode_bytes(p), n_threads)

    def threads_for_decode_bytes(self, nbytes: int, n_threads: int) -> int:
        if self.serial_decode_bytes is None:
            return n_threads
        return 1 if nbytes < self.serial_decode_bytes else n_threads

    def not_supported_reasons(self, problem, op):
        reasons = super().not_supported_reasons(problem, op)
        for attr, why in self.unsupported_options.items():
            if getattr(problem, attr, None) is not None:
                reasons.append(why)
        kind = getattr(problem, "kv_kind", 0)
        if kind and kind not in self.kv_kinds:
            # float16 / bfloat16 / int8 caches (fastattn/_kvdtypes.py): numpy reads them all
            reasons.append(f"{self.name}'s kernels do not read a KV cache of kv_kind {kind} "
                           f"(float16 1, bfloat16 2, int8 3; they read {self.kv_kinds})")
        if op == "backward":
            for attr, why in self.unsupported_backward_options.items():
                if getattr(problem, attr, None) is not None:
                    reasons.append(why)
        return reasons

    def forward_plan(self, p):
        """(kernel, record) of the forward of Problem `p`: decode or tiled forward, and the
        threads for it. fastattn._fastpath keeps them to serve calls of the same key."""
        if use_decode(p):
            kernel, n = self._decode_kernel, self.decode_threads(p, _config.num_threads())
        else:
            kernel, n = self._forward_kernel, _config.num_threads()
        return kernel, kernel_args(p, n)

    def forward(self, p):
        out, lse = forward_outputs(p)
        kernel, args = self.forward_plan(p)
        _process.note_pool_used()
        kernel(args, out, lse)
        return out, lse

    def backward(self, p, dout, out, lse):
        """FlashAttention-2 backward: P recomputed from lse; (dq, dk, dv) shaped like the
        canonical q, k, v, and dsinks (Hq,) when the problem has sinks."""
        dq, dk, dv = np.empty_like(p.q), np.empty_like(p.k), np.empty_like(p.v)
        args = kernel_args(p, _config.num_threads())
        dsinks = np.zeros(args.sinks.shape, p.dtype)
        _process.note_pool_used()
        self._backward_kernel(args, dout, out, lse, dq, dk, dv, dsinks)
        return dq, dk, dv, (dsinks if p.sinks is not None else None)

    def softmax_rows(self, x, keep):
        out = np.empty_like(x)
        # the kernel takes a uint8 keep matrix and a flag saying whether to read it
        keep_u8 = np.zeros((1, 1), np.uint8) if keep is None else keep.view(np.uint8)
        _process.note_pool_used()
        self._softmax_kernel(x, int(keep is not None), keep_u8, out, _config.num_threads())
        return out
