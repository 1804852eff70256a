"""The one description of a call that both compiled backends (cython, numba) receive.

`_inputs.make_problem` validates the user's arguments into a `Problem`; `kernel_args(problem)`
turns it, once per call, into a `KernelArgs` record: C-contiguous arrays of one float dtype and
plain scalars, no None (absent masks, slopes and sinks are small dummy arrays with a flag), so
one compiled specialization serves every call of a dtype. Numba kernels take the record whole
(a heterogeneous NamedTuple); the Cython extension copies it into one C struct. A new score
option is a field here, one scores function per language, the reference, the docs
(docs/KERNELS.md, "how to add a score option").

Kernel entry points (both backends, same arguments):
    forward(args, out, lse)             decode(args, out, lse)
    backward(args, dout, out, lse, dq, dk, dv, dsinks)
    softmax_rows(x, mask_kind, mask, out, n_threads)
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._inputs import MASK_BOOL, MASK_FLOAT, lse_dtype
from .._tuning import Tuning, current_tuning

_DUMMY_BOOL = np.zeros((1, 1, 1, 1), np.uint8)
_DUMMY = {np.dtype(t): (np.zeros((1, 1, 1, 1), t), np.zeros((1, 1), t), np.zeros(1, t),
                        np.zeros((1, 1, 1), t))
          for t in (np.float32, np.float64)}


class KernelArgs(NamedTuple):
    """One attention call as the compiled kernels see it. Shapes as in docs/KERNELS.md."""

    q: np.ndarray              # (B, Hq, L, E)   T, C-contiguous
    k: np.ndarray              # (B, Hkv, S, E)  T
    v: np.ndarray              # (B, Hkv, S, Ev) T
    mask_kind: int             # 0 none, 1 bool keep-mask, 2 float additive mask
    mask_bool: np.ndarray      # (Bm, Hm, Lm, Sm) uint8, each dim 1 (broadcast) or full; dummy
    mask_float: np.ndarray     # (Bm, Hm, Lm, Sm) T; dummy when mask_kind != 2
    mask_strides: tuple        # element strides (b, h, i, j) of the active mask, 0 = broadcast
    has_alibi: bool
    alibi: np.ndarray          # (Ba, Hq) T, Ba in {1, B}; dummy (1, 1)
    scale: float               # s = scale * q.k
    softcap: float             # 0.0 = off
    q_offset: int              # query row i sits at key position i + q_offset
    win_left: int              # key j allowed iff pos_i - win_left <= j <= pos_i + win_right
    win_right: int             #   (an unbounded side is L + S + 1; causal is win_right = 0)
    dropout_p: float           # 0.0 = off
    seed: int                  # uint32 held in a Python int
    # Where this call's pieces sit in a larger problem, for the dropout hash (a chunk computed
    # elsewhere keeps the whole problem's kept set): the hash's (bh, i, j) are
    # (dropout_bh0 + b * dropout_bh_stride + h, dropout_row0 + i, dropout_col0 + j).
    dropout_bh0: int
    dropout_bh_stride: int     # Hq for a whole problem
    dropout_row0: int
    dropout_col0: int
    has_sinks: bool
    sinks: np.ndarray          # (Hq,) T: one logit per query head in the softmax denominator
    n_threads: int
    # Backward only: when has_delta, k/v are a part of the keys and lse belongs to the whole
    # problem; the kernel uses P = exp(s - lse) (no renormalization by its own Z) and
    # D_i = delta[b, h, i] (= rowsum(dout * out) of the whole problem) instead of the D it
    # would recompute from its tiles. Dummy (1, 1, 1) when off.
    has_delta: bool
    delta: np.ndarray          # (B, Hq, L) T
    # A KV cache read in place (docs/KERNELS.md, section 2). k and v are 4-D views whose last
    # axis is contiguous; their element strides along (batch or page, head, position):
    k_strides: tuple           # (H*S*E, S*E, E) for a C-contiguous k
    v_strides: tuple
    has_seqlens: bool          # sequence b attends its first seqlens[b] keys, and its query
    seqlens: np.ndarray        #   row i sits at i + q_offset + seqlens[b] - S; (B,) int32,
                               #   dummy (1,)
    has_block_table: bool      # paged: key j of sequence b is row j % page_size of page
    block_table: np.ndarray    #   block_table[b, j // page_size] of k/v (num_pages, Hkv,
    page_size: int             #   page_size, E); S = max_pages * page_size. (B, max_pages)
                               #   int32, dummy (1, 1); page_size 0 when not paged
    # A low-precision cache (fastattn/_kvdtypes.py), computed in float32: kv_kind 1 float16,
    # 2 bfloat16 (k/v then arrive as uint16 views of their bits), 3 int8 codes, whose key j of
    # (b, h) reads float32(code) * k_scale[b, h, j] (v likewise); 0: k/v in the compute dtype.
    kv_kind: int
    k_scale: np.ndarray        # (Bk, Hkv, Sk) float32 views like k's first three axes;
    v_scale: np.ndarray        #   dummy (1, 1, 1) unless kv_kind == 3
    k_scale_strides: tuple     # their element strides (batch or page, head, position)
    v_scale_strides: tuple
    tuning: Tuning             # block sizes and prefetch options; 0 / -1 = the backend's choice


def _mask_strides(mask: np.ndarray | None) -> tuple:
    if mask is None:
        return (0, 0, 0, 0)
    shape = mask.shape
    st, acc = [0, 0, 0, 0], 1
    for ax in (3, 2, 1, 0):
        st[ax] = 0 if shape[ax] == 1 else acc
        acc *= shape[ax]
    return tuple(st)


# Built with tuple.__new__ and positional fields: the NamedTuple's keyword constructor cost
# ~2 us of a ~10 us decode step. _FIELDS pins the order this function writes them in.
_new_record = tuple.__new__
_FIELDS = ("q", "k", "v", "mask_kind", "mask_bool", "mask_float", "mask_strides", "has_alibi",
           "alibi", "scale", "softcap", "q_offset", "win_left", "win_right", "dropout_p", "seed",
           "dropout_bh0", "dropout_bh_stride", "dropout_row0", "dropout_col0", "has_sinks",
           "sinks", "n_threads", "has_delta", "delta", "k_strides", "v_strides", "has_seqlens",
           "seqlens", "has_block_table", "block_table", "page_size", "kv_kind", "k_scale",
           "v_scale", "k_scale_strides", "v_scale_strides", "tuning")
assert KernelArgs._fields == _FIELDS
_NO_MASK_STRIDES = (0, 0, 0, 0)
_NO_SEQLENS = np.zeros(1, np.int32)
_NO_BLOCK_TABLE = np.zeros((1, 1), np.int32)
_NO_SCALE = np.zeros((1, 1, 1), np.float32)
_NO_SCALE_STRIDES = (0, 0, 0)
# how k/v of each kv_kind reach the kernels: the bits of a 16-bit float as uint16 (one view
# for both, whatever their Python type), int8 codes as they are
_KV_VIEW = {1: np.uint16, 2: np.uint16, 3: np.int8}


def _scale_strides(s: np.ndarray) -> tuple:
    return tuple(st // 4 for st in s.strides)




def _whole_origin(p) -> tuple:
    """The dropout hash coordinates of a whole problem: (bh0, bh_stride, row0, col0)."""
    return (0, p.q.shape[1], 0, 0)


def kernel_args(p, n_threads: int) -> KernelArgs:
    """The record for Problem `p` (built once per call)."""
    dummy_mask, dummy_alibi, dummy_sinks, dummy_delta = _DUMMY[p.dtype]
    band = p.band
    alibi = p.alibi
    sinks = p.sinks
    delta = p.delta
    kind = p.mask_kind
    kv_strides = p.kv_strides
    if kv_strides is None:               # C-contiguous (B, H, S, E): strides from the shapes
        _, H, S, E = p.k.shape
        Ev = p.v.shape[3]
        kv_strides = ((H * S * E, S * E, E), (H * S * Ev, S * Ev, Ev))
    seqlens, table = p.seqlens, p.block_table
    kv_kind = p.kv_kind
    k, v = p.k, p.v
    ks = vs = _NO_SCALE
    ks_st = vs_st = _NO_SCALE_STRIDES
    if kv_kind:
        k, v = k.view(_KV_VIEW[kv_kind]), v.view(_KV_VIEW[kv_kind])
        if p.k_scale is not None:
            ks, vs = p.k_scale, p.v_scale
            ks_st, vs_st = _scale_strides(ks), _scale_strides(vs)
    if kind:
        mask_bool = p.mask.view(np.uint8) if kind == MASK_BOOL else _DUMMY_BOOL
        mask_float = p.mask if kind == MASK_FLOAT else dummy_mask
        strides = _mask_strides(p.mask)
    else:
        mask_bool, mask_float, strides = _DUMMY_BOOL, dummy_mask, _NO_MASK_STRIDES
    # int()/float(): numba specializes on the types, so a NumPy scalar must not get through
    return _new_record(KernelArgs, (
        p.q, k, v, int(kind), mask_bool, mask_float, strides,
        alibi is not None, dummy_alibi if alibi is None else alibi,
        float(p.scale), float(p.softcap), int(band.q_offset), int(band.left), int(band.right),
        float(p.dropout_p), int(p.seed),
        *(_whole_origin(p) if p.dropout_origin is None else p.dropout_origin),
        sinks is not None, dummy_sinks if sinks is None else sinks,
        int(n_threads), delta is not None, dummy_delta if delta is None else delta,
        *kv_strides,
        seqlens is not None, _NO_SEQLENS if seqlens is None else seqlens,
        table is not None, _NO_BLOCK_TABLE if table is None else table,
        0 if table is None else p.k.shape[2],
        kv_kind, ks, vs, ks_st, vs_st,
        current_tuning()))


def forward_outputs(p) -> tuple:
    """Fresh (out, lse) for the kernels to fill."""
    B, Hq, L, _ = p.q.shape
    return (np.empty((B, Hq, L, p.v.shape[3]), p.dtype), np.empty((B, Hq, L), lse_dtype(p.dtype)))
