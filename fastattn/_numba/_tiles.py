"""Tile passes shared by the forward and decode kernels (Numba).

Score pipeline, lazy online softmax, dropout, finalize, the non-finite-V
check and its exact slow path, and the block mask status.
"""
import numpy as np
from numba import njit

from ._blas import gemm_nn
from ._exp import LOG2E, exp2_row_sum, exp2v, tanhv
from ._gemm import MR, NO_LIMIT, tile_cols
from ._hash import dropout_bits, dropout_row_key
from ._intrinsics import FM, fcast, fmax_nan, wide_vectors


# --------------------------------------------------------------------------
# A score tile S is a C-contiguous (rows, Bk) array; each pass works on rows
# r0..r1-1 and the first n columns. Passes take the 2-D tile and loop over
# rows inside: calling a helper per row with a row view cost ~170 ns per row
# (view refcounting + a non-inlined call with ~30 arguments), i.e. as much as
# the exp of the row itself at Bk=512.
#
# Units. The GEMM leaves the raw products x = q.k (Q is NOT prescaled).
# With softcap, ALiBi or a float mask the pipeline turns x into the natural
# score s = scale*x first (those terms are defined on s); otherwise the tile
# stays raw. tile_online then takes c = scale*log2(e) (raw tile) or log2(e)
# (natural tile) and exponentiates 2**(x*c - m), where the running max m is
# in log2 units; x*c - m is one FMA, rounded once, relative to the small
# |x*c - m| of the weights that matter. Folding scale*log2(e) into Q instead
# (one multiply less per score) rounded every q element and added an error
# relative to sum|q_e k_e|: with large logits (q, k x100) the output error
# was 11x the naive float32 computation's (tests/test_forward.py,
# test_large_values_stay_finite and the large-logit sweep).
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
def active_mask_strides(mask_kind, mask_bool, mask_float, B, H, L, S):
    """Strides of whichever mask the call has (kind 1: bool; else float, a dummy when none)."""
    if mask_kind == 1:
        return mask_strides(mask_bool, B, H, L, S)
    return mask_strides(mask_float, B, H, L, S)


@njit(fastmath=FM)
def tile_pipeline(S, r0, r1, n, j0, pos0, to_nat, scale, use_cap, softcap,
                  has_alibi, slope, mask_kind, mbf, mff, mbase, sL, sS, mstat,
                  band_partial, win_left, win_right, Gc, save_grad):
    """docs/KERNELS.md score pipeline on rows r0..r1-1 of a tile of raw
    products, in order: scale (only when to_nat), softcap, ALiBi, float mask,
    bool mask, band. Row r sits at position pos0 + (r - r0) and reads mask
    entries at mbase + (r - r0)*sL + j*sS. Each step is a separate vectorized
    loop; steps the block does not need are skipped. Replacement (not
    addition) of -inf keeps NaN scores of masked keys out. With save_grad
    (backward), softcap's derivative 1 - tanh**2 goes to Gc[r, j]."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    sc = fcast(S, scale)
    # softcap divides (like the spec) rather than multiplying by a rounded
    # 1/cap: one rounding fewer in tanh's argument; only softcap pays for it
    cap = fcast(S, softcap) if use_cap else fcast(S, 1.0)
    for r in range(r0, r1):
        d = r - r0
        pos = pos0 + d
        if use_cap and save_grad:
            for j in range(n):
                th = tanhv((S[r, j] * sc) / cap)
                S[r, j] = cap * th
                Gc[r, j] = fcast(S, 1.0) - th * th
        elif use_cap:
            for j in range(n):
                S[r, j] = cap * tanhv((S[r, j] * sc) / cap)
        elif to_nat:
            for j in range(n):
                S[r, j] = S[r, j] * sc
        if has_alibi:
            for j in range(n):
                S[r, j] = S[r, j] - slope * fcast(S, abs(pos - (j0 + j)))
        mo = mbase + d * sL
        if mask_kind == 2:
            if sS == 0:
                mv = mff[mo]
                if mv == ninf:
                    for j in range(n):
                        S[r, j] = ninf
                else:
                    for j in range(n):
                        S[r, j] = S[r, j] + mv
            else:
                for j in range(n):
                    mv = mff[mo + j]
                    S[r, j] = ninf if mv == ninf else S[r, j] + mv
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


@njit
def score_units(arr, scale, softcap, has_alibi, mask_kind):
    """(to_nat, c, kappa) of a call, see the units note above: whether the
    pipeline turns tiles into natural scores, the factor c of tile_online
    (as passed; tile_online rounds it to the dtype) and kappa of
    tile_finalize."""
    to_nat = softcap > 0.0 or has_alibi or mask_kind == 2
    c = LOG2E if to_nat else scale * LOG2E
    kappa = (1.0 if to_nat else scale) / np.float64(fcast(arr, c))
    return to_nat, c, kappa


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
    nfull = n
    for r in range(r0, r1):
        n = max(0, min(nfull, tile_cols(r // MR, MR, dlim)))
        m_old = m[r]
        if m_old != ninf:
            s = exp2_row_sum(S, r, P, n, c, m_old)
            if s <= lim:            # False for inf and NaN
                lsum[r] += s
                continue
        elif r > 0 and m[r - 1] != ninf:
            # first block of this row: guess the max of the row above
            # (acc row and lsum are still 0, nothing to rescale)
            mg = m[r - 1]
            s = exp2_row_sum(S, r, P, n, c, mg)
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
        s = exp2_row_sum(S, r, P, n, c, m_new)
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


@njit(fastmath=FM)
def tile_grad(S, Z, Gc, nq, n, c, lse2, Dd, Iz, roff, use_cap, do_drop, seed, bh,
              i0, j0, thresh, inv_keep):
    """Backward tile pass (docs/KERNELS.md): S holds the scores as tile_online
    reads them (log2-unit score = S * c) and becomes dS; Z holds dO . V^T and
    becomes the weights after dropout, Pd. Row r is query i0 + r, with
    lse2 = lse in the same log2 units and D at lse2/Dd[roff + r]:
        P = 2**(S*c - lse2), Pd = P*keep/(1-p),
        dS = P*(Z*keep/(1-p) - D) (* Gc = 1 - tanh**2 with softcap),
    without the final factor scale (applied to dq/dk at the end). dS = 0
    wherever P = 0: a NaN/Inf of a masked V reaches Z, and 0*NaN = NaN."""
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
            for j in range(n):
                S[r, j] = S[r, j] * Gc[r, j]


@njit
def tile_finalize(acc, m, lsum, nq, Ev, of, ooff, lse_flat, loff, inv_keep, kappa):
    """out rows = acc * (1/(1-p)) / l, lse = m * kappa + ln l; rows that
    never saw an allowed key (m = -inf or l = 0) get out = 0, lse = -inf.

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
        if m[r] == ninf or lr == zero:
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
