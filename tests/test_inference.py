"""attention_with_kvcache, varlen_attention (+ backward) and KVCache against a dense float64
computation written here, in flash-attn's layout, for every backend."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn as fa
from fastattn import reference


def dense(q, k, v, *, causal=True, scale=None, window=None, softcap=None):
    """q (Lq, Hq, E) against k (n, Hkv, E), v (n, Hkv, Ev), bottom-right causal; float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    Lq, Hq, E = q.shape
    n, Hkv = k.shape[:2]
    g = Hq // Hkv
    scale = 1 / np.sqrt(E) if scale is None else scale
    kk = np.repeat(k, g, axis=1)
    vv = np.repeat(v, g, axis=1)
    s = np.einsum("ihe,jhe->hij", q, kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    pos = np.arange(Lq)[:, None] + n - Lq
    j = np.arange(n)[None, :]
    keep = np.ones((Lq, n), bool)
    if causal:
        keep &= j <= pos
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            keep &= j >= pos - left
        if right is not None and right >= 0:
            keep &= j <= pos + right
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True) if n else np.zeros((Hq, Lq, 1))
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True)
    w = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
    out = np.einsum("hij,jhe->ihe", w, vv)
    with np.errstate(divide="ignore"):
        lse = (np.log(tot) + m)[..., 0]
    return out, lse


def rotate_complex(x, pos, cos, sin, interleaved):
    """Rotary as a complex multiplication (an independent formulation of the rotation)."""
    x = np.asarray(x, np.float64)
    half = cos.shape[1]
    theta = np.arctan2(sin[pos], cos[pos])[:, None, :]          # (n, 1, half)
    out = x.copy()
    if interleaved:
        z = x[..., 0:2 * half:2] + 1j * x[..., 1:2 * half:2]
        z = z * np.exp(1j * theta)
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = z.real, z.imag
    else:
        z = x[..., :half] + 1j * x[..., half:2 * half]
        z = z * np.exp(1j * theta)
        out[..., :half], out[..., half:2 * half] = z.real, z.imag
    return out


def rope_tables(n, rotary_dim, base=10000.0):
    inv = base ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = np.outer(np.arange(n), inv)
    return np.cos(ang), np.sin(ang)


def tol(dtype):
    return 1e-10 if dtype == np.float64 else 2e-5


def _case(rng, B=3, S_max=64, Hq=4, Hkv=2, E=16, Ev=16, Lnew=3, dtype=np.float32):
    k_cache = rng.standard_normal((B, S_max, Hkv, E)).astype(dtype)
    v_cache = rng.standard_normal((B, S_max, Hkv, Ev)).astype(dtype)
    lens = rng.integers(0, S_max - Lnew, size=B).astype(np.int32)
    q = rng.standard_normal((B, Lnew, Hq, E)).astype(dtype)
    k = rng.standard_normal((B, Lnew, Hkv, E)).astype(dtype)
    v = rng.standard_normal((B, Lnew, Hkv, Ev)).astype(dtype)
    return q, k_cache, v_cache, k, v, lens


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kvcache_appends_in_place_and_attends_each_sequence(backend, rng, dtype):
    q, kc, vc, k, v, lens = _case(rng, dtype=dtype)
    before_k, before_v = kc.copy(), vc.copy()
    kc_ptr = kc.__array_interface__["data"][0]
    out, lse = fa.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, return_lse=True,
                                         backend=backend)
    assert kc.__array_interface__["data"][0] == kc_ptr            # the caller's array, in place
    for b in range(len(lens)):
        n = lens[b] + k.shape[1]
        np.testing.assert_array_equal(kc[b, lens[b]:n], k[b])
        np.testing.assert_array_equal(vc[b, lens[b]:n], v[b])
        np.testing.assert_array_equal(kc[b, :lens[b]], before_k[b, :lens[b]])
        np.testing.assert_array_equal(kc[b, n:], before_k[b, n:])  # nothing past the new end
        np.testing.assert_array_equal(vc[b, n:], before_v[b, n:])
        ref_out, ref_lse = dense(q[b], kc[b, :n], vc[b, :n])
        np.testing.assert_allclose(out[b], ref_out, rtol=tol(dtype), atol=tol(dtype))
        np.testing.assert_allclose(lse[b], ref_lse, rtol=tol(dtype), atol=tol(dtype))
    assert out.shape == q.shape[:3] + (vc.shape[3],) and out.dtype == dtype


def test_kvcache_decode_without_new_tokens_and_options(backend, rng):
    q, kc, vc, _, _, lens = _case(rng, Lnew=1)
    lens[0] = 0                                          # an empty sequence: out 0, lse -inf
    out, lse = fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, softcap=3.0,
                                         window=(5, -1), return_lse=True, backend=backend)
    for b in range(len(lens)):
        n = lens[b]
        ref_out, ref_lse = dense(q[b], kc[b, :n], vc[b, :n], softcap=3.0, window=(5, None))
        np.testing.assert_allclose(out[b], ref_out, atol=2e-5)
        np.testing.assert_allclose(lse[b], ref_lse, atol=2e-5)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))


def test_paged_cache_equals_contiguous(backend, rng):
    B, S_max, page = 3, 64, 8
    q, kc, vc, k, v, lens = _case(rng, B=B, S_max=S_max)
    per_seq = S_max // page
    perm = rng.permutation(B * per_seq + 5).astype(np.int32)   # pages shuffled, some spare
    table = perm[:B * per_seq].reshape(B, per_seq)
    kp = rng.standard_normal((B * per_seq + 5, page) + kc.shape[2:]).astype(kc.dtype)
    vp = rng.standard_normal((B * per_seq + 5, page) + vc.shape[2:]).astype(vc.dtype)
    for b in range(B):                                  # the same tokens, paged
        kp[table[b]] = kc[b].reshape(per_seq, page, *kc.shape[2:])
        vp[table[b]] = vc[b].reshape(per_seq, page, *vc.shape[2:])
    spare_k = kp[perm[B * per_seq:]].copy()
    want = fa.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, backend=backend)
    got = fa.attention_with_kvcache(q, kp, vp, k, v, cache_seqlens=lens, block_table=table,
                                    backend=backend)
    np.testing.assert_array_equal(got, want)
    for b in range(B):
        np.testing.assert_array_equal(kp[table[b]].reshape(S_max, *kc.shape[2:]), kc[b])
        np.testing.assert_array_equal(vp[table[b]].reshape(S_max, *vc.shape[2:]), vc[b])
    np.testing.assert_array_equal(kp[perm[B * per_seq:]], spare_k)   # unused pages untouched


def test_cache_batch_idx_picks_rows(backend, rng):
    q, kc, vc, k, v, lens = _case(rng, B=2)
    kc4 = np.concatenate([kc, kc[::-1]])                # 4 cache rows
    vc4 = np.concatenate([vc, vc[::-1]])
    idx = np.array([3, 0], np.int32)
    out = fa.attention_with_kvcache(q, kc4, vc4, k, v, cache_seqlens=lens, cache_batch_idx=idx,
                                    backend=backend)
    for b, row in enumerate(idx):
        n = lens[b] + k.shape[1]
        np.testing.assert_array_equal(kc4[row, lens[b]:n], k[b])
        ref, _ = dense(q[b], kc4[row, :n], vc4[row, :n])
        np.testing.assert_allclose(out[b], ref, atol=2e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_applied_at_absolute_positions(backend, rng, interleaved, rotary_dim):
    q, kc, vc, k, v, lens = _case(rng, dtype=np.float64)
    cos, sin = rope_tables(80, rotary_dim)
    out = fa.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, rotary_cos=cos,
                                    rotary_sin=sin, rotary_interleaved=interleaved,
                                    backend=backend)
    for b in range(len(lens)):
        pos = lens[b] + np.arange(k.shape[1])
        k_rot = rotate_complex(k[b], pos, cos, sin, interleaved)
        np.testing.assert_allclose(kc[b, pos], k_rot, rtol=1e-12, atol=1e-12)  # cached rotated
        n = pos[-1] + 1
        ref, _ = dense(rotate_complex(q[b], pos, cos, sin, interleaved), kc[b, :n], vc[b, :n])
        np.testing.assert_allclose(out[b], ref, rtol=1e-10, atol=1e-10)


def _bad_calls(q, kc, vc, k, v, lens):
    ro = kc.copy()
    ro.flags.writeable = False
    table = np.arange(kc.shape[0] * 4, dtype=np.int32).reshape(kc.shape[0], 4)
    dup = table.copy()
    dup[1, 0] = dup[0, 0]
    return [
        ("cache_seqlens", dict(cache_seqlens=lens + np.int32(kc.shape[1])), ValueError),
        ("cache_seqlens", dict(cache_seqlens=lens.astype(np.int64)), TypeError),
        ("cache_seqlens", dict(cache_seqlens=-lens - 1), ValueError),
        ("cache_seqlens", dict(cache_seqlens=lens[:1]), ValueError),
        ("k_cache", dict(cache_seqlens=lens, k_cache=ro), ValueError),
        ("same dtype", dict(cache_seqlens=lens, k=k.astype(np.float64)), TypeError),
        ("head dims", dict(cache_seqlens=lens, v=v[..., :3]), ValueError),
        ("k and v go together", dict(cache_seqlens=lens, v=None), ValueError),
        ("scale", dict(cache_seqlens=lens, scale="x"), TypeError),
        ("window", dict(cache_seqlens=lens, window=(1, 2, 3)), ValueError),
        ("alibi_slopes", dict(cache_seqlens=lens, alibi_slopes=np.ones(3, np.float32)), ValueError),
        ("rotary_cos", dict(cache_seqlens=lens, rotary_cos=np.ones((2, 4)), rotary_sin=np.ones((2, 4))),
         ValueError),
        ("cache_batch_idx", dict(cache_seqlens=lens, cache_batch_idx=np.zeros(len(lens), np.int32)),
         ValueError),
        ("block_table", dict(cache_seqlens=lens, block_table=table.astype(np.int64)), TypeError),
        ("block_table", dict(cache_seqlens=lens, block_table=table + 1000), ValueError),
        ("block_table", dict(cache_seqlens=np.full(len(lens), 8, np.int32), block_table=dup),
         ValueError),
    ]


def test_rejected_calls_write_nothing(rng):
    q, kc, vc, k, v, lens = _case(rng, S_max=32)
    for what, override, exc in _bad_calls(q, kc, vc, k, v, lens):
        kw = dict(k_cache=kc, v_cache=vc, k=k, v=v)
        kw.update(override)
        if "block_table" in override:                # a paged cache of 4 pages of 8 per sequence
            kw["k_cache"] = kc.reshape(-1, 8, *kc.shape[2:])
            kw["v_cache"] = vc.reshape(-1, 8, *vc.shape[2:])
        saved_k, saved_v = kc.tobytes(), vc.tobytes()
        with pytest.raises(exc) as info:
            fa.attention_with_kvcache(q, kw.pop("k_cache"), kw.pop("v_cache"), kw.pop("k"),
                                      kw.pop("v"), **kw)
        assert kc.tobytes() == saved_k and vc.tobytes() == saved_v, what
        named = what.split()[0]
        assert named in str(info.value) or what in str(info.value), (what, str(info.value))


# ----------------------------------------------------------------------------------------------
# varlen
# ----------------------------------------------------------------------------------------------
def _packed(rng, lens_q, lens_k, Hq=4, Hkv=2, E=16, Ev=8, dtype=np.float64):
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], Hq, E)).astype(dtype)
    k = rng.standard_normal((ck[-1], Hkv, E)).astype(dtype)
    v = rng.standard_normal((ck[-1], Hkv, Ev)).astype(dtype)
    return q, k, v, cq, ck


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_each_sequence_attends_within_itself(backend, rng, causal):
    q, k, v, cq, ck = _packed(rng, [5, 1, 0, 17], [9, 1, 3, 17])
    out, lse = fa.varlen_attention(q, k, v, cq, ck, is_causal=causal, return_lse=True,
                                   backend=backend)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and lse.shape == (4, q.shape[0])
    for i in range(4):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ref_out, ref_lse = dense(q[qs], k[ks], v[ks], causal=causal)
        np.testing.assert_allclose(out[qs], ref_out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[:, qs], ref_lse, rtol=1e-10, atol=1e-12)


def test_varlen_backward_matches_the_reference_per_sequence(backend, rng):
    q, k, v, cq, ck = _packed(rng, [6, 3, 11], [6, 8, 11])
    out, lse = fa.varlen_attention(q, k, v, cq, ck, is_causal=True, return_lse=True,
                                   backend=backend)
    g = rng.standard_normal(out.shape)
    dq, dk, dv = fa.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, is_causal=True,
                                              backend=backend)
    t = lambda x: x.transpose(1, 0, 2)                                  # noqa: E731
    for i in range(3):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        rq, rk, rv = reference.scaled_dot_product_attention_backward(
            t(g[qs]), t(q[qs]), t(k[ks]), t(v[ks]), is_causal=True,
            causal_alignment="bottom_right", enable_gqa=True)
        for got, want in ((dq[qs], rq), (dk[ks], rk), (dv[ks], rv)):
            np.testing.assert_allclose(got, t(want), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("cu, exc, words", [
    (np.array([0, 5, 3, 20], np.int32), ValueError, "non-decreasing"),
    (np.array([0, 5, 10, 19], np.int32), ValueError, "packed length"),
    (np.array([0, 5, 10, 20], np.int64), TypeError, "int32"),
    (np.array([1, 5, 10, 20], np.int32), ValueError, "start at 0"),
])
def test_varlen_rejects_bad_cu_seqlens(rng, cu, exc, words):
    q, k, v, cq, ck = _packed(rng, [5, 5, 10], [5, 5, 10])
    with pytest.raises(exc, match="cu_seqlens_q") as info:
        fa.varlen_attention(q, k, v, cu, ck)
    assert words in str(info.value)


# ----------------------------------------------------------------------------------------------
# KVCache
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [None, 4])
def test_kvcache_decode_loop_equals_full_causal_attention(backend, rng, page_size):
    B, Hq, Hkv, E, T = 2, 4, 2, 8, 11
    q = rng.standard_normal((B, T, Hq, E))
    k = rng.standard_normal((B, T, Hkv, E))
    v = rng.standard_normal((B, T, Hkv, E))
    cache = fa.KVCache(B, 16, Hkv, E, np.float64, page_size=page_size)
    first = cache.attend(q[:, :5], k[:, :5], v[:, :5], backend=backend)       # prefill
    steps = [cache.attend(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], backend=backend)
             for t in range(5, T)]                                          # one token at a time
    got = np.concatenate([first] + steps, axis=1)
    want = fa.scaled_dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                           v.transpose(0, 2, 1, 3), is_causal=True,
                                           enable_gqa=True).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert cache.seqlens.tolist() == [T, T]
    with pytest.raises(ValueError, match="capacity"):
        cache.attend(q[:, :6], k[:, :6], v[:, :6])
    assert cache.seqlens.tolist() == [T, T]            # a rejected call does not advance


def test_kvcache_reorder_trim_reset(rng):
    B, Hkv, E = 3, 1, 4
    cache = fa.KVCache(B, 8, Hkv, E, np.float64, page_size=2)
    q = rng.standard_normal((B, 1, 1, E))
    k = rng.standard_normal((B, 5, Hkv, E))
    v = rng.standard_normal((B, 5, Hkv, E))
    cache.attend(q, k, v)
    before = cache.attend(q)
    cache.reorder(np.array([2, 2, 0]))
    after = cache.attend(q[[2, 2, 0]])
    np.testing.assert_array_equal(after, before[[2, 2, 0]])
    cache.trim(2)
    assert cache.seqlens.tolist() == [2, 2, 2]
    out = cache.attend(q)
    ref, _ = dense(q[0], k[2, :2], v[2, :2], causal=False)
    np.testing.assert_allclose(out[0], ref, rtol=1e-10)
    cache.reset()
    assert cache.seqlens.tolist() == [0, 0, 0]
    assert np.all(cache.attend(q) == 0)
    with pytest.raises(ValueError, match="batch_idx"):
        cache.reorder(np.array([0, 1, 3]))


def test_kvcache_and_varlen_pass_sinks_through(backend, rng):
    missing = getattr(fa._backends.registry[backend], "unsupported_options", {})
    if "sinks" in missing:
        pytest.skip(f"{backend}: {missing['sinks']}")
    q, kc, vc, k, v, lens = _case(rng, dtype=np.float64)
    sinks = rng.standard_normal(q.shape[2])
    out = fa.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, sinks=sinks,
                                    backend=backend)
    qq, kk, vv, cq, ck = _packed(rng, [4, 7], [9, 7])
    vout = fa.varlen_attention(qq, kk, vv, cq, ck, is_causal=True, sinks=sinks, backend=backend)
    t = lambda x: x.transpose(1, 0, 2)                                  # noqa: E731
    for b in range(len(lens)):
        n = lens[b] + k.shape[1]
        want = fa.scaled_dot_product_attention(t(q[b]), t(kc[b, :n]), t(vc[b, :n]), is_causal=True,
                                               causal_alignment="bottom_right", enable_gqa=True,
                                               sinks=sinks, backend="numpy")
        np.testing.assert_allclose(out[b], t(want), rtol=1e-10, atol=1e-12)
    for i in range(2):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        want = fa.scaled_dot_product_attention(t(qq[qs]), t(kk[ks]), t(vv[ks]), is_causal=True,
                                               causal_alignment="bottom_right", enable_gqa=True,
                                               sinks=sinks, backend="numpy")
        np.testing.assert_allclose(vout[qs], t(want), rtol=1e-10, atol=1e-12)
    # the sink lowers every weight: the output differs from the call without it
    assert not np.allclose(out, fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens + 3,
                                                          backend=backend))
