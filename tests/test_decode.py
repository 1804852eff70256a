"""The decode kernel family: a few queries against a long KV cache (L <= 16, S large).

Backends switch to a decode path for these shapes (K/V read once per KV group, keys split
across threads when batch * kv_heads is small); the results must still equal the reference.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import check_sdpa, randn

import fastattn as fa


def cache(rng, B=1, Hq=8, Hkv=2, L=1, S=3000, E=64, Ev=None, dtype=np.float32):
    Ev = E if Ev is None else Ev
    return (randn(rng, (B, Hq, L, E), dtype), randn(rng, (B, Hkv, S, E), dtype),
            randn(rng, (B, Hkv, S, Ev), dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B,Hq,Hkv", [(1, 8, 2), (1, 4, 4), (3, 6, 1), (2, 32, 8)])
@pytest.mark.parametrize("L", [1, 4, 16])
def test_decode_matches_reference(backend, rng, dtype, B, Hq, Hkv, L):
    q, k, v = cache(rng, B, Hq, Hkv, L, S=1037, E=32, dtype=dtype)
    check_sdpa(q, k, v, backend, enable_gqa=True, is_causal=True, causal_alignment="bottom_right")


@pytest.mark.parametrize("Hq", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("E", [7, 33])
def test_decode_few_rows_odd_head_dims(backend, rng, Hq, E):
    """1-5 query rows per KV group (one row: the numba dot-product scores; more: the panels)
    with head dims that leave vector tails."""
    q, k, v = cache(rng, Hq=Hq, Hkv=1, S=700, E=E, Ev=E + 2)
    check_sdpa(q, k, v, backend, enable_gqa=True)


@pytest.mark.parametrize("S", [1, 2, 511, 512, 513, 4099])
def test_decode_odd_cache_lengths(backend, rng, S):
    q, k, v = cache(rng, Hq=4, Hkv=2, S=S, E=16, Ev=24)
    check_sdpa(q, k, v, backend, enable_gqa=True)


def test_decode_with_padding_window_softcap_alibi(backend, rng):
    B, Hq, Hkv, S = 2, 8, 2, 2000
    q, k, v = cache(rng, B, Hq, Hkv, 2, S, E=32)
    mask = fa.padding_mask(np.array([1500, 37]), S)
    check_sdpa(q, k, v, backend, enable_gqa=True, attn_mask=mask)
    check_sdpa(q, k, v, backend, enable_gqa=True, window=(700, 0), is_causal=True,
               causal_alignment="bottom_right", softcap=20.0, alibi_slopes=rng.random(Hq))
    check_sdpa(q, k, v, backend, enable_gqa=True, attn_mask=rng.standard_normal((B, Hq, 2, S)))
    check_sdpa(q, k, v, backend, enable_gqa=True, dropout_p=0.25, rng=3)


def test_decode_with_garbage_in_unused_cache(backend, rng):
    """A preallocated cache: only the first `used` slots are written, the rest is NaN."""
    B, Hq, Hkv, S, used = 1, 8, 2, 4096, 1234
    q, k, v = cache(rng, B, Hq, Hkv, 1, S, E=64)
    k[:, :, used:] = np.nan
    v[:, :, used:] = np.nan
    mask = fa.padding_mask(np.array([used]), S)
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, backend=backend)
    want = fa.scaled_dot_product_attention(q, k[:, :, :used], v[:, :, :used], enable_gqa=True,
                                           backend="numpy")
    np.testing.assert_allclose(out, want, atol=2e-6)


def test_decode_step_by_step_equals_prefill(backend, rng):
    """Feeding the sequence one query at a time (bottom-right causal) equals one causal call."""
    B, Hq, Hkv, L, E = 1, 4, 2, 12, 32
    q, k, v = cache(rng, B, Hq, Hkv, L, L, E)
    full = fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
    for t in range(L):
        step = fa.scaled_dot_product_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                               is_causal=True, causal_alignment="bottom_right",
                                               enable_gqa=True, backend=backend)
        np.testing.assert_allclose(step[:, :, 0], full[:, :, t], atol=2e-6)


def test_decode_threads_do_not_change_results(backend, rng, monkeypatch):
    q, k, v = cache(rng, 1, 8, 2, 1, 8000, E=64)
    monkeypatch.setenv("FASTATTN_NUM_THREADS", "1")
    fa.reload_environment()
    one = fa.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
    monkeypatch.setenv("FASTATTN_NUM_THREADS", "2")
    fa.reload_environment()
    two = fa.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
    np.testing.assert_allclose(one, two, rtol=0, atol=1e-6)


@pytest.mark.parametrize("E,Ev", [(8, 8), (33, 17), (64, 64), (128, 128), (128, 200),
                                  (144, 64)])
@pytest.mark.parametrize("S", [1, 15, 64, 65, 1000, 2500])
def test_mha_decode_one_row_per_head(backend, rng, E, Ev, S):
    """Hq = Hkv, L = 1 (cython: the one-row kernel, fa_decode1.h): head dims with vector tails
    and above 128 (its long path), d = 64 and 128 (its copies compiled for them), cache
    lengths around its 16-key groups and 64-key blocks, split over threads or not, and a band
    cutting the keys."""
    q, k, v = cache(rng, 2, 12, 12, 1, S, E=E, Ev=Ev)
    check_sdpa(q, k, v, backend)
    check_sdpa(q, k, v, backend, is_causal=True, causal_alignment="bottom_right",
               window=(S // 3, 0))


@pytest.mark.parametrize("E,Ev", [(64, 64), (128, 128), (128, 96), (80, 80)])
@pytest.mark.parametrize("G", [2, 4, 7, 8])
def test_gqa_decode_group_kernel_head_dims(backend, rng, E, Ev, G):
    """G query rows per kv head, L = 1 (cython: the group kernel, fa_decodeg.h, and its copy
    compiled for d = 128), cache lengths not a multiple of its 16-key groups, and a band."""
    for S in (37, 1000):
        q, k, v = cache(rng, 2, 2 * G, 2, 1, S, E=E, Ev=Ev)
        check_sdpa(q, k, v, backend, enable_gqa=True)
        check_sdpa(q, k, v, backend, enable_gqa=True, is_causal=True,
                   causal_alignment="bottom_right", window=(S // 3, 0))


def test_mha_decode_extreme_scores_and_nan(backend, rng):
    """Large logits (the running max moves block to block, tiny weights elsewhere), and a NaN
    key in one head: that head's row is NaN (the NaN rule), the other heads are untouched."""
    q, k, v = cache(rng, 1, 4, 4, 1, 700, E=64)
    k[:, :, 300:310] *= 40.0
    check_sdpa(q * 3.0, k, v, backend)
    k[0, 1, 5, 0] = np.nan
    out = fa.scaled_dot_product_attention(q, k, v, backend=backend)
    assert np.isnan(out[0, 1]).all()
    keep = [0, 2, 3]
    check_sdpa(q[:, keep], k[:, keep], v[:, keep], backend)
    np.testing.assert_array_equal(
        out[:, keep], fa.scaled_dot_product_attention(q[:, keep], k[:, keep], v[:, keep],
                                                      backend=backend))
