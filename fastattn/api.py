"""The public functions: validate -> canonicalize -> dispatch -> give results back in the caller's shape.

`scaled_dot_product_attention` has torch's signature and semantics on ndarrays; `softmax`,
`attention`, `multihead`, `split_heads` and `merge_heads` replace the classic hand-written NumPy
functions (same call shapes, safe on fully masked rows).
"""
from __future__ import annotations

import numbers

import numpy as np

from . import _backends, _fastpath, _parts
from ._backends.numpy_ import safe_matmul
from ._inputs import (as_float_array, check_backward_rng, check_same_dtype, check_scale,
                      check_window, compute_dtype, describe, dq_from_kernels, for_kernels,
                      lse_dtype, make_problem, native_byte_order)

__all__ = ["scaled_dot_product_attention", "scaled_dot_product_attention_backward", "merge_attention", "softmax", "attention", "multihead",
           "split_heads", "merge_heads"]


def _numpy():
    return _backends.registry["numpy"]


# ----------------------------------------------------------------------------------------------
# scaled dot-product attention
# ----------------------------------------------------------------------------------------------
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, causal_alignment="top_left",
                                 window=None, softcap=None, alibi_slopes=None, sinks=None,
                                 return_lse=False, rng=None, backend=None, part_of=None):
    """Exact attention softmax(scale * Q K^T + bias) V on ndarrays, torch-compatible.

    Parameters
    ----------
    query : (..., Hq, L, E) array; key : (..., Hkv, S, E); value : (..., Hkv, S, Ev)
        float16, bfloat16 (ml_dtypes), float32 or float64, all the same dtype. float16/bfloat16
        compute in float32 and the result is cast back.
    attn_mask : bool array (True = take part) or float array (added to the scores), broadcastable
        to (..., Hq, L, S). Never expanded in memory. Integer masks are rejected, as in torch.
    dropout_p : probability of dropping an attention weight; kept ones are scaled by 1/(1-p).
        Which weights are kept is a hash of (seed, batch*head, i, j): the same in every backend.
    is_causal : query i attends keys j <= i (top-left, torch) or j <= i + S - L
        (causal_alignment="bottom_right", flash-attn / KV-cache decoding). Combines with attn_mask.
    scale : multiplier of Q K^T, default 1/sqrt(E). Any finite number, as in torch: negative
        scales flip the scores, 0 gives uniform weights over the attended keys. A scale beyond
        the compute dtype's range (|scale| > 3.4e38 for float32/float16) raises ValueError.
    enable_gqa : allow Hq != Hkv (Hq % Hkv == 0); query head h reads kv head h // (Hq // Hkv).
    causal_alignment : "top_left" or "bottom_right"; also aligns `window` and `alibi_slopes`.
    window : (left, right) sliding window around each query's aligned position; None/-1 unbounded.
    softcap : s = softcap * tanh(s / softcap) before masking (Gemma-2 style); None = off.
    alibi_slopes : (Hq,) or (batch, Hq); adds -slope * |pos_q - pos_k| to the scores.
    sinks : (Hq,) float array, one "attention sink" logit per query head (gpt-oss, StreamingLLM):
        a term exp(sink_h) added to every row's softmax denominator, with no value vector, so
        the weights of the real keys sum to less than 1. lse includes it. Not dropped by
        dropout. -inf = no sink for that head; a NaN (or +inf) sink makes its head's rows NaN.
    return_lse : also return the log-sum-exp of the scores (and the sink), shape (..., Hq, L),
        float32 (float64 for float64 input), natural log, -inf for rows with no key and no sink.
    rng : int seed or numpy Generator for dropout. The backward needs the forward's int seed, so
        pass an int when you will differentiate (a Generator draws a seed nobody sees).
    backend : "auto" (default), "cython", "numba" or "numpy".
    part_of : (query_start, key_start, total_queries, total_keys), for context parallelism: the
        call computes query rows query_start.. and keys key_start.. of a larger problem of
        total_queries x total_keys, and causal (either alignment), window, ALiBi and the dropout
        hash use that problem's positions. With a part of the keys, out and lse are this part's
        partial result: combine the key parts with merge_attention (and pass `sinks` there, not
        here: a sink belongs to no key part). attn_mask is this part's own piece of the mask.
        The dropout hash's batch*head coordinate is the call's own (split the sequences, not
        the heads, when you need the whole problem's dropout mask).

    Returns
    -------
    out (..., Hq, L, Ev) in the input dtype, and lse if return_lse. A row whose keys are all
    masked gives 0 (and lse -inf, or the head's sink with sinks), never NaN.
    """
    pkey = None
    if (attn_mask is None and softcap is None and alibi_slopes is None and sinks is None
            and part_of is None):
        # the per-token path: a call with the key of an earlier one reuses its plan
        # (fastattn/_fastpath.py); any other call, or the first of a key, goes the full way
        pkey = _fastpath.plan_key(query, key, value, dropout_p, is_causal, scale, enable_gqa,
                                  causal_alignment, window, backend)
        if pkey is not None:
            res = _fastpath.run(pkey, query, key, value)
            if res is not None:
                return res if return_lse else res[0]
    p0 = make_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      causal_alignment=causal_alignment, window=window, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks, rng=rng)
    shift = 0
    if part_of is not None:
        fn = "scaled_dot_product_attention"
        shift, keys_part = _place_part(p0, part_of, is_causal, causal_alignment, window, fn)
        if keys_part and sinks is not None:
            raise ValueError(f"{fn}: sinks with part_of={tuple(part_of)}, a part of the keys: a "
                             f"sink belongs to no key part; compute the parts without sinks and "
                             f"pass sinks to merge_attention(outs, lses, sinks=...)")
    p = for_kernels(p0)[0]       # scale <= 0 rewritten for the kernels, same scores
    be = _backends.resolve(p, "forward", backend)
    if p.is_empty or p.q.shape[3] == 0:
        be = _numpy()            # degenerate sizes: the NumPy code path handles every edge
    if pkey is not None and p is p0:
        out, lse = _fastpath.forward_and_plan(pkey, p, be)     # the first call of its key
    else:
        out, lse = be.forward(p)
    if shift:
        lse = lse - _parts.alibi_shift(p.alibi, shift, lse.dtype)
    if out.dtype != p.in_dtype or out.shape != p.out_shape:   # (the usual call: neither)
        with np.errstate(over="ignore"):  # float16 beyond 65504 is inf, its own answer
            out = out.astype(p.in_dtype, copy=False).reshape(p.out_shape)
    if return_lse:
        return out, lse.reshape(p.lse_shape)
    return out


def _place_part(p, part_of, is_causal, alignment, window, fn: str) -> tuple[int, bool]:
    """Problem p as the part `part_of` of a larger problem (in place): (the ALiBi shift of
    _parts.place, whether its keys are a part of the keys)."""
    L, S = p.q.shape[2], p.k.shape[2]
    r0, c0, L_tot, S_tot = _parts.check_part_of(part_of, L, S, fn)
    band = _parts.global_band(L_tot, S_tot, bool(is_causal), alignment, check_window(window, fn))
    shift = _parts.place(p, band, r0, c0, (0, p.q.shape[1], r0, c0))
    return shift, (c0 > 0 or c0 + S < S_tot)


def _saved(x, name: str, shape: tuple, dtype, fn: str) -> np.ndarray:
    """A saved forward tensor (grad_out, out, lse) checked against its expected shape."""
    arr = as_float_array(x, name, fn)
    if arr.shape != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}, got {arr.shape}")
    return np.ascontiguousarray(arr, dtype=dtype)


def scaled_dot_product_attention_backward(grad_out, query, key, value, out, lse, attn_mask=None,
                                          dropout_p=0.0, is_causal=False, scale=None,
                                          enable_gqa=False, *, causal_alignment="top_left",
                                          window=None, softcap=None, alibi_slopes=None,
                                          sinks=None, rng=None, backend=None, part_of=None):
    """Gradients (dq, dk, dv[, dsinks]) of scaled_dot_product_attention, FlashAttention-2 style.

    grad_out : upstream gradient, shaped like the forward's output (..., Hq, L, Ev).
    out, lse : the forward's output and log-sum-exp (return_lse=True); the attention weights are
        recomputed from them tile by tile, so memory stays O(L) — nothing of size L x S is kept.
    Every other argument must be what the forward was called with. For dropout, pass the same
    int seed as `rng`: the kept weights are regenerated from the hash, not stored. rng=None or a
    Generator raise ValueError when dropout_p > 0 (None would draw a fresh seed, a Generator a
    seed from its current state: the gradients of another dropout mask, silently).

    Returns dq, dk, dv shaped and typed like query, key, value. Under GQA, dk/dv are summed
    over the query heads of each group. Rows whose keys were all masked get zero gradients.
    With sinks, a fourth value: dsinks, shaped and typed like sinks,
    dsinks_h = -sum over batch and rows of exp(sink_h - lse) * rowsum(grad_out * out).

    part_of : (query_start, key_start, total_queries, total_keys), the backward of the forward's
        part_of (context parallelism). key/value may then be a part of the keys, and grad_out,
        out and lse are always those of the WHOLE forward for these query rows (out and lse
        after merging the key parts), as flash-attn's backward takes them in ring attention:
        the weights are exp(s - lse) over this part's keys and D = rowsum(grad_out * out).
        Sum dq over the key parts of its rows, and dk/dv over the query parts of their keys.
        With sinks and a part of the keys, dsinks is that of these query rows, the same for
        every key part: take it from one of them, do not sum it.
    """
    fn = "scaled_dot_product_attention_backward"
    check_backward_rng(dropout_p, rng, fn)
    p = make_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     causal_alignment=causal_alignment, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, sinks=sinks, rng=rng, fn=fn)
    shift, keys_part = 0, False
    if part_of is not None:
        shift, keys_part = _place_part(p, part_of, is_causal, causal_alignment, window, fn)
    p, dq_factor = for_kernels(p)
    B, Hq, L, _ = p.q.shape
    Ev = p.v.shape[3]
    dout = _saved(grad_out, "grad_out", p.out_shape, p.dtype, fn).reshape(B, Hq, L, Ev)
    fwd_out = _saved(out, "out", p.out_shape, p.dtype, fn).reshape(B, Hq, L, Ev)
    fwd_lse = _saved(lse, "lse", p.lse_shape, lse_dtype(p.dtype), fn).reshape(B, Hq, L)
    dsinks = None
    if keys_part:
        # P = exp(s - lse) needs no sink (the whole lse has it); dsinks comes from lse and D
        sinks_c, p.sinks = p.sinks, None
        p.delta = _parts.row_delta(dout, fwd_out, p.dtype)
        if sinks_c is not None:
            dsinks = _parts.sink_grad(sinks_c, fwd_lse, p.delta)
    lse_k = _parts.backward_lse(p, shift, fwd_lse, fn)
    be = _backends.resolve(p, "backward", backend)
    if p.is_empty:
        be = _numpy()
    dq, dk, dv, ds = be.backward(p, dout, fwd_out, lse_k)
    dsinks = ds if dsinks is None else dsinks
    dq = dq_from_kernels(dq, dq_factor)  # the kernels' q was -q (or q * 0): chain rule
    shapes = (np.shape(query), np.shape(key), np.shape(value))
    with np.errstate(over="ignore"):     # float16 beyond 65504 is inf, as in torch
        grads = tuple(g.astype(p.in_dtype, copy=False).reshape(s)
                      for g, s in zip((dq, dk, dv), shapes))
    if sinks is None:
        return grads
    return grads + (dsinks.astype(np.asarray(sinks).dtype, copy=False),)


def merge_attention(outs, lses, *, sinks=None):
    """Combine attention results computed over disjoint sets of keys.

    outs : sequence of (..., L, Ev) arrays (or one array with the parts on axis 0);
    lses : the matching log-sum-exps (..., L). Returns (out, lse) as if all keys had been
    attended at once: out = sum_i exp(lse_i - lse) * out_i, lse = logsumexp_i(lse_i).
    Parts with lse = -inf (no key) contribute nothing; if every part is empty, out = 0 and
    lse = -inf.
    sinks : the attention sinks of the whole problem, (H,) for lses shaped (..., H, L) (any
        shape that broadcasts against the lse as sinks[..., None], e.g. (B, H)). The parts must
        have been computed WITHOUT sinks: a sink belongs to no key set, so it is counted here,
        once, as one more term of the denominator: lse = logsumexp(lse_1, ..., lse_n, sink).
        If every part is empty, out = 0 and lse = sink.
    """
    fn = "merge_attention"
    outs = [as_float_array(o, f"outs[{i}]", fn) for i, o in enumerate(outs)]
    lses = [as_float_array(s, f"lses[{i}]", fn) for i, s in enumerate(lses)]
    if not outs or len(outs) != len(lses):
        raise ValueError(f"{fn}: need the same non-zero number of outs and lses, got "
                         f"{len(outs)} and {len(lses)}")
    shape = outs[0].shape
    for i, (o, s) in enumerate(zip(outs, lses)):
        if o.ndim < 1 or o.shape != shape:
            raise ValueError(f"{fn}: outs[{i}] has shape {o.shape}, expected {shape} like outs[0]")
        if s.shape != shape[:-1]:
            raise ValueError(f"{fn}: lses[{i}] has shape {s.shape}, expected {shape[:-1]} "
                             f"(the shape of outs[{i}] without its last axis)")
    out_dtype = check_same_dtype(fn, **{f"outs[{i}]": o for i, o in enumerate(outs)})
    cdt = compute_dtype(out_dtype)
    ldt = np.result_type(*[s.dtype for s in lses], lse_dtype(cdt))
    lse_all = np.stack([s.astype(ldt) for s in lses])
    terms = lse_all
    if sinks is not None:
        sink = _merge_sinks(sinks, shape[:-1], fn).astype(ldt)
        terms = np.concatenate([lse_all, sink[None]])
    top = terms.max(axis=0)
    top_safe = np.where(np.isneginf(top), 0, top)
    weights = np.exp(lse_all - top_safe)                      # 0 for empty parts
    total = np.exp(terms - top_safe).sum(axis=0)              # with the sink's term, once
    out = np.zeros(shape, cdt)
    for w, o in zip(weights, outs):
        w = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
        out += np.where(w[..., None] != 0, w[..., None] * o.astype(cdt), 0)
    with np.errstate(divide="ignore"):
        lse = np.where(total != 0, top_safe + np.log(total), -np.inf).astype(ldt)
    return out.astype(out_dtype, copy=False), lse


def _merge_sinks(sinks, lse_shape: tuple, fn: str) -> np.ndarray:
    """merge_attention's sinks broadcast to the lse shape (..., H, L) as sinks[..., None]."""
    s = as_float_array(sinks, "sinks", fn)
    ok = s.ndim + 1 <= len(lse_shape)
    if ok:
        try:
            ok = np.broadcast_shapes(s.shape + (1,), lse_shape) == tuple(lse_shape)
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{fn}: sinks of shape {s.shape} do not broadcast as sinks[..., None] "
                         f"against the lse shape {tuple(lse_shape)} (..., H, L); pass (H,) "
                         f"sinks for (..., H, L) lses")
    return np.broadcast_to(s[..., None], lse_shape)


# ----------------------------------------------------------------------------------------------
# the classic helpers
# ----------------------------------------------------------------------------------------------
def _keep_mask(mask, shape: tuple, fn: str) -> np.ndarray:
    """A keep-mask (bool, or numbers with nonzero = keep) broadcast to `shape`, as bool."""
    m = mask if isinstance(mask, np.ndarray) else np.asarray(mask)
    if m.dtype.kind not in "biuf":
        raise TypeError(f"{fn}: mask must be bool or numeric (nonzero = keep), got dtype {m.dtype}")
    try:
        np.broadcast_shapes(m.shape, shape)
        if np.broadcast_shapes(m.shape, shape) != tuple(shape):
            raise ValueError
    except ValueError:
        raise ValueError(f"{fn}: mask of shape {m.shape} does not broadcast to {tuple(shape)}") from None
    return np.broadcast_to(m if m.dtype == np.bool_ else m != 0, shape)


def _softmax_last(x: np.ndarray, keep, backend, fn: str) -> np.ndarray:
    """Softmax over the last axis of a compute-dtype array through the selected backend."""
    # the row count spelled out: reshape(-1, 0) is ambiguous for an empty last axis
    n_rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    rows = np.ascontiguousarray(x).reshape(n_rows, x.shape[-1])
    keep2 = None if keep is None else np.ascontiguousarray(keep).reshape(rows.shape)
    be = _backends.resolve(None, "softmax", backend)
    if rows.size == 0:
        be = _numpy()
    return be.softmax_rows(rows, keep2).reshape(x.shape)


def softmax(x, axis=-1, mask=None, *, backend=None):
    """Numerically stable softmax along `axis`, with an optional keep-mask.

    mask : bool, or numbers with nonzero = keep (both tutorial conventions), broadcastable to x.
    Masked entries get weight 0; a row with nothing kept (or all -inf) is all zeros, never NaN.
    Integer/bool x is promoted to float64 as NumPy's exp would; float16/bfloat16 compute in
    float32 and return their own dtype.
    """
    fn = "softmax"
    arr = native_byte_order(x if isinstance(x, np.ndarray) else np.asarray(x))
    if arr.dtype.kind in "biu":
        arr = arr.astype(np.float64)
    cdt = compute_dtype(arr.dtype)
    if cdt is None:
        raise TypeError(f"{fn}: x must be a real (float, int or bool) array, got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise ValueError(f"{fn}: x must have at least one dimension, got a 0-d array")
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (numbers.Integral, np.integer)):
        raise TypeError(f"{fn}: axis must be an int, got {describe(axis)}")
    if not -arr.ndim <= axis < arr.ndim:
        raise np.exceptions.AxisError(int(axis), arr.ndim, f"{fn}: axis")
    keep = None if mask is None else _keep_mask(mask, arr.shape, fn)
    moved = np.moveaxis(arr, axis, -1).astype(cdt, copy=False)
    if keep is not None:
        keep = np.moveaxis(keep, axis, -1)
    res = _softmax_last(moved, keep, backend, fn)
    res = np.moveaxis(res, -1, axis).astype(arr.dtype, copy=False)
    return np.ascontiguousarray(res)


def attention(q, k, v, mask=None, *, scale=None, backend=None):
    """(out, weights) = (softmax(scale * q k^T, masked) @ v, weights) — the classic function.

    q (..., L, E), k (..., S, E), v (..., S, Ev); leading dims broadcast like matmul.
    mask : keep-mask (bool, or nonzero = keep) broadcastable to (..., L, S).
    Returns the full weights (..., L, S), so memory is O(L * S); for long sequences use
    scaled_dot_product_attention, which never forms them.
    """
    fn = "attention"
    q = as_float_array(q, "q", fn)
    k = as_float_array(k, "k", fn)
    v = as_float_array(v, "v", fn)
    dtype = check_same_dtype(fn, q=q, k=k, v=v)
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(f"{fn}: q, k and v must be at least 2-D (..., L, E), got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{fn}: q and k must have the same last dim, got q {q.shape} and k {k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{fn}: k and v must have the same length (axis -2), got k {k.shape} "
                         f"and v {v.shape}")
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(f"{fn}: leading dims of q {q.shape}, k {k.shape} and v {v.shape} do "
                         f"not broadcast") from None
    cdt = compute_dtype(dtype)
    s_scale = check_scale(scale, q.shape[-1], fn, cdt)
    qc, kc, vc = (a.astype(cdt, copy=False) for a in (q, k, v))
    scores = np.matmul(qc, np.swapaxes(kc, -1, -2))
    scores *= cdt.type(s_scale)
    keep = None if mask is None else _keep_mask(mask, scores.shape, fn)
    weights = _softmax_last(scores, keep, backend, fn)
    out = safe_matmul(weights, np.broadcast_to(vc, batch + vc.shape[-2:]))
    return out.astype(dtype, copy=False), weights.astype(dtype, copy=False)


def _num_heads(num_heads, fn: str) -> int:
    if isinstance(num_heads, (bool, np.bool_)) or not isinstance(num_heads, (numbers.Integral, np.integer)):
        raise TypeError(f"{fn}: num_heads must be a positive int, got {describe(num_heads)}")
    if num_heads < 1:
        raise ValueError(f"{fn}: num_heads must be a positive int, got {int(num_heads)}")
    return int(num_heads)


def split_heads(X, num_heads):
    """(..., L, D) -> (..., num_heads, L, D // num_heads): head h takes columns h*dh:(h+1)*dh."""
    fn = "split_heads"
    X = np.asarray(X)
    H = _num_heads(num_heads, fn)
    if X.ndim < 2:
        raise ValueError(f"{fn}: X must be at least 2-D (..., L, D), got shape {X.shape}")
    L, D = X.shape[-2:]
    if D % H:
        raise ValueError(f"{fn}: the last dim of X ({D}, shape {X.shape}) is not divisible by "
                         f"num_heads={H}")
    return np.swapaxes(X.reshape(X.shape[:-1] + (H, D // H)), -2, -3)


def merge_heads(Y):
    """(..., H, L, dh) -> (..., L, H * dh): the inverse of split_heads."""
    Y = np.asarray(Y)
    if Y.ndim < 3:
        raise ValueError(f"merge_heads: Y must be at least 3-D (..., H, L, dh), got shape {Y.shape}")
    H, L, dh = Y.shape[-3:]
    return np.swapaxes(Y, -2, -3).reshape(Y.shape[:-3] + (L, H * dh))


def multihead(X, Wq, Wk, Wv, Wo, num_heads, mask=None, *, backend=None):
    """Multi-head self-attention: (Y, A) with Y (..., L, Dout) and A (..., H, L, L).

    Q = split_heads(X @ Wq), K = split_heads(X @ Wk), V = split_heads(X @ Wv);
    out, A = attention(Q, K, V, mask); Y = merge_heads(out) @ Wo.
    mask : keep-mask broadcastable to (..., H, L, L), e.g. causal_mask(L).
    """
    fn = "multihead"
    H = _num_heads(num_heads, fn)
    X = as_float_array(X, "X", fn)
    W = {name: as_float_array(w, name, fn) for name, w in
         (("Wq", Wq), ("Wk", Wk), ("Wv", Wv), ("Wo", Wo))}
    check_same_dtype(fn, X=X, **W)
    if X.ndim < 2:
        raise ValueError(f"{fn}: X must be at least 2-D (..., L, D), got shape {X.shape}")
    D = X.shape[-1]
    for name, w in W.items():
        if w.ndim != 2:
            raise ValueError(f"{fn}: {name} must be 2-D, got shape {w.shape}")
    for name in ("Wq", "Wk", "Wv"):
        if W[name].shape[0] != D:
            raise ValueError(f"{fn}: {name} must have {D} rows (the last dim of X {X.shape}), "
                             f"got shape {W[name].shape}")
        if W[name].shape[1] % H:
            raise ValueError(f"{fn}: {name} has {W[name].shape[1]} columns, not divisible by "
                             f"num_heads={H}")
    if W["Wq"].shape[1] != W["Wk"].shape[1]:
        raise ValueError(f"{fn}: Wq and Wk must have the same number of columns, got "
                         f"{W['Wq'].shape} and {W['Wk'].shape}")
    if W["Wo"].shape[0] != W["Wv"].shape[1]:
        raise ValueError(f"{fn}: Wo must have {W['Wv'].shape[1]} rows (the columns of Wv), got "
                         f"shape {W['Wo'].shape}")
    Q = split_heads(X @ W["Wq"], H)
    K = split_heads(X @ W["Wk"], H)
    V = split_heads(X @ W["Wv"], H)
    out, A = attention(Q, K, V, mask, backend=backend)
    return merge_heads(out) @ W["Wo"], A
