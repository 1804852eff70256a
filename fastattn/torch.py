"""fastattn inside torch: an attention op with autograd, and an attention backend for transformers.

    import fastattn.torch as fat
    out = fat.scaled_dot_product_attention(q, k, v, is_causal=True)        # torch tensors
    fat.register_transformers()          # then attn_implementation="fastattn" in transformers

`import fastattn` never imports this module, so torch is loaded only by those who ask for it.
The op hands the tensors' memory to fastattn's NumPy kernels without copying (`Tensor.numpy()`
views keep the strides; fastattn reads strided arrays) and its backward is fastattn's
FlashAttention-2 backward: between forward and backward only q, k, v, out, the lse (and the
sinks) are kept, nothing of size L x S.
"""
from __future__ import annotations

try:
    import torch
except ImportError as exc:          # pragma: no cover - the tests run with torch installed
    raise ImportError("fastattn.torch needs PyTorch, which is not installed: pip install torch "
                      "(fastattn itself works on NumPy arrays without it)") from exc

import numpy as np
from torch.autograd.function import once_differentiable

from . import api as _api

__all__ = ["scaled_dot_product_attention", "register_transformers"]

_FN = "fastattn.torch.scaled_dot_product_attention"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

try:                                # bfloat16 reaches the kernels as ml_dtypes.bfloat16
    import ml_dtypes as _ml_dtypes
except ImportError:                 # ... or, without ml_dtypes, as a float32 copy
    _ml_dtypes = None


# ----------------------------------------------------------------------------------------------
# tensors <-> arrays, without copies
# ----------------------------------------------------------------------------------------------
def _as_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of CPU tensor t, strides kept (no copy), bfloat16 included where it can be."""
    t = t.detach()
    if t.is_conj() or t.is_neg():   # lazy conjugate/negation bits: numpy() refuses them
        t = t.resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        if _ml_dtypes is None:
            return t.float().numpy()
        # numpy() refuses bfloat16: read the same bytes as int16, then name them bfloat16
        return t.view(torch.int16).numpy().view(_ml_dtypes.bfloat16)
    return t.numpy()


def _as_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of dtype `dtype` on array a's memory (a copy only for a float32 stand-in)."""
    if dtype == torch.bfloat16:
        if a.dtype == np.float32:   # computed from a float32 copy (no ml_dtypes)
            return torch.from_numpy(a).to(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _check_tensor(t, name: str, allow_none: bool = False) -> None:
    if t is None and allow_none:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_FN}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{_FN}: {name} is on device {t.device}; fastattn computes on the CPU: "
                         f"move it with .cpu() (or use torch's own attention on {t.device.type})")
    if t.layout != torch.strided:
        raise ValueError(f"{_FN}: {name} must be a dense (strided) tensor, got layout {t.layout}")


def _check_inputs(query, key, value, attn_mask, sinks, alibi_slopes) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(t, name)
        if t.dtype not in _FLOATS:
            raise TypeError(f"{_FN}: {name} must be float16, bfloat16, float32 or float64, "
                            f"got {t.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"{_FN}: query, key and value must have one dtype, got "
                        f"{query.dtype}, {key.dtype} and {value.dtype}")
    _check_tensor(attn_mask, "attn_mask", allow_none=True)
    _check_tensor(sinks, "sinks", allow_none=True)
    _check_tensor(alibi_slopes, "alibi_slopes", allow_none=True)
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError(f"{_FN}: attn_mask requires grad, but fastattn computes no gradient for "
                         f"a mask (it would silently be zero); pass attn_mask.detach() if that "
                         f"is what you mean, or use torch's attention for a learned bias")
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError(f"{_FN}: alibi_slopes requires grad, but fastattn computes no gradient "
                         f"for ALiBi slopes; pass alibi_slopes.detach() for fixed slopes")
    if sinks is not None and sinks.dtype not in _FLOATS:
        raise TypeError(f"{_FN}: sinks must be a float tensor, got {sinks.dtype}")


def _dropout_seed() -> int:
    """A seed for fastattn's hash dropout drawn from torch's generator, so torch.manual_seed
    makes the dropped weights reproducible; the backward regenerates them from it."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


# ----------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------
def _forward(query, key, value, sinks, attn_mask, alibi_slopes, options, return_lse):
    """fastattn's forward on the tensors' memory: (out tensor, lse array or None, the mask and
    slopes as arrays)."""
    arrays = [_as_array(t) for t in (query, key, value)]
    extra = {"attn_mask": None if attn_mask is None else _as_array(attn_mask),
             "alibi_slopes": None if alibi_slopes is None else _as_array(alibi_slopes)}
    sinks_a = None if sinks is None else _as_array(sinks)
    res = _api.scaled_dot_product_attention(*arrays, **extra, **options, sinks=sinks_a,
                                            return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    return _as_tensor(out, query.dtype), lse, extra


class _Attention(torch.autograd.Function):
    """Forward: fastattn's forward with its lse. Backward: fastattn's backward from q, k, v,
    out and lse (and the dropout seed), which recomputes the weights tile by tile."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, attn_mask, alibi_slopes, options):
        out_t, lse, extra = _forward(query, key, value, sinks, attn_mask, alibi_slopes,
                                     options, True)
        ctx.save_for_backward(query, key, value, sinks, out_t, torch.from_numpy(lse))
        ctx.extra = extra
        ctx.options = options
        return out_t

    @staticmethod
    @once_differentiable     # computed in NumPy: a second derivative must raise, not be 0
    def backward(ctx, grad_out):
        query, key, value, sinks, out, lse = ctx.saved_tensors
        arrays = [_as_array(t) for t in (grad_out, query, key, value, out)]
        sinks_a = None if sinks is None else _as_array(sinks)
        grads = _api.scaled_dot_product_attention_backward(
            *arrays, lse.numpy(), **ctx.extra, sinks=sinks_a, **ctx.options)
        dq, dk, dv = (_as_tensor(g, t.dtype) for g, t in zip(grads[:3], (query, key, value)))
        dsinks = _as_tensor(grads[3], sinks.dtype) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, window=None,
                                 softcap=None, alibi_slopes=None, sinks=None, backend=None,
                                 causal_alignment="top_left"):
    """`torch.nn.functional.scaled_dot_product_attention` computed by fastattn, with autograd.

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev): CPU tensors of one
    dtype, float32 or float64 (float16/bfloat16 computed in float32, returned in their dtype).
    The shared arguments mean what they mean in torch; `attn_mask` bool (True = take part) or
    float (added to the scores), broadcastable, never expanded. Beyond torch, fastattn's:
    window (left, right), softcap, alibi_slopes ((Hq,) or (B, Hq)), sinks ((Hq,) tensor, one
    logit per head in every row's softmax denominator), causal_alignment ("bottom_right" for
    a query block at the end of its keys) and backend ("cython", "numba", "numpy", "auto").
    Also unlike torch: is_causal together with attn_mask applies both.

    Gradients flow to query, key, value and sinks. A mask or ALiBi slopes that require grad
    raise ValueError (fastattn computes no gradient for them). Dropout draws its seed from
    torch's generator (torch.manual_seed reproduces it); the backward regenerates the same
    dropped weights from that seed, nothing of size L x S is kept.
    """
    _check_inputs(query, key, value, attn_mask, sinks, alibi_slopes)
    options = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
               "enable_gqa": enable_gqa, "causal_alignment": causal_alignment,
               "window": window, "softcap": softcap, "backend": backend}
    if dropout_p:
        options["rng"] = _dropout_seed()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (query, key, value, sinks)):
        return _Attention.apply(query, key, value, sinks, attn_mask, alibi_slopes, options)
    # nothing to differentiate (inference, a decode step): no autograd node, no lse kept
    return _forward(query, key, value, sinks, attn_mask, alibi_slopes, options, False)[0]


def register_transformers(name: str = "fastattn") -> str:
    """Register fastattn with transformers' AttentionInterface (and a mask builder with its
    AttentionMaskInterface) under `name`; returns the name for `attn_implementation=`."""
    from ._transformers import register
    return register(name)
