"""Issue 16's inference API against an independent dense model of flash-attn's semantics.

`flash_model_kvcache` and `flash_model_varlen` below are written from flash-attn's documented
behaviour (the docstrings of flash_attn_with_kvcache / flash_attn_varlen_func and what its
flash_api.cpp does with the arguments), not from fastattn/reference.py or fastattn/inference.py:

- layouts: q (B, Lq, Hq, E); caches (B_cache, S_max, Hkv, E) or paged (num_pages, page_size,
  Hkv, E) + block_table int32 (B, max_pages); packed (total, H, E) + cu_seqlens int32 (B + 1,).
- the new k/v (B, Lnew, Hkv, E) land at cache positions cache_seqlens[b] ... of the cache row
  cache_batch_idx[b] (or of the pages block_table[b]), after rotary; sequence b then attends
  its first cache_seqlens[b] + Lnew keys.
- rotary (seqlen_ro, rotary_dim / 2) tables rotate the new k at cache_seqlens[b] + t, and q at
  cache_seqlens[b] + i when causal or local, else all of q at cache_seqlens[b]. "Local" is
  flash-attn's: a window side counts only when it is >= 0 and below seqlen_k = the cache's
  capacity per sequence (flash_api.cpp sets a wider side to -1). GPT-J pairs (2i, 2i+1) when
  interleaved, GPT-NeoX halves (i, i + rotary_dim/2) otherwise; dims past rotary_dim are kept.
  Here the rotation is an (E, E) matrix per position, a different formulation from fastattn's.
- query row i of a sequence of n keys sits at key position i + n - Lq (bottom-right): causal
  keeps j <= pos, window (left, right) keeps pos - left <= j <= pos + right, ALiBi adds
  -slope * |pos - j| (slopes (Hq,) or (B, Hq)); softcap * tanh(s / softcap) comes before ALiBi;
  scale default 1/sqrt(E); GQA head h reads kv head h // (Hq / Hkv).
- sinks (fastattn's, DESIGN.md §7): one more logit per head in the softmax denominator.
- a row with no key: out 0 and lse -inf (flash-attn's CUDA kernel stores +inf there; fastattn's
  contract, DESIGN.md §1, says -inf: kept); with a sink, lse = sink.

Each property test draws random ragged batches (empty sequences, Lq != Lnew, Lnew = 0 with
k = v = None), layouts (cache rows picked by cache_batch_idx, paged caches with shuffled pages,
spare pages and block_table padding past each sequence's end), every option, float32/float64,
and NaN in every cache slot that no query may read (so a read past a sequence's end shows),
on every available backend. Outputs and lse follow the tolerance rule (tests/helpers.py: the
float64 model vs the same model run in the input's precision); the cache after the call equals
the model's cache bit for bit (rotated rows within the rule) and is untouched elsewhere.
Rejected calls raise ValueError/TypeError naming the argument and leave both caches
byte-identical. KVCache (attend, reset, trim, reorder) is checked against a list-of-tokens model.

FASTATTN_FUZZ=long runs 20x the examples.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import LOW_PRECISION_FLOOR, max_err
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fastattn as fa

LONG = os.environ.get("FASTATTN_FUZZ") == "long"


def _settings(n):
    return settings(max_examples=n * (20 if LONG else 1), derandomize=not LONG, deadline=None,
                    database=None, print_blob=True,
                    phases=[Phase.explicit, Phase.generate] if not LONG else list(Phase),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def assert_close_to_reference(got, ref64, naive, dtype, what="out"):
    """The tolerance rule (tests/helpers.py) with the fuzzer's floor (tests/test_fuzz.py): the
    1e-6 floor scales with the result's magnitude (lse of a few large scores is ~20, where
    one float32 ulp is 2e-6 and the naive run may happen to round exactly)."""
    got, ref64, naive = (np.asarray(x, np.float64) for x in (got, ref64, naive))
    assert got.shape == ref64.shape, f"{what}: shape {got.shape} != {ref64.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(ref64)), f"{what}: NaN positions differ"
    assert np.array_equal(np.isneginf(got), np.isneginf(ref64)), f"{what}: -inf positions differ"
    err = max_err(got, ref64)
    mag = max(1.0, float(np.max(np.abs(np.where(np.isfinite(ref64), ref64, 0)), initial=0)))
    if np.dtype(dtype) == np.float64:
        bound = 1e-10 * mag
    else:
        bound = 2 * max_err(naive, ref64) + LOW_PRECISION_FLOOR * mag
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} ({np.dtype(dtype).name})"


# ==============================================================================================
# the model
# ==============================================================================================
def rotation_matrices(pos, cos, sin, E, interleaved, dt):
    """(n, E, E) matrices R with x_rot = R @ x for x at positions pos (n,)."""
    half = cos.shape[1]
    if interleaved:
        first, second = np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)
    else:
        first, second = np.arange(half), np.arange(half, 2 * half)
    c = np.asarray(cos, dt)[pos]
    s = np.asarray(sin, dt)[pos]
    R = np.zeros((len(pos), E, E), dt)
    R[:, np.arange(E), np.arange(E)] = 1
    R[:, first, first] = c
    R[:, first, second] = -s
    R[:, second, first] = s
    R[:, second, second] = c
    return R


def rotate(x, pos, cos, sin, interleaved, dt):
    """x (n, H, E) rotated at positions pos (n,), in dt."""
    R = rotation_matrices(np.asarray(pos), cos, sin, x.shape[-1], interleaved, dt)
    return np.einsum("nfe,nhe->nhf", R, np.asarray(x, dt))


def attend(q, k, v, qpos, *, causal, window, softcap, slopes, sinks, scale, dt):
    """q (Lq, Hq, E) of one sequence against its keys k (n, Hkv, E), v (n, Hkv, Ev); query row
    i at key position qpos[i]. Computed in dt. Returns out (Lq, Hq, Ev), lse (Hq, Lq)."""
    q, k, v = (np.asarray(x, dt) for x in (q, k, v))
    Lq, Hq, E = q.shape
    n, Hkv = k.shape[:2]
    head = np.arange(Hq) // (Hq // Hkv)
    scale = 1 / np.sqrt(E) if scale is None else scale
    s = np.einsum("ihe,jhe->hij", q, k[:, head]) * dt(scale)
    if softcap:
        s = dt(softcap) * np.tanh(s / dt(softcap))
    d = np.asarray(qpos)[:, None] - np.arange(n)[None, :]            # (Lq, n) pos - j
    if slopes is not None:
        s = s - np.asarray(slopes, dt)[:, None, None] * np.abs(d).astype(dt)[None]
    keep = np.ones((Lq, n), bool)
    if causal:
        keep &= d >= 0
    left, right = (None, None) if window is None else window
    if left is not None and left >= 0:
        keep &= d <= left
    if right is not None and right >= 0:
        keep &= -d <= right
    s = np.where(keep[None], s, -np.inf)
    m = s.max(-1) if n else np.full((Hq, Lq), -np.inf, dt)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, dt)[:, None])
    safe = np.where(np.isfinite(m), m, 0).astype(dt)
    e = np.exp(s - safe[..., None])
    z = e.sum(-1)
    if sinks is not None:
        z = z + np.exp(np.asarray(sinks, dt)[:, None] - safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(z > 0, safe + np.log(np.where(z > 0, z, 1)), -np.inf).astype(dt)
        w = np.where(z[..., None] > 0, e / np.where(z > 0, z, 1)[..., None], 0).astype(dt)
    out = np.einsum("hij,jhe->ihe", w, v[:, head]) if n else np.zeros((Lq, Hq, v.shape[2]), dt)
    return out.astype(dt), lse


def _slopes(alibi, b):
    if alibi is None:
        return None
    alibi = np.asarray(alibi)
    return alibi[b] if alibi.ndim == 2 else alibi


def _side(x, cap):
    """A window side as flash-attn's kernel sees it: -1 (none) when None, negative or >= cap."""
    return -1 if x is None or x < 0 or x >= cap else x


def flash_model_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                        cache_batch_idx=None, block_table=None, rotary_cos=None, rotary_sin=None,
                        rotary_interleaved=False, is_causal=True, window=None, softcap=None,
                        alibi_slopes=None, sinks=None, scale=None, dt=np.float64):
    """flash_attn_with_kvcache, dense, in dt. Returns (out, lse (B, Hq, Lq), k_cache', v_cache')
    with the caches copied (in their own dtype) and the new rows written."""
    B, Lq, Hq, E = q.shape
    Lnew = 0 if k is None else k.shape[1]
    lens = np.broadcast_to(np.asarray(cache_seqlens, np.int64), (B,))
    kc, vc = k_cache.copy(), v_cache.copy()
    if block_table is not None:
        page = k_cache.shape[1]
        cap = block_table.shape[1] * page

        def slot(b, p):
            return block_table[b, p // page], p % page
    else:
        cap = k_cache.shape[1]
        rows = np.arange(B) if cache_batch_idx is None else np.asarray(cache_batch_idx)

        def slot(b, p):
            return rows[b], p
    rot = rotary_cos is not None
    left, right = (None, None) if window is None else window
    local = _side(left, cap) >= 0 or _side(right, cap) >= 0
    out = np.zeros((B, Lq, Hq, v_cache.shape[3]), dt)
    lse = np.zeros((B, Hq, Lq), dt)
    for b in range(B):
        old = np.arange(lens[b])
        keys = np.asarray(kc[slot(b, old)], dt)
        vals = np.asarray(vc[slot(b, old)], dt)
        if Lnew:
            new = lens[b] + np.arange(Lnew)
            knew = np.asarray(k[b], dt)
            if rot:
                knew = rotate(knew, new, rotary_cos, rotary_sin, rotary_interleaved, dt)
            kc[slot(b, new)] = knew
            vc[slot(b, new)] = v[b]
            keys = np.concatenate([keys, knew])
            vals = np.concatenate([vals, np.asarray(v[b], dt)])
        qb = np.asarray(q[b], dt)
        if rot:
            qrot = lens[b] + (np.arange(Lq) if (is_causal or local) else np.zeros(Lq, np.int64))
            qb = rotate(qb, qrot, rotary_cos, rotary_sin, rotary_interleaved, dt)
        n = lens[b] + Lnew
        out[b], lse[b] = attend(qb, keys, vals, np.arange(Lq) + n - Lq, causal=is_causal,
                                window=window, softcap=softcap,
                                slopes=_slopes(alibi_slopes, b), sinks=sinks, scale=scale, dt=dt)
    return out, lse, kc, vc


def flash_model_varlen(q, k, v, cu_q, cu_k, *, is_causal=False, window=None, softcap=None,
                       alibi_slopes=None, sinks=None, scale=None, dt=np.float64):
    """flash_attn_varlen_func, dense, in dt: out (total_q, Hq, Ev), lse (Hq, total_q)."""
    out = np.zeros(q.shape[:2] + (v.shape[2],), dt)
    lse = np.zeros((q.shape[1], q.shape[0]), dt)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        out[qs], lse[:, qs] = attend(q[qs], k[ks], v[ks], np.arange(lq) + lk - lq,
                                     causal=is_causal, window=window, softcap=softcap,
                                     slopes=_slopes(alibi_slopes, i), sinks=sinks, scale=scale,
                                     dt=dt)
    return out, lse


def attend_backward(g, q, k, v, qpos, *, causal, window, softcap, slopes, sinks, scale, dt):
    """The gradients of `attend` (analytic, dense): dq, dk, dv, dsinks (Hq,)."""
    q, k, v, g = (np.asarray(x, dt) for x in (q, k, v, g))
    Lq, Hq, E = q.shape
    n, Hkv = k.shape[:2]
    G = Hq // Hkv
    head = np.arange(Hq) // G
    out, lse = attend(q, k, v, qpos, causal=causal, window=window, softcap=softcap,
                      slopes=slopes, sinks=sinks, scale=scale, dt=dt)
    scale = 1 / np.sqrt(E) if scale is None else scale
    s0 = np.einsum("ihe,jhe->hij", q, k[:, head]) * dt(scale)
    t = dt(softcap) * np.tanh(s0 / dt(softcap)) if softcap else s0
    d = np.asarray(qpos)[:, None] - np.arange(n)[None, :]
    if slopes is not None:
        t = t - np.asarray(slopes, dt)[:, None, None] * np.abs(d).astype(dt)[None]
    keep = np.ones((Lq, n), bool)
    if causal:
        keep &= d >= 0
    left, right = (None, None) if window is None else window
    if left is not None and left >= 0:
        keep &= d <= left
    if right is not None and right >= 0:
        keep &= -d <= right
    live = np.isfinite(lse)[..., None] & keep[None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(live, np.exp(np.where(live, t - lse[..., None], 0)), 0).astype(dt)
    dv_h = np.einsum("hij,ihe->jhe", p, g)                       # per query head
    dp = np.einsum("ihe,jhe->hij", g, v[:, head])
    D = np.einsum("ihe,ihe->hi", g, out)
    ds = p * (dp - D[..., None])
    if softcap:
        ds = ds * (1 - np.tanh(s0 / dt(softcap)) ** 2)
    dq = np.einsum("hij,jhe->ihe", ds, k[:, head]) * dt(scale)
    dk_h = np.einsum("hij,ihe->jhe", ds, q) * dt(scale)
    dk = dk_h.reshape(n, Hkv, G, E).sum(2)
    dv = dv_h.reshape(n, Hkv, G, v.shape[2]).sum(2)
    dsinks = None
    if sinks is not None:
        with np.errstate(invalid="ignore"):
            psink = np.where(np.isfinite(lse), np.exp(np.asarray(sinks, dt)[:, None] - lse), 0)
        dsinks = -(psink * D).sum(-1)
    return dq, dk, dv, dsinks


def flash_model_varlen_backward(g, q, k, v, cu_q, cu_k, *, is_causal=False, window=None,
                                softcap=None, alibi_slopes=None, sinks=None, scale=None,
                                dt=np.float64):
    dq, dk, dv = (np.zeros(x.shape, dt) for x in (q, k, v))
    dsinks = None if sinks is None else np.zeros(len(sinks), dt)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        a, b_, c, ds = attend_backward(g[qs], q[qs], k[ks], v[ks], np.arange(lq) + lk - lq,
                                       causal=is_causal, window=window, softcap=softcap,
                                       slopes=_slopes(alibi_slopes, i), sinks=sinks,
                                       scale=scale, dt=dt)
        dq[qs], dk[ks], dv[ks] = a, b_, c
        if ds is not None:
            dsinks += ds
    return dq, dk, dv, dsinks


def test_the_model_against_hand_worked_cases():
    """The model itself: a sequence of 3 keys seen by 2 queries (bottom-right: positions 1, 2),
    a rotation by 90 degrees, and the backward against central finite differences."""
    q = np.zeros((2, 1, 2))
    k = np.array([[[1.0, 0]], [[0, 1.0]], [[1.0, 1.0]]])
    v = np.array([[[1.0]], [[2.0]], [[4.0]]])
    out, lse = attend(q, k, v, np.array([1, 2]), causal=True, window=None, softcap=None,
                      slopes=None, sinks=None, scale=None, dt=np.float64)
    np.testing.assert_allclose(out[:, 0, 0], [1.5, 7 / 3])          # equal weights: means
    np.testing.assert_allclose(lse[0], [np.log(2), np.log(3)])
    out, lse = attend(q, k, v, np.array([1, 2]), causal=True, window=(0, None), softcap=None,
                      slopes=[np.log(2)], sinks=[0.0], scale=None, dt=np.float64)
    np.testing.assert_allclose(out[:, 0, 0], [1.0, 2.0])             # key 1 vs the sink
    np.testing.assert_allclose(lse[0], [np.log(2), np.log(2)])
    out, lse = attend(q, k[:0], v[:0], np.array([0, 0]), causal=False, window=None,
                      softcap=None, slopes=None, sinks=None, scale=None, dt=np.float64)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    cos, sin = np.array([[1.0, 1.0], [0.0, 1.0]]), np.array([[0.0, 0.0], [1.0, 0.0]])
    x = np.arange(1.0, 6.0).reshape(1, 1, 5)                           # rotary_dim 4 < E = 5
    np.testing.assert_array_equal(rotate(x, [1], cos, sin, False, np.float64)[0, 0],
                                  [-3.0, 2.0, 1.0, 4.0, 5.0])          # pair (0, 2) turned
    np.testing.assert_array_equal(rotate(x, [1], cos, sin, True, np.float64)[0, 0],
                                  [-2.0, 1.0, 3.0, 4.0, 5.0])          # pair (0, 1) turned
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal(s) for s in [(3, 4, 5), (4, 2, 5), (4, 2, 3), (3, 4, 3)])
    kw = dict(qpos=np.arange(3) + 1, causal=True, window=(2, None), softcap=2.0,
              slopes=rng.uniform(0, 0.5, 4), sinks=rng.standard_normal(4), scale=0.7,
              dt=np.float64)
    grads = attend_backward(g, q, k, v, **kw)

    def loss(q, k, v, sinks):
        return float((attend(q, k, v, **{**kw, "sinks": sinks})[0] * g).sum())
    args = [q, k, v, kw["sinks"]]
    for which, grad in enumerate(grads):
        num = np.zeros_like(args[which])
        for idx in np.ndindex(num.shape):
            hi = [a.copy() for a in args]
            lo = [a.copy() for a in args]
            hi[which][idx] += 1e-6
            lo[which][idx] -= 1e-6
            num[idx] = (loss(*hi) - loss(*lo)) / 2e-6
        np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-8)


# ==============================================================================================
# random problems
# ==============================================================================================
@st.composite
def score_options(draw, B, Hq, rng):
    opts = {}
    if draw(st.booleans()):
        opts["window"] = (draw(st.sampled_from([None, -1, 0, 1, 3, 10, 500])),
                          draw(st.sampled_from([None, -1, 0, 1, 4, 500])))
    if draw(st.integers(0, 3)) == 0:
        opts["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    if draw(st.integers(0, 3)) == 0:
        shape = (Hq,) if draw(st.booleans()) else (B, Hq)
        opts["alibi_slopes"] = rng.uniform(0, 0.5, shape)
    if draw(st.integers(0, 3)) == 0:
        opts["sinks"] = rng.standard_normal(Hq)
    if draw(st.integers(0, 2)) == 0:
        opts["scale"] = draw(st.sampled_from([0.3, 1.0, -0.5, 0.0, 2.5]))
    return opts


@st.composite
def kvcache_calls(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    B = draw(st.integers(1, 4))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2, 3]))
    E = draw(st.sampled_from([2, 4, 8, 17, 32]))
    Ev = draw(st.sampled_from([E, 1, 5, 16]))
    layout = draw(st.sampled_from(["contiguous", "rows", "paged"]))
    Lnew = draw(st.sampled_from([0, 1, 1, 2, 5]))
    Lq = draw(st.sampled_from([1, 1, 2, 3, 7] + ([Lnew] * 3 if Lnew else [])))
    if layout == "paged":
        page = draw(st.sampled_from([1, 3, 4, 16]))
        pages_per_seq = draw(st.integers(max(1, -(-Lnew // page)), max(1, 40 // page)))
        cap = pages_per_seq * page
    else:
        cap = draw(st.integers(Lnew, 40))
    lens = np.array([draw(st.integers(0, cap - Lnew)) for _ in range(B)], np.int32)
    if draw(st.integers(0, 3)) == 0:
        lens[:] = lens[0]                          # equal lengths (another fastattn path)
    n_after = lens + Lnew

    def filled(shape, poison):
        x = rng.standard_normal(shape).astype(dtype)
        if poison:
            x[...] = np.nan
        return x
    poison = draw(st.booleans())           # NaN/Inf wherever no query may read
    kw = {}
    if layout == "paged":
        n_pages = B * pages_per_seq + draw(st.integers(0, 3))
        perm = rng.permutation(n_pages).astype(np.int32)
        table = perm[:B * pages_per_seq].reshape(B, pages_per_seq).copy()
        pad = draw(st.sampled_from(["pages", "zero", "garbage"]))
        for b in range(B):                  # entries past a sequence's last page are not read
            used = -(-int(n_after[b]) // page)
            if pad == "zero":
                table[b, used:] = 0
            elif pad == "garbage":
                table[b, used:] = rng.choice([-1, 10**6, n_pages])
        kc = filled((n_pages, page, Hkv, E), poison)
        vc = filled((n_pages, page, Hkv, Ev), poison)
        kw["block_table"] = table
        seq_slots = [(table[b, p // page], p % page) for b in range(B) for p in range(lens[b])]
        slots = tuple(np.array(x) for x in zip(*seq_slots)) if seq_slots else None
    else:
        n_rows = B + (draw(st.integers(0, 3)) if layout == "rows" else 0)
        kc = filled((n_rows, cap, Hkv, E), poison)
        vc = filled((n_rows, cap, Hkv, Ev), poison)
        rows = np.arange(B)
        if layout == "rows":
            rows = rng.permutation(n_rows)[:B].astype(np.int32)
            if Lnew == 0 and B > 1 and draw(st.booleans()):
                rows[1] = rows[0]                  # a repeated row is fine when nothing is written
                lens[1] = lens[0]
            kw["cache_batch_idx"] = rows.astype(np.int32)
        seq = [(rows[b], p) for b in range(B) for p in range(lens[b])]
        slots = tuple(np.array(x) for x in zip(*seq)) if seq else None
    if slots is not None:                          # the held tokens: finite
        kc[slots] = rng.standard_normal((len(slots[0]), Hkv, E))
        vc[slots] = rng.standard_normal((len(slots[0]), Hkv, Ev))
    q = rng.standard_normal((B, Lq, Hq, E)).astype(dtype)
    k = v = None
    if Lnew:
        k = rng.standard_normal((B, Lnew, Hkv, E)).astype(dtype)
        v = rng.standard_normal((B, Lnew, Hkv, Ev)).astype(dtype)
    opts = draw(score_options(B, Hq, rng))
    opts["is_causal"] = draw(st.sampled_from([True, True, False]))
    if draw(st.booleans()) and E >= 2:
        rdim = 2 * draw(st.integers(1, E // 2))
        need = int(lens.max()) + max(Lnew, Lq)
        n_ro = need + draw(st.sampled_from([0, 0, 3]))
        inv = 10000.0 ** (-np.arange(0, rdim, 2) / rdim)
        ang = np.outer(np.arange(n_ro), inv)
        tdt = draw(st.sampled_from([dtype, np.float64]))
        opts.update(rotary_cos=np.cos(ang).astype(tdt), rotary_sin=np.sin(ang).astype(tdt),
                    rotary_interleaved=draw(st.booleans()))
    if draw(st.booleans()):
        opts["cache_seqlens"] = lens
    else:
        opts["cache_seqlens"] = lens if B > 1 and np.any(lens != lens[0]) else int(lens[0])
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, options={**kw, **opts}, dtype=dtype,
                poison=poison)


BACKENDS = [n for n, info in fa.backends().items() if info.available]


def _run_kvcache(call, backend):
    q, kc, vc, k, v = (call[x] for x in ("q", "k_cache", "v_cache", "k", "v"))
    opts = call["options"]
    before_k, before_v = kc.copy(), vc.copy()
    try:
        out, lse = fa.attention_with_kvcache(q, kc, vc, k, v, return_lse=True, backend=backend,
                                             **opts)
    except (ValueError, TypeError) as err:
        # a backend may refuse an option it does not take (listed in unsupported_options);
        # a refusal must write nothing
        assert kc.tobytes() == before_k.tobytes() and vc.tobytes() == before_v.tobytes()
        missing = getattr(fa._backends.registry[backend], "unsupported_options", {})
        assert any(name in str(err) for name in missing), str(err)
        return None
    return out, lse, before_k, before_v


def _check_cache(got, before, want64, want_low, dtype, rotated_rows):
    """The cache after the call: bit for bit the model's, except rows of rotated keys, which
    follow the tolerance rule."""
    if rotated_rows is None:
        assert got.tobytes() == want64.tobytes(), "cache differs from the model's"
        return
    other = np.ones(got.shape[:2], bool)
    other[rotated_rows] = False
    np.testing.assert_array_equal(got[other], before[other])   # untouched (NaN = NaN here)
    assert_close_to_reference(got[rotated_rows], want64[rotated_rows].astype(np.float64),
                              want_low[rotated_rows], dtype, "rotated new keys")


@pytest.mark.parametrize("backend", BACKENDS)
@_settings(120)
@given(call=kvcache_calls())
def test_attention_with_kvcache_matches_the_flash_model(backend, call):
    dtype = call["dtype"]
    got = _run_kvcache(call, backend)
    if got is None:
        return
    out, lse, before_k, before_v = got
    kw = {x: call[x] for x in ("q", "k", "v")}
    out64, lse64, kc64, vc64 = flash_model_kvcache(k_cache=before_k, v_cache=before_v, **kw,
                                                   **call["options"])
    out_lo, lse_lo, kc_lo, vc_lo = flash_model_kvcache(k_cache=before_k, v_cache=before_v, **kw,
                                                       **call["options"], dt=dtype)
    assert out.shape == out64.shape and out.dtype == dtype
    assert lse.shape == lse64.shape and lse.dtype == dtype
    assert_close_to_reference(out, out64, out_lo, dtype, "out")
    assert_close_to_reference(lse, lse64, lse_lo, dtype, "lse")
    rotated = None
    if call["k"] is not None and call["options"].get("rotary_cos") is not None:
        rotated = _written_slots(call, before_k.shape)
    _check_cache(call["k_cache"], before_k, kc64, kc_lo, dtype, rotated)
    _check_cache(call["v_cache"], before_v, vc64, vc_lo, dtype, None)


def _written_slots(call, shape):
    """(cache axis 0, axis 1) mask of the slots the new keys go to."""
    opts = call["options"]
    lens = np.broadcast_to(np.asarray(opts["cache_seqlens"]), (call["q"].shape[0],))
    Lnew = call["k"].shape[1]
    mask = np.zeros(shape[:2], bool)
    for b, n in enumerate(lens):
        pos = n + np.arange(Lnew)
        if opts.get("block_table") is not None:
            mask[opts["block_table"][b, pos // shape[1]], pos % shape[1]] = True
        else:
            row = b if opts.get("cache_batch_idx") is None else opts["cache_batch_idx"][b]
            mask[row, pos] = True
    return mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_rotary_query_positions_with_a_window_wider_than_the_cache(backend, paged):
    """flash-attn rotates q at cache_seqlens + i only when causal or local, and a window side
    >= the cache's capacity (seqlen_k = S_max, or max_pages * page_size) is no window there
    (flash_api.cpp sets it to -1): then every query row is rotated at cache_seqlens. A side
    below the capacity makes the call local: rows at cache_seqlens + i. Decision: as flash-attn
    (a port gets the same numbers)."""
    rng = np.random.default_rng(16)
    B, Lq, Hkv, E, cap = 2, 3, 1, 8, 12
    q = rng.standard_normal((B, Lq, Hkv, E))
    k, v = rng.standard_normal((2, B, 2, Hkv, E))
    lens = np.array([4, 7], np.int32)
    cos, sin = (f(np.outer(np.arange(cap), [1.0, 0.3, 0.1])) for f in (np.cos, np.sin))
    for window in [(cap, -1), (cap + 5, cap), (-1, cap), (cap - 1, -1), (None, 0)]:
        kc, vc = rng.standard_normal((2, B, cap, Hkv, E))
        kw = dict(cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin, is_causal=False,
                  window=window)
        if paged:
            kc, vc = kc.reshape(B * 3, 4, Hkv, E), vc.reshape(B * 3, 4, Hkv, E)
            kw["block_table"] = np.arange(B * 3, dtype=np.int32).reshape(B, 3)
        want, _, kc_want, _ = flash_model_kvcache(q, kc, vc, k, v, **kw)
        got = fa.attention_with_kvcache(q, kc, vc, k, v, backend=backend, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=str(window))
        np.testing.assert_allclose(kc, kc_want, rtol=1e-12, atol=1e-14)
