"""fastattn.torch.scaled_dot_product_attention against torch: outputs and gradients.

The referee is torch itself in float64: torch's SDPA for the arguments the two share, and a dense
float64 torch computation (autograd for the gradients) for fastattn's own options (window,
softcap, ALiBi, sinks, bottom-right causal).
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0 to run the torch tests")
import fastattn.torch as fat  # noqa: E402
F = torch.nn.functional


def _inputs(B=2, Hq=4, Hkv=4, L=19, S=23, E=16, Ev=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, Ev or E, generator=g, dtype=torch.float64).to(dtype)
    return [t.requires_grad_(True) for t in (q, k, v)]


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(out, inputs, g.to(out.dtype))


def _close(a, b, tol):
    """max |a - b| <= tol * max |b| (b the float64 referee)."""
    a, b = a.detach().double(), b.detach().double()
    scale = max(b.abs().max().item(), 1e-30)
    assert (a - b).abs().max().item() <= tol * scale, ((a - b).abs().max().item(), scale)


def dense_reference(q, k, v, *, mask=None, is_causal=False, alignment="top_left", scale=None,
                    window=None, softcap=None, alibi=None, sinks=None):
    """The score pipeline of DESIGN.md §1 written out densely in torch (differentiable)."""
    L, S = q.shape[-2], k.shape[-2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(L).unsqueeze(1) + (S - L if alignment == "bottom_right" else 0)
    pos_k = torch.arange(S).unsqueeze(0)
    if alibi is not None:
        s = s - alibi.reshape(1, -1, 1, 1) * (pos_q - pos_k).abs()
    keep = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        keep &= pos_k <= pos_q
    if window is not None:
        keep &= pos_k >= pos_q - window[0]
        keep &= pos_k <= pos_q + window[1]
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    m = s.amax(-1, keepdim=True).clamp_min(-1e300)
    p = torch.exp(s - m)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


# ----------------------------------------------------------------------------------------------
# the arguments torch's SDPA has: against torch itself
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["plain", "causal", "gqa_causal", "bool_mask", "float_mask",
                                  "scale", "dv", "causal_L_gt_S", "mqa_bool_mask"])
def test_matches_torch_sdpa_outputs_and_gradients(case, backend):
    kw, shape = {}, {}
    if case == "gqa_causal":
        shape, kw = {"Hq": 6, "Hkv": 2}, {"is_causal": True, "enable_gqa": True}
    elif case == "mqa_bool_mask":
        shape, kw = {"Hq": 4, "Hkv": 1}, {"enable_gqa": True}
    elif case == "causal":
        kw = {"is_causal": True}
    elif case == "scale":
        kw = {"scale": 0.37}
    elif case == "dv":
        shape = {"Ev": 9}
    elif case == "causal_L_gt_S":
        shape, kw = {"L": 29, "S": 11}, {"is_causal": True}
    q, k, v = _inputs(**shape)
    L, S = q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(5)
    if case in ("bool_mask", "mqa_bool_mask"):
        kw["attn_mask"] = torch.rand(q.shape[0], 1, L, S, generator=g) > 0.3
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(1, q.shape[1], L, S, generator=g, dtype=torch.float64)
    out = fat.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _close(out, ref, 1e-10)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        _close(a, b, 1e-10)


def test_float32_close_to_torch_float64(backend):
    q, k, v = _inputs(B=1, Hq=8, Hkv=2, L=130, S=130, E=64)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    out = fat.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True,
                                           backend=backend)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.float32
    _close(out, ref, 1e-5)
    for a, b in zip(_grads(out, (q32, k32, v32)), _grads(ref, (q, k, v))):
        assert a.dtype == torch.float32
        _close(a, b, 1e-4)


# ----------------------------------------------------------------------------------------------
# fastattn's own options: against the dense torch computation, gradients included
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [
    {"window": (3, 0), "is_causal": True},
    {"window": (4, 2)},
    {"softcap": 2.5},
    {"alibi": True, "is_causal": True},
    {"sinks": True},
    {"sinks": True, "is_causal": True, "window": (5, 0), "softcap": 3.0},
    {"is_causal": True, "alignment": "bottom_right"},
], ids=lambda o: "-".join(sorted(o)))
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_fastattn_options_outputs_and_gradients(opts, gqa, backend):
    q, k, v = _inputs(Hq=4, Hkv=2 if gqa else 4, L=13, S=21)
    Hq = q.shape[1]
    g = torch.Generator().manual_seed(3)
    ref_kw = {key: val for key, val in opts.items() if key not in ("alibi", "sinks")}
    op_kw = dict(ref_kw)
    op_kw["causal_alignment"] = op_kw.pop("alignment", "top_left")
    inputs = [q, k, v]
    if opts.get("alibi"):
        slopes = torch.rand(Hq, generator=g, dtype=torch.float64)
        ref_kw["alibi"] = op_kw["alibi_slopes"] = slopes
    if opts.get("sinks"):
        sinks = torch.randn(Hq, generator=g, dtype=torch.float64).requires_grad_(True)
        ref_kw["sinks"] = op_kw["sinks"] = sinks
        inputs.append(sinks)
    out = fat.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, backend=backend, **op_kw)
    ref = dense_reference(q, k, v, **ref_kw)
    _close(out, ref, 1e-10)
    for a, b in zip(_grads(out, inputs), _grads(ref, inputs)):
        _close(a, b, 1e-9)


def test_gradcheck_with_sinks_softcap_window():
    q, k, v = _inputs(B=1, Hq=2, Hkv=1, L=5, S=7, E=4)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sinks):
        return fat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                window=(3, 0), softcap=1.5, sinks=sinks)
    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_dropout_is_torch_seeded_and_its_gradient_is_exact():
    q, k, v = _inputs(B=1, Hq=2, Hkv=2, L=9, S=9, E=4)

    def f(q, k, v):
        torch.manual_seed(7)        # the op draws its dropout seed from torch's generator
        return fat.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    a, b = f(q, k, v), f(q, k, v)
    assert torch.equal(a, b)
    assert not torch.allclose(a, fat.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.manual_seed(8)
    assert not torch.equal(a, fat.scaled_dot_product_attention(q, k, v, dropout_p=0.3,
                                                                is_causal=True))
    # the backward regenerates the forward's dropped weights: finite differences agree
    assert torch.autograd.gradcheck(f, (q, k, v))


# ----------------------------------------------------------------------------------------------
# dtypes and strides
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_computes_in_float32_returns_input_dtype(dtype, monkeypatch):
    q, k, v = _inputs(B=1, Hq=4, Hkv=2, L=33, S=40, E=32, dtype=dtype)
    out = fat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=True,
                                         enable_gqa=True)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    _close(out, ref, tol)
    ref_grads = _grads(ref, (q, k, v))
    for gr, ref_g in zip(_grads(out, (q, k, v)), ref_grads):
        assert gr.dtype == dtype
        _close(gr, ref_g, 4 * tol)
    if dtype == torch.bfloat16:     # without ml_dtypes: a float32 copy, the same answer
        monkeypatch.setattr(fat, "_ml_dtypes", None)
        out2 = fat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert out2.dtype == dtype
        _close(out2, ref, tol)
        for gr, ref_g in zip(_grads(out2, (q, k, v)), ref_grads):
            assert gr.dtype == dtype
            _close(gr, ref_g, 4 * tol)


def test_strided_inputs_are_read_in_place(backend):
    g = torch.Generator().manual_seed(2)
    # (B, L, H, E) storage as transformers' projections give it, seen as (B, H, L, E)
    base = torch.randn(2, 17, 3, 4, 8, generator=g, dtype=torch.float64)
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    for t in (q, k, v):
        a = fat._as_array(t)
        assert a.ctypes.data == t.data_ptr() and a.strides == tuple(8 * s for s in t.stride())
    qc, kc, vc = (t.contiguous().requires_grad_(True) for t in (q, k, v))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mask = (torch.rand(17, generator=g) > 0.2).expand(2, 1, 17, 17)     # stride-0 mask
    out = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    ref = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask.contiguous())
    _close(out, ref, 1e-12)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (qc, kc, vc))):
        _close(a, b, 1e-12)
    bf = torch.randn(2, 6, 2, 8, dtype=torch.bfloat16).transpose(1, 2)
    a = fat._as_array(bf)
    assert a.ctypes.data == bf.data_ptr() and a.dtype.name == "bfloat16"


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    q, k, v = _inputs(B=1, Hq=2, Hkv=2, L=4, S=4, E=4)
    with pytest.raises(TypeError, match="key"):
        fat.scaled_dot_product_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="value"):
        fat.scaled_dot_product_attention(q, k, v.detach().numpy())
    with pytest.raises(TypeError, match="query"):
        fat.scaled_dot_product_attention(q.long(), k, v)
    with pytest.raises(ValueError, match="query.*meta"):
        fat.scaled_dot_product_attention(torch.empty(1, 2, 4, 4, device="meta"), k, v)
    with pytest.raises(ValueError, match="key"):
        fat.scaled_dot_product_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="attn_mask"):
        fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        fat.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.zeros(4, 4, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        fat.scaled_dot_product_attention(
            q, k, v, alibi_slopes=torch.ones(2, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match="sinks"):
        fat.scaled_dot_product_attention(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="enable_gqa"):
        fat.scaled_dot_product_attention(q, k[:, :1], v[:, :1])


def test_import_fastattn_does_not_import_torch():
    code = ("import sys, fastattn, numpy as np; "
            "fastattn.scaled_dot_product_attention(*[np.ones((1, 2, 3, 4))] * 3); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('torch', 'transformers')))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_transformers_without_transformers_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)      # import transformers fails
    monkeypatch.delitem(sys.modules, "fastattn._transformers", raising=False)
    with pytest.raises(ImportError, match="transformers"):
        fat.register_transformers()


def test_fully_masked_rows_give_zero_and_zero_gradients():
    q, k, v = _inputs(B=1, Hq=2, Hkv=2, L=3, S=4, E=4)
    mask = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    out = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 1] == 0) and torch.isfinite(out).all()
    dq, dk, dv = _grads(out, (q, k, v))
    assert torch.all(dq[:, :, 1] == 0)
    ref = dense_reference(q, k, v, mask=mask)
    _close(out, ref, 1e-12)
    np.testing.assert_allclose(dv.numpy(), _grads(ref, (q, k, v))[2].numpy(), atol=1e-12)


def test_double_backward_raises_instead_of_a_silent_zero():
    q, k, v = _inputs(B=1, Hq=1, Hkv=1, L=3, S=3, E=2)
    out = fat.scaled_dot_product_attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()


def test_nothing_of_size_L_by_S_is_kept_for_the_backward():
    q, k, v = _inputs(B=1, Hq=2, Hkv=2, L=64, S=80, E=4)
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    out = fat.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
    saved = out.grad_fn.saved_tensors
    # q, k, v, sinks, out and the lse (B, H, L): nothing with an L x S axis pair
    assert sum(t.numel() for t in saved) == (q.numel() + k.numel() + v.numel() + 2
                                             + out.numel() + 2 * 64)
    assert not any(t.shape[-2:] == (64, 80) for t in saved)
    with torch.no_grad():           # inference: no graph at all
        assert fat.scaled_dot_product_attention(q, k, v).grad_fn is None
