"""The dtypes a KV cache may have, in one table: what each stores, what it computes in, how a new
token is written, how a stored element is read back.

    kind  cache dtype       stored per element            a cached value is
    0     float32/float64   the value                     itself (the compute dtype: q's)
    1     float16           the value, rounded            float32(x)              (exact)
    2     bfloat16          the value, rounded            float32(x)              (exact)
    3     int8              a code in [-127, 127]         float32(code) * scale[b, s, h]

Kinds 1-3 compute in float32 whatever q's dtype (float16, bfloat16, float32, float64): q is
cast to float32, out is given back in q's dtype and lse in float32. New keys/values are cast to
the cache's dtype on write (NumPy's astype: round to nearest even), or quantized (int8):
per token and kv head over the head dim, scale = max|x| / 127 in float32 and code =
round-half-to-even(x / scale) clipped to +-127, symmetric (no zero point).

bfloat16 is ml_dtypes.bfloat16; this module never imports ml_dtypes (a bfloat16 array brings
its dtype with it, recognized by name).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._inputs import as_float_array, describe

__all__ = ["quantize_kv", "dequantize_kv"]


class CacheKind(NamedTuple):
    code: int            # the kernel record's kv_kind
    name: str
    low: bool            # stored below the compute precision: compute in float32
    scaled: bool         # int8: per-token, per-head float32 scales go with the codes


FULL = CacheKind(0, "float", False, False)
FLOAT16 = CacheKind(1, "float16", True, False)
BFLOAT16 = CacheKind(2, "bfloat16", True, False)
INT8 = CacheKind(3, "int8", True, True)

_BY_DTYPE = {np.dtype(np.float32): FULL, np.dtype(np.float64): FULL,
             np.dtype(np.float16): FLOAT16, np.dtype(np.int8): INT8}

CODE_MAX = 127                                   # symmetric: -128 is never written


def kind_of(dtype: np.dtype) -> CacheKind | None:
    """The cache kind of a (native-order) dtype, or None when a cache cannot have it."""
    kind = _BY_DTYPE.get(dtype)
    if kind is None and dtype.name == "bfloat16" and dtype.itemsize == 2:
        kind = BFLOAT16
    return kind


_BY_CODE = {k.code: k for k in (FULL, FLOAT16, BFLOAT16, INT8)}


def kind_by_code(code: int) -> CacheKind:
    return _BY_CODE[code]


def cache_array(x, name: str, fn: str) -> np.ndarray:
    """A cache argument as an ndarray of a cache dtype (float in native order: a converted
    copy of another byte order, which the caller also writes back into)."""
    if isinstance(x, np.ndarray) and x.dtype == np.int8:
        return x
    if not isinstance(x, np.ndarray) and np.asarray(x).dtype == np.int8:
        return np.asarray(x)
    try:
        return as_float_array(x, name, fn)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be a float16, bfloat16, float32, float64 or int8 "
                        f"array, got {describe(x)}") from None


def quantize_kv(x) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale) of a float array x (..., E): int8 codes (..., E) and float32 scales (...,).

    Per row over the last axis, in float32 (x is converted first): scale = max|x| / 127 and
    code = round-half-to-even(x / scale) clipped to [-127, 127]; a row whose scale is 0 (all
    zeros, or so small that max|x| / 127 underflows) gets codes 0. The row then reads back as
    float32(code) * scale. x must be finite: ValueError otherwise (a NaN or Inf has no code).
    """
    fn = "quantize_kv"
    arr = as_float_array(x, "x", fn)
    if arr.ndim < 1:
        raise ValueError(f"{fn}: x must have at least one axis (the head dim), got a scalar")
    return _quantize(arr, "x", fn)


def _compiled_quantizer():
    """The extension's quantize_kv_rows (csrc/fa_kvconv.h), or None without the extension."""
    global _QUANTIZER
    if _QUANTIZER is None:
        try:
            # the backend's import: libgomp must load with its threads waiting passively
            from ._backends.cython_ import _import_kernels
            _QUANTIZER = _import_kernels().quantize_kv_rows
        except ImportError:
            _QUANTIZER = False
    return _QUANTIZER or None


_QUANTIZER = None


def _quantize(arr: np.ndarray, name: str, fn: str) -> tuple[np.ndarray, np.ndarray]:
    x = arr.astype(np.float32, copy=False)
    if x.shape[-1] == 0:
        return np.zeros(x.shape, np.int8), np.zeros(x.shape[:-1], np.float32)
    quantize_rows = _compiled_quantizer()
    if quantize_rows is not None and x.size:
        # one C call: a decode step quantizes one token per kv head, where the NumPy code's ~12
        # calls, not the elements, were the time (~12 us per array at (1, 1, 12, 64))
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        codes = np.empty(rows.shape, np.int8)
        scale = np.empty(rows.shape[0], np.float32)
        if not quantize_rows(rows, codes, scale):
            raise ValueError(f"{fn}: {name} must be finite to be quantized to int8, got NaN or "
                             f"Inf (in {describe(arr)})")
        scale = scale.reshape(x.shape[:-1])
        # one row: a float32 scalar, as NumPy's reduction gives
        return codes.reshape(x.shape), (scale[()] if x.ndim == 1 else scale)
    return _quantize_numpy(x, arr, name, fn)


def _quantize_numpy(x: np.ndarray, arr: np.ndarray, name: str, fn: str):
    """The rule in NumPy (the reference; and without the extension): x float32 of arr."""
    amax = np.abs(x).max(axis=-1)
    if not np.isfinite(amax).all():              # max carries a NaN or an Inf through
        raise ValueError(f"{fn}: {name} must be finite to be quantized to int8, got NaN or Inf "
                         f"(in {describe(arr)})")
    scale = amax / np.float32(CODE_MAX)          # float32 throughout
    codes = x / np.where(scale > 0, scale, np.float32(1))[..., None]
    np.rint(codes, out=codes)                    # np.rint: round half to even
    # |x| / (max|x| / 127) rounds to 127 at most, but for a scale in float32's subnormal range,
    # whose rounding can push a quotient past it (max|x| = 190 * 2^-149: scale 2^-149). A row
    # whose scale is 0 has max|x| <= 127 * 2^-150: divided by 1 and rounded, its codes are 0.
    np.clip(codes, -CODE_MAX, CODE_MAX, out=codes)
    return codes.astype(np.int8), scale


def dequantize_kv(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32(codes) * scale[..., None]: the values an int8 cache holds (float32)."""
    return codes.astype(np.float32) * np.asarray(scale, np.float32)[..., None]


def encode(kind: CacheKind, x: np.ndarray, cache_dtype: np.dtype, name: str, fn: str):
    """New tokens x (B, Lnew, Hkv, E) as the cache stores them: (values, scales or None)."""
    if kind.scaled:
        return _quantize(x, name, fn)
    return x.astype(cache_dtype, copy=False), None


def as_compute(kind: CacheKind, tile: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """A tile of stored keys/values (..., n, E) as float32 values (the reference's reading:
    scales (..., n) of int8 codes). Kind 0 is returned as it is."""
    if not kind.low:
        return tile
    out = tile.astype(np.float32)
    if kind.scaled:
        out *= scales[..., None]
    return out


def check_scales(kind: CacheKind, k_scale, v_scale, want: tuple, writes: bool, fn: str):
    """(k_scale, v_scale) of an int8 cache of (slots, slot_len, Hkv): float32 arrays of that
    shape, writeable when new tokens are written; (None, None) for a float cache, which must
    not get any."""
    if not kind.scaled:
        given = [n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None]
        if given:
            raise ValueError(f"{fn}: {' and '.join(given)} belong to an int8 cache; this cache "
                             f"is {kind.name}")
        return None, None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{fn}: an int8 cache needs {name} (float32 {want}: the per-token, "
                             f"per-head scale of its codes), got None")
        if not isinstance(s, np.ndarray) or s.dtype != np.float32:
            raise TypeError(f"{fn}: {name} must be a float32 array (native byte order) of shape "
                            f"{want}, got {describe(s)}")
        if s.shape != want:
            raise ValueError(f"{fn}: {name} must have the cache's shape {want} (slots, "
                             f"positions, kv heads), got {s.shape}")
        if writes and not s.flags.writeable:
            raise ValueError(f"{fn}: {name} is read-only; the new tokens' scales are written "
                             f"into it in place")
        out.append(s)
    return out[0], out[1]
