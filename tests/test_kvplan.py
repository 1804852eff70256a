"""KVCache.attend's per-token path (fastattn/_kvplan.py): a planned step gives the bits and the
cache of the full path (attention_with_kvcache), and anything the full path would check or
decide differently -- a changed page table, a full cache, a read-only cache, another backend,
another option -- goes the full way, with its error and nothing written."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import randn

import fastattn as fa
from fastattn import _backends as B
from fastattn import nn


@pytest.fixture
def in_place():
    """The auto backend must read a cache in place for calls to be planned."""
    be = B.resolve(None, "forward")
    if "kv_strides" in be.unsupported_options:
        pytest.skip(f"{be.name} does not read a KV cache in place: steps are never planned")
    return be.name


def no_full_path(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("the full path ran")
    monkeypatch.setattr(nn, "attention_with_kvcache", boom)


def _tables(rng, n, half, dtype):
    ang = rng.uniform(0, 6.3, (n, half))
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("dtype,steps", [(np.float32, 1), (np.float64, 1), (np.float32, 3)])
def test_planned_steps_give_the_full_paths_bits_and_cache(in_place, monkeypatch, rng, page_size,
                                                         rotary, dtype, steps):
    """Two caches, fed the same tokens: one through KVCache.attend (planned from its 2nd call),
    the other through attention_with_kvcache on its arrays. Same outputs and caches, bit for
    bit, over ragged lengths and a decode loop long enough to change the thread choice (its
    threshold lowered to 40 tokens of this cache)."""
    Bb, Hq, Hkv, E, Ev, cap = 2, 4, 2, 16, 8, 64
    be = B.registry[in_place]
    monkeypatch.setattr(be, "serial_decode_bytes", 40 * Hkv * (E + Ev) * np.dtype(dtype).itemsize)
    planned = fa.KVCache(Bb, cap, Hkv, E, dtype, page_size=page_size, value_dim=Ev)
    plain = fa.KVCache(Bb, cap, Hkv, E, dtype, page_size=page_size, value_dim=Ev)
    if page_size:                     # pages out of order, as a serving engine hands them out
        perm = rng.permutation(planned.block_table.size).astype(np.int32)
        planned.block_table = perm.reshape(planned.block_table.shape)
        plain.block_table = planned.block_table.copy()
    opts = {}
    if rotary:
        cos, sin = _tables(rng, cap, 6, dtype)            # rotary_dim 12 < head_dim 16
        opts = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary == "interleaved")
    for t in range(cap // steps - 2):
        if t == 3:
            planned.trim(np.array([2, 5]))                # ragged lengths from here on
            plain.trim(np.array([2, 5]))
        q = randn(rng, (Bb, steps, Hq, E), dtype)
        k, v = randn(rng, (Bb, steps, Hkv, E), dtype), randn(rng, (Bb, steps, Hkv, Ev), dtype)
        got = planned.attend(q, k, v, **opts)
        want = fa.attention_with_kvcache(q, plain.k, plain.v, k, v, cache_seqlens=plain.seqlens,
                                         block_table=plain.block_table, **opts)
        plain.seqlens += steps
        assert got.shape == want.shape == (Bb, steps, Hq, Ev) and got.dtype == dtype
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(planned.seqlens, plain.seqlens)
        np.testing.assert_array_equal(planned.k, plain.k)
        np.testing.assert_array_equal(planned.v, plain.v)
    assert planned._plan is not None


def _warm(rng, page_size=None, dtype=np.float32):
    cache = fa.KVCache(2, 8, 2, 16, dtype, page_size=page_size)
    q, k, v = randn(rng, (2, 1, 4, 16), dtype), randn(rng, (2, 1, 2, 16), dtype), randn(
        rng, (2, 1, 2, 16), dtype)
    cache.attend(q, k, v)                                 # full path: makes the plan
    assert cache._plan is not None
    return cache, q, k, v


def test_a_planned_step_does_not_go_the_full_way(in_place, monkeypatch, rng):
    cache, q, k, v = _warm(rng)
    no_full_path(monkeypatch)
    cache.attend(q, k, v)
    assert cache.seqlens.tolist() == [2, 2]


def test_a_full_cache_is_refused_by_the_full_path_with_nothing_written(in_place, rng):
    cache, q, k, v = _warm(rng)
    for _ in range(7):
        cache.attend(q, k, v)
    before = cache.k.copy(), cache.v.copy(), cache.seqlens.copy()
    with pytest.raises(ValueError, match="capacity"):
        cache.attend(q, k, v)
    for a, b in zip((cache.k, cache.v, cache.seqlens), before):
        np.testing.assert_array_equal(a, b)


def test_a_changed_page_table_is_checked_again(in_place, rng):
    cache, q, k, v = _warm(rng, page_size=2)
    cache.block_table[1, 0] = cache.block_table[0, 0]     # two live sequences share a page
    before = cache.k.copy()
    with pytest.raises(ValueError, match="block_table"):
        cache.attend(q, k, v)
    np.testing.assert_array_equal(cache.k, before)


def test_a_read_only_cache_is_refused(in_place, rng):
    cache, q, k, v = _warm(rng)
    cache.v.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        cache.attend(q, k, v)


def test_other_options_and_backends_go_the_full_way(in_place, monkeypatch, rng):
    cache, q, k, v = _warm(rng)
    calls = []
    real = nn.attention_with_kvcache

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)
    monkeypatch.setattr(nn, "attention_with_kvcache", spy)
    cache.attend(q, k, v, softcap=30.0)                   # an option the plan does not take
    assert len(calls) == 1
    with fa.use_backend("numpy"):                         # another backend choice
        cache.attend(q, k, v)
    assert len(calls) == 2
    with pytest.raises(TypeError):                        # a dtype the cache does not hold
        cache.attend(q.astype(np.float64), k, v)
    assert len(calls) == 3


@pytest.mark.parametrize("lengths", [[1, 1], np.array([1, 1], np.int64), np.array([1], np.int32),
                                     np.array([-1, 1], np.int32)])
def test_replaced_lengths_get_the_full_paths_error(in_place, rng, lengths):
    """seqlens is a public attribute: whatever replaced it is checked by the full path, which
    names cache_seqlens, with nothing written."""
    cache, q, k, v = _warm(rng)
    cache.seqlens = lengths
    before = cache.k.copy()
    with pytest.raises((TypeError, ValueError), match="cache_seqlens"):
        cache.attend(q, k, v)
    np.testing.assert_array_equal(cache.k, before)
