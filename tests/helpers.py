"""Test helpers: inputs, and the tolerance rule used against the float64 reference.

Tolerance (flash-attn's rule; docs/KERNELS.md states it too): float64 within 1e-10 relative; for
lower precision, error vs the float64 reference <= 2 x the error of a naive same-precision NumPy
computation (the reference run in that dtype) + a small floor.
"""
from __future__ import annotations

import numpy as np

from fastattn import reference

LOW_PRECISION_FLOOR = 1e-6


def randn(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def max_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    same = (a == b)                                # -inf lse on both sides counts as equal
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(a - b))
    return float(np.max(diff)) if diff.size else 0.0


def assert_close_to_reference(got, ref64, naive, dtype, what="out"):
    """got (any dtype) vs ref64 (float64), with naive = the same computation in `dtype`'s precision."""
    got = np.asarray(got)
    assert got.shape == ref64.shape, f"{what}: shape {got.shape} != {ref64.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(ref64)), f"{what}: NaN positions differ"
    assert np.array_equal(np.isneginf(got), np.isneginf(ref64)), f"{what}: -inf positions differ"
    err = max_err(got, ref64)
    if np.dtype(dtype) == np.float64:
        scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(ref64), ref64, 0)), initial=0)))
        bound = 1e-10 * scale
    else:
        bound = 2 * max_err(naive, ref64) + LOW_PRECISION_FLOOR
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} ({np.dtype(dtype).name})"


def check_sdpa(q, k, v, backend, **kw):
    """Run fastattn and the reference in float64 and in the input's precision; assert the rule."""
    import fastattn as fa

    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, backend=backend, **kw)
    ref_out, ref_lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    low = np.float64 if q.dtype == np.float64 else np.float32
    naive_out, naive_lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, dtype=low, **kw)
    if q.dtype == np.float16:
        naive_out = naive_out.astype(np.float16)
    assert out.dtype == q.dtype
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    assert_close_to_reference(out, ref_out, naive_out, low if q.dtype != np.float16 else np.float16, "out")
    assert_close_to_reference(lse, ref_lse, naive_lse, low, "lse")
    return out, lse


def package_root() -> str:
    """Where the fastattn under test lives: the working directory for `python -c`/`-m` children,
    which put their working directory first on sys.path. Run from a source checkout, they would
    otherwise import the tree's fastattn/ (without its compiled extension), not this one."""
    import os

    import fastattn

    return os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
