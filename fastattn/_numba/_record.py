"""The kernel record (fastattn/_backends/_kernel_args.py, KernelArgs) as the numba kernels take it.

A parallel kernel hands the variables of its prange body to numba's gufunc builder, which
accepts arrays, scalars and tuples of those, one level deep: a nested tuple in the record
(KernelArgs.mask_strides, KernelArgs.tuning) fails with "scalar type UniTuple(...) given for
non scalar argument". So the numba kernels get the record with its nested tuples taken out:
the mask strides become four scalar fields (msB, msH, msL, msS), the K/V strides six
(ksB, ksH, ksS, vsB, vsH, vsS) and the tuning, read in Python
when the kernel plans its blocks, is left behind. The field list is derived from KernelArgs,
so a new scalar or array field reaches the kernels with no edit here.

A KV cache read in place (docs/KERNELS.md, section 2) arrives as strided k/v views. numba
compiles a kernel per array layout, and reshape(-1) needs a contiguous array, so such a k or v
reaches the kernels as a (1, 1, 1, n) C-contiguous view of the memory from its first element
to its last (`_flat_view`): every call of a dtype then has the one type of the record, and the
kernels index k/v through the element strides (ksB ...) and the logical sizes Hkv, S
(max_pages * page_size when paged) and Ev, which are fields of their own.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .._backends._kernel_args import KernelArgs

# (the scale strides of a low-precision cache: numba's kernels do not read one, and refuse it
# in NumbaBackend.not_supported_reasons)
_NESTED = ("mask_strides", "k_strides", "v_strides", "k_scale_strides", "v_scale_strides",
           "tuning")
_FLAT = tuple(f for f in KernelArgs._fields if f not in _NESTED)
_IDX = tuple(KernelArgs._fields.index(f) for f in _FLAT)

# module level (and named after its variable), so numba's on-disk cache can pickle the type
NumbaArgs = namedtuple("NumbaArgs", _FLAT + ("msB", "msH", "msL", "msS", "ksB", "ksH", "ksS",
                                             "vsB", "vsH", "vsS", "Hkv", "S", "Ev"))


def _flat_view(x: np.ndarray, strides: tuple):
    """(array, element strides) for the kernels: x itself when C-contiguous, else a
    (1, 1, 1, n) C-contiguous view of x's memory from its first element to its last. A
    negative stride (a reversed cache) would put elements before the first: such an x is
    copied instead (rare; the copy is C-contiguous and its strides follow from its shape)."""
    if x.flags.c_contiguous:
        return x, strides
    shape = x.shape
    if x.size == 0:
        return np.zeros((1, 1, 1, 1), x.dtype), strides
    if any(n > 1 and st < 0 for n, st in zip(shape[:3], strides)):
        x = np.ascontiguousarray(x)
        _, H, S, E = shape
        return x, (H * S * E, S * E, E)
    item = x.itemsize
    span = 1 + sum((n - 1) * st for n, st in zip(shape, tuple(strides) + (1,)) if n > 1)
    return as_strided(x, shape=(1, 1, 1, span), strides=(span * item,) * 3 + (item,)), strides


def check_kv_layout(a: KernelArgs, S: int) -> None:
    """The record's cache layout against its arrays (make_cache_problem and inference.py have
    checked the caller's; this is the safety net the Cython entry has too, fill_kv_layout):
    strides that match k/v, lengths in [0, S], every page a sequence reads in the pool. The
    numba kernels do not check bounds, so a bad record would read outside the arrays."""
    k, v, B = a.k, a.v, a.q.shape[0]
    for name, x, st in (("k", k, a.k_strides), ("v", v, a.v_strides)):
        if len(st) != 3 or any(n > 1 and s * x.itemsize != xs
                               for n, s, xs in zip(x.shape, st, x.strides)):
            raise ValueError(f"attention kernel: {name} strides {tuple(st)} (elements) do not "
                             f"match the {name} array (shape {x.shape}, byte strides "
                             f"{x.strides})")
        if x.shape[3] > 1 and x.strides[3] != x.itemsize:
            raise ValueError(f"attention kernel: the last axis of {name} must be contiguous, "
                             f"got byte strides {x.strides}")
    if a.kv_kind == 3 and (a.k_scale.shape != k.shape[:3] or a.v_scale.shape != v.shape[:3]):
        raise ValueError(f"attention kernel: k_scale {a.k_scale.shape} / v_scale "
                         f"{a.v_scale.shape} must match the first three axes of k {k.shape} / "
                         f"v {v.shape}")
    paged = a.has_block_table
    if (v.shape[:3] != k.shape[:3] or k.shape[3] != a.q.shape[3]
            or (paged and (a.page_size <= 0 or k.shape[2] != a.page_size
                           or a.block_table.shape[0] != B))
            or (not paged and k.shape[0] != B)):
        raise ValueError(f"attention kernel: q {a.q.shape}, k {k.shape}, v {v.shape}"
                         + (f", block_table {a.block_table.shape}, page_size {a.page_size}"
                            if paged else "") + " do not agree")
    lens = None
    if a.has_seqlens:
        lens = a.seqlens
        if lens.shape != (B,):
            raise ValueError(f"attention kernel: seqlens shape {lens.shape}, expected ({B},)")
        if B and (lens.min() < 0 or lens.max() > S):
            raise ValueError(f"attention kernel: seqlens {lens.tolist()[:16]} outside [0, {S}]")
    if paged:
        ps, bt = a.page_size, a.block_table
        n = np.full(B, S, np.int64) if lens is None else lens.astype(np.int64)
        pages = bt[np.arange(bt.shape[1])[None, :] < ((n + ps - 1) // ps)[:, None]]
        if pages.size and (pages.min() < 0 or pages.max() >= k.shape[0]):
            raise ValueError(f"attention kernel: block_table holds pages outside [0, "
                             f"{k.shape[0]}) among those the sequences read")


def numba_args(a: KernelArgs) -> NumbaArgs:
    """The record without nested tuples (one per call, a few microseconds)."""
    k, v = a.k, a.v
    ks, vs = a.k_strides, a.v_strides
    # The row stride of a one-row key axis addresses nothing and may be anything (broadcast_to
    # leaves 0), but the float64 kernels hand it to BLAS as a leading dimension, which must be
    # at least the row's length: DGEMM rejected 0 ("parameter number 8 had an illegal value")
    # and left the scores unwritten, so a (B, H, 1, E) cache broadcast over B gave garbage.
    if k.shape[2] == 1:
        ks = (ks[0], ks[1], max(k.shape[3], 1))
    if v.shape[2] == 1:
        vs = (vs[0], vs[1], max(v.shape[3], 1))
    S = a.block_table.shape[1] * a.page_size if a.has_block_table else k.shape[2]
    dims = (k.shape[1], S, v.shape[3])
    if a.has_seqlens or a.has_block_table or a.kv_kind or not (k.flags.c_contiguous
                                                  and v.flags.c_contiguous):
        check_kv_layout(a, S)
    if not (k.flags.c_contiguous and v.flags.c_contiguous):
        k, ks = _flat_view(k, ks)
        v, vs = _flat_view(v, vs)
        a = a._replace(k=k, v=v)
    return NumbaArgs(*[a[i] for i in _IDX], *a.mask_strides, *ks, *vs, *dims)


def positive(name: str, value: int, default: int) -> int:
    """A tuning field's value: `default` for 0 (the backend chooses), else value, which must be
    >= 1."""
    value = int(value)
    if value == 0:
        return default
    if value < 0:
        raise ValueError(f"tuning.{name} must be >= 1 (or 0 for the default), got {value}")
    return value
