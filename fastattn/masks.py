"""Boolean mask builders (True = may attend) and their shared index rules.

The rules here are the ones every backend applies without building a mask: causal and sliding
windows are a band around the diagonal, shifted by the alignment.
"""
from __future__ import annotations

import numbers

import numpy as np

from ._inputs import check_alignment, check_window, describe, make_band

__all__ = ["causal_mask", "padding_mask", "sliding_window_mask"]


def _length(x, name: str, fn: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise TypeError(f"{fn}: {name} must be a non-negative int, got {describe(x)}")
    if x < 0:
        raise ValueError(f"{fn}: {name} must be a non-negative int, got {int(x)}")
    return int(x)


def band_mask(L: int, S: int, band) -> np.ndarray:
    """(L, S) bool mask of a Band (see fastattn._inputs.Band)."""
    pos = np.arange(L)[:, None] + band.q_offset
    j = np.arange(S)[None, :]
    return (j >= pos - band.left) & (j <= pos + band.right)


def causal_mask(L, S=None, *, alignment="top_left") -> np.ndarray:
    """(L, S) bool mask, True where query i may attend key j.

    alignment="top_left" is torch's is_causal (tril(ones(L, S))); "bottom_right" puts the last
    query at the last key (flash-attn; decoding with a KV cache), i.e. j <= i + S - L.
    """
    fn = "causal_mask"
    L = _length(L, "L", fn)
    S = L if S is None else _length(S, "S", fn)
    check_alignment(alignment, "alignment", fn)
    return band_mask(L, S, make_band(L, S, True, alignment, (None, None)))


def sliding_window_mask(L, S, window, *, alignment="top_left") -> np.ndarray:
    """(L, S) bool mask of a (left, right) window around each query's aligned position.

    Query i (at position p = i, or i + S - L bottom-right aligned) may attend key j iff
    p - left <= j <= p + right; None or -1 leaves a side unbounded.
    """
    fn = "sliding_window_mask"
    L = _length(L, "L", fn)
    S = _length(S, "S", fn)
    check_alignment(alignment, "alignment", fn)
    win = check_window(window, fn)
    return band_mask(L, S, make_band(L, S, False, alignment, win))


def padding_mask(lengths, S) -> np.ndarray:
    """(B, 1, 1, S) bool mask: key j of batch b may be attended iff j < lengths[b]."""
    fn = "padding_mask"
    S = _length(S, "S", fn)
    lens = np.asarray(lengths)
    if lens.ndim != 1 or not (np.issubdtype(lens.dtype, np.integer) or lens.size == 0):
        raise TypeError(f"{fn}: lengths must be a 1-D array of ints, got {describe(lengths)}")
    lens = lens.astype(np.int64)
    if lens.size and (lens.min() < 0 or lens.max() > S):
        raise ValueError(f"{fn}: lengths must be in [0, S={S}], got min {lens.min()}, max {lens.max()}")
    return (np.arange(S)[None, :] < lens[:, None])[:, None, None, :]
