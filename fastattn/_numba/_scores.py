"""The score pipeline of docs/KERNELS.md, once for every numba kernel (forward, decode, backward).

    s = scale * q.k -> softcap -> ALiBi -> float mask -> bool mask -> causal/window band

Every function reads the options from the kernel record `a` (_record.NumbaArgs): a new score
option is a field of the record and a step in tile_scores (plus, if it can skip blocks, a
clause in block_status).

Units. The GEMM leaves the raw products x = q.k (Q is NOT prescaled). With softcap, ALiBi or a
float mask the pipeline turns x into the natural score s = scale*x first (those terms are
defined on s); otherwise the tile stays raw. The softmax then takes c = scale*log2(e) (raw
tile) or log2(e) (natural tile) and exponentiates 2**(x*c - m), where the running max m is in
log2 units; x*c - m is one FMA, rounded once, relative to the small |x*c - m| of the weights
that matter. Folding scale*log2(e) into Q instead (one multiply less per score) rounded every
q element and added an error relative to sum|q_e k_e|: with large logits (q, k x100) the
output error was 11x the naive float32 computation's (tests/test_forward.py,
test_large_values_stay_finite and the large-logit sweep).
"""
import math

import numpy as np
from numba import njit

from ._exp import LOG2E, tanhv
from ._gemm import MR, NO_LIMIT, tile_cols
from ._intrinsics import FM, fcast, wide_vectors


@njit
def natural_tiles(a):
    """Whether the pipeline turns raw tiles into natural scores s = scale*x (see the units
    note): softcap, ALiBi and a float mask are defined on s; and a scale whose scale*log2(e)
    overflows the dtype (float32 scale > ~2.4e38: c = inf made every row NaN) is applied to
    the scores instead of folded into c."""
    if a.softcap > 0.0 or a.has_alibi or a.mask_kind == 2:
        return True
    return not (abs(fcast(a.q, a.scale * LOG2E)) < np.inf)


@njit
def score_units(a):
    """(to_nat, c, kappa) of a call, see the units note above: whether the pipeline turns
    tiles into natural scores, the factor c of the softmax (as passed; the softmax rounds it to
    the dtype) and kappa, which turns a log2-unit max back into a natural lse."""
    to_nat = natural_tiles(a)
    c = LOG2E if to_nat else a.scale * LOG2E
    kappa = (1.0 if to_nat else a.scale) / np.float64(fcast(a.q, c))
    return to_nat, c, kappa


@njit
def needs_rows(a, band_partial, mstat):
    """Whether a block's tile goes through tile_scores at all (else it stays raw products)."""
    return band_partial or mstat == 2 or natural_tiles(a)


@njit
def alibi_slope(a, b, h):
    """ALiBi slope of (batch b, query head h) in the compute dtype; 0 when off."""
    if not a.has_alibi:
        return fcast(a.q, 0.0)
    return fcast(a.q, a.alibi[b if a.alibi.shape[0] > 1 else 0, h])


@njit
def sink_logit(a, h):
    """The sink logit of query head h as a float64 natural score; -inf (no sink) when off."""
    if not a.has_sinks:
        return -np.inf
    return np.float64(a.sinks[h])


@njit
def mask_base(a, b, h, i, j):
    """Flat offset of mask entry (b, h, i, j) of the active mask (0 when there is none)."""
    return b * a.msB + h * a.msH + i * a.msL + j * a.msS


@njit
def band_partial(a, j0, n, pos_first, pos_last):
    """True when the band (causal/window) masks some (row, key) of keys j0..j0+n-1 for rows at
    positions pos_first..pos_last."""
    return (j0 < pos_last - a.win_left) or (j0 + n - 1 > pos_first + a.win_right)


@njit
def outside_band(a, j0, n, pos_first, pos_last):
    """True when the band masks every (row, key) of the block."""
    return j0 + n - 1 < pos_first - a.win_left or j0 > pos_last + a.win_right


@njit
def _status_bool(mflat, base, sL, sS, nq, n):
    """0: every (row, key) of the block masked; 1: every one kept; 2: mixed.

    Reads at most nq*n mask bytes (one row when the mask broadcasts over queries) - far less
    work than the block's GEMM, and a fully masked block (padding, unused KV-cache tail) then
    skips its GEMMs entirely."""
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
def _status_float(mflat, base, sL, sS, nq, n):
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


@njit
def block_status(a, base, nq, n):
    """What the masks do to the nq x n block whose first mask entry is at `base`:
    0 every (row, key) masked (skip the block), 1 none (no per-element mask pass), 2 mixed."""
    if a.mask_kind == 1:
        return _status_bool(a.mask_bool.reshape(-1), base, a.msL, a.msS, nq, n)
    if a.mask_kind == 2:
        return _status_float(a.mask_float.reshape(-1), base, a.msL, a.msS, nq, n)
    return 1


@njit
def group_block_status(a, b, h0, g, nq, j0, n):
    """block_status over the same rows of g adjacent query heads h0..h0+g-1 (decode's group
    tile): 0 or 1 when every head agrees, else 2."""
    if a.mask_kind == 0:
        return 1
    mstat = 0
    for hh in range(g):
        st = block_status(a, mask_base(a, b, h0 + hh, 0, j0), nq, n)
        if hh == 0:
            mstat = st
        elif st != mstat:
            mstat = 2
        if mstat == 2:
            break
    return mstat


@njit(fastmath=FM)
def tile_scores(S, r0, r1, n, j0, pos0, a, slope, mbase, mstat, Gc, save_grad,
                dlim=NO_LIMIT):
    """The score pipeline on rows r0..r1-1 of a tile of raw products S[r, :n] (keys j0..), in
    order: scale (only for a natural tile, see score_units), softcap, ALiBi (slope of the rows'
    head), float mask, bool mask (only in a mixed block, mstat == 2), band. Row r sits at
    position pos0 + (r - r0) and reads mask entries at mbase + (r - r0)*msL + j*msS. Each step is
    a separate vectorized loop; steps the block does not need are skipped. Replacement (not
    addition) of -inf keeps NaN scores of masked keys out. With save_grad (backward), softcap's
    derivative 1 - tanh**2 goes to Gc[r, j]. With dlim (the band's right edge inside the block,
    as the forward's products and tile_online take it), row r covers only the columns of its
    micro-tile (rows counted from r0): the float32 products left the rest unwritten and nothing
    reads it, so masking it was a pass over half of every diagonal block for nothing."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    sc = fcast(S, a.scale)
    use_cap = a.softcap > 0.0
    to_nat = natural_tiles(a)
    has_alibi = a.has_alibi
    mask_kind = a.mask_kind
    sL = a.msL
    sS = a.msS
    mbf = a.mask_bool.reshape(-1)
    mff = a.mask_float.reshape(-1)
    partial = band_partial(a, j0, n, pos0, pos0 + (r1 - r0) - 1)
    # softcap divides (like the spec) rather than multiplying by a rounded
    # 1/cap: one rounding fewer in tanh's argument; only softcap pays for it
    cap = fcast(S, a.softcap) if use_cap else fcast(S, 1.0)
    # A softcap the dtype cannot hold: one that overflows to inf caps nothing (s / inf = 0
    # and inf * tanh(0) would be NaN); one that underflows to 0 (1e-300 in float32: the
    # division raised ZeroDivisionError, as SystemError) is applied in float64.
    cap_inf = use_cap and cap == fcast(S, np.inf)
    cap_tiny = use_cap and cap == fcast(S, 0.0)
    c64 = np.float64(a.softcap)
    for r in range(r0, r1):
        d = r - r0
        pos = pos0 + d
        nr = n if dlim == NO_LIMIT else max(0, min(n, tile_cols(d // MR, MR, dlim)))
        if cap_inf:
            for j in range(nr):
                S[r, j] = S[r, j] * sc
                if save_grad:
                    Gc[r, j] = fcast(S, 1.0)
        elif cap_tiny:
            for j in range(nr):
                th = math.tanh(np.float64(S[r, j] * sc) / c64)
                S[r, j] = fcast(S, c64 * th)
                if save_grad:
                    Gc[r, j] = fcast(S, 1.0 - th * th)
        elif use_cap and save_grad:
            for j in range(nr):
                th = tanhv((S[r, j] * sc) / cap)
                S[r, j] = cap * th
                Gc[r, j] = fcast(S, 1.0) - th * th
        elif use_cap:
            for j in range(nr):
                S[r, j] = cap * tanhv((S[r, j] * sc) / cap)
        elif to_nat:
            for j in range(nr):
                S[r, j] = S[r, j] * sc
        if has_alibi:
            for j in range(nr):
                S[r, j] = S[r, j] - slope * fcast(S, abs(pos - (j0 + j)))
        mo = mbase + d * sL
        if mask_kind == 2:
            if sS == 0:
                mv = mff[mo]
                if mv == ninf:
                    for j in range(nr):
                        S[r, j] = ninf
                else:
                    for j in range(nr):
                        S[r, j] = S[r, j] + mv
            else:
                for j in range(nr):
                    mv = mff[mo + j]
                    S[r, j] = ninf if mv == ninf else S[r, j] + mv
        elif mask_kind == 1 and mstat == 2:
            if sS == 0:
                if mbf[mo] == 0:
                    for j in range(nr):
                        S[r, j] = ninf
            else:
                for j in range(nr):
                    S[r, j] = ninf if mbf[mo + j] == 0 else S[r, j]
        if partial:
            # allowed columns [lo, hi): j0 + j in [pos - win_left, pos + win_right]
            lo = min(max(pos - a.win_left - j0, 0), nr)
            hi = min(max(pos + a.win_right - j0 + 1, 0), nr)
            if hi < lo:
                hi = lo
            for j in range(0, lo):
                S[r, j] = ninf
            for j in range(hi, nr):
                S[r, j] = ninf
