"""Call plans (fastattn/_fastpath.py): a planned call gives the full path's bits, and anything
the full path would decide differently -- a bool for a number, another backend choice, another
tuning, another environment reading -- does not reuse a plan."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import randn

import fastattn as fa
from fastattn import _backends as B
from fastattn import _fastpath, api
from fastattn._tuning import tuning

SDPA = fa.scaled_dot_product_attention


@pytest.fixture
def compiled():
    """The compiled backend auto picks (plans are made only for compiled backends)."""
    name = B.resolve(None, "forward").name
    if name == "numpy":
        pytest.skip("no compiled backend available: calls are never planned")
    _fastpath.clear()
    yield name
    _fastpath.clear()


def no_full_path(monkeypatch):
    """From here on, a call that goes the full way fails the test."""
    def boom(*a, **kw):
        raise AssertionError("the full path ran")
    monkeypatch.setattr(api, "make_problem", boom)


CASES = [
    ("decode", (1, 4, 1, 64), (1, 4, 77, 64), {}),
    ("decode_gqa_causal_br", (2, 8, 3, 32), (2, 2, 50, 32),
     dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right")),
    ("forward_causal", (1, 2, 40, 16), (1, 2, 40, 16), dict(is_causal=True, scale=0.3)),
    ("forward_int_scale", (2, 1, 30, 8), (2, 1, 45, 8), dict(scale=2)),
    ("decode_window", (1, 3, 1, 16), (1, 3, 90, 16), dict(window=(0, 40))),
    ("forward_window_causal", (1, 2, 33, 16), (1, 2, 50, 16),
     dict(window=(7, None), is_causal=True, causal_alignment="bottom_right")),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,qs,ks,kw", CASES, ids=[c[0] for c in CASES])
def test_planned_call_gives_the_full_paths_bits(compiled, monkeypatch, rng, dtype, name, qs, ks,
                                               kw):
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, ks, dtype)
    out1, lse1 = SDPA(q, k, v, return_lse=True, **kw)         # full path: makes the plan
    assert len(_fastpath._plans) == 1
    no_full_path(monkeypatch)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()                  # new arrays, same key
    out2, lse2 = SDPA(q2, k2, v2, return_lse=True, **kw)
    out3 = SDPA(q2, k2, v2, **kw)
    assert out2.dtype == dtype and lse2.shape == qs[:3] and out2.shape == qs
    for a, b in ((out1, out2), (lse1, lse2), (out1, out3)):
        assert np.array_equal(a, b, equal_nan=True)
    # a transposed layout of the same shape is made contiguous, as the full path does
    kt = np.ascontiguousarray(k.swapaxes(2, 3)).swapaxes(2, 3)
    assert np.array_equal(SDPA(q, kt, v, **kw), out1)


@pytest.mark.parametrize("qs,ks", [((3, 1, 16), (3, 20, 16)), ((2, 2, 3, 1, 8), (2, 2, 3, 9, 8))],
                         ids=["3d", "5d"])
def test_other_ranks_keep_their_shapes(compiled, rng, qs, ks):
    q, k, v = randn(rng, qs), randn(rng, ks), randn(rng, ks)
    first = SDPA(q, k, v, return_lse=True)
    again = SDPA(q, k, v, return_lse=True)
    assert first[0].shape == again[0].shape == qs and again[1].shape == qs[:-1]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_a_bool_or_int_never_finds_the_plan_of_a_number_or_bool(compiled, rng):
    q, k, v = randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 9, 8)), randn(rng, (1, 2, 9, 8))
    SDPA(q, k, v, scale=1, is_causal=True, enable_gqa=True)
    SDPA(q, k, v, scale=1, is_causal=True, enable_gqa=True)
    with pytest.raises(TypeError, match="scale must be a real number"):
        SDPA(q, k, v, scale=True, is_causal=True, enable_gqa=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        SDPA(q, k, v, scale=1, is_causal=1, enable_gqa=True)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        SDPA(q, k, v, scale=1, is_causal=True, enable_gqa=1)
    with pytest.raises(TypeError, match="dropout_p must be a real number"):
        SDPA(q, k, v, dropout_p=False, scale=1, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="causal_alignment"):
        SDPA(q, k, v, scale=1, is_causal=True, enable_gqa=True, causal_alignment="top")
    SDPA(q, k, v, window=(1, 0))
    SDPA(q, k, v, window=(1, 0))
    with pytest.raises(TypeError, match="window sides must be ints"):
        SDPA(q, k, v, window=(True, 0))
    with pytest.raises(TypeError, match="window sides must be ints"):
        SDPA(q, k, v, window=(1.0, 0))
    w = SDPA(q, k, v, window=(1, 0))
    assert np.array_equal(SDPA(q, k, v, window=[1, 0]), w)   # a list: the full path, same result
    assert np.array_equal(SDPA(q, k, v, window=(np.int64(1), 0)), w)


class Spy:
    def __init__(self, forward):
        self.calls = 0
        self._forward = forward

    def __call__(self, p):
        self.calls += 1
        return self._forward(p)


def test_backend_choice_is_not_frozen_by_a_plan(compiled, monkeypatch, rng):
    q, k, v = randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 9, 8)), randn(rng, (1, 2, 9, 8))
    SDPA(q, k, v)
    numpy_be = B.registry["numpy"]
    spy = Spy(numpy_be.forward)
    monkeypatch.setattr(numpy_be, "forward", spy)
    with fa.use_backend("numpy"):
        SDPA(q, k, v)
    assert spy.calls == 1
    SDPA(q, k, v, backend="numpy")
    assert spy.calls == 2
    fa.set_backend("numpy")
    try:
        SDPA(q, k, v)
    finally:
        fa.set_backend(None)
    assert spy.calls == 3
    # a backend replaced in the registry (as the dispatch tests do) is the one called
    other = type(B.registry[compiled])()
    other.load()
    spy2 = Spy(other.forward)
    monkeypatch.setattr(other, "forward", spy2)
    monkeypatch.setitem(B.registry, compiled, other)
    SDPA(q, k, v)
    SDPA(q, k, v)
    assert spy2.calls == 2


def test_tuning_and_environment_are_read_again(compiled, monkeypatch, rng):
    q, k, v = randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 9, 8)), randn(rng, (1, 2, 9, 8))
    SDPA(q, k, v)
    SDPA(q, k, v)
    if compiled == "cython":          # the record's tuning reaches the kernel's checks
        with tuning(decode_block_k=-5), pytest.raises(ValueError, match="tuning.decode_block_k"):
            SDPA(q, k, v)
    monkeypatch.setenv("FASTATTN_NUM_THREADS", "zero")
    fa.reload_environment()
    try:
        with pytest.raises(ValueError, match="FASTATTN_NUM_THREADS"):
            SDPA(q, k, v)
    finally:
        monkeypatch.delenv("FASTATTN_NUM_THREADS")
        fa.reload_environment()
    SDPA(q, k, v)
