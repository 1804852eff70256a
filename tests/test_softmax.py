"""The softmax kernel family and the classic helpers built on it (softmax, attention, multihead)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import randn

import fastattn as fa
from fastattn import reference


def classic_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,axis", [((7,), 0), ((4, 33), -1), ((3, 5, 129), 1), ((2, 3, 4, 1000), -1),
                                        ((6, 1), 0)])
def test_matches_classic(backend, rng, dtype, shape, axis):
    x = randn(rng, shape, dtype, scale=5)
    got = fa.softmax(x, axis=axis, backend=backend)
    assert got.dtype == dtype and got.shape == shape
    want = classic_softmax(x.astype(np.float64), axis=axis)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("threads", [2, 3])
def test_rows_split_across_threads_are_each_done_once(backend, rng, monkeypatch, threads):
    """Large enough for the compiled kernels to use threads (cython: >= 64k elements per
    thread), in chunks of rows claimed from a shared counter with a short last chunk
    (3003 rows): every row matches the classic softmax, masked or not."""
    monkeypatch.setenv("FASTATTN_NUM_THREADS", str(threads))
    fa.reload_environment()
    x = randn(rng, (3, 1001, 67), np.float32, scale=5)
    np.testing.assert_allclose(fa.softmax(x, backend=backend), classic_softmax(x.astype(np.float64)),
                               rtol=2e-6, atol=2e-6)
    keep = rng.random(x.shape) < 0.7
    got = fa.softmax(x, mask=keep, backend=backend)
    want = classic_softmax(np.where(keep, x.astype(np.float64), -np.inf))
    np.testing.assert_allclose(got, np.nan_to_num(want), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("mask_kind", ["bool", "int01", "float01"])
def test_mask_conventions(backend, rng, mask_kind):
    x = randn(rng, (3, 4, 50), scale=3)
    keep = rng.random((4, 50)) > 0.4
    keep[1] = False                                      # a fully masked row
    mask = {"bool": keep, "int01": keep.astype(np.int64), "float01": keep.astype(np.float32)}[mask_kind]
    got = fa.softmax(x, mask=mask, backend=backend)
    want = reference.softmax(x, mask=keep)
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert np.all(got[:, 1] == 0) and not np.isnan(got).any()
    np.testing.assert_allclose(got[:, [0, 2, 3]].sum(-1), 1, rtol=1e-5)


def test_rows_of_neg_inf_and_large_values(backend):
    x = np.array([[-np.inf, -np.inf, -np.inf], [1000.0, 0.0, -1000.0], [-np.inf, 0.0, -np.inf]],
                 np.float32)
    got = fa.softmax(x, backend=backend)
    np.testing.assert_array_equal(got[0], 0)
    np.testing.assert_allclose(got[1], [1, 0, 0])
    np.testing.assert_allclose(got[2], [0, 1, 0])


def test_nan_propagates_in_its_row_only(backend):
    x = np.array([[0.0, np.nan, 1.0], [0.0, 1.0, 2.0]])
    got = fa.softmax(x, backend=backend)
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


def test_dtypes_and_promotion(backend, rng):
    assert fa.softmax(np.arange(4), backend=backend).dtype == np.float64
    x16 = randn(rng, (5, 9), np.float16)
    got = fa.softmax(x16, backend=backend)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), classic_softmax(x16.astype(np.float64)), atol=1e-3)
    with pytest.raises(TypeError, match="softmax: x must be a real"):
        fa.softmax(np.ones(3, np.complex64))
    with pytest.raises(np.exceptions.AxisError):
        fa.softmax(np.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match="mask of shape"):
        fa.softmax(np.ones((2, 3)), mask=np.ones(4, bool))


def test_softmax_property_based():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from hypothesis.extra.numpy import arrays

    @settings(max_examples=60, deadline=None)
    @given(arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(1, 40)),
                  elements=st.floats(-1e6, 1e6)))
    def rows_sum_to_one(x):
        w = fa.softmax(x)
        assert np.all(w >= 0)
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
        np.testing.assert_allclose(w, classic_softmax(x), atol=1e-12)

    rows_sum_to_one()


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_matches_classic(backend, rng, dtype):
    q, k, v = randn(rng, (2, 3, 11, 8), dtype), randn(rng, (2, 3, 13, 8), dtype), randn(rng, (2, 3, 13, 5), dtype)
    mask = rng.random((11, 13)) > 0.3
    out, w = fa.attention(q, k, v, mask, backend=backend)
    ref_out, ref_w = reference.attention(q, k, v, mask)
    tol = 1e-12 if dtype == np.float64 else 3e-6
    np.testing.assert_allclose(w, ref_w, atol=tol)
    np.testing.assert_allclose(out, ref_out, atol=tol)
    assert out.dtype == w.dtype == dtype
    # the same as the torch-style entry point with a bool mask
    np.testing.assert_allclose(out, fa.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=tol)


def test_attention_fully_masked_row_is_zero_not_uniform(backend, rng):
    q, k, v = randn(rng, (4, 8)), randn(rng, (6, 8)), randn(rng, (6, 3))
    mask = np.ones((4, 6), np.int64)
    mask[2] = 0
    out, w = fa.attention(q, k, v, mask, backend=backend)
    assert np.all(w[2] == 0) and np.all(out[2] == 0)


def test_attention_broadcasts_leading_dims(rng):
    q = randn(rng, (2, 3, 5, 4))
    k = randn(rng, (3, 6, 4))
    v = randn(rng, (1, 1, 6, 2))
    out, w = fa.attention(q, k, v)
    assert out.shape == (2, 3, 5, 2) and w.shape == (2, 3, 5, 6)
    ref_out, _ = reference.attention(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)


def test_split_and_merge_heads_roundtrip(rng):
    X = randn(rng, (2, 7, 12))
    Y = fa.split_heads(X, 3)
    assert Y.shape == (2, 3, 7, 4)
    np.testing.assert_array_equal(Y[:, 1], X[..., 4:8])
    np.testing.assert_array_equal(fa.merge_heads(Y), X)
    with pytest.raises(ValueError, match="not divisible by num_heads=5"):
        fa.split_heads(X, 5)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        fa.split_heads(X, 0)
    with pytest.raises(TypeError, match="num_heads"):
        fa.split_heads(X, 2.0)


def test_multihead_matches_per_head_loop(backend, rng):
    L, D, H = 9, 12, 3
    X = randn(rng, (2, L, D), np.float64)
    Wq, Wk, Wv, Wo = (randn(rng, (D, D), np.float64) * 0.3 for _ in range(4))
    Y, A = fa.multihead(X, Wq, Wk, Wv, Wo, H, mask=fa.causal_mask(L), backend=backend)
    assert Y.shape == (2, L, D) and A.shape == (2, H, L, L)
    dh = D // H
    heads = []
    for h in range(H):
        sl = slice(h * dh, (h + 1) * dh)
        o, a = reference.attention(X @ Wq[:, sl], X @ Wk[:, sl], X @ Wv[:, sl], fa.causal_mask(L))
        np.testing.assert_allclose(A[:, h], a, atol=1e-12)
        heads.append(o)
    np.testing.assert_allclose(Y, np.concatenate(heads, -1) @ Wo, atol=1e-12)
    with pytest.raises(ValueError, match="Wq must have 12 rows"):
        fa.multihead(X, Wq[:5], Wk, Wv, Wo, H)
