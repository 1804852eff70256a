"""Tile passes of the numba kernels (the score pipeline itself is in _scores.py).

Lazy online softmax, dropout, finalize (forward, decode), the backward's
gradient tile pass, the non-finite-V check and its exact slow path.
"""
import numpy as np
from numba import njit

from ._blas import gemm_nn
from ._exp import exp2_row_sum, exp2v
from ._gemm import MR, NO_LIMIT, tile_cols
from ._hash import dropout_bits, dropout_row_key, dropout_threshold_nb
from ._intrinsics import FM, fcast, fmax_nan, wide_vectors
from ._scores import sink_logit


# Lazy rescaling: once a row has a running max m, a new block is first
# exponentiated against that m in a single pass (no separate max pass). If
# the row sum stays <= 2**16 every weight is <= 2**16 - nothing can overflow
# and precision is unaffected (floating point is scale-free) - so m is kept
# and the accumulator is not rescaled. Only when the sum exceeds that (the
# max grew by > 16 in log2 units), or is inf/NaN, is the row redone with
# the exact max. lse = m + log2(l) holds for any m.
LAZY_LIMIT = 65536.0
# A row's first block (no running max yet) is tried against the max of the
# row above as a guess, in the same single pass: accepted when the row sum
# lands in [LAZY_LOW, LAZY_LIMIT]. Then the largest weight is >= 2**-20 / n,
# so every weight that matters (>= 2**-50 of the largest) is a normal float
# and no precision is lost; otherwise (NaN, -inf rows, far-off guesses) the
# row takes the exact two-pass path. Saves the separate max pass, ~1/3 of a
# first block's softmax (the only block when L = S <= 512).
LAZY_LOW = 2.0 ** -20


# |m| (log2 units) from which rows take the rounded pass (see _row_sum): 2**22, where float32's
# ulp(m)/2, the FMA's residual at the max, reaches 1/8. float64 uses the same bound: there ulp(m)
# is still small, but scores that large (~3e6) carry GEMM rounding far above the 1e-10 tolerance
# anyway, so the FMA's extra accuracy buys nothing there and the max gets weight exactly 1.
BIG_MAX = 2.0 ** 22


@njit(fastmath={'nsz', 'arcp', 'afn'})     # no 'contract': x*c is rounded before m is taken off
def _exp2_row_sum_rounded(S, r, P, n, c, m):
    """exp2_row_sum with t = round(x*c) - m instead of one FMA. With m the rounded max of the
    x*c, t is exactly 0 at the max, so its weight is exactly 1 however large |m| is."""
    s = fcast(P, 0.0)
    for j in range(n):
        x = S[r, j] * c
        p = exp2v(x - m)
        P[r, j] = p
        s += p
    return s


@njit(fastmath=FM)
def _row_sum(S, r, P, n, c, m, big):
    """The weights 2**(S*c - m) of row r and their sum. The FMA of exp2_row_sum leaves at the
    row max the rounding error of m itself, up to ulp(m)/2 in log2 units: harmless for ordinary
    scores, but at |q.k| ~ 1e9 in float32 (ulp(m) ~ 2**7..2**11) the max's weight under- or
    overflowed (NaN rows, or 0 with lse -inf). Rows with |m| >= big take the rounded pass."""
    if abs(m) >= big:               # False for NaN: NaN rows stay on the FMA pass (NaN anyway)
        return _exp2_row_sum_rounded(S, r, P, n, c, m)
    return exp2_row_sum(S, r, P, n, c, m)


@njit(fastmath=FM)
def tile_online(S, P, r0, r1, n, m, lsum, acc, Ev, c, dlim=NO_LIMIT):
    """Online-softmax update of rows r0..r1-1 with their scores S[r, :n]
    (log2-unit score = S * c, c > 0).

    Writes the unnormalized weights 2**(S*c - m) to P (zeros for rows with
    nothing allowed yet), updates m (log2 units), lsum and rescales acc rows
    whose m moved. The weights of a row come from one exp2_row_sum pass
    (_exp.py: AVX-512 instructions for float32 where the CPU has them).
    With dlim (the band's right edge inside the block, _gemm.NO_LIMIT), a
    row covers only the columns its micro-tile's P.V reads: the rest of the
    row is masked anyway, and P there is left as it was."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    one = fcast(S, 1.0)
    zero = fcast(S, 0.0)
    lim = fcast(S, LAZY_LIMIT)
    low = fcast(S, LAZY_LOW)
    c = fcast(S, c)
    big = fcast(S, BIG_MAX)
    nfull = n
    for r in range(r0, r1):
        n = max(0, min(nfull, tile_cols(r // MR, MR, dlim)))
        m_old = m[r]
        if m_old != ninf:
            s = _row_sum(S, r, P, n, c, m_old, big)
            if s <= lim:            # False for inf and NaN
                lsum[r] += s
                continue
        elif r > 0 and m[r - 1] != ninf:
            # first block of this row: guess the max of the row above
            # (acc row and lsum are still 0, nothing to rescale)
            mg = m[r - 1]
            s = _row_sum(S, r, P, n, c, mg, big)
            if s <= lim and s >= low:   # False for NaN
                lsum[r] = s
                m[r] = mg
                continue
        # from -inf over all n (not S[r, 0] then 1..n): a trip count of n - 1
        # left a scalar tail of 15 dependent maximum ops per row, which made
        # this pass 3x slower (0.29 vs 0.10 ns per score at n = 256)
        mx = ninf
        for j in range(n):
            mx = fmax_nan(mx, S[r, j])
        m_new = fmax_nan(m_old, mx * c)
        if m_new == ninf:
            for j in range(n):
                P[r, j] = zero
            continue
        alpha = exp2v(m_old - m_new)
        s = _row_sum(S, r, P, n, c, m_new, big)
        lsum[r] = lsum[r] * alpha + s
        m[r] = m_new
        if alpha != one:
            for t in range(Ev):
                acc[r, t] *= alpha


@njit
def zero_past_limit(P, nq, n, dlim):
    """P[r, j] = 0 for the columns tile_online left alone (see its dlim), so
    a product over all n columns (the non-finite-V path) reads zeros there."""
    zero = fcast(P, 0.0)
    for r in range(nq):
        for j in range(max(0, min(n, tile_cols(r // MR, MR, dlim))), n):
            P[r, j] = zero


@njit
def tile_dropout(P, r0, r1, n, seed, bh, i0, j0, thresh):
    """Zero the weights P[r, :n] the spec's dropout drops (row r = query
    i0 + r - r0). The 1/(1-p) factor is applied once per output element in
    finalize (one rounding instead of one per weight)."""
    zero = fcast(P, 0.0)
    for r in range(r0, r1):
        rk = dropout_row_key(seed, bh, i0 + (r - r0))
        for j in range(n):
            if dropout_bits(rk, j0 + j) < thresh:
                P[r, j] = zero


# The backward's weights are 2**(round(S*c) - m) (no 'contract', so no FMA): with m the row's
# max of the same rounded products, the largest weight is exactly 1 however large |m| is, and
# a row that attends one key gets P = 1, D = dP and dS = 0 exactly (see tile_norm). 'reassoc'
# stays: without it tile_norm's float64 row sums did not vectorize (the backward took 1.5x).
FM_ROUNDED = FM - {'contract'}


@njit(fastmath=FM_ROUNDED)
def tile_norm(S, Z, nq, n, a, c, bh, i0, j0, ms, zs, ds, aoff):
    """Sweep 1 of the backward on one tile: S holds the scores as tile_online reads them
    (log2-unit score = S * c), Z = dO . V^T. Row r (query i0 + r) keeps its running max
    ms[aoff + r] of the rounded S*c (log2 units; a value of the dtype, held in float64) and,
    relative to it, Z = sum_j P and D = sum_j P dP (dP with dropout's keep/(1-p)) in float64
    at zs/ds[aoff + r], rescaled when the max moves. bh, i0, j0: the dropout hash's
    coordinates of the tile's first (row, key).

    The row's own max rather than the forward's lse: lse/kappa is rounded, and at |lse| >~ 2**22
    (float32 q.k ~ 1e9, float64 scores ~ 1e16 and beyond) that rounding over- or underflowed
    every weight of the row (NaN or zero gradients); with the own max the largest weight is
    exactly 1 at any magnitude, and where a row attends a single key (or one key outweighs the
    rest by more than the dtype's range) D = dP exactly, so its dS is exactly 0, as the
    reference's softmax gives, instead of dP's rounding times |P| (times |k| and the scale in
    dq: ~1e-15 relative, or 1e15 absolute with |v| ~ 1e30)."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    zero = fcast(S, 0.0)
    cc = fcast(S, c)
    do_drop = a.dropout_p > 0.0
    thresh = dropout_threshold_nb(a.dropout_p)
    ik = fcast(S, 1.0 / (1.0 - a.dropout_p))
    for r in range(nq):
        mx = ninf
        for j in range(n):
            mx = fmax_nan(mx, S[r, j] * cc)
        m_old = ms[aoff + r]
        m = fmax_nan(fcast(S, m_old), mx)
        if m == ninf:
            continue                            # nothing of this row in the tile
        m64 = np.float64(m)
        if not (m64 == m_old):                  # the max moved (or is NaN)
            if m_old != -np.inf:
                f = exp2v(m_old - m64)
                zs[aoff + r] *= f
                ds[aoff + r] *= f
            ms[aoff + r] = m64
        za = 0.0
        da = 0.0
        if do_drop:
            rk = dropout_row_key(a.seed, bh, i0 + r)
            for j in range(n):
                p = exp2v(S[r, j] * cc - m)
                ks = ik if dropout_bits(rk, j0 + j) >= thresh else zero
                pd = np.float64(p)
                za += pd
                t = pd * np.float64(Z[r, j] * ks)
                da += t if p != zero else 0.0      # dP may be Inf/NaN under a masked key
        else:
            for j in range(n):
                p = exp2v(S[r, j] * cc - m)
                pd = np.float64(p)
                za += pd
                t = pd * np.float64(Z[r, j])
                da += t if p != zero else 0.0
        zs[aoff + r] += za
        ds[aoff + r] += da


@njit(fastmath=FM)
def norm_rows(a, h, rows, rowoff, nq, ms, zs, ds, aoff, kappa):
    """After sweep 1 (tile_norm over every key of the rows): rows rowoff.. (nq of them, query
    head h) get rows = (m2 = m, Dd = D/Z, Iz = 1/Z, P_sink * D) from their float64 max m, Z and
    D at ms/zs/ds[aoff + r]. A row with no key and no sink (m = -inf) gets P = 0 everywhere
    (m2 = +inf, Iz = Dd = 0). With a sink, its weight joins Z (the row's real keys sum to
    1 - P_sink) and its share P_sink * D feeds dsinks (no value row: its dS is -P_sink * D);
    m >= the sink (ms started there), so its weight is <= 1."""
    lse2, Dd, Iz = rows[0], rows[1], rows[2]
    zero = fcast(lse2, 0.0)
    sink2 = sink_logit(a, h) / kappa          # the sink in log2 units
    for r in range(nq):
        m = ms[aoff + r]
        if m == -np.inf:
            lse2[rowoff + r] = np.inf
            Iz[rowoff + r] = zero
            Dd[rowoff + r] = zero
            if a.has_sinks:
                rows[3][rowoff + r] = 0.0
            continue
        z = zs[aoff + r]
        if a.has_sinks:
            e = exp2v(sink2 - m) if sink2 != -np.inf else 0.0
            z += e
            rows[3][rowoff + r] = (e / z) * (ds[aoff + r] / z)
        lse2[rowoff + r] = fcast(lse2, m)     # exact: m is a value of the dtype
        Iz[rowoff + r] = fcast(lse2, 1.0 / z)  # z >= 1 (the max's weight), or NaN
        Dd[rowoff + r] = fcast(lse2, ds[aoff + r] / z)


@njit(fastmath=FM_ROUNDED)
def tile_grad(S, Z, Gc, nq, n, a, c, rows, roff, bh, i0, j0):
    """Backward tile pass (docs/KERNELS.md): S holds the scores as tile_online
    reads them (log2-unit score = S * c) and becomes dS; Z holds dO . V^T and
    becomes the weights after dropout, Pd. Row r is query i0 + r, with
    rows = (m2, Dd, Iz): m2 the row's offset in the same log2 units (tile_norm's max, or
    lse / kappa in the partial-keys mode), D and 1/Z at Dd/Iz[roff + r]:
        P = 2**(round(S*c) - m2) * Iz, Pd = P*keep/(1-p),
        dS = P*(Z*keep/(1-p) - D) (* Gc = 1 - tanh**2 with softcap),
    without the final factor scale (applied to dq/dk at the end). dS = 0
    wherever P = 0: a NaN/Inf of a masked V reaches Z, and 0*NaN = NaN.
    Dropout and softcap come from the record `a`; bh, i0, j0 are the dropout hash's
    coordinates of the tile's first (row, key)."""
    lse2, Dd, Iz = rows[0], rows[1], rows[2]
    use_cap = a.softcap > 0.0
    do_drop = a.dropout_p > 0.0
    seed = a.seed
    thresh = dropout_threshold_nb(a.dropout_p)
    inv_keep = 1.0 / (1.0 - a.dropout_p)
    wide_vectors()
    zero = fcast(S, 0.0)
    cc = fcast(S, c)
    ik = fcast(S, inv_keep)
    for r in range(nq):
        l2 = lse2[roff + r]
        d = Dd[roff + r]
        iz = Iz[roff + r]
        if do_drop:
            rk = dropout_row_key(seed, bh, i0 + r)
            for j in range(n):
                p = exp2v(S[r, j] * cc - l2) * iz
                ks = ik if dropout_bits(rk, j0 + j) >= thresh else zero
                ds = p * (Z[r, j] * ks - d)
                S[r, j] = ds if p != zero else zero
                Z[r, j] = p * ks
        else:
            for j in range(n):
                p = exp2v(S[r, j] * cc - l2) * iz
                ds = p * (Z[r, j] - d)
                S[r, j] = ds if p != zero else zero
                Z[r, j] = p
        if use_cap:
            # dS = 0 (P = 0) must stay 0: Gc is NaN where a masked key holds NaN
            for j in range(n):
                ds = S[r, j]
                S[r, j] = ds if ds == zero else ds * Gc[r, j]


@njit
def sink_row(mk, lr, sink, inv_keep):
    """(factor, lse) of a row whose softmax denominator also holds exp(sink) (attention sinks,
    docs/KERNELS.md): the row's weights sum to lr relative to exp(mk) (mk its max as a natural
    score, float64), so out = acc * factor and lse = ln(lr e^mk + e^sink). Relative to the
    larger of mk and sink, so a sink far above the scores neither overflows nor loses lr. A
    row with nothing attended (lr = 0) gives factor 0 and lse = sink; a NaN or +inf sink takes
    part in every row of its head, so by the NaN rule the row is NaN (factor and lse NaN)."""
    if not (sink < np.inf):
        return np.nan, np.nan
    if lr == 0.0:
        return 0.0, sink
    if sink > mk:                     # False for a NaN row: it stays NaN below
        w = np.exp(mk - sink)
        lt = lr * w + 1.0
        return inv_keep * w / lt, sink + np.log(lt)
    lt = lr + np.exp(sink - mk)
    return inv_keep / lt, mk + np.log(lt)


@njit
def tile_finalize(acc, m, lsum, nq, Ev, of, ooff, lse_flat, loff, inv_keep, kappa, sink):
    """out rows = acc * (1/(1-p)) / l, lse = m * kappa + ln l; rows that
    never saw an allowed key (m = -inf or l = 0) get out = 0, lse = -inf.
    With a sink logit (-inf is no sink) the denominator also holds
    exp(sink), see sink_row; an empty row then has out = 0 and lse = sink.

    kappa converts the log2-unit max back to a natural score: the weights
    were 2**(x*c - m) with c the dtype-rounded factor of tile_online, so
    kappa = (scale for a raw tile, 1 for a natural one) / c, in float64 -
    using ln2 instead would add c's rounding times |score| to lse. The factor
    and lse are formed in float64 so float32 results are rounded once.
    Output rows are written through a row slice: indexing the flat output
    directly kept the loop scalar (15.6 vs 5.5 us per 256x64 block)."""
    wide_vectors()
    ninf = fcast(acc, -np.inf)
    zero = fcast(acc, 0.0)
    for r in range(nq):
        lr = lsum[r]
        orow = of[ooff + r * Ev:ooff + r * Ev + Ev]
        if sink != -np.inf:                     # a sink (NaN included)
            empty = m[r] == ninf
            f, ls = sink_row(-np.inf if empty else np.float64(m[r]) * kappa,
                             0.0 if empty else np.float64(lr), sink, inv_keep)
            for t in range(Ev):
                orow[t] = np.float64(acc[r, t]) * f     # acc is 0 in an empty row
            lse_flat[loff + r] = ls
        elif m[r] == ninf or lr == zero:
            for t in range(Ev):
                orow[t] = zero
            lse_flat[loff + r] = ninf
        else:
            f = np.float64(inv_keep) / np.float64(lr)
            for t in range(Ev):
                orow[t] = np.float64(acc[r, t]) * f
            lse_flat[loff + r] = np.float64(m[r]) * kappa + np.log(np.float64(lr))


@njit(fastmath=FM)
def block_all_finite(vflat, off, cnt):
    """True when vflat[off:off+cnt] has no NaN/Inf.

    sum(x*0) is 0 for finite x and NaN otherwise; without 'nnan'/'ninf' LLVM
    may not fold x*0 to 0, and the reduction vectorizes (cheap next to the
    block's GEMM). It reads a slice: indexed as vflat[off + t], each element
    went through numba's negative-index wraparound and the loop stayed scalar
    (0.47 against 0.034 ns an element; 3.6% of a causal forward's samples at
    L = S = 1024, where every diagonal block is checked)."""
    wide_vectors()
    w = vflat[off:off + cnt]
    z = fcast(vflat, 0.0)
    for t in range(w.size):
        z += w[t] * fcast(vflat, 0.0)
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
