"""Reading a low-precision KV cache (fastattn/_kvdtypes.py) as float32, a key block at a time.

The record's kv_kind: 1 float16 and 2 bfloat16 (k/v arrive as uint16 views of their bits),
3 int8 codes whose key j of (b, h) reads float32(code) * k_scale[b, h, j] (paged: the page's
row). `convert_rows` converts the rows of one kv head's key block (found as _kv.gather_k finds
them: run by run of one stride) into a dense float32 tile, which the float32 decode code then
reads; never more than a block, so the cache is read in place. The conversions are exact (the
cache's value is a float32 number; int8's product is the one the cache is defined to hold),
written as arithmetic (a float16 or bfloat16 number is an integer significand times a power of
two), as csrc/fa_kvconv.h does with bits.
"""
import math

import numpy as np
from numba import njit

from ._kv import kv_run


@njit(inline="always")
def half_to_float(h):
    """IEEE binary16 bits (an int in [0, 65535]) -> its value as float32."""
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0x1F:
        x = np.inf if man == 0 else np.nan
    elif exp == 0:
        x = math.ldexp(float(man), -24)
    else:
        x = math.ldexp(float(1024 + man), exp - 25)
    return np.float32(-x if h & 0x8000 else x)


@njit(inline="always")
def bf16_to_float(h):
    """bfloat16 bits -> its value as float32 (the top half of a binary32)."""
    exp = (h >> 7) & 0xFF
    man = h & 0x7F
    if exp == 0xFF:
        x = np.inf if man == 0 else np.nan
    elif exp == 0:
        x = math.ldexp(float(man), -133)
    else:
        x = math.ldexp(float(128 + man), exp - 134)
    return np.float32(-x if h & 0x8000 else x)


@njit(nogil=True)
def convert_rows(a, b, hk, j0, n, xf, scales, dst, values):
    """Keys j0 .. j0+n-1 of kv head (b, hk) from the stored k (values: v), xf = its flat view,
    into rows 0 .. n-1 of dst (E or Ev float32 elements apart); scales: k_scale / v_scale
    (int8 only)."""
    width = a.Ev if values else a.q.shape[3]
    kind = a.kv_kind
    s0 = 0
    while s0 < n:
        j = j0 + s0
        ko, vo, end = kv_run(a, b, j)
        ns = min(n - s0, end - j)
        off = (vo + hk * a.vsH) if values else (ko + hk * a.ksH)
        ld = a.vsS if values else a.ksS
        for r in range(ns):
            src = off + r * ld
            d = (s0 + r) * width
            if kind == 3:
                jj = j + r
                if a.has_block_table:
                    sc = scales[a.block_table[b, jj // a.page_size], hk, jj % a.page_size]
                else:
                    sc = scales[b, hk, jj]
                for t in range(width):
                    dst[d + t] = np.float32(xf[src + t]) * sc
            elif kind == 2:
                for t in range(width):
                    dst[d + t] = bf16_to_float(np.int64(xf[src + t]))
            else:
                for t in range(width):
                    dst[d + t] = half_to_float(np.int64(xf[src + t]))
        s0 += ns
