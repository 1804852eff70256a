"""The dropout hash of docs/KERNELS.md, in Numba (same bits as fastattn/_dropout.py)."""
import math

import numpy as np
from numba import njit

# --------------------------------------------------------------------------
# Dropout hash (docs/KERNELS.md). All values are uint64 holding 32-bit
# numbers; every product is masked back to 32 bits. Constants are typed
# uint64 explicitly: uint64 op int64 would be promoted to float64 by Numba.
# --------------------------------------------------------------------------
_M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(0x7FEB352D)
_C2 = np.uint64(0x846CA68B)
_GOLD = np.uint64(0x9E3779B1)
_S15 = np.uint64(15)
_S16 = np.uint64(16)


@njit
def mix32(x):
    x = x ^ (x >> _S16)
    x = (x * _C1) & _M32
    x = x ^ (x >> _S15)
    x = (x * _C2) & _M32
    x = x ^ (x >> _S16)
    return x


@njit
def dropout_row_key(seed, bh, i):
    s = np.uint64(seed) & _M32
    k = mix32(s ^ mix32(np.uint64(bh) & _M32))
    return mix32((k + (np.uint64(i) & _M32)) & _M32)


@njit
def dropout_bits(row_key, j):
    return mix32(row_key ^ ((np.uint64(j) * _GOLD) & _M32))


def dropout_threshold(p):
    """Python-side: min(floor(p * 2**32), 2**32 - 1) as an int."""
    return min(int(math.floor(p * 4294967296.0)), 4294967295)


@njit
def dropout_threshold_nb(p):
    t = math.floor(p * 4294967296.0)
    if t > 4294967295.0:
        t = 4294967295.0
    return np.uint64(t)



@njit
def dropout_bh(a, b, h):
    """The hash's (batch, head) coordinate of batch b, query head h of the record `a`: where
    this call sits in a larger problem (KernelArgs.dropout_bh0, dropout_bh_stride; a whole
    problem is b * Hq + h). Rows and keys add a.dropout_row0 / a.dropout_col0."""
    return a.dropout_bh0 + b * a.dropout_bh_stride + h
