"""FlashAttention-2 backward kernel (Numba), docs/KERNELS.md.

backward() runs float32 problems whose query blocks' tiles fit tuning.bwd_keep_bytes on
_bwd_kept.py (query blocks outer, S and dP kept between the sweeps: five tile products); the rest
(float64, the partial-keys mode, long bands) on this module's kernel, described here, which
recomputes S and dP instead (seven products) and whose memory does not grow with the band.

Work items are (batch, kv head, key chunk). An item owns its keys: for each
key block it walks every query head of the KV group and every query block
the causal/window band lets in, recomputes the scores, P, dP = dO . V^T, and
accumulates dV += Pd^T dO, dK += dS^T Q
(both in the item's registers/cache, so dk/dv are complete when the key block
ends: GQA's sum over the group needs no second pass) and dQ += dS . K into
a dq accumulator of the item's own. Nothing is shared between items except
the read-only inputs, so the result does not depend on thread timing: no
atomics, and every sum runs in a fixed order.

Before that, sweep 1 (a pass over (batch, kv head, chunk of query blocks) units)
takes each row's own max m, Z = sum_j P and D = sum_j P dP from the same tiles
(QK^T and dO V^T, scores by the same code, P = 2**(round(S*c) - m)), and the main
pass uses P/Z and dS = (P/Z)(dP - D/Z), as the Cython kernel does (docs/KERNELS.md
sec. 7): with P from the given float32 lse and D from rowsum(dO*O) of the given out,
float32 gradients broke the tolerance rule on ~1-5% of random small problems (the
lse's rounding scales whole rows of P, out's error reaches dS through D); the lse's
rounding at large scores (|lse| >~ 2**22 in log2 units) over/underflowed whole rows;
and with m the row's exact max, a row attending one key gets dS = 0 exactly. Sweep 1
costs two of the main pass's five tile products.

The partial-keys mode (record field has_delta, for a part of the keys whose lse and
D = rowsum(dO*O) belong to the whole problem) skips sweep 1: P = exp(s - lse) as
given, D = delta, no renormalization (_delta_rows).

Keys are split into chunks only when batch*kv_heads cannot keep the threads
busy (as decode does); then each chunk leaves a dq partial and a last pass
adds the partials in chunk order. Memory: per worker the packed Q/dO of one
KV group and one dq accumulator (O(L*d)), plus small tiles.

float32 uses the register-blocked kernels of _gemm.py, float64 BLAS.
"""
import threading
from collections import namedtuple

import numpy as np
from numba import njit, prange

from ._blas import blas_single_thread, numba_threads, prime_blas
from ._bwd_kept import kept_bytes, kept_kernel, kept_workspace
from ._bwd_ops import b_nn, b_pack_a, b_pack_b, b_pack_rows, b_qk, b_tn, dq_nonfinite
from ._gemm import MR, PW
from ._hash import dropout_bh
from ._intrinsics import FM, atomic_next, counters, fcast, wide_vectors
from ._record import numba_args, positive
from ._scores import (
    alibi_slope, band_partial, block_status, mask_base, needs_rows, outside_band, score_units,
    sink_logit, tile_scores)
from ._tiles import block_all_finite, norm_rows, tile_grad, tile_norm


@njit(cache=True, fastmath=FM, nogil=True)
def _delta_rows(r0, r1, a, lse, kappa, rows):
    """The partial-keys mode (a.has_delta: k/v hold part of the keys, lse and delta belong to the
    whole problem): rows r0..r1-1 of rows = (m2, Dd, Iz, P_sink * D) from the given lse and D
    instead of sweep 1, so P = exp(s - lse) is not renormalized by this part's Z: m2 = lse in
    tile_grad's log2 units (lse / kappa, kappa as the forward's finalize used it; +inf for
    rows with lse = -inf, so their P = 2**(-inf) = 0), Dd = delta, Iz = 1, and with sinks
    P_sink * D = exp(sink - lse) * delta (dsinks = -sum P_sink * D, as in the whole problem)."""
    lse2, Dd, Iz = rows[0], rows[1], rows[2]
    lf = lse.reshape(-1)
    df = a.delta.reshape(-1)
    B, Hq, L = lse.shape
    one = fcast(lse2, 1.0)
    for r in range(r0, r1):
        x = lf[r]
        lse2[r] = np.inf if x == -np.inf else np.float64(x) / kappa
        Dd[r] = df[r]
        Iz[r] = one
        if a.has_sinks:
            h = (r // L) % Hq
            sk = sink_logit(a, h)
            ps = 0.0 if x == -np.inf else np.exp(sk - np.float64(x))
            rows[3][r] = ps * np.float64(df[r])


@njit(cache=True, fastmath=FM, nogil=True)
def _norm_unit(u, a, dout, rows, plan, ws, zs, ds, ms):
    """Sweep 1: each row's offset m (its own max score), Z = sum_j P and D = sum_j P dP
    (P = 2**(round(S*c) - m), dP with dropout's keep/(1-p)), in float64, over every key the
    row sees, from the tiles the main pass recomputes with the same score code (tile_norm).
    Writes rows = (m2 = m, Dd = D/Z, Iz = 1/Z, P_sink * D) (with a sink, Z includes its
    weight), so the main pass uses P/Z and dS = (P/Z)(dP - D/Z). Neither the given lse nor
    `out` is read: the lse's rounding scales a whole row of P (and at large scores over- or
    underflows it), and D from rowsum(dO*O) cancels against dP where a row's attention sits on
    one key. Unit u = (batch, kv head, chunk c of the query blocks, plan.nqc chunks): the
    query blocks of chunk c of every head of the group, key blocks outer, so each K/V block is
    packed once per unit (as in _backward_item). zs, ds, ms: the worker's float64 row
    accumulators (Z, D, running max)."""
    wide_vectors()
    q, k, v = a.q, a.k, a.v
    Qa, Da, Kb, Vb, Ws, Wz, Wg = ws
    Bq, Bk, nqc = plan.Bq, plan.Bk, plan.nqc
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    S = k.shape[2]
    Ev = v.shape[3]
    g = Hq // Hkv
    Eld = max(E, 1)
    Evld = max(Ev, 1)
    nqb = (L + Bq - 1) // Bq
    Bqp = ((Bq + MR - 1) // MR) * MR
    Lp = nqb * Bqp
    TB = Ws.shape[1]
    bk = u // nqc
    c = u - bk * nqc
    b = bk // Hkv
    hk = bk - b * Hkv
    cs = (nqb + nqc - 1) // nqc
    qb_lo = c * cs
    qb_hi = min(nqb, qb_lo + cs)
    qf = q.reshape(-1)
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    dof = dout.reshape(-1)
    to_nat, c_exp, kappa = score_units(a)
    zero = fcast(q, 0.0)
    ab = np.empty(2, q.dtype)
    ab[0] = fcast(q, 1.0)
    ab[1] = zero
    kbase = (b * Hkv + hk) * S * E
    vbase = (b * Hkv + hk) * S * Ev
    if qb_lo >= qb_hi:
        return
    # keys any row of the unit can see
    s_lo = max(0, qb_lo * Bq + a.q_offset - a.win_left)
    s_hi = min(S, min(L, qb_hi * Bq) - 1 + a.q_offset + a.win_right + 1)
    for hh in range(g):
        h = hk * g + hh
        for qb in range(qb_lo, qb_hi):
            i0 = qb * Bq
            nq = min(Bq, L - i0)
            rowoff = (b * Hq + h) * L + i0
            b_pack_a(qf, rowoff * E, nq, E, Qa, (hh * Lp + qb * Bqp) * Eld)
            b_pack_a(dof, rowoff * Ev, nq, Ev, Da, (hh * Lp + qb * Bqp) * Evld)
            # the running max starts at the sink (as the forward's does), so Z's terms are <= 1
            m0 = np.float64(fcast(q, sink_logit(a, h) / kappa))
            for r in range(nq):
                zs[hh * Lp + qb * Bqp + r] = 0.0
                ds[hh * Lp + qb * Bqp + r] = 0.0
                ms[hh * Lp + qb * Bqp + r] = m0
    j_first = (s_lo // Bk) * Bk
    for j0 in range(j_first, max(s_hi, j_first), Bk):
        n = min(Bk, S - j0)
        b_pack_b(kf, kbase + j0 * E, n, E, Kb)
        b_pack_b(vf, vbase + j0 * Ev, n, Ev, Vb)
        for hh in range(g):
            h = hk * g + hh
            bh = b * Hq + h
            dbh = dropout_bh(a, b, h)
            slope = alibi_slope(a, b, h)
            for qb in range(qb_lo, qb_hi):
                i0 = qb * Bq
                nq = min(Bq, L - i0)
                ntq = (nq + MR - 1) // MR
                pos_first = i0 + a.q_offset
                pos_last = i0 + nq - 1 + a.q_offset
                if outside_band(a, j0, n, pos_first, pos_last):
                    continue
                mbase = mask_base(a, b, h, i0, j0)
                mstat = block_status(a, mbase, nq, n)
                if mstat == 0:
                    continue
                rowoff = bh * L + i0
                aoff = hh * Lp + qb * Bqp
                b_qk(Ws, TB, Qa, aoff * Eld, qf, rowoff * E, E, ntq, nq, Kb, kf, kbase + j0 * E,
                     n, ab)
                if needs_rows(a, band_partial(a, j0, n, pos_first, pos_last), mstat):
                    tile_scores(Ws, 0, nq, n, j0, pos_first, a, slope, mbase, mstat, Wg, False)
                b_qk(Wz, TB, Da, aoff * Evld, dof, rowoff * Ev, Ev, ntq, nq, Vb, vf,
                     vbase + j0 * Ev, n, ab)
                tile_norm(Ws, Wz, nq, n, a, c_exp, dbh, a.dropout_row0 + i0, a.dropout_col0 + j0,
                          ms, zs, ds, aoff)
    for hh in range(g):
        h = hk * g + hh
        for qb in range(qb_lo, qb_hi):
            i0 = qb * Bq
            nq = min(Bq, L - i0)
            norm_rows(a, h, rows, (b * Hq + h) * L + i0, nq, ms, zs, ds, hh * Lp + qb * Bqp,
                      kappa)


@njit(cache=True, fastmath=FM, nogil=True)
def _backward_item(it, a, dout, rows, grads, plan, dqp, ws):
    """Item `it` = (batch, kv head, key chunk): dk, dv of the chunk's keys (final when the key
    block ends) and the dq contributions of the chunk (the worker's accumulator, or the item's
    partial in dqp when keys are chunked). rows = (lse2, Dd, Iz) from _norm_unit,
    grads = (dq, dk flat, dv flat), ws = the worker's scratch slices (workspace())."""
    wide_vectors()
    q, k, v = a.q, a.k, a.v
    dq, dk, dv = grads
    Qa, Da, Qr, Dr, Kb, Vb, Ws, Wz, Wg, Wdk, Wdv, Wdq, Vs = ws
    Bq, Bk, nchunks, csize = plan.Bq, plan.Bk, plan.nchunks, plan.csize
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    S = k.shape[2]
    Ev = v.shape[3]
    g = Hq // Hkv
    Eld = max(E, 1)
    Evld = max(Ev, 1)
    Ep = ((E + MR - 1) // MR) * MR            # padded row lengths of Qr, Dr
    Evp = ((Ev + MR - 1) // MR) * MR
    TB = Ws.shape[1]
    nqb = (L + Bq - 1) // Bq
    Bqp = ((Bq + MR - 1) // MR) * MR          # row stride of a query block in Qa/Da/dq acc
    Lp = nqb * Bqp
    qf = q.reshape(-1)
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    dof = dout.reshape(-1)
    to_nat, c_exp, kappa = score_units(a)
    zero = fcast(q, 0.0)
    sc = fcast(q, a.scale)
    ab = np.empty(2, q.dtype)                 # BLAS alpha/beta: ab[0] = 1, ab[1] = 0
    ab[0] = fcast(q, 1.0)
    ab[1] = zero

    bk = it // nchunks
    c = it - bk * nchunks
    b = bk // Hkv
    hk = bk - b * Hkv
    s_lo = c * csize
    s_hi = min(S, s_lo + csize)
    kbase = (b * Hkv + hk) * S * E
    vbase = (b * Hkv + hk) * S * Ev
    # dq accumulator: the worker's own (one chunk) or this item's partial
    dqa = Wdq if nchunks == 1 else dqp[it]
    # query rows any key of the chunk can see: pos_i - win_left <= j <= pos_i + win_right
    i_lo = max(0, s_lo - a.win_right - a.q_offset)
    i_hi = min(L, s_hi - 1 + a.win_left - a.q_offset + 1)
    qb_lo = i_lo // Bq
    qb_hi = (i_hi + Bq - 1) // Bq if i_hi > i_lo else qb_lo
    for x in range(g * Lp * Eld):
        dqa[x] = zero                         # rows no key of the chunk sees stay 0
    for hh in range(g):
        h = hk * g + hh
        for qb in range(qb_lo, qb_hi):
            i0 = qb * Bq
            nq = min(Bq, L - i0)
            rowoff = (b * Hq + h) * L + i0
            b_pack_a(qf, rowoff * E, nq, E, Qa, (hh * Lp + qb * Bqp) * Eld)
            b_pack_a(dof, rowoff * Ev, nq, Ev, Da, (hh * Lp + qb * Bqp) * Evld)
            b_pack_rows(qf, rowoff * E, nq, E, Ep, Qr, (hh * Lp + qb * Bqp) * Ep)
            b_pack_rows(dof, rowoff * Ev, nq, Ev, Evp, Dr, (hh * Lp + qb * Bqp) * Evp)

    for j0 in range(s_lo, s_hi, Bk):
        n = min(Bk, s_hi - j0)
        # dK^T (Ep x TB) and dV^T (Evp x TB) of this key block
        for x in range(Ep * TB):
            Wdk[x] = zero
        for x in range(Evp * TB):
            Wdv[x] = zero
        b_pack_b(kf, kbase + j0 * E, n, E, Kb)
        b_pack_b(vf, vbase + j0 * Ev, n, Ev, Vb)
        kfin = block_all_finite(kf, kbase + j0 * E, n * E)
        for hh in range(g):
            h = hk * g + hh
            bh = b * Hq + h
            dbh = dropout_bh(a, b, h)
            slope = alibi_slope(a, b, h)
            for qb in range(qb_lo, qb_hi):
                i0 = qb * Bq
                nq = min(Bq, L - i0)
                ntq = (nq + MR - 1) // MR
                pos_first = i0 + a.q_offset
                pos_last = i0 + nq - 1 + a.q_offset
                if outside_band(a, j0, n, pos_first, pos_last):
                    continue                  # tile outside the band
                mbase = mask_base(a, b, h, i0, j0)
                mstat = block_status(a, mbase, nq, n)
                if mstat == 0:
                    continue                  # every (query, key) of the tile masked
                rowoff = bh * L + i0
                aoff = (hh * Lp + qb * Bqp)
                b_qk(Ws, TB, Qa, aoff * Eld, qf, rowoff * E, E, ntq, nq, Kb, kf, kbase + j0 * E, n, ab)
                if needs_rows(a, band_partial(a, j0, n, pos_first, pos_last), mstat):
                    tile_scores(Ws, 0, nq, n, j0, pos_first, a, slope, mbase, mstat, Wg, True)
                b_qk(Wz, TB, Da, aoff * Evld, dof, rowoff * Ev, Ev, ntq, nq, Vb, vf,
                     vbase + j0 * Ev, n, ab)
                tile_grad(Ws, Wz, Wg, nq, n, a, c_exp, rows, rowoff, dbh, a.dropout_row0 + i0,
                          a.dropout_col0 + j0)
                b_tn(Wdv, TB, Evp // MR, Ev, Dr, aoff * Evp, Evp, dof, rowoff * Ev, Ev, Wz, TB,
                     nq, n, ab)
                b_tn(Wdk, TB, Ep // MR, E, Qr, aoff * Ep, Ep, qf, rowoff * E, E, Ws, TB, nq, n, ab)
                if kfin:
                    b_nn(dqa, aoff * Eld, Eld, ntq, nq, Ws, TB, kf, kbase + j0 * E, E, n, E, ab)
                else:
                    dq_nonfinite(dqa, aoff * Eld, Eld, nq, Ws, n, kf, kbase + j0 * E, E, Vs, ab)
        # this item owns keys j0..j0+n-1: dk, dv are final (zero if no query saw them)
        for r in range(n):
            for t in range(E):
                dk[kbase + (j0 + r) * E + t] = Wdk[t * TB + r] * sc
            for t in range(Ev):
                dv[vbase + (j0 + r) * Ev + t] = Wdv[t * TB + r]

    if nchunks == 1:
        _write_dq(dqa, dq, b, hk, g, L, E, Bq, Lp, sc)


@njit(fastmath=FM)
def _write_dq(dqa, dq, b, hk, g, L, E, Bq, Lp, sc):
    """dq rows of the group's heads = scale * accumulator (block-padded rows)."""
    Hq = dq.shape[1]
    Bqp = ((Bq + MR - 1) // MR) * MR
    Eld = max(E, 1)
    dqf = dq.reshape(-1)
    for hh in range(g):
        base = ((b * Hq + hk * g + hh) * L) * E
        for i in range(L):
            qb = i // Bq
            src = (hh * Lp + qb * Bqp + (i - qb * Bq)) * Eld
            for t in range(E):
                dqf[base + i * E + t] = dqa[src + t] * sc


@njit(fastmath=FM)
def _merge_dq(bk, nchunks, dqp, dq, Hkv, g, L, E, Bq, Lp, sc, tmp):
    """Chunked keys: dq = scale * sum of the chunks' partials, in chunk order."""
    b = bk // Hkv
    hk = bk - b * Hkv
    n = tmp.shape[0]
    for x in range(n):
        tmp[x] = dqp[bk * nchunks, x]
    for c in range(1, nchunks):
        for x in range(n):
            tmp[x] += dqp[bk * nchunks + c, x]
    _write_dq(tmp, dq, b, hk, g, L, E, Bq, Lp, sc)


# Largest kept tiles a worker holds (bytes) before the backward recomputes them instead: as
# the Cython kernel's BWD_KEEP_BYTES (csrc/problem.pxi); tuning.bwd_keep_bytes overrides it.
KEEP_BYTES = 16 << 20

# Blocks of a backward call: query/key block sizes, key chunk length and count, threads,
# query-block chunks of the _norm_unit pass.
BwdPlan = namedtuple("BwdPlan", "Bq Bk csize nchunks nthreads nqc")


@njit(parallel=True, cache=True, nogil=True)
def _backward_kernel(a, dout, lse, grads, plan, rows, dqp, zsum, ws):
    """Parallel body of backward(): rows = (m2, Dd, Iz, P_sink * D) per query row, filled here;
    ws = the stacked per-worker scratch arrays (workspace())."""
    q, k = a.q, a.k
    dq, dk, dv = grads
    Bq = plan.Bq
    nthreads = plan.nthreads
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    kappa = score_units(a)[2]
    wQ, wD, wQr, wDr, wK, wV, wS, wZ, wG, wdk, wdv, wdq, wVs = ws
    nqb = (L + Bq - 1) // Bq
    if a.has_delta:
        # the partial-keys mode: the rows come from the given lse and D, no sweep 1
        R = B * Hq * L
        nr = min(R, 4 * nthreads)
        per = (R + nr - 1) // nr
        for x in prange(nr):
            _delta_rows(x * per, min(R, x * per + per), a, lse, kappa, rows)
    # Z = sum_j P and D = sum_j P dP from the tiles (_norm_unit); units (batch,
    # kv head, chunk of query blocks), chunks only when B*Hkv alone cannot keep
    # every thread busy
    n_units = 0 if a.has_delta else B * Hkv * plan.nqc
    ucount = counters(1)
    if n_units > 0:                       # (a prange of no iterations still wakes the pool)
        for w in prange(min(nthreads, n_units)):
            while True:
                u = atomic_next(ucount)
                if u >= n_units:
                    break
                _norm_unit(u, a, dout, rows, plan,
                           (wQ[w], wD[w], wK[w], wV[w], wS[w], wZ[w], wG[w]),
                           zsum[w, 0], zsum[w, 1], zsum[w, 2])
    n_items = B * Hkv * plan.nchunks
    dkf = dk.reshape(-1)
    dvf = dv.reshape(-1)
    # one prange iteration per worker; workers claim items from an atomic
    # counter (the item -> result mapping is fixed, so timing cannot change bits)
    counter = counters(1)
    for w in prange(min(nthreads, n_items)):
        while True:
            it = atomic_next(counter)
            if it >= n_items:
                break
            _backward_item(it, a, dout, rows, (dq, dkf, dvf), plan, dqp,
                           (wQ[w], wD[w], wQr[w], wDr[w], wK[w], wV[w], wS[w], wZ[w], wG[w],
                            wdk[w], wdv[w], wdq[w], wVs[w]))
    if plan.nchunks > 1:
        Lp = nqb * (((Bq + MR - 1) // MR) * MR)
        for x in prange(B * Hkv):
            tmp = np.empty(dqp.shape[1], q.dtype)
            _merge_dq(x, plan.nchunks, dqp, dq, Hkv, g, L, E, Bq, Lp, fcast(q, a.scale), tmp)


def backward_chunks(B, Hkv, S, n_threads, Bk):
    """Key chunks per (batch, kv head): split only when batch*kv_heads alone
    cannot keep every thread busy (as decode_chunks)."""
    bh = max(B * Hkv, 1)
    if bh >= n_threads and bh % n_threads == 0:
        return 1
    want = -(-2 * n_threads // bh) if bh < 2 * n_threads else 1
    return max(1, min(want, -(-S // Bk)))


_ws = threading.local()


def workspace(dtype, T, g, L, E, Ev, Bq, Bk, softcap, n_items, nchunks):
    """Per-worker scratch (cached per Python thread, latest shape only, like
    the forward's): packed Q and dO of a KV group, K/V panels of a key block,
    the score/dS and Z/Pd tiles, the dk/dv/dq accumulators."""
    Eld, Evld = max(E, 1), max(Ev, 1)
    Ep, Evp = -(-E // MR) * MR, -(-Ev // MR) * MR
    f32 = np.dtype(dtype) == np.float32
    Bqp = -(-Bq // MR) * MR
    Bkp = -(-Bk // MR) * MR
    TB = max(-(-Bk // PW) * PW, Bkp)
    Lp = -(-L // Bq) * Bqp
    dqn = g * Lp * Eld
    key = ("recompute", np.dtype(dtype).str, T, g, L, E, Ev, Bq, Bk, softcap > 0, n_items,
           nchunks)

    def make():
        npan = -(-Bk // PW)
        arrs = (np.empty((T, g * Lp * Eld), dtype),                 # packed Q blocks
                np.empty((T, g * Lp * Evld), dtype),                # packed dO blocks
                np.empty((T, g * Lp * Ep if f32 else 1), dtype),    # Q rows, padded
                np.empty((T, g * Lp * Evp if f32 else 1), dtype),   # dO rows, padded
                np.empty((T, max(npan * PW, Bkp) * Eld), dtype),    # K panels of a key block
                np.empty((T, max(npan * PW, Bkp) * Evld), dtype),   # V panels
                np.empty((T, Bqp, TB), dtype),                      # S -> dS
                np.empty((T, Bqp, TB), dtype),                      # Z -> Pd
                np.empty((T, Bqp, TB) if softcap > 0 else (T, 1, 1), dtype),  # 1 - tanh^2
                np.empty((T, max(Ep, 1) * TB), dtype),              # dK^T accumulator
                np.empty((T, max(Evp, 1) * TB), dtype),             # dV^T accumulator
                np.empty((T, dqn if nchunks == 1 else 1), dtype),   # dq accumulator
                np.empty((T, Bk, Eld), dtype))                      # non-finite K slow path
        dqp = np.empty((n_items if nchunks > 1 else 1, dqn if nchunks > 1 else 1), dtype)
        return (dqp,) + arrs
    return cached_scratch(key, make)


def cached_scratch(key, make):
    """make()'s arrays, cached per Python thread for the latest key. Fresh arrays cost page
    faults on first touch in every call (the kept-tiles backward, B1 H4 L=S=2048 d64: 133
    against 153 GF/s cached). Only small sets are kept: a 16k-token head's is tens of MB."""
    cached = getattr(_ws, 'arrays', None)
    if cached is not None and cached[0] == key:
        return cached[1]
    res = make()
    size = sum(x.nbytes for x in res if isinstance(x, np.ndarray))
    size += sum(y.nbytes for x in res if isinstance(x, tuple) for y in x)
    _ws.arrays = (key, res) if size <= (64 << 20) else None
    return res


def backward(args, dout, out, lse, dq, dk, dv, dsinks):
    """docs/KERNELS.md backward of the record `args` (KernelArgs); args.tuning.bwd_block_q,
    bwd_block_k and bwd_chunks override the defaults (0 = choose). `out` is not read, nor `lse`
    unless args.has_delta (the row offsets, Z and D come from the recomputed tiles, see the
    module docstring)."""
    q, k, v = args.q, args.k, args.v
    if args.has_seqlens or args.has_block_table or not (k.flags.c_contiguous
                                                        and v.flags.c_contiguous):
        # the backend lists these in unsupported_backward_options; this is the safety net
        raise ValueError("attention kernel: numba's backward does not read a KV cache in place "
                         "(strided k/v, seqlens or a block table)")
    B, Hq, L, E = q.shape
    S = k.shape[2]
    t = args.tuning
    Bq = positive("bwd_block_q", t.bwd_block_q, 128)
    Bk = positive("bwd_block_k", t.bwd_block_k, 128)
    nchunks = positive("bwd_chunks", t.bwd_chunks, 0)
    if B * Hq * L == 0 or S == 0:
        dq[...] = 0
        dk[...] = 0
        dv[...] = 0
        return
    prime_blas()
    keep = t.bwd_keep_bytes
    if keep < -1:
        raise ValueError(f"tuning.bwd_keep_bytes must be >= 0 (or -1 for the default "
                         f"{KEEP_BYTES}), got {keep}")
    # m2, Dd, Iz per query row, and each row's P_sink * D (float64) for dsinks
    rows = (np.empty(B * Hq * L, q.dtype), np.empty(B * Hq * L, q.dtype),
            np.empty(B * Hq * L, q.dtype),
            np.empty(B * Hq * L if args.has_sinks else 1, np.float64))
    with blas_single_thread, numba_threads(args.n_threads) as T:
        if (q.dtype == np.float32 and not args.has_delta and kept_bytes(
                Bq, Bk, S, args.softcap) <= (KEEP_BYTES if keep == -1 else keep)):
            _kept(args, dout, dq, dk, dv, rows, T, Bq, Bk)
        else:
            _recompute(args, dout, lse, dq, dk, dv, rows, T, Bq, Bk, nchunks)
    if args.has_sinks:
        # dsinks[h] = -sum_{b,i} P_sink * D, summed here in a fixed order (deterministic)
        dsinks[:] = -rows[3].reshape(B, Hq, L).sum(axis=(0, 2))


def _query_chunks(B, Hkv, L, Bq, T):
    """Query-block chunks per (batch, kv head) of the passes whose units are (batch, kv head,
    query blocks): only when B*Hkv alone cannot keep every thread busy (T here is the thread
    count the kernel's prange loops run with)."""
    bhk = B * Hkv
    return 1 if bhk >= 2 * T else min(-(-L // Bq), -(-2 * T // bhk))


def _kept(args, dout, dq, dk, dv, rows, T, Bq, Bk):
    """float32, the band's tiles kept between the sweeps (_bwd_kept.py)."""
    q, k, v = args.q, args.k, args.v
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    nqc = _query_chunks(B, Hkv, L, Bq, T)
    n_units = B * Hkv * nqc
    T = max(1, min(T, n_units))
    ws, parts = cached_scratch(
        ("kept", T, L, S, E, Ev, Bq, Bk, args.softcap > 0, n_units, nqc),
        lambda: kept_workspace(T, L, S, E, Ev, Bq, Bk, args.softcap, n_units, nqc))
    plan = BwdPlan(Bq, Bk, 0, 1, T, nqc)
    kept_kernel(numba_args(args), dout, (dq, dk, dv), plan, rows, ws, parts)


def _recompute(args, dout, lse, dq, dk, dv, rows, T, Bq, Bk, nchunks):
    """Key blocks outer, S and dP recomputed in the main pass (the module docstring)."""
    q, k, v = args.q, args.k, args.v
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    g = Hq // Hkv
    nc = nchunks if nchunks else backward_chunks(B, Hkv, S, T, Bk)
    # chunk length: a multiple of Bk, so only a chunk's last block is short
    csize = -(-(-(-S // max(nc, 1))) // Bk) * Bk
    nc = -(-S // csize)
    n_items = B * Hkv * nc
    T = max(1, min(T, n_items))
    ws = workspace(q.dtype, T, g, L, E, Ev, Bq, Bk, args.softcap, n_items, nc)
    zsum = np.empty((T, 3, g * -(-L // Bq) * (-(-Bq // MR) * MR)))
    plan = BwdPlan(Bq, Bk, csize, nc, T, _query_chunks(B, Hkv, L, Bq, T))
    _backward_kernel(numba_args(args), dout, lse, (dq, dk, dv), plan, rows, ws[0], zsum, ws[1:])
