"""The public contract outside the kernels: validation, shapes, layouts, dtypes, merging."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import randn

import fastattn as fa
from fastattn import reference

SDPA = fa.scaled_dot_product_attention


def qkv(rng, shape_q=(2, 4, 10, 8), shape_k=(2, 4, 12, 8), shape_v=None, dtype=np.float32):
    shape_v = shape_k if shape_v is None else shape_v
    return randn(rng, shape_q, dtype), randn(rng, shape_k, dtype), randn(rng, shape_v, dtype)


# ----------------------------------------------------------------------------------------------
# bad input: a clear error naming the argument and what was received
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_dtype", [np.int32, np.int64, np.complex64, object, np.bool_])
def test_unsupported_dtypes(rng, bad_dtype):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="query.*dtype"):
        SDPA(q.astype(bad_dtype), k, v)
    with pytest.raises(TypeError, match="value.*dtype"):
        SDPA(q, k, v.astype(bad_dtype))


def test_mixed_dtypes(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="same dtype.*query float32, key float64"):
        SDPA(q, k.astype(np.float64), v)


@pytest.mark.parametrize("shapes,match", [
    (((2, 4, 10, 8), (2, 4, 12, 6), (2, 4, 12, 8)), "head dim"),
    (((2, 4, 10, 8), (2, 4, 12, 8), (2, 4, 13, 8)), "sequence length"),
    (((2, 4, 10, 8), (3, 4, 12, 8), (3, 4, 12, 8)), "batch dims"),
    (((2, 4, 10, 8), (2, 4, 12, 8), (2, 2, 12, 8)), "number of heads"),
    (((4, 10, 8), (2, 4, 12, 8), (2, 4, 12, 8)), "number of dims"),
    (((8,), (8,), (8,)), "at least 2-D"),
])
def test_shape_mismatches(rng, shapes, match):
    q, k, v = (randn(rng, s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        SDPA(q, k, v)


def test_gqa_rules(rng):
    q, k, v = qkv(rng, (1, 6, 5, 8), (1, 4, 7, 8))
    with pytest.raises(ValueError, match="enable_gqa"):
        SDPA(q, k, v)
    with pytest.raises(ValueError, match="multiple.*6 query heads and 4"):
        SDPA(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("mask_shape", [(3, 12), (10, 11), (2, 4, 10, 12, 1), (5, 4, 10, 12)])
def test_mask_that_does_not_broadcast(rng, mask_shape):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=r"attn_mask of shape .* does not broadcast"):
        SDPA(q, k, v, attn_mask=np.ones(mask_shape, bool))


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint8, np.complex128])
def test_mask_dtype_rejected(rng, dtype):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="attn_mask must be a bool mask"):
        SDPA(q, k, v, attn_mask=np.ones((10, 12), dtype))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_out_of_range(rng, p):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        SDPA(q, k, v, dropout_p=p)


@pytest.mark.parametrize("scale", [float("inf"), -float("inf"), float("nan")])
def test_bad_scale(rng, scale):
    # any finite scale is allowed (torch's rule; tests/test_reliability.py checks 0 and < 0)
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        SDPA(q, k, v, scale=scale)


def test_bad_options(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="causal_alignment"):
        SDPA(q, k, v, causal_alignment="diagonal")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        SDPA(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="window"):
        SDPA(q, k, v, window=5)
    with pytest.raises(ValueError, match="window sides must be >= 0"):
        SDPA(q, k, v, window=(3, -2))
    with pytest.raises(ValueError, match="softcap"):
        SDPA(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        SDPA(q, k, v, alibi_slopes=np.ones(3))
    with pytest.raises(TypeError, match="rng"):
        SDPA(q, k, v, dropout_p=0.1, rng="seed")
    with pytest.raises(TypeError, match="scale must be a real number"):
        SDPA(q, k, v, scale="0.1")
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        SDPA(q, k, v, is_causal="yes")


# ----------------------------------------------------------------------------------------------
# shapes, layouts, dtypes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 4, 10, 8), (2, 0, 10, 8), (2, 4, 0, 8)])
def test_empty_query_side(rng, shape):
    q = randn(rng, shape)
    k = randn(rng, shape[:2] + (12, 8))
    out, lse = SDPA(q, k, k, return_lse=True)
    assert out.shape == shape[:3] + (8,) and lse.shape == shape[:3]


def test_empty_keys_give_zero_rows(rng):
    q = randn(rng, (2, 3, 5, 8))
    k = randn(rng, (2, 3, 0, 8))
    out, lse = SDPA(q, k, k, return_lse=True)
    assert out.shape == (2, 3, 5, 8) and np.all(out == 0) and np.all(np.isneginf(lse))


def test_zero_head_dims(rng):
    q = randn(rng, (1, 2, 4, 0))
    k = randn(rng, (1, 2, 6, 0))
    v = randn(rng, (1, 2, 6, 3))
    out, lse = SDPA(q, k, v, return_lse=True)       # all scores 0: the mean of v
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape), rtol=1e-6)
    np.testing.assert_allclose(lse, np.log(6), rtol=1e-6)
    out, lse = SDPA(randn(rng, (1, 2, 4, 5)), randn(rng, (1, 2, 6, 5)), randn(rng, (1, 2, 6, 0)),
                    return_lse=True)
    assert out.shape == (1, 2, 4, 0) and np.isfinite(lse).all()


def test_two_and_three_dim_inputs(rng):
    q, k, v = randn(rng, (7, 8)), randn(rng, (9, 8)), randn(rng, (9, 5))
    out, lse = SDPA(q, k, v, return_lse=True, is_causal=True)
    assert out.shape == (7, 5) and lse.shape == (7,)
    ref = reference.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    np.testing.assert_allclose(out, ref, atol=2e-6)
    out3 = SDPA(q[None], k[None], v[None], attn_mask=np.ones((7, 9), bool))
    np.testing.assert_allclose(out3[0], SDPA(q, k, v), atol=1e-6)


def test_extra_batch_dims(rng):
    q, k, v = qkv(rng, (2, 3, 4, 5, 8), (2, 3, 4, 6, 8))
    out = SDPA(q, k, v)
    ref = SDPA(q.reshape(6, 4, 5, 8), k.reshape(6, 4, 6, 8), v.reshape(6, 4, 6, 8))
    np.testing.assert_allclose(out, ref.reshape(out.shape), rtol=0, atol=0)


def test_strided_and_readonly_inputs_match_contiguous(rng):
    q, k, v = qkv(rng, (2, 4, 10, 8), (2, 4, 12, 8))
    base = SDPA(q, k, v, is_causal=True)
    big = randn(rng, (4, 8, 20, 16))
    big[::2, ::2, ::2, ::2] = q
    strided = big[::2, ::2, ::2, ::2]
    fortran = np.asfortranarray(k)
    neg = v[:, :, ::-1, ::-1].copy()[:, :, ::-1, ::-1]
    transposed = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    ro = [a.copy() for a in (q, k, v)]
    for a in ro:
        a.flags.writeable = False
    for args in [(strided, k, v), (q, fortran, v), (q, k, neg), (transposed, k, v), tuple(ro)]:
        np.testing.assert_array_equal(SDPA(*args, is_causal=True), base)


def test_inputs_are_not_modified(rng):
    q, k, v = qkv(rng)
    mask = rng.random((10, 12)) > 0.3
    copies = [a.copy() for a in (q, k, v, mask)]
    SDPA(q, k, v, attn_mask=mask, dropout_p=0.2, rng=1, softcap=2.0)
    for a, c in zip((q, k, v, mask), copies):
        np.testing.assert_array_equal(a, c)


def test_output_does_not_alias_inputs(rng):
    q, k, v = qkv(rng, (1, 1, 4, 4), (1, 1, 4, 4))
    out = SDPA(q, k, v)
    assert not np.shares_memory(out, q) and not np.shares_memory(out, v)


def test_list_inputs_are_accepted():
    q = [[[1.0, 0.0], [0.0, 1.0]]]
    out = SDPA(q, q, q)
    assert out.dtype == np.float64 and out.shape == (1, 2, 2)


def test_torch_defaults_match(rng):
    torch = pytest.importorskip("torch", reason="torch not installed")
    q, k, v = qkv(rng, (2, 4, 10, 8), (2, 2, 12, 8), dtype=np.float64)
    mask = rng.random((2, 1, 10, 12)) > 0.3
    fmask = rng.standard_normal((4, 10, 12))
    T = torch.from_numpy
    F = torch.nn.functional.scaled_dot_product_attention
    for kwargs, tkwargs in [({}, {}), ({"is_causal": True}, {"is_causal": True}),
                            ({"attn_mask": mask}, {"attn_mask": T(mask)}),
                            ({"attn_mask": fmask}, {"attn_mask": T(fmask)}),
                            ({"scale": 0.3}, {"scale": 0.3})]:
        ours = SDPA(q, k, v, enable_gqa=True, **kwargs)
        theirs = F(T(q), T(k), T(v), enable_gqa=True, **tkwargs).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# merging partial results (split-KV, ring attention, prefix caching)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_attention_equals_attending_all_keys(rng, dtype):
    q, k, v = qkv(rng, (2, 3, 7, 8), (2, 3, 40, 8), dtype=dtype)
    full, full_lse = SDPA(q, k, v, return_lse=True, is_causal=True, causal_alignment="bottom_right")
    mask = fa.causal_mask(7, 40, alignment="bottom_right")
    parts = [SDPA(q, k[:, :, a:b], v[:, :, a:b], attn_mask=mask[:, a:b], return_lse=True)
             for a, b in [(0, 13), (13, 30), (30, 40)]]
    out, lse = fa.merge_attention([o for o, _ in parts], [s for _, s in parts])
    tol = 1e-12 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(out, full, atol=tol)
    np.testing.assert_allclose(lse, full_lse, atol=tol)


def test_merge_attention_empty_parts():
    outs = [np.ones((2, 3)), np.zeros((2, 3))]
    lses = [np.array([0.5, -np.inf]), np.array([-np.inf, -np.inf])]
    out, lse = fa.merge_attention(outs, lses)
    np.testing.assert_allclose(out[0], 1.0)
    assert np.all(out[1] == 0) and lse[0] == 0.5 and np.isneginf(lse[1])
    with pytest.raises(ValueError, match="lses\\[1\\] has shape"):
        fa.merge_attention(outs, [lses[0], lses[1][:1]])
    with pytest.raises(ValueError, match="same non-zero number"):
        fa.merge_attention(outs, lses[:1])
