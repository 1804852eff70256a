"""Problem -> the positional arguments of the compiled kernels (shared by Cython and Numba).

The kernels take no None and no optional arrays: absent masks and slopes are passed as small
dummy arrays with a flag, so one compiled specialization serves every call of a dtype.
"""
from __future__ import annotations

import numpy as np

from .._inputs import MASK_BOOL, MASK_FLOAT, lse_dtype

_DUMMY_BOOL = np.zeros((1, 1, 1, 1), np.uint8)
_DUMMY = {np.dtype(t): (np.zeros((1, 1, 1, 1), t), np.zeros((1, 1), t)) for t in (np.float32, np.float64)}


def forward_inputs(p) -> tuple:
    """(q, k, v, mask_kind, mask_bool, mask_float, has_alibi, alibi, scale, softcap,
    q_offset, win_left, win_right, dropout_p, seed) as in the kernel spec."""
    dummy_mask, dummy_alibi = _DUMMY[p.dtype]
    mask_bool = p.mask.view(np.uint8) if p.mask_kind == MASK_BOOL else _DUMMY_BOOL
    mask_float = p.mask if p.mask_kind == MASK_FLOAT else dummy_mask
    has_alibi = p.alibi is not None
    alibi = p.alibi if has_alibi else dummy_alibi
    band = p.band
    return (p.q, p.k, p.v, int(p.mask_kind), mask_bool, mask_float, has_alibi, alibi,
            float(p.scale), float(p.softcap), int(band.q_offset), int(band.left), int(band.right),
            float(p.dropout_p), int(p.seed))


def forward_outputs(p) -> tuple:
    """Fresh (out, lse) for the kernels to fill."""
    B, Hq, L, _ = p.q.shape
    return (np.empty((B, Hq, L, p.v.shape[3]), p.dtype), np.empty((B, Hq, L), lse_dtype(p.dtype)))
