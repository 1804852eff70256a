"""The float32 backward with the band's tiles kept between the sweeps (docs/KERNELS.md).

backward.py's key-block-outer order cannot keep a row's tiles until its Z and D are known (they
need every key of the row), so it computes S = Q K^T and dP = dO V^T twice: seven tile
products where FlashAttention-2 counts five, and it ran at ~0.70x the Cython kernel's speed,
which keeps them (csrc/backward.pxi). This order is the Cython kernel's: a work unit is
(batch, kv head, query blocks c, c + nqc, c + 2 nqc, ...) over every head of the KV group; per
query block,

    sweep 1, each key block of the band: S, dP -> kept tiles; the row max m, Z and D (tile_norm)
    sweep 2, over the kept tiles: dS and Pd (tile_grad), dV^T += dO^T Pd and dK^T += Q^T dS
             into the unit's (E x S) accumulators, dQ_blk += dS K; then the block's dq rows.

The tiles are those of backward.py's sweeps (same blocks from key 0, same score code) and each
row's sums and products run in the same order, so with one unit per kv head (nqc = 1) the
gradients are bit for bit those of the key-block-outer kernel. Kept tiles cost
Bq x band x 8 bytes a worker (12 with softcap's derivative): backward() takes this path while
they fit tuning.bwd_keep_bytes (16 MiB by default, as Cython's), the other one past it. With
nqc > 1 (fewer kv heads than threads) each unit leaves dk/dv partials, summed in unit order.
"""
import numpy as np
from numba import njit, prange

from ._bwd_ops import b_pack_a, b_pack_b, b_pack_rows, dq_nonfinite
from ._gemm import MR, NO_LIMIT, PW, gemm_acc_nn, gemm_acc_tn_packed, gemm_qk
from ._hash import dropout_bh
from ._intrinsics import FM, atomic_next, counters, fcast, wide_vectors
from ._scores import (
    alibi_slope, band_partial, block_status, mask_base, needs_rows, outside_band, score_units,
    sink_logit, tile_scores)
from ._tiles import block_all_finite, norm_rows, tile_grad, tile_norm


@njit
def _dlim(a, j0, n, pos_first):
    """The band's right edge inside keys j0..j0+n-1: row r (at pos_first + r) sees the columns
    below r + dlim only (_gemm.tile_cols); NO_LIMIT when it does not cut the block."""
    d = pos_first + a.win_right - j0 + 1
    return d if d < n else NO_LIMIT


@njit(cache=True, fastmath=FM, nogil=True)
def _kept_unit(u, a, dout, rows, grads, plan, ws, parts):
    """Unit u: dq of its query blocks, and dk/dv of its kv head (into grads when it owns the
    head, plan.nqc == 1, else unscaled into parts[0/1][u]). ws = the worker's scratch."""
    wide_vectors()
    q, k, v = a.q, a.k, a.v
    dqf, dkf, dvf = grads
    Qa, Da, Qr, Dr, Kb, Vb, KS, KZ, KG, dkT, dvT, dqa, Vs, used, kfin, acc = ws
    Bq, Bk, nqc = plan.Bq, plan.Bk, plan.nqc
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    S = k.shape[2]
    Ev = v.shape[3]
    g = Hq // Hkv
    Eld = max(E, 1)
    Ep = ((E + MR - 1) // MR) * MR
    Evp = ((Ev + MR - 1) // MR) * MR
    Sp = dkT.shape[0] // max(Ep, 1)           # row length of the dK^T / dV^T accumulators
    TB = KS.shape[2]
    nqb = (L + Bq - 1) // Bq
    nkb = (S + Bk - 1) // Bk
    qf = q.reshape(-1)
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    dof = dout.reshape(-1)
    c_exp, kappa = score_units(a)[1:]
    zero = fcast(q, 0.0)
    sc = fcast(q, a.scale)
    ab = np.empty(2, q.dtype)                 # alpha/beta of the products' common signature
    ab[0] = fcast(q, 1.0)
    ab[1] = zero
    ms, zs, ds = acc[0], acc[1], acc[2]
    bk = u // nqc
    c = u - bk * nqc
    b = bk // Hkv
    hk = bk - b * Hkv
    kbase = (b * Hkv + hk) * S * E
    vbase = (b * Hkv + hk) * S * Ev
    for jb in range(nkb):                     # key blocks holding NaN/Inf take dq's exact path
        kfin[jb] = block_all_finite(kf, kbase + jb * Bk * E, min(Bk, S - jb * Bk) * E)
    for x in range(Ep * Sp):
        dkT[x] = zero
    for x in range(Evp * Sp):
        dvT[x] = zero
    for hh in range(g):
        h = hk * g + hh
        bh = b * Hq + h
        dbh = dropout_bh(a, b, h)
        slope = alibi_slope(a, b, h)
        # the running max starts at the sink (as the forward's does), so Z's terms are <= 1
        m0 = np.float64(fcast(q, sink_logit(a, h) / kappa))
        for qb in range(c, nqb, nqc):
            i0 = qb * Bq
            nq = min(Bq, L - i0)
            ntq = (nq + MR - 1) // MR
            rowoff = bh * L + i0
            pos_first = i0 + a.q_offset
            pos_last = pos_first + nq - 1
            s_lo = max(0, pos_first - a.win_left)
            s_hi = min(S, pos_last + a.win_right + 1)
            jb_lo = s_lo // Bk
            jb_hi = (s_hi + Bk - 1) // Bk if s_hi > s_lo else jb_lo
            b_pack_a(qf, rowoff * E, nq, E, Qa, 0)
            b_pack_a(dof, rowoff * Ev, nq, Ev, Da, 0)
            for r in range(nq):
                zs[r] = 0.0
                ds[r] = 0.0
                ms[r] = m0
            # sweep 1: S and dP of the band, kept; each row's max, Z and D
            for jb in range(jb_lo, jb_hi):
                j0 = jb * Bk
                n = min(Bk, S - j0)
                used[jb] = 0
                if outside_band(a, j0, n, pos_first, pos_last):
                    continue
                mbase = mask_base(a, b, h, i0, j0)
                mstat = block_status(a, mbase, nq, n)
                if mstat == 0:
                    continue
                used[jb] = 1
                Ws, Wz = KS[jb], KZ[jb]
                b_pack_b(kf, kbase + j0 * E, n, E, Kb)
                b_pack_b(vf, vbase + j0 * Ev, n, Ev, Vb)
                # S and dP of the micro-tiles' keys inside the band only (dlim, as the
                # forward's); the band pass of tile_scores masks the rest of each row, so
                # every product of sweep 2 may skip it too
                dlim = _dlim(a, j0, n, pos_first)
                npan = (n + PW - 1) // PW
                gemm_qk(Ws, TB, Qa, 0, E, ntq, Kb, 0, 0, npan, dlim)
                if needs_rows(a, band_partial(a, j0, n, pos_first, pos_last), mstat):
                    tile_scores(Ws, 0, nq, n, j0, pos_first, a, slope, mbase, mstat,
                                KG[jb if KG.shape[0] > 1 else 0], True)
                gemm_qk(Wz, TB, Da, 0, Ev, ntq, Vb, 0, 0, npan, dlim)
                tile_norm(Ws, Wz, nq, n, a, c_exp, dbh, a.dropout_row0 + i0,
                          a.dropout_col0 + j0, ms, zs, ds, 0)
            norm_rows(a, h, rows, rowoff, nq, ms, zs, ds, 0, kappa)
            # sweep 2 over the kept tiles
            b_pack_rows(qf, rowoff * E, nq, E, Ep, Qr, 0)
            b_pack_rows(dof, rowoff * Ev, nq, Ev, Evp, Dr, 0)
            for x in range(ntq * MR * Eld):
                dqa[x] = zero
            for jb in range(jb_lo, jb_hi):
                if used[jb] == 0:
                    continue
                j0 = jb * Bk
                n = min(Bk, S - j0)
                Ws, Wz = KS[jb], KZ[jb]
                tile_grad(Ws, Wz, KG[jb if KG.shape[0] > 1 else 0], nq, n, a, c_exp, rows,
                          rowoff, dbh, a.dropout_row0 + i0, a.dropout_col0 + j0)
                dlim = _dlim(a, j0, n, pos_first)
                gemm_acc_tn_packed(dvT, j0, Sp, Evp // MR, Dr, 0, Wz, 0, TB, nq, n, dlim)
                gemm_acc_tn_packed(dkT, j0, Sp, Ep // MR, Qr, 0, Ws, 0, TB, nq, n, dlim)
                if kfin[jb]:
                    gemm_acc_nn(dqa, 0, Eld, ntq, Ws, 0, TB, kf, kbase + j0 * E, E, n, E, dlim)
                else:
                    dq_nonfinite(dqa, 0, Eld, nq, Ws, n, kf, kbase + j0 * E, E, Vs, ab)
            for r in range(nq):
                for t in range(E):
                    dqf[(rowoff + r) * E + t] = dqa[r * Eld + t] * sc
    if nqc == 1:
        for j in range(S):
            for t in range(E):
                dkf[kbase + j * E + t] = dkT[t * Sp + j] * sc
            for t in range(Ev):
                dvf[vbase + j * Ev + t] = dvT[t * Sp + j]
    else:
        pk, pv = parts[0][u], parts[1][u]
        for j in range(S):
            for t in range(E):
                pk[j * E + t] = dkT[t * Sp + j]
            for t in range(Ev):
                pv[j * Ev + t] = dvT[t * Sp + j]


@njit(fastmath=FM)
def _merge_parts(bk, nqc, parts, dkf, dvf, sc, S, E, Ev):
    """dk = scale * (sum of the units' partials, in unit order), dv = the sum."""
    pk, pv = parts
    for x in range(S * E):
        s = pk[bk * nqc, x]
        for c in range(1, nqc):
            s += pk[bk * nqc + c, x]
        dkf[bk * S * E + x] = s * sc
    for x in range(S * Ev):
        s = pv[bk * nqc, x]
        for c in range(1, nqc):
            s += pv[bk * nqc + c, x]
        dvf[bk * S * Ev + x] = s


@njit(parallel=True, cache=True, nogil=True)
def kept_kernel(a, dout, grads, plan, rows, ws, parts):
    """Parallel body: units claimed from an atomic counter by one prange iteration per worker
    (the unit -> result mapping is fixed, so timing cannot change bits), then the partials'
    sums when units share a kv head."""
    q, k, v = a.q, a.k, a.v
    dq, dk, dv = grads
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    S = k.shape[2]
    Ev = v.shape[3]
    nqc = plan.nqc
    n_units = B * Hkv * nqc
    dqf = dq.reshape(-1)
    dkf = dk.reshape(-1)
    dvf = dv.reshape(-1)
    wQ, wD, wQr, wDr, wK, wV, wS, wZ, wG, wdk, wdv, wdq, wVs, wused, wfin, wacc = ws
    counter = counters(1)
    for w in prange(min(plan.nthreads, n_units)):
        while True:
            u = atomic_next(counter)
            if u >= n_units:
                break
            _kept_unit(u, a, dout, rows, (dqf, dkf, dvf), plan,
                       (wQ[w], wD[w], wQr[w], wDr[w], wK[w], wV[w], wS[w], wZ[w], wG[w], wdk[w],
                        wdv[w], wdq[w], wVs[w], wused[w], wfin[w], wacc[w]), parts)
    if nqc > 1:
        for x in prange(B * Hkv):
            _merge_parts(x, nqc, parts, dkf, dvf, fcast(q, a.scale), S, E, Ev)


def kept_bytes(Bq, Bk, S, softcap):
    """Bytes of kept tiles a worker needs (float32): every key block of a query block's band."""
    Bqp = -(-Bq // MR) * MR
    TB = max(-(-Bk // PW) * PW, -(-Bk // MR) * MR)
    return -(-S // Bk) * Bqp * TB * 4 * (3 if softcap > 0 else 2)


def kept_workspace(T, L, S, E, Ev, Bq, Bk, softcap, n_units, nqc):
    """Per-worker scratch of kept_kernel (float32) and the dk/dv partials (nqc > 1)."""
    f32 = np.float32
    Eld, Evld = max(E, 1), max(Ev, 1)
    Ep, Evp = -(-E // MR) * MR, -(-Ev // MR) * MR
    Bqp = -(-Bq // MR) * MR
    Bkp = -(-Bk // MR) * MR
    TB = max(-(-Bk // PW) * PW, Bkp)
    nkb = max(-(-S // Bk), 1)
    # rows of the dK^T / dV^T accumulators: a multiple of 16 floats plus 16, so that S a power
    # of two does not put every row of a micro-tile in the same L1 sets (2% at S = 2048)
    Sp = -(-S // 16) * 16 + 16
    npan = -(-Bk // PW)
    ws = (np.empty((T, Bqp * Eld), f32),                   # packed Q block
          np.empty((T, Bqp * Evld), f32),                  # packed dO block
          np.empty((T, Bqp * max(Ep, 1)), f32),            # Q rows, tile-packed for dK^T
          np.empty((T, Bqp * max(Evp, 1)), f32),           # dO rows, for dV^T
          np.empty((T, max(npan * PW, Bkp) * Eld), f32),  # K panels of a key block
          np.empty((T, max(npan * PW, Bkp) * Evld), f32),  # V panels
          np.empty((T, nkb, Bqp, TB), f32),                # kept S -> dS tiles
          np.empty((T, nkb, Bqp, TB), f32),                # kept dP -> Pd tiles
          np.empty((T, nkb if softcap > 0 else 1, Bqp if softcap > 0 else 1,
                    TB if softcap > 0 else 1), f32),       # kept 1 - tanh^2
          np.empty((T, max(Ep, 1) * Sp), f32),             # dK^T accumulator
          np.empty((T, max(Evp, 1) * Sp), f32),            # dV^T accumulator
          np.empty((T, Bqp * Eld), f32),                   # dQ of a block
          np.empty((T, Bk, Eld), f32),                     # non-finite K slow path
          np.empty((T, nkb), np.int8),                     # key blocks with kept tiles
          np.empty((T, nkb), np.bool_),                    # key blocks all finite
          np.empty((T, 3, Bqp)))                           # row max, Z, D (float64)
    parts = (np.empty((n_units if nqc > 1 else 1, S * E if nqc > 1 else 1), f32),
             np.empty((n_units if nqc > 1 else 1, S * Ev if nqc > 1 else 1), f32))
    return ws, parts
