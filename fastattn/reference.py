"""Dense, untiled attention in plain NumPy: the oracle of the tests and the teaching code.

Everything here builds the full (L, S) score matrix and follows the textbook formulas step by
step, made safe: a row whose keys are all masked gives weights 0 (not NaN, not the uniform
average the `-1e9` trick gives). It computes in float64 by default; `dtype=np.float32` gives the
"naive same-precision" computation the tests use to size float32 tolerances.

It is not a fallback backend: it needs O(L * S) memory. The backends must agree with it.
"""
from __future__ import annotations

import numpy as np

from . import _dropout
from ._inputs import MASK_BOOL, MASK_FLOAT, make_problem
from .masks import band_mask


def softmax(x, axis=-1, mask=None, *, dtype=np.float64):
    """softmax(x) along axis; entries where mask is False/0 get weight 0; empty rows give 0."""
    x = np.asarray(x, dtype=dtype)
    if mask is not None:
        x = np.where(np.asarray(mask) != 0, x, -np.inf)
    m = np.max(x, axis=axis, keepdims=True) if x.size else x
    m = np.where(np.isneginf(m), 0, m)            # an all -inf row: exp(-inf) = 0, no NaN
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total != 0)


def _weighted_sum(w, v):
    """w @ v where a zero weight never lets a NaN/Inf of v through (0 * NaN would be NaN)."""
    out = w @ np.where(np.isfinite(v), v, 0)
    bad = ~np.isfinite(v)
    if bad.any():
        terms = np.where((w[..., :, :, None] != 0) & bad[..., None, :, :],
                         w[..., :, :, None] * v[..., None, :, :], 0)
        out = out + terms.sum(axis=-2)
    return out


def attention(q, k, v, mask=None, *, scale=None, dtype=np.float64):
    """(softmax(scale * q k^T, masked) @ v, weights) for (..., L, E), (..., S, E), (..., S, Ev)."""
    q, k, v = (np.asarray(a, dtype=dtype) for a in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ np.swapaxes(k, -1, -2)) * dtype(scale)
    weights = softmax(scores, mask=mask, dtype=dtype)
    return _weighted_sum(weights, v), weights


def scores_and_keep(p, dtype=np.float64):
    """The full masked score tensor (B, Hq, L, S) of a Problem, with -inf where a key is excluded."""
    B, Hq, L, E = p.q.shape
    S = p.k.shape[2]
    q = p.q.astype(dtype)
    k = np.repeat(p.k.astype(dtype), p.group, axis=1)          # GQA: head h reads kv head h // group
    s = (q @ np.swapaxes(k, -1, -2)) * dtype(p.scale)
    if p.softcap:
        c = dtype(p.softcap)
        s = c * np.tanh(s / c)
    if p.alibi is not None:
        pos = np.arange(L)[:, None] + p.band.q_offset
        dist = np.abs(pos - np.arange(S)[None, :]).astype(dtype)
        s = s - p.alibi.astype(dtype)[:, :, None, None] * dist
    if p.mask_kind == MASK_FLOAT:
        m = p.mask.astype(dtype)
        s = np.where(np.isneginf(m), -np.inf, s + m)
    elif p.mask_kind == MASK_BOOL:
        s = np.where(p.mask, s, -np.inf)
    return np.where(band_mask(L, S, p.band), s, -np.inf)


def _sink_column(p, dtype):
    """The sink logits as a (1, Hq, 1) array (one per query head, the same for every row), or
    None without sinks."""
    return None if p.sinks is None else p.sinks.astype(dtype).reshape(1, -1, 1)


def _keep(p, B, Hq, L, S):
    """The dropout keep-mask (B, Hq, L, S) of a Problem, at its hash coordinates (its
    dropout_origin when it is a piece of a larger problem)."""
    return _dropout.piece_keep(p.seed, p.dropout_p, _dropout.origin(p),
                               np.arange(B).reshape(B, 1, 1, 1), np.arange(Hq).reshape(1, Hq, 1, 1),
                               np.arange(L)[:, None], np.arange(S)[None, :])


def forward(p, dtype=np.float64, return_weights=False):
    """Dense forward of a Problem: (out (B,Hq,L,Ev), lse (B,Hq,L)[, weights before dropout]).

    With sinks, each row's softmax denominator has one more term, exp(sink_h), that has no
    value vector: weights = exp(s) / (sum_j exp(s_j) + exp(sink_h)), lse = log of that
    denominator. The weights then sum to less than 1 and a row with every key masked gives
    out 0 and lse = sink_h.
    """
    B, Hq, L, _ = p.q.shape
    S = p.k.shape[2]
    s = scores_and_keep(p, dtype)
    sink = _sink_column(p, dtype)
    m = s.max(axis=-1) if S else np.full((B, Hq, L), -np.inf, dtype)
    if sink is not None:
        m = np.maximum(m, sink)                   # NaN in either stays NaN (the NaN rule)
    m_safe = np.where(np.isneginf(m), 0, m)
    e = np.exp(s - m_safe[..., None])
    total = e.sum(axis=-1)
    if sink is not None:
        total = total + np.exp(sink - m_safe)     # exp(-inf) = 0: a -inf sink is no sink
    weights = np.divide(e, total[..., None], out=np.zeros_like(e), where=total[..., None] != 0)
    with np.errstate(divide="ignore"):
        lse = np.where(total != 0, m_safe + np.log(total), -np.inf).astype(dtype)
    dropped = weights
    if p.dropout_p > 0:
        keep = _keep(p, B, Hq, L, S)
        dropped = weights * keep / dtype(1.0 - p.dropout_p)
    v = np.repeat(p.v.astype(dtype), p.group, axis=1)
    out = _weighted_sum(dropped, v)
    return (out, lse, weights) if return_weights else (out, lse)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, causal_alignment="top_left",
                                 window=None, softcap=None, alibi_slopes=None, sinks=None,
                                 return_lse=False, rng=None, dtype=np.float64):
    """Same arguments and semantics as fastattn.scaled_dot_product_attention, computed densely in
    `dtype` and returned in `dtype` (not cast back to the input dtype)."""
    p = make_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     causal_alignment=causal_alignment, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, sinks=sinks, rng=rng,
                     fn="reference.scaled_dot_product_attention")
    out, lse = forward(p, dtype)
    out = out.reshape(p.out_shape)
    return (out, lse.reshape(p.lse_shape)) if return_lse else out


def backward(p, grad_out, dtype=np.float64, lse=None):
    """Closed-form gradients (dq, dk, dv, dsinks) of forward(p) for the upstream gradient grad_out.

    Written from the definitions, densely: with s the final scores, P = softmax(s), Pd = P with
    dropout applied and O = Pd V,
        dV = Pd^T dO                      dP = (dO V^T) * keep / (1 - p)
        dS = P * (dP - sum_j P dP)        (softmax's Jacobian; 0 where P = 0)
        dR = dS * (1 - tanh(r / cap)^2)   (softcap's derivative; r = scale * q.k)
        dQ = scale * dR K                 dK = scale * dR^T Q
    ALiBi and masks are additive constants (derivative 1). GQA sums dK/dV over each group.
    A sink is one more softmax column whose value is 0 and whose upstream gradient is 0, so dS
    keeps its form (P already includes the sink in its denominator) and, with
    P_sink = exp(sink - lse) its weight,
        dsink_h = sum_{b,i} P_sink * (0 - sum_j P dP) = -sum_{b,i} P_sink,bhi * D_bhi.
    dsinks is None without sinks.

    The partial-keys form (p.delta set, FlashAttention-2's): k and v are a part of the keys of a
    larger problem whose log-sum-exp `lse` (B, Hq, L) and D = rowsum(dO * O) = p.delta are
    given; P = exp(s - lse) over this part's keys (not a softmax of its own: the part's weights
    sum to its share of the row) and dS = P * (dP - D). Summing dq over the parts, and taking
    each part's dk/dv, gives the whole problem's gradients.
    """
    B, Hq, L, _ = p.q.shape
    Hkv, S = p.k.shape[1], p.k.shape[2]
    G = p.group
    q = p.q.astype(dtype)
    k = np.repeat(p.k.astype(dtype), G, axis=1)
    v = np.repeat(p.v.astype(dtype), G, axis=1)
    dO = np.asarray(grad_out, dtype).reshape(B, Hq, L, p.v.shape[3])   # not -1: L may be 0
    if p.delta is None:
        _, lse, P = forward(p, dtype, return_weights=True)
    else:
        if lse is None:
            raise ValueError("reference.backward: a partial-keys problem (delta) needs the "
                             "whole problem's lse")
        lse = np.asarray(lse, dtype).reshape(B, Hq, L)
        s = scores_and_keep(p, dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            # rows with lse = -inf attend no key anywhere: weight 0 (not exp(-inf + inf) = NaN)
            P = np.where(np.isneginf(lse)[..., None], 0, np.exp(s - lse[..., None]))
    keep_scale = np.ones_like(P)
    if p.dropout_p > 0:
        keep = _keep(p, B, Hq, L, S)
        keep_scale = keep / dtype(1.0 - p.dropout_p)
    Pd = P * keep_scale
    dV = np.swapaxes(Pd, -1, -2) @ dO
    with np.errstate(invalid="ignore"):                  # inf/NaN in masked keys: zeroed below
        dP = np.where(P != 0, (dO @ np.swapaxes(v, -1, -2)) * keep_scale, 0)
        D = (np.sum(P * dP, axis=-1, keepdims=True) if p.delta is None
             else np.asarray(p.delta, dtype).reshape(B, Hq, L, 1))
        dS = P * (dP - D)
        if p.softcap:
            t = np.tanh((q @ np.swapaxes(k, -1, -2)) * dtype(p.scale) / dtype(p.softcap))
            dS = np.where(P != 0, dS * (1 - t * t), 0)
        dQ = _weighted_sum(dS, k) * dtype(p.scale)
        dK = (np.swapaxes(dS, -1, -2) @ q) * dtype(p.scale)
    dsinks = None
    sink = _sink_column(p, dtype)
    if sink is not None:
        with np.errstate(invalid="ignore"):
            # rows with lse = -inf (no key and a -inf sink) have no sink weight: 0, not NaN
            p_sink = np.where(np.isneginf(lse), 0, np.exp(sink - lse))
            dsinks = -np.sum(p_sink * D[..., 0], axis=(0, 2))
    group_sum = lambda x: x.reshape(B, Hkv, G, S, x.shape[-1]).sum(axis=2)
    return dQ, group_sum(dK), group_sum(dV), dsinks


def scaled_dot_product_attention_backward(grad_out, query, key, value, attn_mask=None, dropout_p=0.0,
                                          is_causal=False, scale=None, enable_gqa=False, *,
                                          causal_alignment="top_left", window=None, softcap=None,
                                          alibi_slopes=None, sinks=None, rng=None,
                                          dtype=np.float64):
    """(dq, dk, dv) of reference.scaled_dot_product_attention, densely, in `dtype`; with sinks
    also dsinks (Hq,), as a fourth value."""
    p = make_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     causal_alignment=causal_alignment, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, sinks=sinks, rng=rng,
                     fn="reference.scaled_dot_product_attention_backward")
    dq, dk, dv, dsinks = backward(p, grad_out, dtype)
    grads = (dq.reshape(np.shape(query)), dk.reshape(np.shape(key)), dv.reshape(np.shape(value)))
    return grads if dsinks is None else grads + (dsinks,)
