"""Reading a low-precision KV cache (fastattn/_kvdtypes.py) as float32, a key block at a time.

The record's kv_kind: 1 float16 and 2 bfloat16 (k/v arrive as uint16 views of their bits),
3 int8 codes whose key j of (b, h) reads float32(code) * k_scale[b, h, j] (paged: the page's
row). `convert_rows` converts the rows of one kv head's key block (found as _kv.gather_k finds
them: run by run of one stride) into a dense float32 tile, which the float32 decode code then
reads; never more than a block, so the cache is read in place. The conversions are exact (the
cache's value is a float32 number; int8's product is the one the cache is defined to hold).
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from ._intrinsics import HAVE_F16C, bf16_to_f32, f16_to_f32, i8_to_f32, prefetch_l2
from ._kv import kv_run

# Rows ahead of the one converted whose lines convert_rows prefetches (to L2). The
# conversion is the cache's first touch, and the float32 kernels' own prefetch then reads the
# converted tile, so without this the cache's rows (a kv head's 1-2 KiB apart) came in at
# DRAM latency: one thread, B1 32/8 heads d128 8192 keys, int8 17.5-19.8 -> 9.9-11.3 ms,
# float16 25.7-34.9 -> 19.4-21.8 (interleaved processes, the host busy); 32 rows: no better.
CONV_PF_ROWS = 16


# float16 -> float32 where the CPU has F16C: LLVM's fpext, vcvtph2ps (_intrinsics.f16_to_f32;
# B4 32/8 heads d128 1024 keys, Zen 4: the integer code below took ~0.5 ns an element). Else,
# by integer operations that vectorize (a table of every pattern's value,
# one gather per element, ran at ~1 ns an element; this, ~0.6): the exponent and significand
# shifted into float32's places and the exponent rebiased (+112) by an integer add; the
# largest exponent (inf, NaN) set to float32's; then the sign. Subnormals (exponent 0, their
# float32 values normal) are the one case computed in float, mant * 2^-24, and only when a
# row has one. No float operation here reads or makes a subnormal: with denormals-are-zero on
# (torch.set_flush_denormal(True)), a rebias by multiplication read the shifted bits as 0.
# Every one of the 65536 patterns equals NumPy's conversion bit for bit (tests/test_kvdtypes.py).
_F16_SUBNORMAL_ULP = np.float32(2.0 ** -24)


@njit(nogil=True, inline="always")
def _f16_row(xs, ds, du):
    """float16 bits xs (uint16) -> float32 ds; du: ds's uint32 view."""
    sub = np.uint32(0)
    for t in range(xs.shape[0]):
        h = np.uint32(xs[t])
        e = h & np.uint32(0x7C00)
        u = ((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(0x38000000)
        if e == np.uint32(0x7C00):
            u = u | np.uint32(0x7F800000)
        elif e == np.uint32(0):
            sub |= h & np.uint32(0x3FF)
            u = np.uint32(0)
        du[t] = u | ((h & np.uint32(0x8000)) << np.uint32(16))
    if sub:
        for t in range(xs.shape[0]):
            h = np.uint32(xs[t])
            if (h & np.uint32(0x7C00)) == np.uint32(0):
                v = np.float32(h & np.uint32(0x3FF)) * _F16_SUBNORMAL_ULP
                ds[t] = -v if (h & np.uint32(0x8000)) else v


@njit(nogil=True, inline="always")
def key_scale(a, b, hk, j, scales):
    """The int8 scale of key j of kv head (b, hk): scales (k_scale / v_scale) by sequence, or,
    paged, by the page holding the key."""
    if a.has_block_table:
        return scales[a.block_table[b, j // a.page_size], hk, j % a.page_size]
    return scales[b, hk, j]


def _convert_row(kind, xf, src, dst, d, width, sc):  # pragma: no cover - see the overload
    raise NotImplementedError


@overload(_convert_row, inline="always")
def _convert_row_ol(kind, xf, src, dst, d, width, sc):
    """dst[d:d+width] = the values of the stored elements xf[src:src+width], by kind, through
    the vector converters of _intrinsics.py (no slices: each costs numba a reference count,
    an atomic, and per cache row they were ~20% of an int8 decode's samples)."""
    if xf.dtype == types.int8:
        return lambda kind, xf, src, dst, d, width, sc: i8_to_f32(xf, src, dst, d, width, sc)

    def impl(kind, xf, src, dst, d, width, sc):
        if kind == 2:                          # bfloat16: the top half of a float32
            bf16_to_f32(xf, src, dst, d, width, sc)
        elif HAVE_F16C:                        # one vcvtph2ps a vector
            f16_to_f32(xf, src, dst, d, width, sc)
        else:
            _f16_row(xf[src:src + width], dst[d:d + width], dst.view(np.uint32)[d:d + width])
    return impl


@njit(nogil=True)
def convert_rows(a, b, hk, j0, n, xf, scales, dst, values):
    """Keys j0 .. j0+n-1 of kv head (b, hk) from the stored k (values: v), xf = its flat view,
    into rows 0 .. n-1 of dst (E or Ev float32 elements apart); scales: k_scale / v_scale
    (int8 only). Each row by one vector converter (_convert_row): indexed as xf[src + t] the
    loops stayed scalar (numba's negative-index handling, ~1 ns an element), and slices cost
    a reference count each."""
    width = a.Ev if values else a.q.shape[3]
    kind = a.kv_kind
    line = 64 // xf.itemsize            # elements per cache line, for the prefetch
    s0 = 0
    while s0 < n:
        j = j0 + s0
        ko, vo, end = kv_run(a, b, j)
        ns = min(n - s0, end - j)
        off = (vo + hk * a.vsH) if values else (ko + hk * a.ksH)
        ld = a.vsS if values else a.ksS
        for r in range(ns):
            src = off + r * ld
            ahead = src + CONV_PF_ROWS * ld
            t = 0
            while t < width:        # range(0, width, line) divided for its trip count each row
                prefetch_l2(xf, ahead + t)
                t += line
            sc = key_scale(a, b, hk, j + r, scales) if kind == 3 else np.float32(0.0)
            _convert_row(kind, xf, src, dst, (s0 + r) * width, width, sc)
        s0 += ns
