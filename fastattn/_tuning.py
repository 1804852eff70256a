"""Kernel tuning knobs (block sizes, prefetch distances) carried per call in the kernel record.

They used to be process-global setters in the extension, which one thread could change under
another's call. Now they are fields of `KernelArgs.tuning`, taken from a contextvar when the
record is built, so a test or the bench sets them for the calls inside a `with` block only:

    from fastattn._tuning import tuning
    with tuning(block_q=192, block_k=512):
        fa.scaled_dot_product_attention(q, k, v, backend="cython")

0 (or -1 where 0 is a meaningful value) means "the backend chooses". Each backend reads the
fields it has and ignores the others; an invalid value raises ValueError from the kernel call.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple


class Tuning(NamedTuple):
    block_q: int = 0                 # forward: query rows per work item
    block_k: int = 0                 # forward: keys per block
    block_q_banded: int = 0          # forward (cython): query rows per item under a band
    bwd_block_q: int = 0             # backward: query rows per block
    bwd_block_k: int = 0             # backward: keys per (interior) block
    bwd_block_edge: int = 0          # backward (cython): keys per band-edge sub-block
    bwd_items_per_thread: int = 0    # backward (cython): split query blocks below this
    bwd_keep_bytes: int = -1         # backward (cython, numba float32): kept tiles a thread holds
    bwd_chunks: int = 0              # backward (numba, recomputing order): key chunks per kv head
    decode_block_k: int = 0          # decode: keys per block
    decode_use_dot: int = -1         # decode (cython): dot-product scores for <= 4 rows (0/1)
    prefetch_qk: int = 0             # decode (cython): keys per slice between prefetches
    prefetch_pv: int = 0
    decode_prefetch: int = -1        # decode (cython): 0 off, 1 prefetcht0, 2 prefetcht1, 3 nta
    decode_prefetch_ahead: int = 0   # decode (cython): prefetch keys this far ahead


DEFAULT = Tuning()
_current: contextvars.ContextVar[Tuning] = contextvars.ContextVar("fastattn_tuning",
                                                                  default=DEFAULT)


def current_tuning() -> Tuning:
    return _current.get()


@contextlib.contextmanager
def tuning(**fields):
    """Override tuning fields for the calls inside the block (this thread/task only)."""
    unknown = set(fields) - set(Tuning._fields)
    if unknown:
        raise TypeError(f"tuning: unknown fields {sorted(unknown)}; known: {list(Tuning._fields)}")
    token = _current.set(_current.get()._replace(**{k: int(v) for k, v in fields.items()}))
    try:
        yield
    finally:
        _current.reset(token)
