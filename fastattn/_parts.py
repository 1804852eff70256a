"""A piece of a larger attention problem: its band, ALiBi and dropout positions made global.

A piece is the rows r0.. and keys c0.. of a whole problem (context parallelism: the public
`part_of=` option of fa.scaled_dot_product_attention and its backward, and fastattn.dask's
tiles). Every position-dependent option must see the whole problem's coordinates:

- causal/window: the band of the whole problem, moved into the piece's coordinates (tile_band);
- ALiBi: reads the same q_offset; when tile_band has to move a far tile's q_offset (below), the
  bias of every (i, j) of the tile is off by the same slope * |shift|, corrected on the lse
  (alibi_lse_shift);
- dropout: the hash coordinates (Problem.dropout_origin).
"""
from __future__ import annotations

import numbers

import numpy as np

from ._inputs import MASK_BOOL, Band, describe

_FALSE = np.zeros((1, 1, 1, 1), np.bool_)


def global_band(L: int, S: int, is_causal: bool, alignment: str, window) -> tuple:
    """(q_offset, left, right) of a whole problem of L queries and S keys; None = unbounded."""
    left, right = window
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return (0 if alignment == "top_left" else S - L), left, right


def tile_band(band: tuple, r0: int, c0: int, L: int, S: int):
    """(Band, shift) for rows r0.. and keys c0.. of a whole problem's global_band, in the
    tile's coordinates, or None when the band leaves the tile no key at all.

    The kernels take a band as j in [i + q_offset - left, i + q_offset + right] with an
    unbounded side stored as L + S + 1, which is unbounded only for q_offset within
    [-(L-1), S-1]. A tile far from the diagonal has q_offset outside that range, so it is moved
    to the nearest end (`shift` = the tile's true q_offset minus the one given) and the bounded
    sides are moved with it: the same constraints. ALiBi reads q_offset too: alibi_lse_shift.
    """
    q_off_g, left, right = band
    q_off = q_off_g + r0 - c0                      # key position of the tile's query row 0
    unb = L + S + 1
    lo = None if left is None else q_off - left    # row i's keys: [i + lo, i + hi]
    hi = None if right is None else q_off + right
    if L == 0 or S == 0 or (lo is not None and lo > S - 1) or (hi is not None and hi < -(L - 1)):
        return None
    if lo is not None and lo <= -(L - 1):
        lo = None                                  # no key of the tile is cut on the left
    if hi is not None and hi >= S - 1:
        hi = None
    q_new = min(max(q_off, -(L - 1)), S - 1)
    return (Band(q_new, unb if lo is None else q_new - lo, unb if hi is None else hi - q_new, unb),
            q_off - q_new)


def place(p, band: tuple, r0: int, c0: int, origin: tuple) -> int:
    """Make Problem `p` (rows r0.., keys c0.. of the whole problem whose global_band is `band`)
    use global positions, in place; returns the ALiBi shift (0 when none).

    A tile the band leaves without keys gets an all-False mask instead (every backend then
    gives its rows out 0, lse -inf or the sink, zero gradients)."""
    L, S = p.q.shape[2], p.k.shape[2]
    tb = tile_band(band, r0, c0, L, S)
    origin = tuple(int(x) for x in origin)
    # only when it matters: a backend whose hash has no offsets yet can still serve the rest
    if p.dropout_p > 0 and origin != (0, p.q.shape[1], 0, 0):
        p.dropout_origin = origin
    if tb is None:
        p.mask_kind, p.mask = MASK_BOOL, _FALSE
        return 0
    p.band, shift = tb
    return shift if p.alibi is not None else 0


def alibi_shift(alibi: np.ndarray, shift: int, dtype) -> np.ndarray:
    """The (Ba, Hq, 1) amount by which a moved tile's scores (and so its lse) exceed the true
    ones: the tile sits wholly on one side of the diagonal, so |pos_i - j| = |i + q_new - j| +
    |shift| for every (i, j), a constant per row, which leaves the weights as they are."""
    return (np.asarray(alibi, np.float64) * abs(shift)).astype(dtype)[..., None]


def backward_lse(p, shift: int, lse: np.ndarray, fn: str) -> np.ndarray:
    """The lse a moved tile's backward must be given (and p.sinks, updated in place): its
    scores exceed the true ones by alibi_shift, so must its lse and the sinks the kernels add
    to its row sums. Unchanged when shift is 0."""
    if not shift:
        return lse
    c = alibi_shift(p.alibi, shift, lse.dtype)
    if p.sinks is not None:
        if c.shape[0] > 1:
            raise ValueError(f"{fn}: sinks with per-batch alibi_slopes (shape {p.alibi.shape}) "
                             f"and query rows past the last key are not supported")
        p.sinks = p.sinks + c[0, :, 0].astype(p.dtype)
    return lse + c


def check_part_of(part_of, L: int, S: int, fn: str) -> tuple:
    """part_of = (query_start, key_start, total_queries, total_keys) as four ints, checked
    against the call's L queries and S keys."""
    if not isinstance(part_of, (tuple, list)) or len(part_of) != 4 or not all(
            isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))
            for x in part_of):
        raise TypeError(f"{fn}: part_of must be a tuple of four ints (query_start, key_start, "
                        f"total_queries, total_keys), got {describe(part_of)}")
    r0, c0, L_tot, S_tot = (int(x) for x in part_of)
    if r0 < 0 or c0 < 0 or r0 + L > L_tot or c0 + S > S_tot or S_tot >= 2 ** 32 or L_tot >= 2 ** 32:
        raise ValueError(
            f"{fn}: part_of={tuple(part_of)} does not place the call's {L} query rows and {S} keys "
            f"inside a problem of total_queries x total_keys: need 0 <= query_start, "
            f"query_start + {L} <= total_queries, 0 <= key_start, key_start + {S} <= total_keys "
            f"(totals below 2**32)")
    return r0, c0, L_tot, S_tot


def row_delta(dout: np.ndarray, out: np.ndarray, dtype) -> np.ndarray:
    """D = rowsum(dout * out), (B, Hq, L) in `dtype`, summed in float64 (the partial-keys
    backward's D; it cancels where a row's weight sits on one key, so no extra rounding)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.ascontiguousarray(np.einsum("bhld,bhld->bhl", dout, out, dtype=np.float64),
                                    dtype=dtype)


def sink_grad(sinks: np.ndarray, lse: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """dsinks_h = -sum_{b,i} exp(sink_h - lse_bhi) * D_bhi (0 for rows with lse = -inf)."""
    with np.errstate(invalid="ignore", over="ignore"):
        sink = np.asarray(sinks, np.float64)[None, :, None]
        lse = np.asarray(lse, np.float64)
        p_sink = np.where(np.isneginf(lse), 0, np.exp(sink - lse))
        return (-np.einsum("bhl,bhl->h", p_sink, np.asarray(delta, np.float64))).astype(sinks.dtype)
