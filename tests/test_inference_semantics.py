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


def assert_close_to_reference(got, ref64, naive, dtype, what="out", slack=0.0):
    """The tolerance rule (tests/helpers.py) with the fuzzer's floor (tests/test_fuzz.py): the
    1e-6 floor scales with the result's magnitude (lse of a few large scores is ~20, where
    one float32 ulp is 2e-6 and the naive run may happen to round exactly). `slack`: see
    score_slack."""
    got, ref64, naive = (np.asarray(x, np.float64) for x in (got, ref64, naive))
    assert got.shape == ref64.shape, f"{what}: shape {got.shape} != {ref64.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(ref64)), f"{what}: NaN positions differ"
    assert np.array_equal(np.isneginf(got), np.isneginf(ref64)), f"{what}: -inf positions differ"
    err = max_err(got, ref64)
    mag = max(1.0, float(np.max(np.abs(np.where(np.isfinite(ref64), ref64, 0)), initial=0)))
    if np.dtype(dtype) == np.float64:
        bound = 1e-10 * mag
    else:
        bound = 2 * max_err(naive, ref64) + LOW_PRECISION_FLOOR * mag + slack
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} ({np.dtype(dtype).name})"


def _finite_max(x, axis=None):
    x = np.abs(np.asarray(x, np.float64))
    return np.max(np.where(np.isfinite(x), x, 0), axis=axis, initial=0)


def score_slack(q, keys, values, opts, max_dist, dtype):
    """An allowance for float32 outputs when scores are large: any float32 evaluation rounds a
    score s to ~|s| eps, which moves its weight by that relative amount, whatever the order of
    the sums (seen: scores ~28, BLAS's sgemm off by 3.5e-6 = 2 ulp, out off by 4e-6 in every
    backend's plain forward, while the naive einsum happened to land within 4e-7). Bounded by
    2 eps * max|s| * max|v|, max|s| from Cauchy-Schwarz and the ALiBi distance."""
    if np.dtype(dtype) == np.float64:
        return 0.0
    scale = opts.get("scale")
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else abs(scale)
    def norm(xs):
        return max(_finite_max(np.linalg.norm(np.nan_to_num(np.asarray(x, np.float64),
                                                            nan=0, posinf=0, neginf=0), axis=-1))
                   for x in xs)
    smax = scale * norm([q]) * norm(keys)
    if opts.get("softcap"):
        smax = min(smax, opts["softcap"])
    if opts.get("alibi_slopes") is not None:
        smax += _finite_max(opts["alibi_slopes"]) * max_dist
    return 2 * float(np.finfo(np.float32).eps) * smax * max(_finite_max(x) for x in values)


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
    v = np.where(keep.any(0)[:, None, None], v, 0)     # keys no row sees (NaN there is ignored)
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
    left, right = _side(left, cap), _side(right, cap)     # flash_api.cpp: >= seqlen_k is -1
    window = (left, right)
    local = left >= 0 or right >= 0
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


def _varlen_window(window, cu_k, max_seqlen_k):
    """flash_api.cpp's mha_varlen_fwd/bwd: a window side >= max_seqlen_k is -1 (no side)."""
    if window is None:
        return None
    cap = max_seqlen_k if max_seqlen_k is not None else int(np.diff(cu_k).max(initial=0))
    return tuple(None if _side(w, cap) < 0 else w for w in window)


def flash_model_varlen(q, k, v, cu_q, cu_k, *, is_causal=False, window=None, softcap=None,
                       alibi_slopes=None, sinks=None, scale=None, max_seqlen_q=None,
                       max_seqlen_k=None, dt=np.float64):
    """flash_attn_varlen_func, dense, in dt: out (total_q, Hq, Ev), lse (Hq, total_q)."""
    window = _varlen_window(window, cu_k, max_seqlen_k)
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
                                max_seqlen_q=None, max_seqlen_k=None, dt=np.float64):
    window = _varlen_window(window, cu_k, max_seqlen_k)
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
    Lq = draw(st.sampled_from([0, 1, 1, 2, 3, 7] + ([Lnew] * 3 if Lnew else [])))
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

        def slot_of(b, p):
            return table[b, p // page], p % page
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
                n_after = lens + Lnew
            kw["cache_batch_idx"] = rows.astype(np.int32)

        def slot_of(b, p):
            return rows[b], p

    def slots(pairs):
        return tuple(np.array(x) for x in zip(*[slot_of(b, p) for b, p in pairs]))
    held = [(b, p) for b in range(B) for p in range(lens[b])]
    if held:                                       # the held tokens: finite
        kc[slots(held)] = rng.standard_normal((len(held), Hkv, E))
        vc[slots(held)] = rng.standard_normal((len(held), Hkv, Ev))
    q = rng.standard_normal((B, Lq, Hq, E)).astype(dtype)
    k = v = None
    if Lnew or draw(st.booleans()):               # Lnew = 0: k = v = None, or of length 0
        k = rng.standard_normal((B, Lnew, Hkv, E)).astype(dtype)
        v = rng.standard_normal((B, Lnew, Hkv, Ev)).astype(dtype)
    opts = draw(score_options(B, Hq, rng))
    opts["is_causal"] = draw(st.sampled_from([True, True, False]))
    left = (opts.get("window") or (None, None))[0]
    if poison and Lq and left is not None and left >= 0:
        # held keys below every query row's window (a sliding-window cache's evicted tokens):
        # NaN there must not reach the output
        gone = [(b, p) for b in range(B) for p in range(min(max(0, int(n_after[b]) - Lq - left),
                                                             int(lens[b])))]
        if gone:
            kc[slots(gone)] = np.nan
            vc[slots(gone)] = np.inf
    if k is not None and draw(st.booleans()) and E >= 2:        # rotary needs new keys
        rdim = 2 * draw(st.integers(1, E // 2))
        need = int(lens.max()) + max(Lnew, Lq if opts["is_causal"] or "window" in opts
                                     else min(Lq, 1))
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
    # the caches as views of bigger buffers (written in place through the view; the rest of
    # the buffer must keep its bytes): K and V fused in one (.., 2, Hkv, E) buffer, a head dim
    # padded in memory, rows in reverse order (a negative stride)
    view = draw(st.sampled_from(["plain", "plain", "fused", "padded", "reversed"]))
    if view == "fused" and Ev != E:
        view = "padded"
    bases = None
    if view == "fused":
        base = np.full(kc.shape[:2] + (2,) + kc.shape[2:], -7.0, dtype)
        base[:, :, 0], base[:, :, 1] = kc, vc
        kc, vc, bases = base[:, :, 0], base[:, :, 1], [base]
    elif view == "padded":
        kb = np.full(kc.shape[:3] + (E + 3,), -7.0, dtype)
        vb = np.full(vc.shape[:3] + (Ev + 1,), -7.0, dtype)
        kb[..., :E], vb[..., :Ev] = kc, vc
        kc, vc, bases = kb[..., :E], vb[..., :Ev], [kb, vb]
    elif view == "reversed":
        kb, vb = kc[::-1].copy(), vc[::-1].copy()
        kc, vc, bases = kb[::-1], vb[::-1], [kb, vb]
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, options={**kw, **opts}, dtype=dtype,
                poison=poison, bases=bases)


BACKENDS = [n for n, info in fa.backends().items() if info.available]


def _outside_views(call):
    """The bytes of the caches' buffers outside the caches (None for plain arrays)."""
    if call["bases"] is None:
        return None
    outside = []
    for base in call["bases"]:
        inside = np.zeros(base.shape, bool)
        for cache in (call["k_cache"], call["v_cache"]):
            if np.shares_memory(cache, base):
                inside[tuple(_view_index(base, cache))] = True
        outside.append(base[~inside].tobytes())
    return outside


def _view_index(base, view):
    """The index expression that makes `view` from `base` (the three kinds built above)."""
    if view.shape[-1] < base.shape[-1] and view.ndim == base.ndim:
        return (Ellipsis, slice(0, view.shape[-1]))
    if view.ndim == base.ndim:                                  # reversed rows: all of it
        return (Ellipsis,)
    part = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0])
    return (slice(None), slice(None), part // (base.strides[2]))  # fused: K = 0, V = 1


def _run_kvcache(call, backend):
    q, kc, vc, k, v = (call[x] for x in ("q", "k_cache", "v_cache", "k", "v"))
    opts = call["options"]
    before_k, before_v = kc.copy(), vc.copy()
    outside = _outside_views(call)
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
    assert _outside_views(call) == outside, "bytes outside the caches' views changed"
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
    slack = score_slack(call["q"], [before_k] + ([] if call["k"] is None else [call["k"]]),
                        [before_v] + ([] if call["v"] is None else [call["v"]]),
                        call["options"], _capacity(call) + call["q"].shape[1], dtype)
    assert_close_to_reference(out, out64, out_lo, dtype, "out", slack)
    assert_close_to_reference(lse, lse64, lse_lo, dtype, "lse")
    rotated = None
    if call["k"] is not None and call["options"].get("rotary_cos") is not None:
        rotated = _written_slots(call, before_k.shape)
    _check_cache(call["k_cache"], before_k, kc64, kc_lo, dtype, rotated)
    _check_cache(call["v_cache"], before_v, vc64, vc_lo, dtype, None)


def _capacity(call):
    table = call["options"].get("block_table")
    n = call["k_cache"].shape[1]
    return n if table is None else n * table.shape[1]


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


# ==============================================================================================
# varlen
# ==============================================================================================
@st.composite
def varlen_calls(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    n_seq = draw(st.integers(1, 4))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2, 3]))
    E = draw(st.sampled_from([1, 4, 8, 17]))
    Ev = draw(st.sampled_from([E, 3, 8]))
    sizes = st.sampled_from([0, 1, 2, 3, 5, 9, 16])
    lq = [draw(sizes) for _ in range(n_seq)]
    lk = list(lq) if draw(st.booleans()) else [draw(sizes) for _ in range(n_seq)]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], Hq, E)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], Hkv, E)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], Hkv, Ev)).astype(dtype)
    opts = draw(score_options(n_seq, Hq, rng))
    opts["is_causal"] = draw(st.booleans())
    extra = {}
    if draw(st.booleans()):
        extra = dict(max_seqlen_q=max(lq) + draw(st.sampled_from([0, 2])),
                     max_seqlen_k=max(lk) + draw(st.sampled_from([0, 3])))
    return dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, options=opts, extra=extra, dtype=dtype,
                g=rng.standard_normal((cu_q[-1], Hq, Ev)).astype(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@_settings(60)
@given(call=varlen_calls())
def test_varlen_forward_and_backward_match_the_flash_model(backend, call):
    q, k, v, cu_q, cu_k, g = (call[x] for x in ("q", "k", "v", "cu_q", "cu_k", "g"))
    dtype, opts = call["dtype"], call["options"]
    saved = [x.copy() for x in (q, k, v, cu_q, cu_k, g)]
    out, lse = fa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend=backend,
                                   **call["extra"], **opts)
    out64, lse64 = flash_model_varlen(q, k, v, cu_q, cu_k, **call["extra"], **opts)
    out_lo, lse_lo = flash_model_varlen(q, k, v, cu_q, cu_k, **call["extra"], **opts, dt=dtype)
    assert out.dtype == dtype and lse.dtype == dtype and lse.shape == (q.shape[1], q.shape[0])
    slack = score_slack(q, [k], [v], opts, q.shape[0] + k.shape[0], dtype)
    assert_close_to_reference(out, out64, out_lo, dtype, "out", slack)
    assert_close_to_reference(lse, lse64, lse_lo, dtype, "lse")
    grads = fa.varlen_attention_backward(g, q, k, v, out, lse, cu_q, cu_k, backend=backend,
                                         **call["extra"], **opts)
    want64 = flash_model_varlen_backward(g, q, k, v, cu_q, cu_k, **call["extra"], **opts)
    want_lo = flash_model_varlen_backward(g, q, k, v, cu_q, cu_k, **call["extra"], **opts,
                                          dt=dtype)
    assert len(grads) == (4 if opts.get("sinks") is not None else 3)
    for name, got, w64, wlo in zip(("dq", "dk", "dv", "dsinks"), grads, want64, want_lo):
        assert got.shape == w64.shape, name
        assert_close_to_reference(got, w64, wlo, dtype, name)
    for before, after in zip(saved, (q, k, v, cu_q, cu_k, g)):
        assert before.tobytes() == after.tobytes()                  # inputs never modified


def test_varlen_sequence_equals_the_same_rows_of_a_bigger_batch():
    """A sequence's output does not depend on its neighbours (each attends within itself),
    whatever their lengths: the packed batch equals the sequences run one by one."""
    rng = np.random.default_rng(3)
    lq, lk = [4, 0, 7, 1], [2, 5, 7, 0]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 2, 8))
    k = rng.standard_normal((cu_k[-1], 2, 8))
    v = rng.standard_normal((cu_k[-1], 2, 8))
    for backend in BACKENDS:
        out, lse = fa.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, return_lse=True,
                                       backend=backend)
        for i in range(4):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            one = np.array([0, lq[i]], np.int32), np.array([0, lk[i]], np.int32)
            o, s = fa.varlen_attention(q[qs], k[ks], v[ks], *one, is_causal=True,
                                       return_lse=True, backend=backend)
            np.testing.assert_array_equal(out[qs], o)
            np.testing.assert_array_equal(lse[:, qs], s)
        # sequence 0: 4 queries on 2 keys, bottom-right: rows 0 and 1 see no key
        assert np.all(out[:2] == 0) and np.all(np.isneginf(lse[:, :2]))


# ==============================================================================================
# rejected calls write nothing
# ==============================================================================================
def _base_call(paged, dtype=np.float32):
    rng = np.random.default_rng(7)
    B, Hkv, Hq, E, Lnew = 3, 2, 4, 8, 4
    lens = np.array([3, 10, 0], np.int32)
    if paged:
        table = np.array([[7, 2, 9, 0], [4, 8, 1, 3], [6, 5, 10, 11]], np.int32)
        kc = rng.standard_normal((12, 4, Hkv, E)).astype(dtype)
        vc = rng.standard_normal((12, 4, Hkv, E)).astype(dtype)
        extra = dict(block_table=table)
    else:
        kc = rng.standard_normal((B + 1, 16, Hkv, E)).astype(dtype)
        vc = rng.standard_normal((B + 1, 16, Hkv, E)).astype(dtype)
        extra = {}
    cos, sin = np.cos(np.ones((16, 4))), np.sin(np.ones((16, 4)))
    return dict(q=rng.standard_normal((B, 2, Hq, E)).astype(dtype), k_cache=kc, v_cache=vc,
                k=rng.standard_normal((B, Lnew, Hkv, E)).astype(dtype),
                v=rng.standard_normal((B, Lnew, Hkv, E)).astype(dtype),
                cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin, **extra)


def _read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


# (name, layout, change(call) -> overrides, exception, words the message must hold)
BAD = [
    ("over capacity", "contiguous", lambda c: dict(cache_seqlens=np.array([3, 13, 0], np.int32)),
     ValueError, "cache_seqlens"),
    ("over capacity, paged", "paged", lambda c: dict(cache_seqlens=np.array([3, 13, 0], np.int32)),
     ValueError, "cache_seqlens"),
    ("lengths int64", "contiguous", lambda c: dict(cache_seqlens=c["cache_seqlens"].astype(np.int64)),
     TypeError, "cache_seqlens"),
    ("lengths float", "contiguous", lambda c: dict(cache_seqlens=c["cache_seqlens"].astype(np.float32)),
     TypeError, "cache_seqlens"),
    ("lengths negative", "paged", lambda c: dict(cache_seqlens=np.array([3, -1, 0], np.int32)),
     ValueError, "cache_seqlens"),
    ("length negative int", "contiguous", lambda c: dict(cache_seqlens=-2), ValueError,
     "cache_seqlens"),
    ("lengths of another batch", "contiguous", lambda c: dict(cache_seqlens=np.zeros(2, np.int32)),
     ValueError, "cache_seqlens"),
    ("page out of range", "paged", lambda c: dict(block_table=np.where(
        c["block_table"] == 2, 12, c["block_table"]).astype(np.int32)), ValueError, "block_table"),
    ("page negative", "paged", lambda c: dict(block_table=np.where(
        c["block_table"] == 4, -1, c["block_table"]).astype(np.int32)), ValueError, "block_table"),
    ("page shared by two sequences", "paged", lambda c: dict(block_table=np.where(
        c["block_table"] == 6, 7, c["block_table"]).astype(np.int32)), ValueError, "block_table"),
    ("page twice in one sequence", "paged", lambda c: dict(block_table=np.where(
        c["block_table"] == 8, 4, c["block_table"]).astype(np.int32)), ValueError, "block_table"),
    ("block_table int64", "paged", lambda c: dict(block_table=c["block_table"].astype(np.int64)),
     TypeError, "block_table"),
    ("block_table of another batch", "paged", lambda c: dict(block_table=c["block_table"][:2]),
     (ValueError, TypeError), "block_table"),
    ("paged with cache_batch_idx", "paged",
     lambda c: dict(cache_batch_idx=np.arange(3, dtype=np.int32)), ValueError, "cache_batch_idx"),
    ("row out of range", "contiguous",
     lambda c: dict(cache_batch_idx=np.array([0, 4, 1], np.int32)), ValueError, "cache_batch_idx"),
    ("row negative", "contiguous",
     lambda c: dict(cache_batch_idx=np.array([0, -1, 1], np.int32)), ValueError, "cache_batch_idx"),
    ("row repeated while writing", "contiguous",
     lambda c: dict(cache_batch_idx=np.array([2, 0, 2], np.int32)), ValueError, "cache_batch_idx"),
    ("rows int64", "contiguous",
     lambda c: dict(cache_batch_idx=np.array([2, 0, 1], np.int64)), TypeError, "cache_batch_idx"),
    ("k without v", "contiguous", lambda c: dict(v=None), ValueError, "v"),
    ("v without k", "paged", lambda c: dict(k=None), ValueError, "k"),
    ("k float64", "contiguous", lambda c: dict(k=c["k"].astype(np.float64)), TypeError, "k"),
    ("v float64", "paged", lambda c: dict(v=c["v"].astype(np.float64)), TypeError, "v"),
    ("q float64", "contiguous", lambda c: dict(q=c["q"].astype(np.float64)), TypeError, "q"),
    ("k of other heads", "contiguous", lambda c: dict(k=c["k"][:, :, :1], v=c["v"][:, :, :1]),
     ValueError, "k"),
    ("k of another head dim", "paged", lambda c: dict(k=c["k"][..., :4]), ValueError, "k"),
    ("k of another batch", "contiguous", lambda c: dict(k=c["k"][:2], v=c["v"][:2]), ValueError,
     "k"),
    ("q heads not a multiple", "paged", lambda c: dict(q=c["q"][:, :, :3]), ValueError, "heads"),
    ("q of 3 dims", "contiguous", lambda c: dict(q=c["q"][:, 0]), ValueError, "q"),
    ("caches of other lengths", "contiguous", lambda c: dict(v_cache=c["v_cache"][:, :8]),
     ValueError, "v_cache"),
    ("k_cache read-only", "contiguous", lambda c: dict(k_cache=_read_only(c["k_cache"])),
     ValueError, "k_cache"),
    ("v_cache read-only", "paged", lambda c: dict(v_cache=_read_only(c["v_cache"])), ValueError,
     "v_cache"),
    ("no rotary positions left", "contiguous",
     lambda c: dict(rotary_cos=c["rotary_cos"][:13], rotary_sin=c["rotary_sin"][:13]), ValueError,
     "rotary_cos"),
    ("no rotary positions left, paged", "paged",
     lambda c: dict(rotary_cos=c["rotary_cos"][:10], rotary_sin=c["rotary_sin"][:10]), ValueError,
     "rotary_cos"),
    ("rotary without new keys", "paged", lambda c: dict(k=None, v=None), ValueError,
     "rotary_cos"),
    ("rotary_sin missing", "contiguous", lambda c: dict(rotary_sin=None), ValueError, "rotary_sin"),
    ("rotary_dim > head_dim", "contiguous",
     lambda c: dict(rotary_cos=np.ones((16, 5)), rotary_sin=np.ones((16, 5))), ValueError,
     "rotary"),
    ("rotary shapes differ", "contiguous", lambda c: dict(rotary_sin=c["rotary_sin"][:, :2]),
     ValueError, "rotary_sin"),
    ("alibi shape", "paged", lambda c: dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
    ("sinks shape", "contiguous", lambda c: dict(sinks=np.ones(3)), ValueError, "sinks"),
    ("window of 3", "contiguous", lambda c: dict(window=(1, 2, 3)), ValueError, "window"),
    ("window of floats", "paged", lambda c: dict(window=(1.5, 0)), TypeError, "window"),
    ("scale string", "contiguous", lambda c: dict(scale="x"), TypeError, "scale"),
    ("scale inf", "paged", lambda c: dict(scale=float("inf")), ValueError, "scale"),
    ("softcap negative", "contiguous", lambda c: dict(softcap=-1.0), ValueError, "softcap"),
    ("unknown backend", "paged", lambda c: dict(backend="cuda"), ValueError, "cuda"),
    ("int cache", "contiguous", lambda c: dict(k_cache=c["k_cache"].astype(np.int32),
                                               v_cache=c["v_cache"].astype(np.int32)),
     TypeError, "k_cache"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, layout, change, exc, words", BAD, ids=[b[0] for b in BAD])
def test_a_rejected_call_names_the_argument_and_writes_nothing(backend, name, layout, change,
                                                               exc, words):
    call = _base_call(layout == "paged")
    fa.attention_with_kvcache(**{**call, "k_cache": call["k_cache"].copy(),
                                 "v_cache": call["v_cache"].copy()}, backend=backend)  # valid
    call.update(change(call))
    call = {key: val for key, val in call.items() if val is not None or key in ("k", "v")}
    call.setdefault("backend", backend)
    kc, vc = call["k_cache"], call["v_cache"]
    saved = kc.tobytes(), vc.tobytes()
    with pytest.raises(exc) as info:
        fa.attention_with_kvcache(**call)
    assert words in str(info.value), (name, str(info.value))
    assert (kc.tobytes(), vc.tobytes()) == saved, f"{name}: the cache was written"


def test_reading_needs_no_writeable_cache_and_allows_shared_rows():
    """Without new tokens nothing is written: a read-only cache and repeated cache rows (two
    batch elements reading one cached prefix) are fine, as in flash-attn."""
    call = _base_call(False, np.float64)
    kc, vc = _read_only(call["k_cache"]), _read_only(call["v_cache"])
    idx = np.array([1, 1, 3], np.int32)
    lens = np.array([5, 5, 2], np.int32)
    for backend in BACKENDS:
        out = fa.attention_with_kvcache(call["q"], kc, vc, cache_seqlens=lens,
                                        cache_batch_idx=idx, backend=backend)
        want, _, _, _ = flash_model_kvcache(call["q"], kc, vc, cache_seqlens=lens,
                                            cache_batch_idx=idx)
        np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)


def test_varlen_rejects_bad_offsets_naming_them():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((10, 2, 4)), rng.standard_normal((12, 1, 4)), \
        rng.standard_normal((12, 1, 4))
    good_q, good_k = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    fa.varlen_attention(q, k, v, good_q, good_k)
    bad = [
        (dict(cu_seqlens_q=np.array([0, 6, 4, 10], np.int32)), ValueError, "cu_seqlens_q"),
        (dict(cu_seqlens_q=np.array([0, 4, 9], np.int32)), ValueError, "cu_seqlens_q"),
        (dict(cu_seqlens_k=np.array([0, 5, 13], np.int32)), ValueError, "cu_seqlens_k"),
        (dict(cu_seqlens_k=np.array([0, 5, 12], np.int64)), TypeError, "cu_seqlens_k"),
        (dict(cu_seqlens_k=np.array([0, 12], np.int32)), ValueError, "cu_seqlens"),
        (dict(max_seqlen_q=5), ValueError, "max_seqlen_q"),
        (dict(max_seqlen_k=6), ValueError, "max_seqlen_k"),
        (dict(k=k.astype(np.float32), v=v.astype(np.float32)), TypeError, "k"),
        (dict(alibi_slopes=np.ones((3, 2))), ValueError, "alibi_slopes"),
    ]
    for change, exc, words in bad:
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=good_q, cu_seqlens_k=good_k)
        kw.update(change)
        with pytest.raises(exc) as info:
            fa.varlen_attention(**kw)
        assert words in str(info.value), (change, str(info.value))


# ==============================================================================================
# KVCache against a list of held tokens
# ==============================================================================================
@st.composite
def cache_sessions(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    B = draw(st.integers(1, 4))
    Hkv = draw(st.sampled_from([1, 2]))
    setup = dict(B=B, Hkv=Hkv, Hq=Hkv * draw(st.sampled_from([1, 2])),
                 E=draw(st.sampled_from([4, 8])), max_len=draw(st.integers(1, 20)),
                 page_size=draw(st.sampled_from([None, 1, 3, 8])),
                 dtype=draw(st.sampled_from([np.float32, np.float64])),
                 rotary=draw(st.booleans()), interleaved=draw(st.booleans()))
    ops = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["append", "append", "append", "read", "reorder", "trim",
                                     "reset"]))
        if kind == "append":
            ops.append((kind, draw(st.integers(1, 6)), draw(st.integers(1, 3))))   # Lnew, Lq
        elif kind == "read":
            ops.append((kind, 0, draw(st.integers(1, 3))))
        elif kind == "reorder":
            ops.append((kind, [draw(st.integers(0, B - 1)) for _ in range(B)], None))
        elif kind == "trim":
            ops.append((kind, draw(st.one_of(st.integers(0, 25),
                                              st.lists(st.integers(0, 25), min_size=B,
                                                       max_size=B))), None))
        else:
            ops.append((kind, None, None))
    return seed, setup, ops


@pytest.mark.parametrize("backend", BACKENDS)
@_settings(40)
@given(session=cache_sessions())
def test_kvcache_follows_a_model_of_held_tokens(backend, session):
    seed, s, ops = session
    rng = np.random.default_rng(seed)
    B, Hkv, Hq, E, dtype = s["B"], s["Hkv"], s["Hq"], s["E"], s["dtype"]
    cache = fa.KVCache(B, s["max_len"], Hkv, E, dtype, page_size=s["page_size"])
    cap = cache.capacity
    assert cap >= s["max_len"]
    held_k = np.zeros((B, cap, Hkv, E), dtype)           # the model: sequences as rows
    held_v = np.zeros((B, cap, Hkv, E), dtype)
    lens = np.zeros(B, np.int32)
    opts = {}
    if s["rotary"]:
        ang = np.outer(np.arange(cap + 3), [1.0, 0.25][: E // 4 or 1])
        opts = dict(rotary_cos=np.cos(ang).astype(dtype), rotary_sin=np.sin(ang).astype(dtype),
                    rotary_interleaved=s["interleaved"])
    for kind, a, b in ops:
        if kind in ("append", "read"):
            q = rng.standard_normal((B, b, Hq, E)).astype(dtype)
            k = v = None
            if kind == "append" or opts:              # rotary needs new keys (maybe 0 of them)
                k = rng.standard_normal((B, a, Hkv, E)).astype(dtype)
                v = rng.standard_normal((B, a, Hkv, E)).astype(dtype)
            if kind == "append" and lens.max() + a > cap:
                saved = cache.k.tobytes(), cache.v.tobytes()
                with pytest.raises(ValueError, match="capacity"):
                    cache.attend(q, k, v, backend=backend, **opts)
                assert (cache.k.tobytes(), cache.v.tobytes()) == saved
                assert cache.seqlens.tolist() == lens.tolist()   # a rejected call: no advance
                continue
            out = cache.attend(q, k, v, backend=backend, **opts)
            want, _, held_k, held_v = flash_model_kvcache(q, held_k, held_v, k, v,
                                                          cache_seqlens=lens, **opts)
            if k is not None:
                lens = lens + np.int32(a)
            tol = 1e-10 if dtype == np.float64 else 2e-5
            np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
        elif kind == "reorder":
            cache.reorder(np.array(a))
            held_k, held_v, lens = held_k[a], held_v[a], lens[a]
        elif kind == "trim":
            cache.trim(np.array(a) if isinstance(a, list) else a)
            lens = np.minimum(lens, np.array(a)).astype(np.int32)
        else:
            cache.reset()
            lens[:] = 0
        assert cache.seqlens.dtype == np.int32 and cache.seqlens.tolist() == lens.tolist()
        # the held tokens, read back through the layout (pages in block_table order)
        seqs_k = (cache.k if cache.block_table is None else
                  cache.k[cache.block_table].reshape(B, cap, Hkv, E))
        for i in range(B):
            np.testing.assert_allclose(seqs_k[i, :lens[i]], held_k[i, :lens[i]],
                                       rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-6)


def test_kvcache_rejects_bad_reorder_and_trim():
    cache = fa.KVCache(3, 8, 1, 4, np.float64, page_size=4)
    for bad, exc in [(np.array([0, 1, 3]), ValueError), (np.array([0, -1, 1]), ValueError),
                     (np.array([0, 1]), TypeError), (np.array([0.0, 1.0, 2.0]), TypeError)]:
        with pytest.raises(exc, match="batch_idx"):
            cache.reorder(bad)
    for bad, exc in [(-1, ValueError), (np.array([1, 2]), TypeError), (1.5, TypeError)]:
        with pytest.raises(exc, match="length"):
            cache.trim(bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_with_a_padded_page_table_refuses_before_writing(backend):
    """A block_table padded past the pages in use (vLLM pads with -1 or 0) is fine until a
    sequence grows into the padding; then the call raises, naming block_table, with nothing
    written -- on the per-token path of KVCache.attend too (it wrote the new key into page -1,
    i.e. another sequence's last page, before the kernel refused)."""
    rng = np.random.default_rng(0)
    for pad in (-1, 2):                                  # page 2 belongs to sequence 1
        cache = fa.KVCache(2, 4, 1, 4, np.float32, page_size=2)
        cache.block_table = np.array([[0, pad], [2, 3]], np.int32)
        steps = [tuple(rng.standard_normal((3, 2, 1, 1, 4)).astype(np.float32))
                 for _ in range(3)]
        with fa.use_backend(backend):                  # no option: the per-token path's kind
            for q, k, v in steps[:2]:
                cache.attend(q, k, v)
            saved = cache.k.tobytes(), cache.v.tobytes()
            with pytest.raises(ValueError, match="block_table"):
                cache.attend(*steps[2])
            assert (cache.k.tobytes(), cache.v.tobytes()) == saved, pad
        assert cache.seqlens.tolist() == [2, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_needs_new_keys_and_only_the_positions_it_uses(backend):
    """flash-attn refuses rotary tables without k/v ("new key / value to be appended to KV
    cache must also be provided"): with no new token, q's position is ambiguous (rotated at
    cache_seqlens it would sit one past the last key, where causal puts the last query on it).
    Decision: refused, as flash-attn. New keys of length 0 are new keys: q rows at
    cache_seqlens + i. An empty q needs no rotary position: a table of cache_seqlens rows is
    enough."""
    rng = np.random.default_rng(2)
    kc, vc = rng.standard_normal((2, 2, 6, 1, 4))
    lens = np.array([2, 4], np.int32)
    cos, sin = np.cos(np.ones((4, 2))), np.sin(np.ones((4, 2)))
    q = rng.standard_normal((2, 1, 1, 4))
    with pytest.raises(ValueError, match="rotary_cos") as info:
        fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, rotary_cos=cos,
                                  rotary_sin=sin, backend=backend)
    assert "k" in str(info.value)
    k0, v0 = np.zeros((2, 0, 1, 4)), np.zeros((2, 0, 1, 4))
    full_cos, full_sin = np.cos(np.ones((5, 2))), np.sin(np.ones((5, 2)))
    got = fa.attention_with_kvcache(q, kc, vc, k0, v0, cache_seqlens=lens, rotary_cos=full_cos,
                                    rotary_sin=full_sin, backend=backend)
    want = flash_model_kvcache(q, kc, vc, k0, v0, cache_seqlens=lens, rotary_cos=full_cos,
                               rotary_sin=full_sin)[0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    for causal in (True, False):
        out = fa.attention_with_kvcache(q[:, :0], kc, vc, k0, v0, cache_seqlens=lens,
                                        rotary_cos=cos, rotary_sin=sin, is_causal=causal,
                                        backend=backend)
        assert out.shape == (2, 0, 1, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_keys_of_length_zero_write_nothing_so_need_nothing_writeable(backend):
    """k, v of length 0 add no token: like k = v = None, a read-only cache and cache rows shared
    by two batch elements are fine (nothing is written)."""
    call = _base_call(False, np.float64)
    kc, vc = _read_only(call["k_cache"]), _read_only(call["v_cache"])
    k0, v0 = call["k"][:, :0], call["v"][:, :0]
    kw = dict(cache_seqlens=np.array([5, 5, 2], np.int32),
              cache_batch_idx=np.array([1, 1, 3], np.int32))
    got = fa.attention_with_kvcache(call["q"], kc, vc, k0, v0, backend=backend, **kw)
    want = flash_model_kvcache(call["q"], kc, vc, **kw)[0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_side_wider_than_the_cache_is_no_side(backend):
    """flash-attn sets a window side >= seqlen_k (the cache's capacity) to -1 before anything
    else, for the mask as for the rotary positions. It shows when more queries than the cache
    holds look right of the band: 5 queries on a cache of capacity 2 holding 1 key,
    window (None, 2): row i sits at i - 4, so rows 0 and 1 would see no key under (None, 2);
    with the side dropped every row sees the key. Decision: as flash-attn."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 5, 1, 4))
    kc, vc = rng.standard_normal((2, 1, 2, 1, 4))
    kw = dict(cache_seqlens=np.array([1], np.int32), is_causal=False, window=(None, 2))
    got = fa.attention_with_kvcache(q, kc, vc, backend=backend, **kw)
    np.testing.assert_allclose(got, np.broadcast_to(vc[0, 0], got.shape[1:])[None], rtol=1e-12)
    want = flash_model_kvcache(q, kc, vc, **kw)[0]
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_window_side_wider_than_max_seqlen_k_is_no_side(backend):
    """flash-attn's varlen forward and backward set a window side >= max_seqlen_k to -1: with
    5 queries on 1 key, window (None, 2) (>= max_seqlen_k = 1 when not given, or given as 2)
    leaves every row the key; given max_seqlen_k = 3 the side counts and rows 0-1 (at
    positions -4, -3) see nothing. Decision: as flash-attn."""
    rng = np.random.default_rng(6)
    q, g = rng.standard_normal((2, 5, 1, 4))
    k, v = rng.standard_normal((2, 1, 1, 4))
    cu_q, cu_k = np.array([0, 5], np.int32), np.array([0, 1], np.int32)
    for mk, open_rows in ((None, 5), (2, 5), (3, 3)):
        kw = dict(is_causal=False, window=(None, 2), max_seqlen_k=mk)
        out, lse = fa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend=backend,
                                       **kw)
        assert np.isfinite(lse).sum() == open_rows, mk
        want = flash_model_varlen(q, k, v, cu_q, cu_k, **kw)
        np.testing.assert_allclose(out, want[0], rtol=1e-12, atol=1e-15)
        grads = fa.varlen_attention_backward(g, q, k, v, out, lse, cu_q, cu_k, backend=backend,
                                             **kw)
        for got, ref in zip(grads, flash_model_varlen_backward(g, q, k, v, cu_q, cu_k, **kw)):
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strided_inputs_give_the_results_of_contiguous_ones(backend, dtype):
    """flash-attn users pass views: q, k, v split from one packed qkv projection
    (total, 3, H, E) or (B, L, 3, H, E), q transposed from (B, H, L, E), negative strides.
    The results are those of contiguous copies, and the views' buffers keep their bytes."""
    rng = np.random.default_rng(9)
    qkv = rng.standard_normal((23, 3, 2, 8)).astype(dtype)
    cu = np.array([0, 7, 7, 23], np.int32)
    views = (qkv[:, 0], qkv[:, 1], qkv[:, 2])
    saved = qkv.tobytes()
    opts = dict(is_causal=True, window=(5, None), softcap=3.0, return_lse=True,
                backend=backend)
    got = fa.varlen_attention(*views, cu, cu, **opts)
    want = fa.varlen_attention(*(np.ascontiguousarray(x) for x in views), cu, cu, **opts)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    g = rng.standard_normal(got[0].shape).astype(dtype)[::-1][::-1]
    bopts = dict(is_causal=True, window=(5, None), softcap=3.0, backend=backend)
    for a, b in zip(fa.varlen_attention_backward(g, *views, *got, cu, cu, **bopts),
                    fa.varlen_attention_backward(g, *(np.ascontiguousarray(x) for x in views),
                                                 *want, cu, cu, **bopts)):
        np.testing.assert_array_equal(a, b)
    assert qkv.tobytes() == saved
    B, Hq, Hkv, E = 2, 4, 2, 8
    qt = rng.standard_normal((B, Hq, 3, E)).astype(dtype).transpose(0, 2, 1, 3)   # (B, L, H, E)
    new = rng.standard_normal((B, 3, 2, Hkv, E)).astype(dtype)[:, ::-1]             # k, v packed
    kc, vc = rng.standard_normal((2, B, 16, Hkv, E)).astype(dtype)
    lens = np.array([4, 9], np.int32)
    kc2, vc2 = kc.copy(), vc.copy()
    kw = dict(cache_seqlens=lens, return_lse=True, backend=backend, softcap=2.0)
    got = fa.attention_with_kvcache(qt, kc, vc, new[:, :, 0], new[:, :, 1], **kw)
    want = fa.attention_with_kvcache(np.ascontiguousarray(qt), kc2, vc2,
                                     np.ascontiguousarray(new[:, :, 0]),
                                     np.ascontiguousarray(new[:, :, 1]), **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert kc.tobytes() == kc2.tobytes() and vc.tobytes() == vc2.tobytes()
