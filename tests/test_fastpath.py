"""Call plans (fastattn/_fastpath.py): a planned call gives the full path's bits, and anything
the full path would decide differently -- a bool for a number, another backend choice, another
tuning, another environment reading -- does not reuse a plan."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import randn

import fastattn as fa
from fastattn import _backends as B
from fastattn import _fastpath, api, reference
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


def _views(rng, dtype, B_, H, S, E):
    """K/V layouts a decode loop or a port from flash-attn passes: name -> (k, v), each (B_, H,
    S, E) and not C-contiguous."""
    big = randn(rng, (2, B_, H, S + 9, E), dtype)              # a preallocated cache
    flash = randn(rng, (2, B_, S, H, E), dtype)                # (B, S, H, E) storage
    heads = randn(rng, (2, B_, 2 * H, S, E), dtype)
    one = randn(rng, (2, B_, 1, S, E), dtype)
    raw = np.zeros(2 * B_ * H * S * E * np.dtype(dtype).itemsize + 8, np.uint8)
    unaligned = np.frombuffer(raw.data, dtype, 2 * B_ * H * S * E, offset=1).reshape(
        (2, B_, H, S, E))                                      # not aligned to its itemsize
    unaligned[...] = randn(rng, unaligned.shape, dtype)
    return {
        "cache_prefix": (big[0, :, :, :S], big[1, :, :, :S]),
        "flash_layout": (flash[0].transpose(0, 2, 1, 3), flash[1].transpose(0, 2, 1, 3)),
        "every_other_head": (heads[0, :, ::2], heads[1, :, ::2]),
        "broadcast_head": (np.broadcast_to(one[0], (B_, H, S, E)),
                           np.broadcast_to(one[1], (B_, H, S, E))),
        "reversed_keys": (big[0, :, :, S - 1::-1], big[1, :, :, S - 1::-1]),
        "unaligned": (unaligned[0], unaligned[1]),
    }


VIEW_NAMES = ["cache_prefix", "flash_layout", "every_other_head", "broadcast_head",
              "reversed_keys", "unaligned"]


@pytest.mark.parametrize("backend", ["cython", "numba"])
@pytest.mark.parametrize("L", [1, 3, 40])
@pytest.mark.parametrize("view", VIEW_NAMES)
def test_planned_call_on_kv_views_gives_the_bits_of_contiguous_copies(monkeypatch, rng, backend,
                                                                     L, view):
    """A planned call whose K/V are views (a cache's prefix, a flash-layout cache, broadcast or
    reversed or unaligned storage) equals the same call on C-contiguous copies, bit for bit:
    read in place where the backend reads strides and the layout keeps each head's rows
    together, copied otherwise (the first call of the key, through make_problem, was served
    from a copy: planned calls must not round differently)."""
    if not B.registry[backend].available:
        pytest.skip(f"{backend}: {B.registry[backend].reason}")
    _fastpath.clear()
    dtype = np.float32 if L != 3 else np.float64
    Bb, H, S, E = 2, 3, 70, 16
    q = randn(rng, (Bb, H, L, E), dtype)
    k, v = _views(rng, dtype, Bb, H, S, E)[view]
    assert not (k.flags.c_contiguous and k.flags.aligned)
    kc, vc = np.ascontiguousarray(k), np.ascontiguousarray(v)
    kw = dict(is_causal=True, causal_alignment="bottom_right", backend=backend, return_lse=True)
    want_out, want_lse = SDPA(q, kc, vc, **kw)                  # full path, makes the plan
    assert len(_fastpath._plans) == 1
    no_full_path(monkeypatch)
    got_out, got_lse = SDPA(q, k, v, **kw)                      # planned, on the views
    np.testing.assert_array_equal(got_out, want_out)
    np.testing.assert_array_equal(got_lse, want_lse)
    _fastpath.clear()


def test_a_cache_prefix_is_read_in_place_not_copied(compiled, monkeypatch, rng):
    """cache[:, :, :t+1] (the decode loop's view) reaches a backend that reads K/V strides as it
    is: the planned call copies only q."""
    be = B.resolve(None, "forward")
    if "kv_strides" in be.unsupported_options:
        pytest.skip(f"{be.name} reads K/V C-contiguous only")
    cache = randn(rng, (2, 1, 4, 64, 32), np.float32)
    q = randn(rng, (1, 4, 1, 32), np.float32)
    k, v = cache[0, :, :, :20], cache[1, :, :, :20]
    want = SDPA(q, np.ascontiguousarray(k), np.ascontiguousarray(v))
    copied = []
    real = _fastpath._ascontiguous

    def spy(x, *a, **kw):
        copied.append(x)
        return real(x, *a, **kw)
    monkeypatch.setattr(_fastpath, "_ascontiguous", spy)
    no_full_path(monkeypatch)
    got = SDPA(q, k, v)
    np.testing.assert_array_equal(got, want)
    assert [x is q for x in copied] == [True], "only q goes through ascontiguousarray"
    copied.clear()
    # (B, S, H, E) storage (split_heads, a flash-layout cache) transposed: read in place too,
    # with the bits of the contiguous copy (its copy took ~70x a decode's kernel)
    flash = np.ascontiguousarray(cache[:, :, :, :20].transpose(0, 1, 3, 2, 4))  # (2, B, S, H, E)
    got = SDPA(q, flash[0].transpose(0, 2, 1, 3), flash[1].transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(got, want)
    assert [x is q for x in copied] == [True], "a (B, S, H, E) view is not copied"


@pytest.mark.parametrize("backend", ["cython", "numba"])
@pytest.mark.parametrize("Hq, Hkv, E", [(12, 12, 64), (8, 2, 128), (4, 4, 40)])
def test_split_heads_views_decode_in_place_with_the_bits_of_copies(rng, backend, Hq, Hkv, E):
    """A decode step on split_heads views of (B, S, H*E) keys and values (the NumPy model's
    layout: heads side by side): planned calls read them in place and give the bits of the
    same calls on contiguous copies, over a growing S (MHA on the one-row kernel, GQA on the
    group kernel, a head dim with a tail), and close to the float64 reference."""
    if not B.registry[backend].available:
        pytest.skip(f"{backend}: {B.registry[backend].reason}")
    _fastpath.clear()
    Bb, S_max = 2, 300
    kx = randn(rng, (Bb, S_max, Hkv * E), np.float32)
    vx = randn(rng, (Bb, S_max, Hkv * E), np.float32)
    q = randn(rng, (Bb, Hq, 1, E), np.float32)
    kw = dict(enable_gqa=Hq != Hkv, backend=backend, return_lse=True)
    for S in (1, 17, 64, 65, 300):
        k, v = fa.split_heads(kx[:, :S], Hkv), fa.split_heads(vx[:, :S], Hkv)
        assert not k.flags.c_contiguous or Hkv == 1
        want_out, want_lse = SDPA(q, np.ascontiguousarray(k), np.ascontiguousarray(v), **kw)
        got_out, got_lse = SDPA(q, k, v, **kw)
        np.testing.assert_array_equal(got_out, want_out)
        np.testing.assert_array_equal(got_lse, want_lse)
        ref = reference.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
        np.testing.assert_allclose(got_out, ref, rtol=2e-5, atol=2e-5)
    assert len(_fastpath._plans) == 1, "one plan served the whole loop"
    _fastpath.clear()


@pytest.mark.parametrize("backend", ["cython", "numba"])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_side_by_side_heads_walked_together_give_the_bits_of_copies(monkeypatch, rng, backend,
                                                                     threads):
    """Both compiled backends walk the kv heads of (B, S, H, E) views together (cython:
    csrc/decode.pxi dec_views_walk, each head in the group kernels' own 64-key blocks from its
    chunk's start, the running sums carried in double from call to call; numba:
    _decode_views_item, each 1024-key block scored and multiplied by V 16 keys at a time for
    the heads in turn): the bits of the head-by-head walk over contiguous copies, on every
    SIMD copy of the extension this CPU has.  Cases: key chunks that split (2500 keys: cython
    splits 2 sequences of 2 kv heads on 2 threads into chunks of 1296 keys, not a multiple of
    64; numba splits one sequence of 3 kv heads), groups of heads (12 kv heads on 2 threads),
    a window that starts mid-block, a head dim with a tail."""
    if not B.registry[backend].available:
        pytest.skip(f"{backend}: {B.registry[backend].reason}")
    levels = [None]
    if backend == "cython":
        from fastattn import _cykernels
        levels = _cykernels.simd_levels()
    monkeypatch.setenv("FASTATTN_NUM_THREADS", threads)
    fa.reload_environment()
    _fastpath.clear()
    window = dict(is_causal=True, causal_alignment="bottom_right", window=(1500, 0))
    try:
        for level in levels:
            if level is not None:
                _cykernels.set_simd(level)
            for Bb, Hq, Hkv, E in [(2, 12, 12, 64), (2, 8, 2, 128), (1, 6, 3, 40)]:
                for S in (65, 2500):
                    kx = randn(rng, (Bb, S, Hkv * E), np.float32)
                    vx = randn(rng, (Bb, S, Hkv * E), np.float32)
                    q = randn(rng, (Bb, Hq, 1, E), np.float32) * 2
                    k, v = fa.split_heads(kx, Hkv), fa.split_heads(vx, Hkv)
                    kc, vc = np.ascontiguousarray(k), np.ascontiguousarray(v)
                    for kw in ({}, window):
                        kw = dict(kw, enable_gqa=Hq != Hkv, backend=backend, return_lse=True)
                        want_out, want_lse = SDPA(q, kc, vc, **kw)
                        SDPA(q, k, v, **kw)          # the plan's first call copies
                        got_out, got_lse = SDPA(q, k, v, **kw)
                        case = f"{level} {Bb}x{Hq}/{Hkv} E={E} S={S} {kw}"
                        np.testing.assert_array_equal(got_out, want_out, err_msg=case)
                        np.testing.assert_array_equal(got_lse, want_lse, err_msg=case)
            ref = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, **window)
            np.testing.assert_allclose(got_out, ref, rtol=2e-5, atol=2e-5)
    finally:
        if backend == "cython":
            _cykernels.set_simd(None)
        monkeypatch.delenv("FASTATTN_NUM_THREADS")
        fa.reload_environment()
        _fastpath.clear()


GROWING = [
    ("decode_causal_br", 1, 4, 4, dict(is_causal=True, causal_alignment="bottom_right")),
    ("decode_gqa_window", 2, 8, 2, dict(enable_gqa=True, window=(5, 0),
                                        causal_alignment="bottom_right")),
    ("decode_no_mask", 1, 4, 4, {}),
    ("decode_top_left_window", 3, 2, 2, dict(window=(0, 9))),
    ("forward_causal_tl", 20, 2, 2, dict(is_causal=True)),
]


@pytest.mark.parametrize("backend", ["cython", "numba"])
@pytest.mark.parametrize("views", [True, False])
@pytest.mark.parametrize("name,L,Hq,Hkv,kw", GROWING, ids=[g[0] for g in GROWING])
def test_a_growing_cache_reuses_one_plan_with_each_lengths_band_and_threads(
        monkeypatch, rng, backend, views, name, L, Hq, Hkv, kw):
    """A decode loop over a growing cache (S = 1 ... 60, as views of a preallocated buffer or
    as fresh arrays): after the first call every call is planned, and each gives the bits the
    full path gives for its S -- band (bottom-right offset, window), strides and the decode
    thread choice (its threshold lowered so that it changes during the loop)."""
    be = B.registry[backend]
    if not be.available:
        pytest.skip(f"{backend}: {be.reason}")
    from fastattn._inputs import for_kernels
    monkeypatch.setattr(be, "serial_decode_bytes", 30 * Hkv * 2 * 16 * 4)
    _fastpath.clear()
    buf = randn(rng, (2, 1, Hkv, 64, 16), np.float32)
    q = randn(rng, (1, Hq, L, 16), np.float32)
    full = []
    real = api.make_problem

    def counting(*a, **k):
        full.append(1)
        return real(*a, **k)
    monkeypatch.setattr(api, "make_problem", counting)
    for S in range(1, 61):
        k, v = buf[0, :, :, :S], buf[1, :, :, :S]
        if not views:
            k, v = k.copy(), v.copy()
        out, lse = SDPA(q, k, v, backend=backend, return_lse=True, **kw)
        p = for_kernels(real(q, np.ascontiguousarray(k), np.ascontiguousarray(v), **kw))[0]
        want_out, want_lse = be.forward(p)
        np.testing.assert_array_equal(out, want_out, err_msg=f"S={S}")
        np.testing.assert_array_equal(lse, want_lse, err_msg=f"S={S}")
    assert len(full) == 1 and len(_fastpath._plans) == 1
    _fastpath.clear()


def test_keys_and_values_of_different_lengths_still_get_the_full_paths_error(compiled, rng):
    q = randn(rng, (1, 2, 1, 8), np.float32)
    k = randn(rng, (1, 2, 10, 8), np.float32)
    SDPA(q, k, k)
    with pytest.raises(ValueError, match="value"):
        SDPA(q, k, k[:, :, :9])
    out = SDPA(q, k[:, :, :0], k[:, :, :0])                  # S = 0: the full path's zeros
    assert out.shape == (1, 2, 1, 8) and not out.any()


@pytest.mark.parametrize("backend", ["cython", "numba"])
def test_a_growing_cache_gets_the_full_paths_thread_choice_for_each_length(monkeypatch, rng,
                                                                          backend):
    """The one plan of a growing cache wakes the second thread exactly where the full path
    would (the keys its band reads cross the backend's threshold, lowered here to 30 keys)."""
    be = B.registry[backend]
    if not be.available:
        pytest.skip(f"{backend}: {be.reason}")
    from fastattn import _config
    from fastattn._inputs import make_problem
    monkeypatch.setattr(be, "serial_decode_bytes", 30 * 4 * 2 * 16 * 4)
    seen = []
    real = be._decode_kernel

    def spy(args, out, lse):
        seen.append(args.n_threads)
        return real(args, out, lse)
    monkeypatch.setattr(be, "_decode_kernel", spy)
    _fastpath.clear()
    buf = randn(rng, (2, 1, 4, 64, 16), np.float32)
    q = randn(rng, (1, 4, 1, 16), np.float32)
    want = []
    for S in range(1, 61):
        k, v = buf[0, :, :, :S], buf[1, :, :, :S]
        kw = dict(window=(40, None), causal_alignment="bottom_right")   # min(S, 41) keys read
        SDPA(q, k, v, backend=backend, **kw)
        want.append(be.decode_threads(make_problem(q, k, v, **kw), _config.num_threads()))
    assert len(_fastpath._plans) == 1
    _fastpath.clear()
    assert seen == want
    assert len(set(want)) == (2 if _config.num_threads() > 1 and be.serial_decode_bytes else 1)
