"""Vectorizable exp2 and tanh for the Numba kernels.

Both are plain arithmetic that LLVM inlines and vectorizes inside the
callers' loops (Numba without SVML would call scalar libm, 3-6 ns/element).
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._intrinsics import FM, as_float, as_int

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# --------------------------------------------------------------------------
# exp2: vectorizable, -inf -> 0, very negative -> 0, NaN -> NaN
# --------------------------------------------------------------------------
# 2**t = 2**n * 2**r, n = round(t), r in [-0.5, 0.5]. 2**r by a polynomial,
# 2**n built in the exponent bits. Rounding uses the "magic number" trick:
# y = t + (1.5*2**23 + 127) rounds t to an integer held in y's low mantissa
# bits, already biased by 127, so (bits(y) << 23) is the float 2**n and
# y - magic is round(t). That is 3 vector ops where floor + convert + add
# took 5 (measured 0.48 -> 0.37 ns per element with the row max).
# The clamp to [-127, 64] makes n = -127 give the bit pattern 0 (an exact
# 0.0 for -inf and for anything below 2**-126.5, no select needed) and keeps
# the shift from wrapping for large positive t (lazy softmax lets arguments
# go slightly positive). NaN passes both clamps and propagates.
# These functions must be compiled WITHOUT 'reassoc': with it LLVM folds
# (t + magic) - magic back to t.
# float32 coefficients: relative-error minimax fit (Lawson iteration, see
# NOTES.md); 7.4e-8 max relative error measured over [-126, 0].
_P32 = (np.float32(1.0), np.float32(0.6931471824645996),
        np.float32(0.24022646248340607), np.float32(0.05550328642129898),
        np.float32(0.009618489071726799), np.float32(0.0013399930903688073),
        np.float32(0.0001534581242594868))
# float64: Taylor coefficients ln2**k / k!, degree 12: truncation
# 0.347**13/13! ~ 2e-16 relative on [-0.5, 0.5].
_P64 = tuple(LN2 ** kk / math.factorial(kk) for kk in range(13))
_MAGIC32 = np.float32(12582912.0 + 127.0)                 # 1.5*2**23 + 127
_MAGIC64 = np.float64(6755399441055744.0 + 1023.0)        # 1.5*2**52 + 1023
FM_EXP = {'contract', 'nsz', 'arcp', 'afn'}               # no 'reassoc'


@njit(fastmath=FM_EXP)
def exp2_f32(t):
    tc = t if not (t < np.float32(-127.0)) else np.float32(-127.0)
    tc = tc if not (tc > np.float32(64.0)) else np.float32(64.0)
    y = tc + _MAGIC32
    r = tc - (y - _MAGIC32)
    p = _P32[6]
    p = p * r + _P32[5]
    p = p * r + _P32[4]
    p = p * r + _P32[3]
    p = p * r + _P32[2]
    p = p * r + _P32[1]
    p = p * r + _P32[0]
    return p * as_float(np.int32(as_int(y) << np.int32(23)))


@njit(fastmath=FM_EXP)
def exp2_f64(t):
    tc = t if not (t < -1023.0) else -1023.0
    tc = tc if not (tc > 64.0) else 64.0
    y = tc + _MAGIC64
    r = tc - (y - _MAGIC64)
    p = _P64[12]
    p = p * r + _P64[11]
    p = p * r + _P64[10]
    p = p * r + _P64[9]
    p = p * r + _P64[8]
    p = p * r + _P64[7]
    p = p * r + _P64[6]
    p = p * r + _P64[5]
    p = p * r + _P64[4]
    p = p * r + _P64[3]
    p = p * r + _P64[2]
    p = p * r + _P64[1]
    p = p * r + _P64[0]
    return p * as_float(np.int64(as_int(y) << np.int64(52)))


def exp2v(t):  # pragma: no cover - typing stub, dispatched by the overload
    raise NotImplementedError


@overload(exp2v, fastmath=FM)
def _exp2v_ol(t):
    if t == types.float32:
        return lambda t: exp2_f32(t)
    if t == types.float64:
        return lambda t: exp2_f64(t)
    return None


# --------------------------------------------------------------------------
# tanh for softcap
# --------------------------------------------------------------------------
# float32: |x| < 0.55 -> x + x**3 * P(x**2), P of degree 4 fitted for
# relative error on [0, 0.55] (iteratively reweighted least squares,
# 1e-9 fit error; 0.79 ulp max in float32 evaluation); otherwise
# 1 - 2/(2**(2x*log2e) + 1). 0.55 is where 2/(e+1) = 1/2: below it the
# subtraction amplifies exp2's error (the earlier 0.25 switch point gave
# 5.4 ulp at x ~ 0.3, and softcap multiplies that error by the cap - enough
# to fail the float32 tolerance rule with softcap 20). Max 1.7 ulp overall
# (numpy's float32 tanh: 1.4). Both branches are computed and selected, so
# the loop vectorizes. float64 uses libm tanh (scalar, exact); float64 speed
# is not a goal.
_T32 = (np.float32(-0.33333316445350647), np.float32(0.13332585990428925),
        np.float32(-0.05385231226682663), np.float32(0.02107168175280094),
        np.float32(-0.006274242885410786))


@njit(fastmath=FM)
def tanh_f32(x):
    ax = abs(x)
    x2 = x * x
    p = _T32[4]
    p = p * x2 + _T32[3]
    p = p * x2 + _T32[2]
    p = p * x2 + _T32[1]
    p = p * x2 + _T32[0]
    small = x + x * x2 * p
    # clamp to keep exp2 finite. tanh(x) rounds to 1 in float32 from x ~ 9.01
    # on (tanh(9) = 1 - 3.05e-8 rounds down to 1 - 2**-24, which a clamp at 9
    # returned for every larger x: -1 ulp on all saturated softcap scores)
    axc = ax if ax < np.float32(10.0) else np.float32(10.0)
    e = exp2_f32(axc * np.float32(2.0 * LOG2E))
    big = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    big = big if x >= np.float32(0.0) else -big
    return small if ax < np.float32(0.55) else big


def tanhv(x):  # pragma: no cover
    raise NotImplementedError


@overload(tanhv, fastmath=FM)
def _tanhv_ol(x):
    if x == types.float32:
        return lambda x: tanh_f32(x)
    if x == types.float64:
        return lambda x: math.tanh(x)
    return None

