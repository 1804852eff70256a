"""Decode kernel (Numba): few queries (L <= ~16) against a long key/value set.

Decode is memory-bound (~0.5 FLOP per byte of K/V), so the one thing that
matters is reading K and V once: an item is (batch, kv head, key chunk) and
processes the G*L query rows of every query head of the KV group together
(G = Hq // Hkv), as an (G*L) x Bk score tile. When batch*kv_heads cannot keep
the threads busy, the keys are split into chunks (flash-decoding); each chunk
leaves (m, l, unnormalized acc) and a final pass merges them by log-sum-exp.
Threads claim items from an atomic counter. float32 uses the register-
blocked kernels of _gemm.py for both products (scores of 1-8 query rows, MHA and
GQA, with the lanes along the head dim: _dec_rows.py; more rows: _gemm.dec_qk),
float64 uses BLAS.

A KV cache is read in place (_kv.py): each sequence its own keys, paged blocks run by run of
one page; on the flash layout (kv heads side by side) an item takes every kv head of a
(batch, chunk) and walks the keys once (_decode_heads_item).
"""
from collections import namedtuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._blas import blas_single_thread, gemm_nn, gemm_nt, numba_threads, prime_blas
from ._exp import exp2v
from ._hash import dropout_bh, dropout_threshold_nb
from ._intrinsics import (
    FM, HAVE_F16C, atomic_count, atomic_next, counters, fcast, fmax_nan, prefetch_l2,
    wide_vectors)
from ._kv import gather_v, kv_run, rows_all_finite, seq_keys, seq_q_offset
from ._kvconv import convert_rows, key_scale
from ._record import numba_args, positive
from ._scores import (
    alibi_slope, band_partial, group_block_status, mask_base, needs_rows, score_units,
    sink_logit, tile_scores)
from ._tiles import pv_nonfinite, sink_row, tile_dropout, tile_online
from ._gemm import MR, dec_pv, dec_pv_bf16, dec_pv_f16, dec_pv_i8, dec_qk
from ._dec_rows import ROWS_MAX, dec_qk_rows, dec_qk_rows_stored


# float32 -> the register-blocked kernels (_gemm.py), float64 -> BLAS,
# resolved at compile time. Q.K^T is computed as K.Q^T (K rows broadcast
# straight from the cache with software prefetch, no packing pass); P.V
# prefetches the V rows ahead of the k-steps (_gemm.gemm_pv_stream). End-to-end
# A/B runs on this shared machine were noisy: B1 Hq32 Hkv8 S16384 d128, 2
# threads, 6 interleaved rounds: t_torch/t_ours median 1.35 with K.Q^T vs 0.88
# with BLAS Q.K^T (an earlier set had them the other way round, 26 vs 31 ms
# medians); K-cache-resident micro-benchmark 0.70 vs 1.2 ms per 8 MB head.
def _dec_pv(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R, ab):  # pragma: no cover
    raise NotImplementedError


def _dec_qk(Sb, c0, Bk, Qs, Qt, SbT, R, E, Eld, kf, koff, ldk, n, ab):  # pragma: no cover
    raise NotImplementedError


@overload(_dec_qk)
def _dec_qk_ol(Sb, c0, Bk, Qs, Qt, SbT, R, E, Eld, kf, koff, ldk, n, ab):
    """Sb[:R, c0:c0+n] = the raw scores of the R query rows Qs (Qt: the same transposed, for
    the float32 panel kernel) against n keys whose rows start at kf[koff] and lie ldk apart."""
    if Sb.dtype == types.float32:
        def impl(Sb, c0, Bk, Qs, Qt, SbT, R, E, Eld, kf, koff, ldk, n, ab):
            if R <= ROWS_MAX:
                dec_qk_rows(Sb, c0, kf, koff, ldk, E, n, Qs, R)
            else:
                dec_qk(Sb, c0, kf, koff, ldk, E, n, Qt, R, SbT)
    else:
        def impl(Sb, c0, Bk, Qs, Qt, SbT, R, E, Eld, kf, koff, ldk, n, ab):
            gemm_nt(R, n, E, Qs, 0, Eld, kf, koff, ldk, 1, Sb, c0, Bk, ab)
    return impl


@overload(_dec_pv)
def _dec_pv_ol(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R, ab):
    """acc[:R] += P[:R, p0:p0+n] . V, V rows from vf[voff] ldv apart."""
    if acc.dtype == types.float32:
        def impl(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R, ab):
            dec_pv(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R)
    else:
        def impl(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R, ab):
            gemm_nn(R, Ev, n, Pb, p0, Bk, vf, voff, ldv, 0, acc, 0, Evld, ab)
    return impl


# Keys of a low-precision cache converted at a time (_block_qk / _block_pv): a 16 KiB float32
# tile at d = 128, in L1 when the kernels read it. Converted a whole block at a time (240 keys,
# 120 KiB), the tile's stores and reads went through L2 and the conversion took ~65% of an
# int8 decode's samples.
LOWP_SUB_KEYS = 32


@njit(fastmath=FM, nogil=True, inline='always')
def _block_qk_stored(a, b, hk, n, kf, koff, ldk, paged, Sb, Qs, Qt, SbT, R, E, Eld, j0, ab):
    """The raw scores Sb[:R, :n] of keys j0 .. j0+n-1 of kv head (b, hk) read where they are:
    rows ldk apart from kf[koff], or, when `paged`, run by run of one page of the whole cache
    (_kv.kv_run) into the columns of the block's tile."""
    Bk = Sb.shape[1]
    if paged:
        s0 = 0
        while s0 < n:
            ko, vo, end = kv_run(a, b, j0 + s0)
            ns = min(n - s0, end - (j0 + s0))
            _dec_qk(Sb, s0, Bk, Qs, Qt, SbT, R, E, Eld, kf, ko + hk * a.ksH, ldk, ns, ab)
            s0 += ns
    else:
        _dec_qk(Sb, 0, Bk, Qs, Qt, SbT, R, E, Eld, kf, koff, ldk, n, ab)


def _block_qk(a, b, hk, n, kf, koff, ldk, paged, Sb, Qs, Qt, SbT, R, E, Eld, j0, ab,
              Kc):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_block_qk, inline="always")
def _block_qk_ol(a, b, hk, n, kf, koff, ldk, paged, Sb, Qs, Qt, SbT, R, E, Eld, j0, ab, Kc):
    """_block_qk_stored on a float32/float64 cache; on a float16, bfloat16 or int8 one (k of
    uint16 or int8), for up to ROWS_MAX query rows the keys read in place and converted in
    the registers of _dec_rows' kernel (int8: the dot over the codes times the key's scale);
    for more rows, or float16 without F16C, LOWP_SUB_KEYS keys at a time converted into the
    float32 tile Kc (_kvconv.py; int8: code x scale an element) and scored from there. Within
    a call every key takes the same path and each score's sum has a fixed order, so a paged
    cache's runs give the bits of the same keys stored contiguously."""
    if kf.dtype in (types.float32, types.float64):
        def impl(a, b, hk, n, kf, koff, ldk, paged, Sb, Qs, Qt, SbT, R, E, Eld, j0, ab, Kc):
            _block_qk_stored(a, b, hk, n, kf, koff, ldk, paged, Sb, Qs, Qt, SbT, R, E, Eld,
                             j0, ab)
    else:
        def impl(a, b, hk, n, kf, koff, ldk, paged, Sb, Qs, Qt, SbT, R, E, Eld, j0, ab, Kc):
            Bk = Sb.shape[1]
            kind = a.kv_kind
            s0 = 0
            if R <= ROWS_MAX and (kind != 1 or HAVE_F16C):
                # the keys converted in the registers of the rows kernel; Kc holds the scales
                while s0 < n:
                    ko, vo, end = kv_run(a, b, j0 + s0)
                    ns = min(min(n - s0, end - (j0 + s0)), Kc.shape[0])
                    if kind == 3:
                        for t in range(ns):
                            Kc[t] = key_scale(a, b, hk, j0 + s0 + t, a.k_scale)
                    dec_qk_rows_stored(Sb, s0, kf, ko + hk * a.ksH, a.ksS, E, ns, Qs, R, Kc,
                                       kind)
                    s0 += ns
                return
            while s0 < n:
                ns = min(LOWP_SUB_KEYS, n - s0)
                convert_rows(a, b, hk, j0 + s0, ns, kf, a.k_scale, Kc, False)
                _dec_qk(Sb, s0, Bk, Qs, Qt, SbT, R, E, Eld, Kc, 0, E, ns, ab)
                s0 += ns
    return impl


@njit(fastmath=FM, nogil=True, inline='always')
def _block_pv_stored(a, b, hk, j0, n, vf, voff, ldv, paged, fast, Pb, acc, R, ab):
    """acc[:R] += P[:R, :n] . V for keys j0 .. j0+n-1 of kv head (b, hk), the values read where
    they are (as _block_qk_stored reads the keys). fast: no weight of the block was zeroed by
    a mask or dropout, so no exact path is needed (see forward.py); else, where V holds a
    NaN/Inf, the exact path on the block's V rows made adjacent."""
    Ev = a.Ev
    Evld = max(Ev, 1)
    Bk = Pb.shape[1]
    if paged:
        s0 = 0
        while s0 < n and not fast:
            ko, vo, end = kv_run(a, b, j0 + s0)
            ns = min(n - s0, end - (j0 + s0))
            if not rows_all_finite(vf, vo + hk * a.vsH, ldv, ns, Ev):
                break
            s0 += ns
        if fast or s0 >= n:
            s0 = 0
            while s0 < n:
                ko, vo, end = kv_run(a, b, j0 + s0)
                ns = min(n - s0, end - (j0 + s0))
                _dec_pv(acc, Evld, Pb, Bk, s0, vf, vo + hk * a.vsH, ldv, Ev, ns, R, ab)
                s0 += ns
            return
    elif fast or rows_all_finite(vf, voff, ldv, n, Ev):
        _dec_pv(acc, Evld, Pb, Bk, 0, vf, voff, ldv, Ev, n, R, ab)
        return
    Vs = np.empty((Bk, Evld), acc.dtype)
    if paged or ldv != Ev:
        Vg = np.empty(Bk * Evld, acc.dtype)
        gather_v(a, b, hk, j0, n, vf, Vg)
        pv_nonfinite(Pb, R, n, Vg, 0, Ev, Evld, Vs, acc, ab)
    else:
        pv_nonfinite(Pb, R, n, vf, voff, Ev, Evld, Vs, acc, ab)


def _block_pv(a, b, hk, j0, n, vf, voff, ldv, paged, fast, Pb, acc, R, ab,
              Vc):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


def _dec_pv_stored(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R,
                   kind):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_dec_pv_stored, inline="always")
def _dec_pv_stored_ol(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R, kind):
    """_dec_pv reading a low-precision cache's values where they are (vf: its int8 or uint16
    view; kind: the record's kv_kind), each vector converted as it is loaded."""
    if vf.dtype == types.int8:
        def impl(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R, kind):
            dec_pv_i8(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R)
    else:
        def impl(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R, kind):
            if kind == 2:
                dec_pv_bf16(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R)
            else:
                dec_pv_f16(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R)
    return impl


@overload(_block_pv, inline="always")
def _block_pv_ol(a, b, hk, j0, n, vf, voff, ldv, paged, fast, Pb, acc, R, ab, Vc):
    """_block_pv_stored on a float32/float64 cache. On a low-precision one, with no exact path
    needed (fast): the values read in place and converted in the registers of the P.V kernel
    (int8: P's columns multiplied first by their values' scales, one multiply a weight
    instead of one an element, as the Cython kernels do; l has summed the plain weights), or,
    for float16 without F16C, LOWP_SUB_KEYS values at a time converted into Vc and multiplied
    from there. Each output element is one FMA chain over the keys in order, continued from
    acc: a page's run gives the bits of the block taken whole. Else (a mask or dropout zeroed
    weights) the block's values converted whole into Vc and _block_pv_stored on them."""
    if vf.dtype in (types.float32, types.float64):
        def impl(a, b, hk, j0, n, vf, voff, ldv, paged, fast, Pb, acc, R, ab, Vc):
            _block_pv_stored(a, b, hk, j0, n, vf, voff, ldv, paged, fast, Pb, acc, R, ab)
    else:
        def impl(a, b, hk, j0, n, vf, voff, ldv, paged, fast, Pb, acc, R, ab, Vc):
            Ev = a.Ev
            kind = a.kv_kind
            if fast and (kind != 1 or HAVE_F16C):
                if kind == 3:
                    for t in range(n):
                        Vc[t] = key_scale(a, b, hk, j0 + t, a.v_scale)
                    for r in range(R):
                        for t in range(n):
                            Pb[r, t] *= Vc[t]
                s0 = 0
                while s0 < n:
                    ko, vo, end = kv_run(a, b, j0 + s0)
                    ns = min(n - s0, end - (j0 + s0))
                    _dec_pv_stored(acc, max(Ev, 1), Pb, Pb.shape[1], s0, vf, vo + hk * a.vsH,
                                   a.vsS, Ev, ns, R, kind)
                    s0 += ns
            elif fast:
                s0 = 0
                while s0 < n:
                    ns = min(LOWP_SUB_KEYS, n - s0)
                    convert_rows(a, b, hk, j0 + s0, ns, vf, a.v_scale, Vc, True)
                    _dec_pv(acc, max(Ev, 1), Pb, Pb.shape[1], s0, Vc, 0, Ev, Ev, ns, R, ab)
                    s0 += ns
            else:
                convert_rows(a, b, hk, j0, n, vf, a.v_scale, Vc, True)
                _block_pv_stored(a, b, hk, j0, n, Vc, 0, Ev, False, fast, Pb, acc, R, ab)
    return impl


@njit(fastmath=FM, nogil=True, inline='always')
def _decode_block(a, b, hk, j0, n, qo, kf, koff, ldk, vf, voff, ldv, paged, Qs, Qt, SbT, Sb,
                  Pb, acc, m, lsum, ab, Kc, Vc):
    """Keys j0 .. j0+n-1 of kv head (b, hk) for the R query rows of its group (Qs; Qt the same
    transposed; query row i of sequence b at key position i + qo): the online-softmax update
    of m, lsum and acc. The keys are read where they are (_block_qk, _block_pv): rows ldk
    (values ldv) apart from kf[koff] / vf[voff], or, when `paged`, run by run of one page, so
    the block's sums are those of the same block stored contiguously; a float16, bfloat16 or
    int8 cache is converted a few keys at a time into the float32 tiles Kc / Vc."""
    q = a.q
    B, Hq, L, E = q.shape
    g = Hq // a.Hkv
    R = g * L
    Eld = max(E, 1)
    # mask status over the whole group tile (all heads, all rows)
    mstat = group_block_status(a, b, hk * g, g, L, j0, n)
    if mstat == 0:
        return
    _block_qk(a, b, hk, n, kf, koff, ldk, paged, Sb, Qs, Qt, SbT, R, E, Eld, j0, ab, Kc)
    to_nat, c_exp, kappa = score_units(a)
    # every head's rows sit at the same positions: one band status for the tile
    partial = band_partial(a, j0, n, qo, L - 1 + qo)
    if needs_rows(a, partial, mstat):
        for hh in range(g):
            # rows hh*L .. hh*L+L-1 belong to query head h
            h = hk * g + hh
            tile_scores(Sb, hh * L, hh * L + L, n, j0, qo, a, alibi_slope(a, b, h),
                        mask_base(a, b, h, 0, j0), mstat, Sb, False)
    tile_online(Sb, Pb, 0, R, n, m, lsum, acc, a.Ev, c_exp)
    do_drop = a.dropout_p > 0.0
    if do_drop:
        thresh = dropout_threshold_nb(a.dropout_p)
        for hh in range(g):
            tile_dropout(Pb, hh * L, hh * L + L, n, a.seed, dropout_bh(a, b, hk * g + hh),
                         a.dropout_row0, a.dropout_col0 + j0, thresh)
    fast = mstat == 1 and not partial and not do_drop
    _block_pv(a, b, hk, j0, n, vf, voff, ldv, paged, fast, Pb, acc, R, ab, Vc)


@njit(nogil=True)
def _item_scratch(a, plan):
    """A worker's scratch for _decode_item, allocated once per call rather than per item (12
    tiny items of an MHA decode spent ~1 us each on allocations)."""
    q = a.q
    B, Hq, L, E = q.shape
    R = (Hq // a.Hkv) * L
    Eld = max(E, 1)
    Evld = max(a.Ev, 1)
    Bk = plan.Bk
    Rp = ((R + MR - 1) // MR) * MR
    low = a.kv_kind != 0
    return (np.empty((R, Eld), q.dtype), np.empty(Eld * R, q.dtype), np.empty(Bk * R, q.dtype),
            np.empty((R, Bk), q.dtype), np.empty((Rp, Bk), q.dtype),
            np.empty((Rp, Evld), q.dtype), np.empty(R, q.dtype), np.empty(R, q.dtype),
            np.empty(min(Bk, LOWP_SUB_KEYS) * Eld if low else 1, q.dtype),
            np.empty(Bk * Evld if low else 1, q.dtype), np.empty(2, q.dtype))


@njit(cache=True, fastmath=FM, nogil=True)
def _decode_item(it, a, plan, pm, pl, pacc, ws):
    """Item `it` = (batch, kv head, key chunk) of the call `a` (_record.NumbaArgs): the scores
    of every query row of the KV group against the chunk's keys, left as partials (running
    max, sum, unnormalized acc) in pm/pl/pacc[it] for _decode_merge. The keys are sequence b's
    first seq_keys(a, b), read where they are (_kv.py, _decode_block)."""
    wide_vectors()
    q, k, v = a.q, a.k, a.v
    Bk, nchunks, csize = plan.Bk, plan.nchunks, plan.csize
    B, Hq, L, E = q.shape
    Hkv = a.Hkv
    Ev = a.Ev
    g = Hq // Hkv
    R = g * L
    qf = q.reshape(-1)
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    bk = it // nchunks            # b * Hkv + hk
    c = it - bk * nchunks
    b = bk // Hkv
    hk = bk - b * Hkv
    c_lo = c * csize
    c_hi = min(a.S, c_lo + csize)   # exclusive

    # rows r = hh * L + i of query head h = hk*g + hh; query rows of one head
    # are contiguous in q, and the heads of a group are adjacent, so the
    # whole group is one contiguous (R, E) slab of q.
    # rows padded to whole micro-tiles for the float32 P.V kernel
    # the worker's scratch (_item_scratch); acc, m and lsum start afresh for each item.
    # Kc/Vc: a low-precision cache's keys/values converted (_decode_block_kv)
    Qs, Qt, SbT, Sb, Pb, acc, m, lsum, Kc, Vc, ab = ws
    qoff = (b * Hq + hk * g) * L * E
    for r in range(R):
        for t in range(E):
            Qs[r, t] = qf[qoff + r * E + t]
            Qt[t * R + r] = qf[qoff + r * E + t]
    acc[:] = 0
    m[:] = fcast(q, -np.inf)
    lsum[:] = 0
    ab[0] = fcast(q, 1.0)
    ab[1] = fcast(q, 0.0)

    # union of the rows' bands, clipped to this chunk and to the sequence's keys
    qo = seq_q_offset(a, b)
    jlo = max(c_lo, qo - a.win_left)
    jhi = min(min(c_hi, seq_keys(a, b)) - 1, L - 1 + qo + a.win_right)
    paged = a.has_block_table
    j0 = jlo
    while j0 <= jhi:
        n = min(Bk, jhi + 1 - j0)
        _decode_block(a, b, hk, j0, n, qo, kf, b * a.ksB + j0 * a.ksS + hk * a.ksH,
                         a.ksS, vf, b * a.vsB + j0 * a.vsS + hk * a.vsH, a.vsS, paged, Qs, Qt,
                         SbT, Sb, Pb, acc, m, lsum, ab, Kc, Vc)
        j0 += n

    for r in range(R):
        pm[it, r] = m[r]
        pl[it, r] = lsum[r]
        for t in range(Ev):
            pacc[it, r, t] = acc[r, t]


@njit(nogil=True, inline='always')
def _prefetch_rows(af, off, ld, width, n):
    """Prefetch into L2 the first `width` elements of n rows ld apart from af[off], in address
    order, a line at a time."""
    for j in range(n):
        for x in range(off + j * ld, off + j * ld + width, 16):
            prefetch_l2(af, x)


@njit(nogil=True)
def _views_scratch(a, plan):
    """_decode_views_item's scratch: _item_scratch's tiles, one per kv head of a group
    (plan.hpg), scores and weights a whole block wide."""
    q = a.q
    B, Hq, L, E = q.shape
    R = (Hq // a.Hkv) * L
    Eld = max(E, 1)
    Evld = max(a.Ev, 1)
    Bk, n = plan.Bk, plan.hpg
    Rp = ((R + MR - 1) // MR) * MR
    return (np.empty((n, R, Eld), q.dtype), np.empty((n, Eld * R), q.dtype),
            np.empty(Bk * R, q.dtype), np.empty((n, R, Bk), q.dtype),
            np.empty((n, Rp, Bk), q.dtype), np.empty((n, Rp, Evld), q.dtype),
            np.empty((n, R), q.dtype), np.empty((n, R), q.dtype), np.empty(1, q.dtype),
            np.empty(1, q.dtype), np.empty(2, q.dtype))


@njit(cache=True, fastmath=FM, nogil=True)
def _decode_views_item(it, a, plan, pm, pl, pacc):
    """Item `it` = (batch, group of plan.hpg kv heads, key chunk) of a call on (B, S, H, E)
    views (scaled_dot_product_attention on split_heads' output: kv heads side by side, no KV
    cache). Item by kv head, each head's key rows are Hkv*E elements apart and the memory is
    walked once per head (from DRAM 2.5-3.5x the time of contiguous heads); here each block
    of plan.Bk keys -- the blocks _decode_item takes -- is read in memory order for the
    group's heads together: the scores VIEWS_SUB_KEYS keys at a time for each head in turn,
    then each head's online softmax over its block, then P.V the same way. Every score sums
    in the same order wherever its key sits (_dec_rows) and each P.V element is one FMA chain
    over the keys continued from acc (_gemm.dec_pv), so each head's partials have the bits
    _decode_item leaves (float32 with at most ROWS_MAX rows: decode() plans no other call
    here). A block that needs more than raw scores (a mask, the band's edge,
    dropout, softcap or ALiBi) goes through _decode_block head by head, as there."""
    wide_vectors()
    q, k, v = a.q, a.k, a.v
    Bk, nchunks, csize, hpg = plan.Bk, plan.nchunks, plan.csize, plan.hpg
    B, Hq, L, E = q.shape
    Hkv = a.Hkv
    Ev = a.Ev
    Evld = max(Ev, 1)
    g = Hq // Hkv
    R = g * L
    Eld = max(E, 1)
    qf = q.reshape(-1)
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    nhg = (Hkv + hpg - 1) // hpg
    bg = it // nchunks
    c = it - bg * nchunks
    b = bg // nhg
    h0 = (bg - b * nhg) * hpg
    nh = min(Hkv, h0 + hpg) - h0
    c_lo = c * csize
    c_hi = min(a.S, c_lo + csize)
    # scratch an item (items are few and long: a group's heads over a key chunk)
    Qs, Qt, SbT, Sb, Pb, acc, m, lsum, Kc, Vc, ab = _views_scratch(a, plan)
    for x in range(nh):
        qoff = (b * Hq + (h0 + x) * g) * L * E
        for r in range(R):
            for t in range(E):
                Qs[x, r, t] = qf[qoff + r * E + t]
                Qt[x, t * R + r] = qf[qoff + r * E + t]
    acc[:] = 0
    m[:] = fcast(q, -np.inf)
    lsum[:] = 0
    ab[0] = fcast(q, 1.0)
    ab[1] = fcast(q, 0.0)
    c_exp = score_units(a)[1]
    qo = seq_q_offset(a, b)
    jlo = max(c_lo, qo - a.win_left)
    jhi = min(min(c_hi, seq_keys(a, b)) - 1, L - 1 + qo + a.win_right)
    plain = a.mask_kind == 0 and a.dropout_p == 0.0
    ksH, vsH = a.ksH, a.vsH
    j0 = jlo
    while j0 <= jhi:
        n = min(Bk, jhi + 1 - j0)
        koff = b * a.ksB + j0 * a.ksS + h0 * ksH
        voff = b * a.vsB + j0 * a.vsS + h0 * vsH
        if not (plain and not needs_rows(a, band_partial(a, j0, n, qo, L - 1 + qo), 1)):
            for x in range(nh):
                _decode_block(a, b, h0 + x, j0, n, qo, kf, koff + x * ksH, a.ksS, vf,
                              voff + x * vsH, a.vsS, False, Qs[x], Qt[x], SbT, Sb[x], Pb[x],
                              acc[x], m[x], lsum[x], ab, Kc, Vc)
            j0 += n
            continue
        for s0 in range(0, n, VIEWS_SUB_KEYS):
            ns = min(VIEWS_SUB_KEYS, n - s0)
            if VIEWS_PREFETCH:
                _prefetch_rows(kf, koff + (s0 + VIEWS_SUB_KEYS) * a.ksS, a.ksS, nh * ksH,
                               min(VIEWS_SUB_KEYS, jhi + 1 - (j0 + s0 + VIEWS_SUB_KEYS)))
            for x in range(nh):
                _dec_qk(Sb[x], s0, Bk, Qs[x], Qt[x], SbT, R, E, Eld, kf,
                        koff + s0 * a.ksS + x * ksH, a.ksS, ns, ab)
        for x in range(nh):
            tile_online(Sb[x], Pb[x], 0, R, n, m[x], lsum[x], acc[x], Ev, c_exp)
        for s0 in range(0, n, VIEWS_SUB_KEYS):
            ns = min(VIEWS_SUB_KEYS, n - s0)
            if VIEWS_PREFETCH:
                _prefetch_rows(vf, voff + (s0 + VIEWS_SUB_KEYS) * a.vsS, a.vsS, nh * vsH,
                               min(VIEWS_SUB_KEYS, jhi + 1 - (j0 + s0 + VIEWS_SUB_KEYS)))
            for x in range(nh):
                _dec_pv(acc[x], Evld, Pb[x], Bk, s0, vf, voff + s0 * a.vsS + x * vsH, a.vsS,
                        Ev, ns, R, ab)
        j0 += n

    for x in range(nh):
        itk = (b * Hkv + h0 + x) * nchunks + c
        for r in range(R):
            pm[itk, r] = m[x, r]
            pl[itk, r] = lsum[x, r]
            for t in range(Ev):
                pacc[itk, r, t] = acc[x, r, t]


@njit(cache=True, fastmath=FM, nogil=True)
def _decode_heads_item(it, a, plan, pm, pl, pacc):
    """Item `it` = (batch, key chunk) for every kv head at once, on a cache whose kv heads' rows
    lie side by side (the flash layout (B, S, Hkv, E) read in place: head stride < key
    stride). Item by kv head, a head's key rows are Hkv*E elements apart (4 KiB at Hkv = 8,
    E = 128: a new page every row, the whole sequence walked Hkv times); here the keys are
    walked once, block by block, and each block is attended head by head, so the heads of a
    key row are read while its pages and lines are near (csrc/decode.pxi dec_heads_item does
    the same). The partials go where _decode_item would leave them (item
    (b * Hkv + hk) * nchunks + c). Copying each block for all heads into a dense scratch first
    was slower: the scalar copy loop ran at ~1.6 GB/s per thread here."""
    wide_vectors()
    q, k, v = a.q, a.k, a.v
    Bk, nchunks, csize = plan.Bk, plan.nchunks, plan.csize
    B, Hq, L, E = q.shape
    Hkv = a.Hkv
    Ev = a.Ev
    g = Hq // Hkv
    R = g * L
    Eld = max(E, 1)
    Evld = max(Ev, 1)
    qf = q.reshape(-1)
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    b = it // nchunks
    c = it - b * nchunks
    c_lo = c * csize
    c_hi = min(a.S, c_lo + csize)
    qo = seq_q_offset(a, b)
    jlo = max(c_lo, qo - a.win_left)
    jhi = min(min(c_hi, seq_keys(a, b)) - 1, L - 1 + qo + a.win_right)

    Rp = ((R + MR - 1) // MR) * MR
    Qs = np.empty((Hkv, R, Eld), q.dtype)
    Qt = np.empty((Hkv, Eld * R), q.dtype)
    for hk in range(Hkv):
        qoff = (b * Hq + hk * g) * L * E
        for r in range(R):
            for t in range(E):
                Qs[hk, r, t] = qf[qoff + r * E + t]
                Qt[hk, t * R + r] = qf[qoff + r * E + t]
    SbT = np.empty(Bk * R, q.dtype)
    Sb = np.empty((R, Bk), q.dtype)
    Pb = np.empty((Rp, Bk), q.dtype)
    acc = np.zeros((Hkv, Rp, Evld), q.dtype)
    m = np.full((Hkv, R), fcast(q, -np.inf), q.dtype)
    lsum = np.zeros((Hkv, R), q.dtype)
    ab = np.empty(2, q.dtype)
    ab[0] = fcast(q, 1.0)
    ab[1] = fcast(q, 0.0)
    low = a.kv_kind != 0
    Kc = np.empty(min(Bk, LOWP_SUB_KEYS) * Eld if low else 1, q.dtype)
    Vc = np.empty(Bk * Evld if low else 1, q.dtype)
    j0 = jlo
    paged = a.has_block_table
    while j0 <= jhi:
        n = min(Bk, jhi + 1 - j0)
        for hk in range(Hkv):
            _decode_block(a, b, hk, j0, n, qo, kf, b * a.ksB + j0 * a.ksS + hk * a.ksH,
                             a.ksS, vf, b * a.vsB + j0 * a.vsS + hk * a.vsH, a.vsS, paged,
                             Qs[hk], Qt[hk], SbT, Sb, Pb, acc[hk], m[hk], lsum[hk], ab, Kc, Vc)
        j0 += n

    for hk in range(Hkv):
        itk = (b * Hkv + hk) * nchunks + c
        for r in range(R):
            pm[itk, r] = m[hk, r]
            pl[itk, r] = lsum[hk, r]
            for t in range(Ev):
                pacc[itk, r, t] = acc[hk, r, t]


@njit(fastmath=FM)
def _decode_merge(bk, a, plan, pm, pl, pacc, out, lse, kappa):
    """Log-sum-exp merge of the chunk partials of one (batch, kv head).

    The weighted sum and the final factor 1/(1-p) / l are formed in float64,
    so a float32 output is rounded once (a single chunk passes through
    exactly: its weight is 2**0). lse as in _tiles.tile_finalize (sinks
    included)."""
    nchunks = plan.nchunks
    L = a.q.shape[2]
    Hkv = a.Hkv
    g = a.q.shape[1] // Hkv
    inv_keep = 1.0 / (1.0 - a.dropout_p)
    Ev = out.shape[3]
    R = g * L
    b = bk // Hkv
    hk = bk - b * Hkv
    ninf = fcast(out, -np.inf)
    zero = fcast(out, 0.0)
    o64 = np.empty(max(Ev, 1), np.float64)
    for r in range(R):
        hh = r // L
        i = r - hh * L
        h = hk * g + hh
        M = ninf
        for c in range(nchunks):
            M = fmax_nan(M, pm[bk * nchunks + c, r])
        ltot = 0.0
        if M != ninf:
            for t in range(Ev):
                o64[t] = 0.0
            for c in range(nchunks):
                mc = pm[bk * nchunks + c, r]
                if mc == ninf:
                    continue      # empty chunk: exp2(-inf - M) is 0 anyway, skip
                w = np.float64(exp2v(mc - M))
                ltot += w * pl[bk * nchunks + c, r]
                for t in range(Ev):
                    o64[t] += w * pacc[bk * nchunks + c, r, t]
        sink = sink_logit(a, h)
        if sink != -np.inf:               # a sink (NaN included)
            if ltot == 0.0:
                for t in range(Ev):
                    o64[t] = 0.0
            f, ls = sink_row(np.float64(M) * kappa if ltot != 0.0 else -np.inf, ltot, sink,
                             inv_keep)
            for t in range(Ev):
                out[b, h, i, t] = o64[t] * f
            lse[b, h, i] = ls
            continue
        if ltot == 0.0:
            for t in range(Ev):
                out[b, h, i, t] = zero
            lse[b, h, i] = ninf
            continue
        f = inv_keep / ltot
        for t in range(Ev):
            out[b, h, i, t] = o64[t] * f
        lse[b, h, i] = np.float64(M) * kappa + np.log(ltot)


# Blocks of a decode call: keys per block, chunk length (a multiple of Bk), chunks per
# (batch, kv head), threads, whether an item takes every kv head (_decode_heads_item), and
# kv heads per item of the views walk (_decode_views_item; 0: item by kv head)
DecPlan = namedtuple("DecPlan", "Bk csize nchunks nthreads heads hpg")


@njit(parallel=True, cache=True, nogil=True)
def _decode_kernel(a, out, lse, plan):
    B, Hq, L, E = a.q.shape
    Hkv = a.Hkv
    Ev = a.Ev
    g = Hq // Hkv
    R = g * L
    nchunks = plan.nchunks
    n_items = B * Hkv * nchunks
    pm = np.empty((n_items, R), a.q.dtype)
    pl = np.empty((n_items, R), a.q.dtype)
    pacc = np.empty((n_items, R, max(Ev, 1)), a.q.dtype)
    # workers claim items dynamically (see forward): decode items are few and
    # large, so one slow thread would otherwise set the call's time
    counter = counters(1)
    # heads together: one loop iteration is (batch, chunk) for every kv head
    n_loop = B * nchunks if plan.heads else n_items
    # Chunks finished per (batch, kv head), per batch when an item takes every kv head: the
    # worker that finishes a group's last chunk merges it (atomic_count orders the other
    # chunks' partials before it). A merge in a second parallel region woke the passive pool
    # a second time and waited for it again: ~80 us a call on two threads here.
    done = counters(B if plan.heads else B * Hkv)
    kappa = score_units(a)[2]
    for w in prange(min(plan.nthreads, n_loop)):
        ws = _item_scratch(a, plan)
        while True:
            it = atomic_next(counter)
            if it >= n_loop:
                break
            grp = it // nchunks
            if plan.heads:
                _decode_heads_item(it, a, plan, pm, pl, pacc)
            else:
                _decode_item(it, a, plan, pm, pl, pacc, ws)
            if nchunks > 1 and atomic_count(done, grp) < nchunks - 1:
                continue
            if plan.heads:
                for hk in range(Hkv):
                    _decode_merge(grp * Hkv + hk, a, plan, pm, pl, pacc, out, lse, kappa)
            else:
                _decode_merge(grp, a, plan, pm, pl, pacc, out, lse, kappa)


@njit(parallel=True, cache=True, nogil=True)
def _decode_views_kernel(a, out, lse, plan):
    """_decode_kernel for the views walk: items of plan.hpg kv heads (_decode_views_item), the
    last chunk of a group merging each of its heads. A kernel of its own so that numba's first
    decode call does not compile the walk: inside _decode_kernel it took that call (a cold
    cache) from ~51 to ~69 s, past the quick bench preset's 60 s per process."""
    B, Hq, L, E = a.q.shape
    Hkv = a.Hkv
    R = (Hq // Hkv) * L
    nchunks, hpg = plan.nchunks, plan.hpg
    n_items = B * Hkv * nchunks
    pm = np.empty((n_items, R), a.q.dtype)
    pl = np.empty((n_items, R), a.q.dtype)
    pacc = np.empty((n_items, R, max(a.Ev, 1)), a.q.dtype)
    nhg = (Hkv + hpg - 1) // hpg
    n_loop = B * nhg * nchunks
    counter = counters(1)
    done = counters(B * nhg)
    kappa = score_units(a)[2]
    for w in prange(min(plan.nthreads, n_loop)):
        while True:
            it = atomic_next(counter)
            if it >= n_loop:
                break
            _decode_views_item(it, a, plan, pm, pl, pacc)
            grp = it // nchunks
            if nchunks > 1 and atomic_count(done, grp) < nchunks - 1:
                continue
            b = grp // nhg
            for hk in range((grp - b * nhg) * hpg, min(Hkv, (grp - b * nhg + 1) * hpg)):
                _decode_merge(b * Hkv + hk, a, plan, pm, pl, pacc, out, lse, kappa)


def decode_chunks(B, Hkv, S, n_threads, Bk):
    """Key chunks per (batch, kv head): split only when B*Hkv alone cannot
    keep every thread busy (2 items per thread so uneven chunks balance)."""
    bh = max(B * Hkv, 1)
    if bh >= n_threads and bh % n_threads == 0:
        return 1
    want = -(-2 * n_threads // bh) if bh < 2 * n_threads else 1
    return max(1, min(want, -(-S // Bk)))


def decode(args, out, lse):
    """docs/KERNELS.md decode of the record `args` (KernelArgs); args.tuning.decode_block_k
    overrides the key block (0 = choose)."""
    q, k = args.q, args.k
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    # the keys of a sequence: S, or max_pages * page_size of a paged cache
    S = args.block_table.shape[1] * args.page_size if args.has_block_table else k.shape[2]
    # Bk = 1024: fewer per-block passes (Q transpose, softmax set-up, tile
    # transposition) over a stream that is memory-bound anyway. B1 Hq32 Hkv8
    # L1 S16384 d128, 2 threads, interleaved in one process, median ms:
    # Bk 512 / 768 / 1024 = 10.2 / 9.0 / 9.2, and 10.8 / - / 9.8, 13.5 / - / 13.0
    Bk = positive("decode_block_k", args.tuning.decode_block_k, 1024)
    if B * Hq * L == 0:
        return
    # the kv heads' rows side by side (a flash-layout cache read in place): items take every
    # kv head (_decode_heads_item), in blocks whose K and V for all heads fit the L2 share.
    # Only for a KV cache's call (seqlens given): the blocks and chunks differ from the
    # head-by-head walk's, and so do the sums' roundings (as csrc/decode.pxi
    # dec_heads_together)
    side_by_side = (Hkv >= 2 and args.k_strides[1] < args.k_strides[2]
                    and args.v_strides[1] < args.v_strides[2])
    heads = bool(HEADS_TOGETHER and args.has_seqlens and side_by_side)
    # ... and scaled_dot_product_attention's (B, S, H, E) views: float32 rows scored in
    # _dec_rows' kernels, groups of kv heads an item (_decode_views_item), the bits of the
    # head-by-head walk
    views = bool(VIEWS_TOGETHER and side_by_side and not heads and not args.has_block_table
                 and not args.kv_kind and q.dtype == np.float32
                 and Hq // Hkv * L <= ROWS_MAX
                 and B * Hkv * S * (E + args.v.shape[3]) * q.itemsize > VIEWS_MIN_BYTES)
    if heads and not args.tuning.decode_block_k:
        if args.kv_kind:          # a low-precision cache
            Bk = HEADS_LOWP_BLOCK_KEYS
        else:
            Bk = HEADS_BLOCK_KEYS * max(1, HEADS_BLOCK_BYTES // (
                Hkv * (E + args.v.shape[3]) * q.itemsize * HEADS_BLOCK_KEYS))
    prime_blas()
    with blas_single_thread, numba_threads(args.n_threads) as nt:
        if heads:
            # Hkv times fewer, larger items, as long as a ragged batch's sequences: split the
            # keys finer, into chunks of at least HEADS_MIN_CHUNK keys
            nc = 1
            if B < HEADS_ITEMS_PER_THREAD * nt:
                nc = min(-(-HEADS_ITEMS_PER_THREAD * nt // B), max(1, S // HEADS_MIN_CHUNK))
        else:
            nc = decode_chunks(B, Hkv, S, nt, Bk)
        # chunk length: a multiple of Bk so only the last block of a chunk is short
        csize = max(-(-(-(-S // nc)) // Bk) * Bk, 1)
        nc = max(1, -(-S // csize))
        if views:
            _decode_views_kernel(numba_args(args), out, lse,
                                 DecPlan(Bk, csize, nc, nt, heads, views_heads(B, Hkv, nc, nt)))
        else:
            _decode_kernel(numba_args(args), out, lse, DecPlan(Bk, csize, nc, nt, heads, 0))


# Heads-together decode: the K and V of a block of keys for every kv head within this much
# (half the 1 MiB L2 of a core here), items per thread and the shortest key chunk (ragged
# lengths make items uneven; as csrc/decode.pxi does)
HEADS_TOGETHER = True             # False: item by kv head on every layout (A/B measurements)
HEADS_BLOCK_BYTES = 512 << 10
# Blocks of whole key strips of the float32 score kernels (_gemm.dec_qk: 12, 8 or MR keys): a
# block's last n % 12 keys go through scalar loops. The bench's decode (B8 Hq32 Hkv8 d128,
# lengths 512..16384, flash layout, 2 threads, interleaved, load ~6): 48 keys 1.51x cython's
# time, 64 keys (60 + a 4-key tail) 2.07x.
HEADS_BLOCK_KEYS = 48
# ... and over a float16/bfloat16/int8 cache, longer blocks: each block of each kv head pays a
# fixed cost (mask status, the softmax pass's set-up, the conversion's start) that 48-key
# blocks did not amortize, and the conversion goes LOWP_SUB_KEYS keys at a time whatever the
# block. B4 32/8 d128 16384 keys, Zen 4, 2 threads, medians of 7 interleaved rounds in one
# process, keys per block 48 / 240 / 480 / 960: int8 19.1 / 16.3 / 16.2 / 15.7 ms, float16
# 26.7 / 21.5 / 20.3 / 18.8 (float32, left at 48: 25.5 / 26.1 / 25.4 / 27.7).
HEADS_LOWP_BLOCK_KEYS = 960
HEADS_ITEMS_PER_THREAD = 32
HEADS_MIN_CHUNK = 1024
# The views walk (_decode_views_item): on (False: head by head, A/B measurements); keys a
# group's heads score (and multiply by V) in turn, each such sub-block prefetching the next
# one's rows in address order; items per thread at least (views_heads). split_heads views,
# 12 heads d64, 2 threads, medians of 7 interleaved rounds (views walk / head by head /
# contiguous copies, ms; /work/scratch/s22/nbv.py): 4096 keys 1.15-1.26 / 1.28-2.01 /
# 0.68-0.93, 16384 keys 4.5-6.2 / 6.4-10.0 / 3.3-4.5. Without the prefetch the walk took
# 1.50-2.16x (4096) and 1.55-1.60x (16384) the contiguous time against 1.31-1.74x and
# 1.36-1.47x with it; a noisy one-thread sweep of 8-240 keys a sub-block favored 16.
# From DRAM numba's walk stays ~1.4-1.6x the contiguous time where cython's is ~1.1-1.4x.
# Below VIEWS_MIN_BYTES of K/V (the L3 we get holds 8-16 MiB, see csrc/decode.pxi
# DEC1_PREFETCH_BYTES) the rows come from cache either way and the walk's calls cost more than
# the order gains: each sub-block's kernel calls pass the head's tiles, ~20% of the samples in
# reference counting; 12 heads d64 at 1024 keys (6 MiB, one thread) took 316-328 us against
# 205-226 head by head.
VIEWS_TOGETHER = True
VIEWS_MIN_BYTES = 8 << 20
VIEWS_SUB_KEYS = 16
VIEWS_PREFETCH = True
VIEWS_ITEMS_PER_THREAD = 2


def views_heads(B, Hkv, nchunks, nt):
    """kv heads an item of the views walk: all, or as few groups as give each thread
    VIEWS_ITEMS_PER_THREAD items (csrc/decode.pxi dec_views_heads: more heads an item read
    more of each key row in order, which pays from DRAM)."""
    if nt == 1:
        return Hkv
    units = B * nchunks
    groups = min(Hkv, -(-VIEWS_ITEMS_PER_THREAD * nt // units))
    return -(-Hkv // groups)
