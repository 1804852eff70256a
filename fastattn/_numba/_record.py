"""The kernel record (fastattn/_backends/_kernel_args.py, KernelArgs) as the numba kernels take it.

A parallel kernel hands the variables of its prange body to numba's gufunc builder, which
accepts arrays, scalars and tuples of those, one level deep: a nested tuple in the record
(KernelArgs.mask_strides, KernelArgs.tuning) fails with "scalar type UniTuple(...) given for
non scalar argument". So the numba kernels get the record with its nested tuples taken out:
the mask strides become four scalar fields (msB, msH, msL, msS), the K/V strides six
(ksB, ksH, ksS, vsB, vsH, vsS) and the tuning, read in Python
when the kernel plans its blocks, is left behind. The field list is derived from KernelArgs,
so a new scalar or array field reaches the kernels with no edit here.
"""
from __future__ import annotations

from collections import namedtuple

from .._backends._kernel_args import KernelArgs

_NESTED = ("mask_strides", "k_strides", "v_strides", "tuning")
_FLAT = tuple(f for f in KernelArgs._fields if f not in _NESTED)
_IDX = tuple(KernelArgs._fields.index(f) for f in _FLAT)

# module level (and named after its variable), so numba's on-disk cache can pickle the type
NumbaArgs = namedtuple("NumbaArgs", _FLAT + ("msB", "msH", "msL", "msS", "ksB", "ksH", "ksS",
                                             "vsB", "vsH", "vsS"))


def numba_args(a: KernelArgs) -> NumbaArgs:
    """The record without nested tuples (one per call, a few microseconds)."""
    return NumbaArgs(*[a[i] for i in _IDX], *a.mask_strides, *a.k_strides, *a.v_strides)


def positive(name: str, value: int, default: int) -> int:
    """A tuning field's value: `default` for 0 (the backend chooses), else value, which must be
    >= 1."""
    value = int(value)
    if value == 0:
        return default
    if value < 0:
        raise ValueError(f"tuning.{name} must be >= 1 (or 0 for the default), got {value}")
    return value
