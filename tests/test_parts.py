"""A call that is a part of a larger problem (context parallelism): `part_of=` on the forward and
the backward, the partial-keys backward (Problem.delta: the whole problem's lse and D given) and
the dropout hash's position offsets (Problem.dropout_origin), in every backend and the reference.

The chunked results must equal the whole problem's: forward parts merged by merge_attention,
backward dq summed over key parts and dk/dv over query parts.
"""
from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np
import pytest

import fastattn as fa
from fastattn import _dropout, _parts, reference
from fastattn._backends import registry
from fastattn._inputs import make_problem

from helpers import assert_close_to_reference

B, HQ, HKV, L, S, E = 2, 4, 2, 37, 53, 8
ROWS = (0, 10, 37)                 # query parts
COLS = (0, 20, 21, 53)             # key parts, one of a single key

OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal bottom-right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (5, 3)},
    "alibi + causal": {"alibi_slopes": "h", "is_causal": True},
    "alibi per batch + window bottom-right": {"alibi_slopes": "bh", "window": (4, None),
                                              "causal_alignment": "bottom_right"},
    "dropout + causal": {"dropout_p": 0.3, "rng": 123, "is_causal": True},
    "softcap + negative scale + window": {"softcap": 1.5, "scale": -0.4, "window": (None, 2)},
    "bool mask + dropout": {"attn_mask": "bool", "dropout_p": 0.2, "rng": 7},
}


def _inputs(rng, dtype=np.float64):
    q = rng.standard_normal((B, HQ, L, E)).astype(dtype)
    k = rng.standard_normal((B, HKV, S, E)).astype(dtype)
    v = rng.standard_normal((B, HKV, S, E)).astype(dtype)
    return q, k, v


def _options(rng, name, dtype=np.float64):
    kw = dict(OPTIONS[name], enable_gqa=True)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = rng.random(HQ).astype(dtype)
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = rng.random((B, HQ)).astype(dtype)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = rng.random((B, 1, L, S)) > 0.3
    return kw


def _piece_kw(kw, r0, r1, c0, c1):
    """The options of one part: the mask is the part's own piece."""
    m = kw.get("attn_mask")
    return kw if m is None else dict(kw, attn_mask=m[..., r0:r1, c0:c1])


def _call(fn, *args, backend, **kw):
    """fn(...) on `backend`; skipped when the backend names one of its declared unsupported
    options (a kernel not built yet), anything else raises."""
    try:
        return fn(*args, backend=backend, **kw)
    except fa.BackendUnavailableError as exc:
        declared = getattr(registry[backend], "unsupported_options", {}).values()
        if any(reason in str(exc) for reason in declared):
            pytest.skip(f"{backend}: {exc}")
        raise


def _chunked_forward(q, k, v, kw, backend):
    out = np.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse = np.zeros(q.shape[:-1], np.float64 if q.dtype == np.float64 else np.float32)
    for r0, r1 in zip(ROWS[:-1], ROWS[1:]):
        parts = [_call(fa.scaled_dot_product_attention, q[:, :, r0:r1], k[:, :, c0:c1],
                       v[:, :, c0:c1], return_lse=True, backend=backend,
                       part_of=(r0, c0, L, S), **_piece_kw(kw, r0, r1, c0, c1))
                 for c0, c1 in zip(COLS[:-1], COLS[1:])]
        out[:, :, r0:r1], lse[:, :, r0:r1] = fa.merge_attention([o for o, _ in parts],
                                                                [s for _, s in parts])
    return out, lse


def _chunked_backward(g, q, k, v, out, lse, kw, backend):
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r0, r1 in zip(ROWS[:-1], ROWS[1:]):
        for c0, c1 in zip(COLS[:-1], COLS[1:]):
            a, b, c = _call(fa.scaled_dot_product_attention_backward, g[:, :, r0:r1],
                            q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], out[:, :, r0:r1],
                            lse[:, :, r0:r1], backend=backend, part_of=(r0, c0, L, S),
                            **_piece_kw(kw, r0, r1, c0, c1))
            dq[:, :, r0:r1] += a
            dk[:, :, c0:c1] += b
            dv[:, :, c0:c1] += c
    return dq, dk, dv


def _close(got, want, what):
    assert_close_to_reference(got, want, want, np.float64, what)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_chunked_forward_merges_to_the_whole(backend, option):
    rng = np.random.default_rng(zlib.crc32(option.encode()))
    q, k, v = _inputs(rng)
    kw = _options(rng, option)
    want, want_lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    out, lse = _chunked_forward(q, k, v, kw, backend)
    _close(out, want, "out")
    _close(lse, want_lse, "lse")


@pytest.mark.parametrize("option", list(OPTIONS))
def test_chunked_backward_sums_to_the_whole(backend, option):
    rng = np.random.default_rng(zlib.crc32(option.encode()) + 1)
    q, k, v = _inputs(rng)
    kw = _options(rng, option)
    out, lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    g = rng.standard_normal(out.shape)
    want = reference.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    got = _chunked_backward(g, q, k, v, out, lse, kw, backend)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        _close(a, b, name)


def test_chunked_backward_float32_within_the_tolerance_rule(backend):
    rng = np.random.default_rng(32)
    q, k, v = _inputs(rng, np.float32)
    kw = dict(is_causal=True, enable_gqa=True, alibi_slopes=np.float32([0.5, 0.25, 0.1, 0.05]))
    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    g = rng.standard_normal(out.shape).astype(np.float32)
    got = _chunked_backward(g, q, k, v, out, lse, kw, backend)
    ref = reference.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    naive = reference.scaled_dot_product_attention_backward(g, q, k, v, dtype=np.float32, **kw)
    for name, a, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        assert a.dtype == np.float32
        assert_close_to_reference(a, r, n, np.float32, name)


def test_reference_partial_keys_backward_sums_to_the_whole():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng)
    kw = dict(is_causal=True, enable_gqa=True, dropout_p=0.25, rng=99)
    p = make_problem(q, k, v, **kw)
    out, lse = reference.forward(p)
    g = rng.standard_normal(out.shape)
    want = reference.backward(p, g)
    band = _parts.global_band(L, S, True, "top_left", (None, None))
    delta = np.einsum("bhld,bhld->bhl", g, out)
    dq = np.zeros_like(q)
    for c0, c1 in zip(COLS[:-1], COLS[1:]):
        part = make_problem(q, k[:, :, c0:c1], v[:, :, c0:c1], **kw)
        _parts.place(part, band, 0, c0, (0, HQ, 0, c0))
        part.delta = delta
        a, b, c, _ = reference.backward(part, g, lse=lse)
        dq += a
        np.testing.assert_allclose(b, want[1][:, :, c0:c1], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(c, want[2][:, :, c0:c1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dq, want[0], rtol=1e-12, atol=1e-12)


def test_dropout_origin_gives_the_whole_problems_kept_set():
    """A piece at (batch 1, heads 2..3, rows 5.., keys 7..) keeps exactly the weights the whole
    problem keeps there: the hash, the reference and the numpy backend."""
    p_drop = 0.5
    seed = make_problem(*_inputs(np.random.default_rng(0)), enable_gqa=True, dropout_p=p_drop,
                        rng=1234).seed                 # the hash's uint32 of the int rng
    whole = _dropout.piece_keep(seed, p_drop, (0, HQ, 0, 0), np.arange(B)[:, None, None, None],
                                np.arange(HQ)[None, :, None, None], np.arange(L)[:, None],
                                np.arange(S)[None, :])
    origin = (1 * HQ + 2, HQ, 5, 7)
    piece = _dropout.piece_keep(seed, p_drop, origin, 0, np.arange(2)[:, None, None],
                                np.arange(L - 5)[:, None], np.arange(S - 7)[None, :])
    assert np.array_equal(piece, whole[1, 2:4, 5:, 7:])
    assert 0.4 < piece.mean() < 0.6
    # the reference and the numpy backend read it (V = identity exposes the kept weights)
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, L - 5, E))
    k = rng.standard_normal((1, 2, S - 7, E))
    v = np.broadcast_to(np.eye(S - 7), (1, 2, S - 7, S - 7)).copy()
    p = make_problem(q, k, v, dropout_p=p_drop, rng=1234)
    p.dropout_origin = origin
    for w in (reference.forward(p)[0], registry["numpy"].forward(p)[0]):
        assert np.array_equal(w[0] != 0, piece)
    shifted = dataclasses.replace(p, dropout_origin=(origin[0] + 1,) + origin[1:])
    assert not np.array_equal(reference.forward(shifted)[0][0] != 0, piece)


def test_auto_never_routes_a_piece_to_a_backend_that_ignores_it():
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng)
    p = make_problem(q, k, v, dropout_p=0.1, rng=3, enable_gqa=True)
    p.delta = np.zeros((B, HQ, L))
    p.dropout_origin = (0, HQ, 4, 4)
    for attr in ("delta", "dropout_origin"):
        only = dataclasses.replace(p, **{a: None for a in ("delta", "dropout_origin")
                                         if a != attr})
        chosen = fa._backends.resolve(only, "backward")
        assert attr not in getattr(chosen, "unsupported_options", {}), chosen.name
        for name, b in registry.items():
            why = getattr(b, "unsupported_options", {}).get(attr)
            if why and b.available:
                with pytest.raises(fa.BackendUnavailableError, match=re.escape(why)):
                    fa._backends.resolve(only, "backward", name)


def test_sinks_with_a_key_part():
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng)
    sinks = rng.standard_normal(HQ)
    with pytest.raises(ValueError, match="sinks.*merge_attention"):
        fa.scaled_dot_product_attention(q, k[:, :, :20], v[:, :, :20], enable_gqa=True,
                                        sinks=sinks, part_of=(0, 0, L, S))
    # the forward of the parts without sinks, merged with them, is the whole forward
    kw = dict(enable_gqa=True, is_causal=True)
    parts = [fa.scaled_dot_product_attention(q, k[:, :, c0:c1], v[:, :, c0:c1], return_lse=True,
                                             part_of=(0, c0, L, S), **kw)
             for c0, c1 in zip(COLS[:-1], COLS[1:])]
    out, lse = fa.merge_attention([o for o, _ in parts], [s for _, s in parts], sinks=sinks)
    want, want_lse, g = *fa.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True,
                                                         **kw), rng.standard_normal(out.shape)
    _close(out, want, "out")
    _close(lse, want_lse, "lse")
    # backward: dq/dk/dv of the parts sum to the whole; dsinks is the rows' own, in every part
    ref = fa.scaled_dot_product_attention_backward(g, q, k, v, want, want_lse, sinks=sinks, **kw)
    dq = np.zeros_like(q)
    for c0, c1 in zip(COLS[:-1], COLS[1:]):
        a, b, c, ds = fa.scaled_dot_product_attention_backward(
            g, q, k[:, :, c0:c1], v[:, :, c0:c1], want, want_lse, sinks=sinks,
            part_of=(0, c0, L, S), **kw)
        dq += a
        _close(b, ref[1][:, :, c0:c1], "dk")
        _close(c, ref[2][:, :, c0:c1], "dv")
        _close(ds, ref[3], "dsinks")
    _close(dq, ref[0], "dq")


@pytest.mark.parametrize("part_of, err, match", [
    ((0, 0, L), TypeError, "part_of must be a tuple of four ints"),
    ([0, 0.0, L, S], TypeError, "part_of must be a tuple of four ints"),
    ((True, 0, L, S), TypeError, "part_of"),
    ("0,0", TypeError, "part_of"),
    ((-1, 0, L, S), ValueError, r"part_of=\(-1, 0, 37, 53\)"),
    ((1, 0, L, S), ValueError, "part_of.*37 query rows"),
    ((0, 0, L, S - 1), ValueError, "part_of.*53 keys"),
])
def test_part_of_bad_input(part_of, err, match):
    q, k, v = _inputs(np.random.default_rng(1))
    for call in (lambda: fa.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                         part_of=part_of),
                 lambda: fa.scaled_dot_product_attention_backward(
                     q, q, k, v, q, q[..., 0], enable_gqa=True, part_of=part_of)):
        with pytest.raises(err, match=match):
            call()


def test_part_of_whole_problem_is_the_plain_call():
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng)
    kw = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", dropout_p=0.1,
              rng=5)
    a = fa.scaled_dot_product_attention(q, k, v, **kw)
    b = fa.scaled_dot_product_attention(q, k, v, part_of=(0, 0, L, S), **kw)
    assert np.array_equal(a, b)


def test_far_query_part_with_alibi_and_sinks():
    # rows 10..11 of 12 queries against 2 keys: the part's q_offset (10) is moved into the
    # kernels' range and the ALiBi bias with it (_parts.backward_lse); with per-head slopes the
    # sinks move with the lse and the gradients are the whole problem's rows; per-batch slopes
    # cannot be folded into the per-head sinks and are refused, naming both
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 2, 12, 4))
    k, v = rng.standard_normal((2, 2, 2, 4)), rng.standard_normal((2, 2, 2, 4))
    sinks = rng.standard_normal(2)
    for slopes in (np.array([0.5, 0.25]), np.array([[0.5, 0.25], [0.3, 0.1]])):
        out, lse = fa.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, sinks=sinks,
                                                   return_lse=True)
        g = rng.standard_normal(out.shape)
        ref = fa.scaled_dot_product_attention_backward(g, q, k, v, out, lse, alibi_slopes=slopes,
                                                       sinks=sinks)
        call = lambda: fa.scaled_dot_product_attention_backward(  # noqa: E731
            g[:, :, 10:], q[:, :, 10:], k, v, out[:, :, 10:], lse[:, :, 10:],
            alibi_slopes=slopes, sinks=sinks, part_of=(10, 0, 12, 2))
        if slopes.ndim == 2:
            with pytest.raises(ValueError, match=r"sinks with per-batch alibi_slopes \(shape "
                                                 r"\(2, 2\)\)"):
                call()
            continue
        dq = call()[0]
        _close(dq, ref[0][:, :, 10:], "dq")
