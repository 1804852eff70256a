"""The dropout hash: which attention weights dropout keeps, as a pure function of (seed, bh, i, j).

Being a function of the coordinates (not a random stream) makes the kept set identical in every
backend and for every tiling, and lets the backward pass regenerate it instead of storing an
(L, S) mask. All arithmetic is on unsigned 32-bit values modulo 2**32; the compiled kernels use
the same constants (see csrc/ and fastattn/_numba/_common.py).

    mix32(x)  = x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    row_key   = mix32(mix32(seed ^ mix32(bh)) + i)
    bits      = mix32(row_key ^ (j * 0x9E3779B1))
    keep      = bits >= floor(p * 2**32)

mix32 is a well-known 32-bit integer finalizer (multiply-xorshift); its constants are published
hash parameters. bh = b * Hq + h over the flattened batch and the *query* head.
"""
from __future__ import annotations

import numpy as np

M32 = np.uint64(0xFFFFFFFF)
C1 = np.uint64(0x7FEB352D)
C2 = np.uint64(0x846CA68B)
GOLDEN = np.uint64(0x9E3779B1)


def mix32(x: np.ndarray) -> np.ndarray:
    """mix32 on uint64 arrays holding 32-bit values (uint64 so products can be reduced mod 2**32)."""
    x = np.asarray(x, dtype=np.uint64)
    x = x ^ (x >> np.uint64(16))
    x = (x * C1) & M32
    x = x ^ (x >> np.uint64(15))
    x = (x * C2) & M32
    return x ^ (x >> np.uint64(16))


def threshold(p: float) -> int:
    """Keep a weight iff its 32 hash bits are >= this; P(keep) = 1 - p up to 2**-32."""
    return min(int(np.floor(p * 2.0**32)), 2**32 - 1)


def row_keys(seed: int, bh, i) -> np.ndarray:
    """row_key for broadcastable arrays of bh and i."""
    base = mix32(np.uint64(seed) ^ mix32(bh))
    return mix32((base + np.asarray(i, dtype=np.uint64)) & M32)


def keep_mask(seed: int, p: float, bh, i, j) -> np.ndarray:
    """Boolean keep-mask for broadcastable index arrays bh, i, j."""
    rk = row_keys(seed, bh, i)
    jbits = (np.asarray(j, dtype=np.uint64) * GOLDEN) & M32
    return mix32(rk ^ jbits) >= np.uint64(threshold(p))


def origin(problem) -> tuple:
    """(bh0, bh_stride, row0, col0) of a Problem: where it sits in the problem whose hash
    coordinates it uses (its own, (0, Hq, 0, 0), unless a caller computing a piece set it)."""
    o = problem.dropout_origin
    return (0, problem.q.shape[1], 0, 0) if o is None else tuple(int(x) for x in o)


def piece_keep(seed: int, p: float, org: tuple, b, h, i, j) -> np.ndarray:
    """keep_mask for element (b, h, i, j) of a piece at origin `org`: hash coordinates
    (bh0 + b * bh_stride + h, row0 + i, col0 + j), each a uint32 (mod 2**32, as in C)."""
    bh0, stride, row0, col0 = (np.uint64(x) for x in org)
    u = lambda x: np.asarray(x, dtype=np.uint64)
    bh = (bh0 + u(b) * stride + u(h)) & M32
    return keep_mask(seed, p, bh, (row0 + u(i)) & M32, (col0 + u(j)) & M32)
