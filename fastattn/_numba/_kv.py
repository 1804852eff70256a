"""Where the keys of a sequence are: the KV cache read in place (docs/KERNELS.md, section 2).

The record's k/v (_record.NumbaArgs) are read through their element strides: key j of kv head
hk of sequence b is row `krow + hk * ksH` of k.reshape(-1), with krow = b*ksB + j*ksS, or, paged,
page*ksB + (j % page_size)*ksS with page = block_table[b, j // page_size]. A dense
(B, Hkv, S, E) k has strides (Hkv*S*E, S*E, E), so the same formulas serve the plain call.
Sequence b attends its first seqlens[b] keys (all S without seqlens), and its query row i sits
at key position i + seq_q_offset(a, b).

The kernels branch on has_block_table / has_seqlens once per key block (or item), never inside
the loops over keys and elements.
"""
import numpy as np
from numba import njit

from ._tiles import block_all_finite


@njit
def seq_keys(a, b):
    """Keys sequence b attends: seqlens[b], or all S."""
    if a.has_seqlens:
        return np.int64(a.seqlens[b])
    return np.int64(a.S)


@njit
def seq_q_offset(a, b):
    """Key position of query row 0 of sequence b: the band of S keys ends where sequence b ends
    (q_offset = S - L, bottom-right, gives seqlens[b] - L)."""
    if a.has_seqlens:
        return np.int64(a.q_offset) + np.int64(a.seqlens[b]) - np.int64(a.S)
    return np.int64(a.q_offset)


@njit
def kv_run(a, b, j):
    """(k offset, v offset, end): the element offsets in k and v of key j of sequence b (kv
    head 0) and the end of the run of keys from j stored at one row stride (ksS / vsS): the end
    of j's page, or S."""
    if not a.has_block_table:
        return b * a.ksB + j * a.ksS, b * a.vsB + j * a.vsS, np.int64(a.S)
    ps = a.page_size
    r = j % ps
    pg = np.int64(a.block_table[b, j // ps])
    return pg * a.ksB + r * a.ksS, pg * a.vsB + r * a.vsS, j - r + ps


@njit
def gather_k(a, b, hk, j0, n, kf, Kg):
    """Keys j0 .. j0+n-1 of kv head (b, hk) into rows 0 .. n-1 of Kg, E elements apart, run by
    run of one stride (a strided cache, or a block that straddles pages, as one dense block)."""
    E = a.q.shape[3]
    s0 = 0
    while s0 < n:
        ko, vo, end = kv_run(a, b, j0 + s0)
        ns = min(n - s0, end - (j0 + s0))
        ko += hk * a.ksH
        for r in range(ns):
            src = ko + r * a.ksS
            dst = (s0 + r) * E
            for t in range(E):
                Kg[dst + t] = kf[src + t]
        s0 += ns


@njit
def gather_v(a, b, hk, j0, n, vf, Vg):
    """gather_k for the values: rows 0 .. n-1 of Vg, Ev elements apart."""
    Ev = a.Ev
    s0 = 0
    while s0 < n:
        ko, vo, end = kv_run(a, b, j0 + s0)
        ns = min(n - s0, end - (j0 + s0))
        vo += hk * a.vsH
        for r in range(ns):
            src = vo + r * a.vsS
            dst = (s0 + r) * Ev
            for t in range(Ev):
                Vg[dst + t] = vf[src + t]
        s0 += ns


@njit
def rows_all_finite(vf, off, ld, n, Ev):
    """True when rows off, off+ld, ... (n rows of Ev elements) of vf hold no NaN/Inf."""
    if ld == Ev:
        return block_all_finite(vf, off, n * Ev)
    for r in range(n):
        if not block_all_finite(vf, off + r * ld, Ev):
            return False
    return True
