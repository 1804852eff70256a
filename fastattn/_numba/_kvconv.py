"""Reading a low-precision KV cache (fastattn/_kvdtypes.py) as float32, a key block at a time.

The record's kv_kind: 1 float16 and 2 bfloat16 (k/v arrive as uint16 views of their bits),
3 int8 codes whose key j of (b, h) reads float32(code) * k_scale[b, h, j] (paged: the page's
row). `convert_rows` converts the rows of one kv head's key block (found as _kv.gather_k finds
them: run by run of one stride) into a dense float32 tile, which the float32 decode code then
reads; never more than a block, so the cache is read in place. The conversions are exact (the
cache's value is a float32 number; int8's product is the one the cache is defined to hold):
16-bit floats through a table of every bit pattern's value.
"""
import numpy as np
from numba import njit

from ._kv import kv_run


# Every 16-bit pattern's value, as NumPy converts it (exactly): a float16 or bfloat16 element
# is one table lookup (256 KiB each, L2-resident while a block is converted). Computing the
# value per element (an integer significand times a power of two, math.ldexp) took ~16x the
# float32 cache's decode time at the bench's size; the tables, numba compiles in as constants.
F16_VALUES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(
    np.float32)
BF16_VALUES = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)


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
                    dst[d + t] = BF16_VALUES[xf[src + t]]
            else:
                for t in range(width):
                    dst[d + t] = F16_VALUES[xf[src + t]]
        s0 += ns
