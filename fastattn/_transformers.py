"""fastattn as an attention implementation of Hugging Face transformers (`attn_implementation=`).

transformers asks two things of an implementation: a mask builder (AttentionMaskInterface) and
an attention function (AttentionInterface). Without a mask builder it builds no mask at all for
an unknown name, and padding would be silently ignored, so both are registered.

The mask builder is transformers' own `sdpa_mask`: a bool mask, True = take part, or None where
the causal flag says it all (no padding, queries and keys aligned, or one query). The attention
function then hands fastattn the least it needs: a None mask becomes is_causal; a dense mask that
is only "causal (either alignment), sliding window and padded keys" becomes the causal flag, the
window and a (B, 1, 1, S) row of kept keys, which lets the kernels skip whole blocks above the
diagonal. Any other mask is passed as it is (fastattn reads broadcast masks in place).
"""
from __future__ import annotations

import weakref

import torch

from .torch import scaled_dot_product_attention

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:
    raise ImportError("fastattn.torch.register_transformers needs Hugging Face transformers, "
                      "which is not installed (or too old to have AttentionInterface and "
                      "AttentionMaskInterface): pip install 'transformers>=5'") from exc


def fastattn_mask(*args, **kwargs):
    """The mask transformers builds for fastattn: sdpa's (bool, True = attend, or None)."""
    return sdpa_mask(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# a dense bool mask -> (is_causal, alignment, window, key row) where it is only that
# ----------------------------------------------------------------------------------------------
_plans: dict = {}    # id(mask) -> (weakref to it, its version, sliding_window, plan)


def _band(L: int, S: int, alignment: str, window_left: int | None) -> torch.Tensor:
    """(L, S) bool: causal in `alignment` (query i at key position i or i + S - L), and at most
    window_left keys behind it."""
    shift = S - L if alignment == "bottom_right" else 0
    pos_q = torch.arange(L).unsqueeze(1) + shift
    pos_k = torch.arange(S).unsqueeze(0)
    band = pos_k <= pos_q
    if window_left is not None:
        band &= pos_k >= pos_q - window_left
    return band


def _split_mask(mask: torch.Tensor, window_left: int | None):
    """(alignment, window_left, keys) with mask == band(alignment, window) & keys, keys (B,1,1,S)
    the keys any query may see (alignment None: mask == keys, no band); None when the mask is
    not of that form."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    L, S = mask.shape[-2:]
    keys = mask.any(dim=-2, keepdim=True)
    if torch.equal(mask, keys.expand_as(mask)):          # padding only (an encoder)
        return None, None, keys
    for alignment in ("bottom_right", "top_left"):
        for left in ((window_left, None) if window_left is not None else (None,)):
            if torch.equal(mask, _band(L, S, alignment, left) & keys):
                return alignment, left, keys
    return None


def _mask_plan(mask: torch.Tensor, window_left: int | None):
    """_split_mask, computed once per mask: every layer of a forward gets the same mask."""
    key = id(mask)
    hit = _plans.get(key)
    if (hit is not None and hit[0]() is mask and hit[1] == mask._version
            and hit[2] == window_left):
        return hit[3]
    plan = _split_mask(mask, window_left)
    if len(_plans) >= 8:
        _plans.clear()
    _plans[key] = (weakref.ref(mask), mask._version, window_left, plan)
    return plan


def _with_position_bias(attention_mask, position_bias, is_causal, L, S):
    """A float mask = the position bias where a key takes part, -inf elsewhere (T5-style)."""
    if position_bias.requires_grad:
        raise ValueError("fastattn: this model learns a position bias added to the scores; "
                         "fastattn computes no gradient for it: train with "
                         "attn_implementation='sdpa' or 'eager' (inference works)")
    keep = attention_mask
    if keep is None and is_causal:
        keep = _band(L, S, "top_left", None)
    if keep is None:
        return position_bias
    if keep.dtype == torch.bool:
        return position_bias.masked_fill(~keep, float("-inf"))
    return position_bias + keep


# ----------------------------------------------------------------------------------------------
# the attention function
# ----------------------------------------------------------------------------------------------
def fastattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                               scaling=None, is_causal=None, softcap=None, sliding_window=None,
                               s_aux=None, position_bias=None, **kwargs):
    """query (B, Hq, L, E), key/value (B, Hkv, S, E) -> ((B, L, Hq, Ev) output, None).

    attention_mask: what fastattn_mask built (bool or None), or a 4-D mask the caller made
    (bool or float). Honours scaling, dropout (the module passes 0 in eval), softcap (Gemma 2),
    s_aux (per-head sinks, gpt-oss; they get gradients), sliding_window and GQA without
    repeating K/V. No attention weights are returned (fastattn never forms them)."""
    L, S = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # transformers' window: a query sees itself and the sliding_window - 1 keys before it. Only
    # an int is read here (the mask carries the window whatever its form); a model whose
    # window is something else gets its dense mask
    window_left = (int(sliding_window) - 1
                   if isinstance(sliding_window, int) and sliding_window > 0 else None)
    options = {"scale": scaling, "dropout_p": float(dropout or 0.0), "softcap": softcap,
               "enable_gqa": query.shape[1] != key.shape[1], "sinks": s_aux}
    if position_bias is not None:
        attention_mask = _with_position_bias(attention_mask, position_bias, causal and L > 1,
                                             L, S)
        causal = False
    if attention_mask is None:
        # no padding: causal top-left (aligned queries and keys, or an empty static cache's
        # prefill), or one query that sees every key (sdpa's own reading of a None mask)
        causal = bool(causal) and L > 1
        window = (window_left, 0) if causal and window_left is not None else None
        out = scaled_dot_product_attention(query, key, value, is_causal=causal, window=window,
                                           **options)
    else:
        plan = _mask_plan(attention_mask, window_left) if L > 1 else None
        if plan is None:
            out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                               **options)
        else:
            alignment, left, keys = plan
            out = scaled_dot_product_attention(
                query, key, value, attn_mask=keys, is_causal=alignment is not None,
                causal_alignment=alignment or "top_left",
                window=None if left is None else (left, 0), **options)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "fastattn") -> str:
    """Register fastattn under `name` in both of transformers' interfaces; returns name."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_transformers: name must be a non-empty str, got {name!r}")
    AttentionInterface.register(name, fastattn_attention_forward)
    AttentionMaskInterface.register(name, fastattn_mask)
    return name
