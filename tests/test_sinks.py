"""Attention sinks (`sinks=`): one logit per query head in the softmax denominator only.

Every backend against the dense float64 reference (forward out and lse, backward dq/dk/dv/dsinks,
under the tolerance rule of tests/helpers.py), the reference and the backends against torch
autograd with the sink written as an extra key whose key and value are 0 and whose score is the
sink (a float-mask column), the reference's backward against finite differences, the fully
masked row rule, merge_attention counting the sink once, decode shapes, and bad input.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import torch_or_skip
from helpers import assert_close_to_reference, check_sdpa, randn

import fastattn as fa
from fastattn import _backends, reference
from fastattn._inputs import make_problem

SDPA = fa.scaled_dot_product_attention
BWD = fa.scaled_dot_product_attention_backward


@pytest.fixture
def backend(backend):
    """conftest's backend; one whose kernels do not implement sinks yet skips with its reason."""
    why = getattr(_backends.registry[backend], "unsupported_options", {}).get("sinks")
    if why:
        pytest.skip(why)
    return backend


def qkvg(rng, B=2, Hq=4, Hkv=None, L=23, S=31, E=16, Ev=None, dtype=np.float64):
    Hkv = Hq if Hkv is None else Hkv
    Ev = E if Ev is None else Ev
    return (randn(rng, (B, Hq, L, E), dtype), randn(rng, (B, Hkv, S, E), dtype),
            randn(rng, (B, Hkv, S, Ev), dtype), randn(rng, (B, Hq, L, Ev), dtype))


def sink_logits(rng, Hq, dtype=np.float64):
    """Sinks around the size of the scores (a sink far below them changes nothing measurable),
    one head with a large one (it takes most of the weight) and one with none (-inf)."""
    s = rng.standard_normal(Hq) * 1.5
    if Hq > 1:
        s[0] = 4.0
    if Hq > 2:
        s[-1] = -np.inf
    return s.astype(dtype)


def check_grads(q, k, v, g, sinks, backend, **kw):
    """A backend's four gradients vs the float64 closed form, with the tolerance rule."""
    out, lse = SDPA(q, k, v, return_lse=True, backend=backend, sinks=sinks, **kw)
    got = BWD(g, q, k, v, out, lse, backend=backend, sinks=sinks, **kw)
    assert len(got) == 4
    want = reference.scaled_dot_product_attention_backward(g, q, k, v, sinks=sinks, **kw)
    low = np.float64 if q.dtype == np.float64 else np.float32
    naive = reference.scaled_dot_product_attention_backward(g, q, k, v, sinks=sinks, dtype=low, **kw)
    for name, a, r, n, x in zip(("dq", "dk", "dv", "dsinks"), got, want, naive, (q, k, v, sinks)):
        assert a.shape == x.shape and a.dtype == x.dtype, (name, a.shape, a.dtype)
        # the naive computation rounded to the result's dtype, as the results are (float16)
        assert_close_to_reference(a, r, n.astype(a.dtype), low if q.dtype != np.float16 else np.float16, name)
    return got


# ----------------------------------------------------------------------------------------------
# the definition itself, written out a second way
# ----------------------------------------------------------------------------------------------
def test_reference_is_softmax_with_an_extra_zero_value_column(rng):
    """P = exp(s - m) / (sum_j exp(s_j - m) + exp(sink - m)); out = P V; lse includes the sink."""
    q, k, v, _ = qkvg(rng, B=1, Hq=3, L=5, S=6, E=4)
    sinks = np.array([0.7, -1.2, 3.0])
    out, lse = reference.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    s = q @ np.swapaxes(k, -1, -2) / 2.0
    ext = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (1, 3, 5, 1))], -1)
    e = np.exp(ext - ext.max(-1, keepdims=True))
    P = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, P[..., :-1] @ v, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, np.log(np.exp(ext).sum(-1)), rtol=1e-13)
    # the sink only takes weight: the keys' weights sum to 1 - P_sink < 1
    assert np.all(P[..., :-1].sum(-1) < 1)


# ----------------------------------------------------------------------------------------------
# every backend against the reference: forward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("L,S", [(1, 1), (3, 17), (17, 3), (113, 203), (129, 129)])
def test_forward_sizes(backend, rng, L, S, dtype):
    q, k, v, _ = qkvg(rng, Hq=4, L=L, S=S, E=24, Ev=20, dtype=dtype)
    check_sdpa(q, k, v, backend, sinks=sink_logits(rng, 4))
    check_sdpa(q, k, v, backend, sinks=sink_logits(rng, 4), is_causal=True)


OPTIONS = {
    "causal": dict(is_causal=True),
    "causal_br": dict(is_causal=True, causal_alignment="bottom_right"),
    "window": dict(window=(6, 2)),
    "window_br": dict(window=(4, 0), causal_alignment="bottom_right"),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
    "alibi_batch": dict(alibi_slopes=np.array([[0.5, 0.25, 0.1, 0.05], [0.3, 0.2, 0.1, 0.0]])),
    "dropout": dict(dropout_p=0.3, rng=42),
    "dropout_causal_softcap": dict(dropout_p=0.6, rng=7, is_causal=True, softcap=4.0),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_options_gqa(backend, rng, option, dtype):
    q, k, v, _ = qkvg(rng, Hq=4, Hkv=2, L=37, S=53, dtype=dtype)
    check_sdpa(q, k, v, backend, sinks=sink_logits(rng, 4), enable_gqa=True, **OPTIONS[option])


@pytest.mark.parametrize("kind", ["bool", "float", "padding"])
def test_forward_masks(backend, rng, kind):
    B, H, L, S = 2, 3, 29, 41
    q, k, v, _ = qkvg(rng, B=B, Hq=H, L=L, S=S, dtype=np.float32)
    mask = {"bool": rng.random((B, 1, L, S)) > 0.3,
            "float": rng.standard_normal((H, L, S)),
            "padding": fa.padding_mask(np.array([S, 9]), S)}[kind]
    check_sdpa(q, k, v, backend, sinks=sink_logits(rng, H), attn_mask=mask, is_causal=kind == "bool")


def test_sinks_of_any_float_dtype_and_2d_inputs(backend, rng):
    """sinks need not share the query's dtype (like alibi_slopes): they compute in its precision.
    2-D (L, E) inputs have one head, so sinks of shape (1,)."""
    q, k, v, _ = qkvg(rng, B=1, Hq=2, L=9, S=13, dtype=np.float32)
    check_sdpa(q, k, v, backend, sinks=np.array([0.5, -0.5], np.float64))
    check_sdpa(q, k, v, backend, sinks=np.array([0.5, -0.5], np.float16))
    check_sdpa(q, k, v, backend, sinks=[0.5, -0.5])
    check_sdpa(q[0, 0], k[0, 0], v[0, 0], backend, sinks=np.array([1.0]))


def test_strided_sinks_and_inputs_untouched(backend, rng):
    q, k, v, _ = qkvg(rng, B=1, Hq=4, L=9, S=13)
    wide = rng.standard_normal(8)
    before = wide.copy()
    out = SDPA(q, k, v, sinks=wide[::2], backend=backend)
    np.testing.assert_array_equal(out, SDPA(q, k, v, sinks=wide[::2].copy(), backend=backend))
    np.testing.assert_array_equal(wide, before)


def test_neg_inf_sink_is_no_sink(backend, rng):
    q, k, v, _ = qkvg(rng, Hq=3, L=20, S=33)
    out, lse = SDPA(q, k, v, sinks=np.full(3, -np.inf), return_lse=True, backend=backend)
    plain, plain_lse = SDPA(q, k, v, return_lse=True, backend=backend)
    np.testing.assert_allclose(out, plain, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, plain_lse, rtol=1e-12)
    g = randn(rng, out.shape, np.float64)
    with_sinks = BWD(g, q, k, v, out, lse, sinks=np.full(3, -np.inf), backend=backend)
    for a, b in zip(with_sinks, BWD(g, q, k, v, plain, plain_lse, backend=backend)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    assert np.all(with_sinks[3] == 0)


def test_a_larger_sink_takes_more_weight(backend, rng):
    """Raising a head's sink lowers every row's key weights, hence pulls out toward 0."""
    q, k, v, _ = qkvg(rng, B=1, Hq=1, L=6, S=10)
    norms = [np.abs(SDPA(q, k, v, sinks=np.array([s]), backend=backend)).sum() for s in (-2.0, 1.0, 4.0, 12.0)]
    assert norms[0] > norms[1] > norms[2] > norms[3] > 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_sink_makes_its_heads_rows_nan(backend, rng, bad):
    """The NaN rule: the sink takes part in every row of its head, masked rows included."""
    q, k, v, _ = qkvg(rng, B=2, Hq=3, L=8, S=12, dtype=np.float32)
    mask = np.ones((8, 12), bool)
    mask[2] = False                                        # a fully masked row
    sinks = np.array([0.5, bad, -1.0], np.float32)
    out, lse = SDPA(q, k, v, sinks=sinks, attn_mask=mask, return_lse=True, backend=backend)
    assert np.isnan(out[:, 1]).all() and np.isnan(lse[:, 1]).all()
    good = np.array([0.5, 0.0, -1.0], np.float32)
    ref_out, ref_lse = SDPA(q, k, v, sinks=good, attn_mask=mask, return_lse=True, backend=backend)
    np.testing.assert_array_equal(out[:, [0, 2]], ref_out[:, [0, 2]])
    np.testing.assert_array_equal(lse[:, [0, 2]], ref_lse[:, [0, 2]])


# ----------------------------------------------------------------------------------------------
# fully masked rows and empty sizes
# ----------------------------------------------------------------------------------------------
def test_fully_masked_row_gives_zero_and_lse_sink(backend, rng):
    B, H, L, S = 2, 3, 10, 12
    q, k, v, g = qkvg(rng, B=B, Hq=H, L=L, S=S)
    mask = np.ones((L, S), bool)
    mask[4] = False
    sinks = np.array([1.5, -0.25, -np.inf])
    out, lse = check_sdpa(q, k, v, backend, sinks=sinks, attn_mask=mask)
    assert np.all(out[:, :, 4] == 0)
    np.testing.assert_array_equal(lse[:, :, 4], np.broadcast_to(sinks, (B, H)))
    dq, dk, dv, ds = check_grads(q, k, v, g, sinks, backend, attn_mask=mask)
    assert np.all(dq[:, :, 4] == 0) and np.isfinite(ds).all()
    # bottom-right alignment with L > S: the top rows see no key
    q2, k2, v2, g2 = qkvg(rng, B=1, Hq=2, L=12, S=5)
    out2, lse2 = check_sdpa(q2, k2, v2, backend, sinks=np.array([0.3, 2.0]), is_causal=True,
                            causal_alignment="bottom_right")
    assert np.all(out2[:, :, :7] == 0) and np.all(lse2[0, :, :7] == np.array([[0.3], [2.0]]))
    dq2 = check_grads(q2, k2, v2, g2, np.array([0.3, 2.0]), backend, is_causal=True,
                      causal_alignment="bottom_right")[0]
    assert np.all(dq2[:, :, :7] == 0)


def test_nan_in_masked_keys_does_not_reach_results(backend, rng):
    q, k, v, g = qkvg(rng, B=2, Hq=2, L=6, S=40, dtype=np.float32)
    k[:, :, 30:] = np.nan
    v[:, :, 30:] = np.inf
    mask = fa.padding_mask(np.array([30, 20]), 40)
    sinks = np.array([0.5, 1.0], np.float32)
    out, lse = SDPA(q, k, v, attn_mask=mask, sinks=sinks, return_lse=True, backend=backend)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    dq, dk, dv, ds = BWD(g, q, k, v, out, lse, attn_mask=mask, sinks=sinks, backend=backend)
    assert np.isfinite(dq).all() and np.isfinite(ds).all()
    assert np.all(dk[:, :, 30:] == 0) and np.all(dv[:, :, 30:] == 0)


@pytest.mark.parametrize("shape", [dict(S=0), dict(L=0), dict(B=0), dict(Hq=0), dict(Ev=0), dict(E=0)])
def test_empty_sizes(backend, rng, shape):
    dims = dict(B=2, Hq=3, L=5, S=7, E=4, Ev=3) | shape
    q, k, v, g = qkvg(rng, **dims)
    sinks = sink_logits(rng, dims["Hq"])
    out, lse = SDPA(q, k, v, sinks=sinks, return_lse=True, backend=backend)
    assert out.shape == g.shape and lse.shape == q.shape[:-1]
    ref_out, ref_lse = reference.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    if dims["S"] == 0 and q.size:
        assert np.all(out == 0)
        np.testing.assert_array_equal(lse, np.broadcast_to(sinks[:, None], lse.shape))
    grads = BWD(g, q, k, v, out, lse, sinks=sinks, backend=backend)
    want = reference.scaled_dot_product_attention_backward(g, q, k, v, sinks=sinks)
    for a, r, x in zip(grads, want, (q, k, v, sinks)):
        assert a.shape == x.shape
        np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# every backend against the reference: backward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("L,S", [(1, 1), (3, 17), (17, 3), (113, 203), (129, 129)])
def test_backward_sizes(backend, rng, L, S, dtype):
    q, k, v, g = qkvg(rng, Hq=4, L=L, S=S, E=24, Ev=20, dtype=dtype)
    check_grads(q, k, v, g, sink_logits(rng, 4, dtype), backend)
    check_grads(q, k, v, g, sink_logits(rng, 4, dtype), backend, is_causal=True)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_options_gqa(backend, rng, option, dtype):
    q, k, v, g = qkvg(rng, Hq=4, Hkv=2, L=37, S=53, dtype=dtype)
    check_grads(q, k, v, g, sink_logits(rng, 4, dtype), backend, enable_gqa=True, **OPTIONS[option])


@pytest.mark.parametrize("kind", ["bool", "float", "padding"])
def test_backward_masks(backend, rng, kind):
    B, H, L, S = 2, 3, 29, 41
    q, k, v, g = qkvg(rng, B=B, Hq=H, L=L, S=S)
    mask = {"bool": rng.random((B, 1, L, S)) > 0.3,
            "float": rng.standard_normal((H, L, S)),
            "padding": fa.padding_mask(np.array([S, 9]), S)}[kind]
    check_grads(q, k, v, g, sink_logits(rng, H), backend, attn_mask=mask, is_causal=kind == "bool")


def test_backward_float16_and_dsinks_dtype(backend, rng):
    """dsinks come back in the sinks' dtype, whatever the query's."""
    q, k, v, g = qkvg(rng, B=1, Hq=2, L=19, S=27, dtype=np.float16)
    check_grads(q, k, v, g, np.array([0.5, 1.5], np.float16), backend)
    out, lse = SDPA(q, k, v, sinks=np.array([0.5, 1.5], np.float64), return_lse=True, backend=backend)
    ds = BWD(g, q, k, v, out, lse, sinks=np.array([0.5, 1.5], np.float64), backend=backend)[3]
    assert ds.dtype == np.float64 and ds.shape == (2,)


# ----------------------------------------------------------------------------------------------
# decode: a few query rows against a long KV, GQA (the compiled backends' decode kernels)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("L", [1, 2, 3, 4])
@pytest.mark.parametrize("S,Hq,Hkv", [(300, 8, 2), (1500, 4, 4), (777, 6, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_shapes(backend, rng, L, S, Hq, Hkv, dtype):
    q, k, v, g = qkvg(rng, B=2, Hq=Hq, Hkv=Hkv, L=L, S=S, E=64, dtype=dtype)
    sinks = sink_logits(rng, Hq, dtype)
    sinks[1] = 9.0                                 # a sink above every score (|s| < ~6 here)
    kw = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
    check_sdpa(q, k, v, backend, sinks=sinks, **kw)
    check_sdpa(q, k, v, backend, sinks=sinks, enable_gqa=True, window=(100, 0),
               causal_alignment="bottom_right")
    check_grads(q, k, v, g, sinks, backend, **kw)


# ----------------------------------------------------------------------------------------------
# torch autograd: the sink as one more key (key 0, value 0) whose score is the sink
# ----------------------------------------------------------------------------------------------
def torch_with_sink_column(torch, q, k, v, g, sinks, mask=None, enable_gqa=False):
    """Out, lse and the gradients of q, k, v, sinks from torch's SDPA over S + 1 keys: key S has
    zero key and value vectors, and a float attn_mask column carries each head's sink logit
    (through which torch differentiates the sinks). mask: (Hq, L, S) float, 0 or -inf, or None."""
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    ts = torch.tensor(sinks, requires_grad=True)
    zk = torch.zeros(B, k.shape[1], 1, k.shape[3], dtype=tk.dtype)
    zv = torch.zeros(B, v.shape[1], 1, v.shape[3], dtype=tv.dtype)
    base = torch.zeros(Hq, L, S, dtype=tq.dtype) if mask is None else torch.from_numpy(mask)
    tmask = torch.cat([base, ts.view(Hq, 1, 1).expand(Hq, L, 1)], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, torch.cat([tk, zk], 2), torch.cat([tv, zv], 2), attn_mask=tmask, enable_gqa=enable_gqa)
    out.backward(torch.from_numpy(g))
    scores = (tq @ torch.repeat_interleave(torch.cat([tk, zk], 2), Hq // k.shape[1], 1).transpose(-1, -2))
    lse = torch.logsumexp(scores.detach() / np.sqrt(q.shape[3]) + tmask.detach(), dim=-1)
    return out.detach().numpy(), lse.numpy(), [t.grad.numpy() for t in (tq, tk, tv, ts)]


@pytest.mark.parametrize("case", ["plain", "causal", "causal_br", "bool_mask", "masked_row", "gqa", "L_ne_S"])
def test_against_torch_autograd(rng, case):
    """The reference (1e-10) and, in float64, every backend that serves sinks under auto."""
    torch = torch_or_skip()
    L, S = (9, 23) if case in ("L_ne_S", "causal_br") else (17, 17)
    Hkv = 2 if case == "gqa" else 4
    q, k, v, g = qkvg(rng, Hq=4, Hkv=Hkv, L=L, S=S, E=8, Ev=6)
    sinks = sink_logits(rng, 4)
    kw = dict(enable_gqa=case == "gqa")
    keep = None
    if case in ("causal", "L_ne_S"):
        kw["is_causal"] = True
        keep = fa.causal_mask(L, S)
    if case == "causal_br":
        kw.update(is_causal=True, causal_alignment="bottom_right")
        keep = fa.causal_mask(L, S, alignment="bottom_right")
    if case in ("bool_mask", "masked_row"):
        keep = rng.random((4, L, S)) > 0.3
        if case == "masked_row":
            keep[:, 3] = False
        kw["attn_mask"] = keep
    tmask = None if keep is None else np.where(np.broadcast_to(keep, (4, L, S)), 0.0, -np.inf)
    t_out, t_lse, t_grads = torch_with_sink_column(torch, q, k, v, g, sinks, tmask, kw["enable_gqa"])
    out, lse = reference.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    np.testing.assert_allclose(out, t_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, t_lse, rtol=1e-10, atol=1e-12)
    ours = reference.scaled_dot_product_attention_backward(g, q, k, v, sinks=sinks, **kw)
    for name, a, t in zip(("dq", "dk", "dv", "dsinks"), ours, t_grads):
        np.testing.assert_allclose(a, t, rtol=1e-10, atol=1e-12, err_msg=name)
    # end to end through the public functions (auto picks a backend that serves sinks)
    out, lse = SDPA(q, k, v, sinks=sinks, return_lse=True, **kw)
    np.testing.assert_allclose(out, t_out, rtol=1e-10, atol=1e-12)
    for name, a, t in zip(("dq", "dk", "dv", "dsinks"), BWD(g, q, k, v, out, lse, sinks=sinks, **kw), t_grads):
        np.testing.assert_allclose(a, t, rtol=1e-10, atol=1e-12, err_msg=name)


def test_backends_against_torch_autograd(backend, rng):
    torch = torch_or_skip()
    q, k, v, g = qkvg(rng, Hq=6, Hkv=2, L=33, S=70, E=16, Ev=12)
    sinks = sink_logits(rng, 6)
    keep = fa.causal_mask(33, 70, alignment="bottom_right")
    t_out, t_lse, t_grads = torch_with_sink_column(
        torch, q, k, v, g, sinks, np.where(np.broadcast_to(keep, (6, 33, 70)), 0.0, -np.inf), True)
    kw = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", backend=backend)
    out, lse = SDPA(q, k, v, sinks=sinks, return_lse=True, **kw)
    np.testing.assert_allclose(out, t_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, t_lse, rtol=1e-10, atol=1e-12)
    for name, a, t in zip(("dq", "dk", "dv", "dsinks"), BWD(g, q, k, v, out, lse, sinks=sinks, **kw), t_grads):
        np.testing.assert_allclose(a, t, rtol=1e-9, atol=1e-11, err_msg=name)


# ----------------------------------------------------------------------------------------------
# the reference's backward against finite differences
# ----------------------------------------------------------------------------------------------
def numeric_grad(f, x, idx, eps=1e-6):
    xp, xm = x.copy(), x.copy()
    xp[idx] += eps
    xm[idx] -= eps
    return (f(xp) - f(xm)) / (2 * eps)


@pytest.mark.parametrize("options", [
    dict(),
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(window=(3, 1)),
    dict(softcap=1.5),
    dict(alibi_slopes=np.array([0.3, 0.7])),
    dict(dropout_p=0.4, rng=3),
    dict(attn_mask=np.tril(np.ones((5, 7), bool), 1) & (np.arange(5) != 2)[:, None], softcap=2.0,
         dropout_p=0.2, rng=11),
], ids=["plain", "bottom_right", "window", "softcap", "alibi", "dropout", "combined_masked_row"])
def test_reference_backward_equals_finite_differences(rng, options):
    q, k, v, g = qkvg(rng, B=2, Hq=2, L=5, S=7, E=4, Ev=3)
    sinks = np.array([0.4, -0.8])

    def loss(qq, kk, vv, ss):
        return float(np.sum(g * reference.scaled_dot_product_attention(qq, kk, vv, sinks=ss, **options)))

    grads = reference.scaled_dot_product_attention_backward(g, q, k, v, sinks=sinks, **options)
    args = (q, k, v, sinks)
    for which, (x, dx) in enumerate(zip(args, grads)):
        picks = [(0,), (1,)] if which == 3 else [tuple(rng.integers(0, n) for n in x.shape) for _ in range(10)]
        for idx in picks:
            def f(xx, which=which):
                a = list(args)
                a[which] = xx
                return loss(*a)
            np.testing.assert_allclose(dx[idx], numeric_grad(f, x, idx), rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# merge_attention: parts over disjoint key sets, computed without the sink; the sink counted once
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuts", [(40,), (10, 25, 60), (0, 70)])
def test_merge_counts_the_sink_once(rng, cuts):
    q, k, v, _ = qkvg(rng, B=2, Hq=4, Hkv=2, L=9, S=70)
    sinks = sink_logits(rng, 4)
    kw = dict(enable_gqa=True, window=(30, 30), causal_alignment="bottom_right")
    whole, whole_lse = reference.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    edges = (0,) + cuts + (70,)
    outs, lses = [], []
    for j0, j1 in zip(edges[:-1], edges[1:]):
        keep = np.zeros((9, 70), bool)
        keep[:, j0:j1] = True                      # the same positions, only keys j0..j1-1
        o, s = fa.scaled_dot_product_attention(q, k, v, attn_mask=keep, return_lse=True, **kw)
        outs.append(o)
        lses.append(s)
    out, lse = fa.merge_attention(outs, lses, sinks=sinks)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12)
    # parts that each carried the sink count it once per part: not the whole problem's answer
    with_sink = [fa.scaled_dot_product_attention(q, k, v, attn_mask=np.pad(np.ones((9, j1 - j0), bool),
                 ((0, 0), (j0, 70 - j1))), sinks=sinks, return_lse=True, **kw) for j0, j1 in zip(edges[:-1], edges[1:])]
    _, wrong_lse = fa.merge_attention([o for o, _ in with_sink], [s for _, s in with_sink])
    assert not np.allclose(wrong_lse[:, 0], whole_lse[:, 0])


def test_merge_with_sinks_shapes_and_empty_parts(rng):
    B, H, L, Ev = 2, 3, 4, 5
    outs = [np.zeros((B, H, L, Ev)), np.zeros((B, H, L, Ev))]
    lses = [np.full((B, H, L), -np.inf)] * 2
    sinks = np.array([0.5, -np.inf, 2.0])
    out, lse = fa.merge_attention(outs, lses, sinks=sinks)        # no part had a key: the sink alone
    assert np.all(out == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[:, None], (B, H, L)))
    # (B, H) sinks broadcast as sinks[..., None] too
    o = [randn(rng, (B, H, L, Ev), np.float64) for _ in range(2)]
    s = [randn(rng, (B, H, L), np.float64) for _ in range(2)]
    per_batch = np.stack([np.array([0.1, 0.2, 0.3]), np.array([1.0, -1.0, 0.0])])
    out, lse = fa.merge_attention(o, s, sinks=per_batch)
    np.testing.assert_allclose(lse, np.logaddexp(np.logaddexp(s[0], s[1]), per_batch[..., None]), rtol=1e-13)
    w = [np.exp(si - lse)[..., None] for si in s]
    np.testing.assert_allclose(out, w[0] * o[0] + w[1] * o[1], rtol=1e-12, atol=1e-14)
    for bad in (np.zeros(H + 1), np.zeros((B, H, L)), np.zeros((3, B, H))):
        with pytest.raises(ValueError, match="sinks of shape"):
            fa.merge_attention(o, s, sinks=bad)
    with pytest.raises(TypeError, match="sinks must have a float dtype"):
        fa.merge_attention(o, s, sinks=np.arange(H))


# ----------------------------------------------------------------------------------------------
# bad input, and the canonical problem
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", ["forward", "backward"])
def test_bad_sinks_raise_naming_sinks(rng, fn):
    q, k, v, g = qkvg(rng, B=2, Hq=4, Hkv=2, L=5, S=6)

    def call(sinks):
        if fn == "forward":
            return SDPA(q, k, v, enable_gqa=True, sinks=sinks)
        out = np.zeros_like(g)
        return BWD(g, q, k, v, out, np.zeros(q.shape[:-1]), enable_gqa=True, sinks=sinks)

    for shape in [(2,), (5,), (2, 4), (1, 4), ()]:            # (Hkv,), wrong, (B, Hq), 2-D, scalar
        with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(4,\).*got shape"):
            call(np.zeros(shape))
    for bad in (np.arange(4), np.zeros(4, complex), np.array(["a"] * 4), [0.1, "x", 0.2, 0.3]):
        with pytest.raises(TypeError, match="sinks must have a float dtype"):
            call(bad)
    with pytest.raises(TypeError, match="sinks"):
        call([[0.1], [0.2, 0.3]])                             # ragged


def test_problem_sinks_in_the_compute_dtype(rng):
    q, k, v, _ = qkvg(rng, B=1, Hq=3, L=4, S=5, dtype=np.float16)
    p = make_problem(q, k, v, sinks=np.array([1, 2, 3], np.float64))
    assert p.sinks.dtype == np.float32 and p.sinks.shape == (3,) and p.sinks.flags.c_contiguous
    assert make_problem(q, k, v).sinks is None


def test_backward_without_sinks_still_returns_three(rng):
    q, k, v, g = qkvg(rng, B=1, Hq=2, L=4, S=5)
    out, lse = SDPA(q, k, v, return_lse=True)
    assert len(BWD(g, q, k, v, out, lse)) == 3
