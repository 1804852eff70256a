"""Tile passes shared by the forward and decode kernels (Numba).

Score pipeline, lazy online softmax, dropout, finalize, the non-finite-V
check and its exact slow path, and the block mask status.
"""
import numpy as np
from numba import njit

from ._blas import gemm_nn
from ._exp import LN2, LOG2E, exp2v, tanhv
from ._hash import dropout_bits, dropout_row_key
from ._intrinsics import FM, fcast, fmax_nan, wide_vectors


# --------------------------------------------------------------------------
# Tile passes shared by forward and decode. A score tile S is a C-contiguous
# (rows, Bk) array in log2 units; each pass works on rows r0..r1-1 and the
# first n columns. Passes take the 2-D tile and loop over rows inside:
# calling a helper per row with a row view cost ~170 ns per row (view
# refcounting + a non-inlined call with ~30 arguments), i.e. as much as the
# exp of the row itself at Bk=512.
# --------------------------------------------------------------------------
@njit(fastmath=FM)
def mask_strides(m, B, H, L, S):
    """Element strides of a broadcast mask (dims of size 1 -> stride 0)."""
    Bm, Hm, Lm, Sm = m.shape
    sS = 1 if Sm > 1 else 0
    sL = Sm if Lm > 1 else 0
    sH = Lm * Sm if Hm > 1 else 0
    sB = Hm * Lm * Sm if Bm > 1 else 0
    return sB, sH, sL, sS


@njit(fastmath=FM)
def tile_pipeline(S, r0, r1, n, j0, pos0, use_cap, softcap, has_alibi,
                  slope2, mask_kind, mbf, mff, mbase, sL, sS, mstat,
                  band_partial, win_left, win_right):
    """docs/KERNELS.md score pipeline on rows r0..r1-1 of a tile, in order:
    softcap, ALiBi, float mask, bool mask, band. Row r sits at position
    pos0 + (r - r0) and reads mask entries at mbase + (r - r0)*sL + j*sS.
    Each step is a separate vectorized loop; steps the block does not need
    are skipped. Replacement (not addition) of -inf keeps NaN scores of
    masked keys out."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    log2e = fcast(S, LOG2E)
    inv_cap = fcast(S, 1.0 / softcap) if use_cap else fcast(S, 0.0)
    c2 = fcast(S, softcap * LOG2E)
    for r in range(r0, r1):
        d = r - r0
        pos = pos0 + d
        if use_cap:
            for j in range(n):
                S[r, j] = c2 * tanhv(S[r, j] * inv_cap)
        if has_alibi:
            for j in range(n):
                S[r, j] = S[r, j] - slope2 * fcast(S, abs(pos - (j0 + j)))
        mo = mbase + d * sL
        if mask_kind == 2:
            if sS == 0:
                mv = mff[mo]
                if mv == ninf:
                    for j in range(n):
                        S[r, j] = ninf
                else:
                    add = mv * log2e
                    for j in range(n):
                        S[r, j] = S[r, j] + add
            else:
                for j in range(n):
                    mv = mff[mo + j]
                    S[r, j] = ninf if mv == ninf else S[r, j] + mv * log2e
        elif mask_kind == 1 and mstat == 2:
            if sS == 0:
                if mbf[mo] == 0:
                    for j in range(n):
                        S[r, j] = ninf
            else:
                for j in range(n):
                    S[r, j] = ninf if mbf[mo + j] == 0 else S[r, j]
        if band_partial:
            # allowed columns [a, b): j0 + j in [pos - win_left, pos + win_right]
            a = min(max(pos - win_left - j0, 0), n)
            b = min(max(pos + win_right - j0 + 1, 0), n)
            if b < a:
                b = a
            for j in range(0, a):
                S[r, j] = ninf
            for j in range(b, n):
                S[r, j] = ninf


# Lazy rescaling: once a row has a running max m, a new block is first
# exponentiated against that m in a single pass (no separate max pass). If
# the row sum stays <= 2**16 every weight is <= 2**16 - nothing can overflow
# and precision is unaffected (floating point is scale-free) - so m is kept
# and the accumulator is not rescaled. Only when the sum exceeds that (the
# max grew by > 16 in log2 units), or is inf/NaN, is the row redone with
# the exact max. lse = m + log2(l) holds for any m.
LAZY_LIMIT = 65536.0


@njit(fastmath=FM)
def tile_online(S, P, r0, r1, n, m, lsum, acc, Ev):
    """Online-softmax update of rows r0..r1-1 with their scores S[r, :n].

    Writes the unnormalized weights 2**(s - m) to P (zeros for rows with
    nothing allowed yet), updates m, lsum and rescales acc rows whose m
    moved."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    one = fcast(S, 1.0)
    zero = fcast(S, 0.0)
    lim = fcast(S, LAZY_LIMIT)
    for r in range(r0, r1):
        m_old = m[r]
        if m_old != ninf:
            s = zero
            for j in range(n):
                p = exp2v(S[r, j] - m_old)
                P[r, j] = p
                s += p
            if s <= lim:            # False for inf and NaN
                lsum[r] += s
                continue
        mx = S[r, 0]
        for j in range(1, n):
            mx = fmax_nan(mx, S[r, j])
        m_new = fmax_nan(m_old, mx)
        if m_new == ninf:
            for j in range(n):
                P[r, j] = zero
            continue
        alpha = exp2v(m_old - m_new)
        s = zero
        for j in range(n):
            p = exp2v(S[r, j] - m_new)
            P[r, j] = p
            s += p
        lsum[r] = lsum[r] * alpha + s
        m[r] = m_new
        if alpha != one:
            for t in range(Ev):
                acc[r, t] *= alpha


@njit
def tile_dropout(P, r0, r1, n, seed, bh, i0, j0, thresh, inv_keep):
    """Apply the spec's dropout to weights P[r, :n], row r = query i0 + r - r0."""
    zero = fcast(P, 0.0)
    for r in range(r0, r1):
        rk = dropout_row_key(seed, bh, i0 + (r - r0))
        for j in range(n):
            bits = dropout_bits(rk, j0 + j)
            P[r, j] = P[r, j] * inv_keep if bits >= thresh else zero


@njit
def tile_finalize(acc, m, lsum, nq, Ev, of, ooff, lse_flat, loff):
    """out rows = acc / l, lse = (m + log2 l) * ln2; rows that never saw an
    allowed key (m = -inf or l = 0) get out = 0, lse = -inf."""
    ninf = fcast(acc, -np.inf)
    zero = fcast(acc, 0.0)
    one = fcast(acc, 1.0)
    for r in range(nq):
        lr = lsum[r]
        if m[r] == ninf or lr == zero:
            for t in range(Ev):
                of[ooff + r * Ev + t] = zero
            lse_flat[loff + r] = ninf
        else:
            inv = one / lr
            for t in range(Ev):
                of[ooff + r * Ev + t] = acc[r, t] * inv
            lse_flat[loff + r] = (m[r] + np.log2(lr)) * fcast(acc, LN2)


@njit(fastmath=FM)
def block_all_finite(vflat, off, cnt):
    """True when vflat[off:off+cnt] has no NaN/Inf.

    sum(x*0) is 0 for finite x and NaN otherwise; without 'nnan'/'ninf' LLVM
    may not fold x*0 to 0, and the reduction vectorizes (cheap next to the
    block's GEMM)."""
    wide_vectors()
    z = fcast(vflat, 0.0)
    for t in range(cnt):
        z += vflat[off + t] * fcast(vflat, 0.0)
    return z == fcast(vflat, 0.0)


@njit
def pv_nonfinite(Pb, nq, n, vf, voff, Ev, Evld, Vs, acc, ab):
    """acc[:nq] += Pb[:nq,:n] . V for a V block holding NaN/Inf, exactly:
    GEMM with the non-finite entries zeroed, then add those entries back only
    for weights that are nonzero, so a masked NaN (weight 0) never leaks
    while an attended one still propagates."""
    zero = fcast(Pb, 0.0)
    for j in range(n):
        for t in range(Ev):
            x = vf[voff + j * Ev + t]
            Vs[j, t] = x if np.isfinite(x) else zero
    gemm_nn(nq, Ev, n, Pb, 0, Pb.shape[1], Vs, 0, Evld, 0, acc, 0, Evld, ab)
    for j in range(n):
        for t in range(Ev):
            x = vf[voff + j * Ev + t]
            if not np.isfinite(x):
                for r in range(nq):
                    p = Pb[r, j]
                    if p != zero:
                        acc[r, t] += p * x


@njit
def block_status_bool(mflat, base, sL, sS, nq, n):
    """0: every (row, key) of the block masked; 1: every one kept; 2: mixed.

    Reads at most nq*n mask bytes (one row when the mask broadcasts over
    queries) - far less work than the block's GEMM, and a fully masked block
    (padding, unused KV-cache tail) then skips its GEMMs entirely."""
    rows = nq if sL != 0 else 1
    cols = n if sS != 0 else 1
    nz = 0
    for r in range(rows):
        o = base + r * sL
        c = 0
        for j in range(cols):
            c += mflat[o + j * sS] != 0
        nz += c
        if nz != 0 and nz != (r + 1) * cols:
            return 2
    if nz == 0:
        return 0
    return 1


@njit
def block_status_float(mflat, base, sL, sS, nq, n):
    """0 when every entry of the block is -inf (skip it), else 2."""
    rows = nq if sL != 0 else 1
    cols = n if sS != 0 else 1
    ninf = fcast(mflat, -np.inf)
    for r in range(rows):
        o = base + r * sL
        for j in range(cols):
            if mflat[o + j * sS] != ninf:
                return 2
    return 0
