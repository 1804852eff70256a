"""Row softmax kernel (Numba), behind fa.softmax and fa.attention's weights.

Three vectorized passes per row (max of the kept entries, exp + sum, scale),
all on data that stays in L1/L2 for rows up to ~100k entries. Masked entries
get weight 0; rows with nothing kept (or only -inf) become all zeros.
"""
import numpy as np
from numba import njit, prange

from ._blas import numba_threads
from ._exp import LOG2E, exp2v
from ._intrinsics import FM, fcast, fmax_nan, wide_vectors


@njit(cache=True, fastmath=FM, nogil=True)
def _softmax_rows_range(x, mask_kind, mask, out, r0, r1):
    wide_vectors()
    C = x.shape[1]
    ninf = fcast(x, -np.inf)
    zero = fcast(x, 0.0)
    one = fcast(x, 1.0)
    log2e = fcast(x, LOG2E)
    for r in range(r0, r1):
        xr = x[r]
        orow = out[r]
        if mask_kind == 1:
            mr = mask[r]
            # masked entries -> -inf in out, which the exp maps to exact 0
            for j in range(C):
                orow[j] = xr[j] if mr[j] != 0 else ninf
        else:
            for j in range(C):
                orow[j] = xr[j]
        mx = ninf
        for j in range(C):
            mx = fmax_nan(mx, orow[j])
        if mx == ninf:
            for j in range(C):
                orow[j] = zero
            continue
        s = zero
        for j in range(C):
            # scale the difference, not x: x*log2e would add an error
            # proportional to |x| instead of |x - max|
            p = exp2v((orow[j] - mx) * log2e)
            orow[j] = p
            s += p
        inv = one / s
        for j in range(C):
            orow[j] *= inv


@njit(parallel=True, cache=True, nogil=True)
def _softmax_kernel(x, mask_kind, mask, out, nchunks):
    R = x.shape[0]
    per = (R + nchunks - 1) // nchunks
    for c in prange(nchunks):
        r0 = c * per
        r1 = min(R, r0 + per)
        if r0 < r1:
            _softmax_rows_range(x, mask_kind, mask, out, r0, r1)


def softmax_rows(x, mask_kind, mask, out, n_threads):
    """docs/KERNELS.md softmax_rows: x (R, C), mask (R, C) uint8 or dummy (1, 1)."""
    R, C = x.shape
    if R == 0 or C == 0:
        return
    # small problems: one serial call (no parallel-region launch)
    if R * C < 32768 or n_threads <= 1 or R == 1:
        _softmax_rows_range(x, int(mask_kind), mask, out, 0, R)
        return
    with numba_threads(n_threads) as nt:
        nchunks = min(R, 4 * nt)
        _softmax_kernel(x, int(mask_kind), mask, out, nchunks)
