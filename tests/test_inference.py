"""attention_with_kvcache, varlen_attention (+ backward) and KVCache against a dense float64
computation written here, in flash-attn's layout, for every backend."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn as fa
from fastattn import reference


def dense(q, k, v, *, causal=True, scale=None, window=None, softcap=None, alibi=None,
          sinks=None):
    """q (Lq, Hq, E) against k (n, Hkv, E), v (n, Hkv, Ev), bottom-right causal; float64.
    alibi (Hq,) slopes, sinks (Hq,) logits (one more denominator term per row)."""
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
    if alibi is not None:
        s = s - np.asarray(alibi, np.float64)[:, None, None] * np.abs(pos - j)[None]
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
    if sinks is not None:                       # the sink: a score column with value 0
        col = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (Hq, Lq, 1))
        s = np.concatenate([s, col], axis=-1)
        vv = np.concatenate([vv, np.zeros((1,) + vv.shape[1:])], axis=0)
        n += 1
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


@pytest.mark.parametrize("paged", [False, True])
def test_a_cache_of_no_slots_attends_no_key(backend, rng, paged):
    """A cache of capacity 0 (S_max = 0, or pages of 0 slots) with no tokens to add: every
    sequence attends no key, as flash-attn's model has it: output 0, lse -inf. With
    cache_batch_idx the cache is read as one page per sequence, of page_size 0 here, which the
    compiled kernels refuse: the call must not reach them (hypothesis found it)."""
    B, Hq, Hkv, E = 4, 2, 2, 8
    q = rng.standard_normal((B, 1, Hq, E))
    kc, vc = np.zeros((5, 0, Hkv, E)), np.zeros((5, 0, Hkv, E))
    new = np.zeros((B, 0, Hkv, E))
    opts = (dict(block_table=np.zeros((B, 2), np.int32)) if paged
            else dict(cache_batch_idx=np.array([0, 4, 3, 1], np.int32)))
    out, lse = fa.attention_with_kvcache(q, kc, vc, new, new, cache_seqlens=0, return_lse=True,
                                         backend=backend, **opts)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_array_equal(out, 0)
    assert np.all(lse == -np.inf)


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


def test_rejected_calls_write_nothing(backend, rng):
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
                                      kw.pop("v"), backend=backend, **kw)
        assert kc.tobytes() == saved_k and vc.tobytes() == saved_v, what
        named = what.split()[0]
        assert named in str(info.value) or what in str(info.value), (what, str(info.value))


# ----------------------------------------------------------------------------------------------
# one kernel call for the whole batch, reading the cache where it is
# ----------------------------------------------------------------------------------------------
def _store(rng, kc, vc, layout, page=None):
    """The same sequences (kc/vc (B, S_max, Hkv, E)) stored as `layout`: "contiguous" as given;
    "rows": rows of a larger cache, picked by cache_batch_idx; "paged": pages of `page` tokens
    shuffled in a pool with spare pages of noise. Returns (k_cache, v_cache, keywords)."""
    B, S_max = kc.shape[:2]
    if layout == "contiguous":
        return kc, vc, {}
    if layout == "rows":
        rows = rng.permutation(B + 2)[:B].astype(np.int32)
        kr = rng.standard_normal((B + 2,) + kc.shape[1:]).astype(kc.dtype)
        vr = rng.standard_normal((B + 2,) + vc.shape[1:]).astype(vc.dtype)
        kr[rows], vr[rows] = kc, vc
        return kr, vr, dict(cache_batch_idx=rows)
    per_seq = -(-S_max // page)
    pool = B * per_seq + 3
    table = rng.permutation(pool)[:B * per_seq].astype(np.int32).reshape(B, per_seq)
    kp = rng.standard_normal((pool, page) + kc.shape[2:]).astype(kc.dtype)
    vp = rng.standard_normal((pool, page) + vc.shape[2:]).astype(vc.dtype)
    for b in range(B):
        for i in range(per_seq):
            part = slice(i * page, min(S_max, (i + 1) * page))
            kp[table[b, i], :part.stop - part.start] = kc[b, part]
            vp[table[b, i], :part.stop - part.start] = vc[b, part]
    return kp, vp, dict(block_table=table)


def _random_options(rng, B, Hq, Lnew):
    opts = {}
    if rng.random() < 0.3:
        opts["window"] = (int(rng.integers(0, 40)), -1)
    if rng.random() < 0.3:
        opts["softcap"] = float(rng.uniform(1, 5))
    if rng.random() < 0.3:
        opts["alibi_slopes"] = rng.uniform(0, 0.3, (Hq,) if rng.random() < 0.5 else (B, Hq))
    if rng.random() < 0.3:
        opts["sinks"] = rng.standard_normal(Hq)
    if rng.random() < 0.3:
        opts["scale"] = float(rng.choice([0.05, -0.2, 0.3]))
    if Lnew == 0 and rng.random() < 0.3:
        opts["is_causal"] = False
    return opts


def _dense_batch(q, kc, vc, lens_total, opts):
    """The dense float64 reference, sequence by sequence, for what attention_with_kvcache got."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(lens_total[b])
        al = opts.get("alibi_slopes")
        if al is not None and al.ndim == 2:
            al = al[b]
        o, l = dense(q[b], kc[b, :n], vc[b, :n], causal=opts.get("is_causal", True),
                     scale=opts.get("scale"), window=opts.get("window"),
                     softcap=opts.get("softcap"), alibi=al, sinks=opts.get("sinks"))
        outs.append(o)
        lses.append(l)
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("layout,page", [("contiguous", None), ("rows", None), ("paged", 5),
                                         ("paged", 16), ("paged", 64)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ragged_batches_in_every_layout_match_the_dense_reference(backend, rng, layout, page,
                                                                   dtype):
    """Random ragged batches (empty sequences, new tokens or none, decode and prefill query
    lengths, GQA and MHA, every score option) against the dense float64 reference."""
    for trial in range(6):
        B = int(rng.integers(1, 5))
        Hkv = int(rng.choice([1, 2]))
        Hq = Hkv * int(rng.choice([1, 3, 4]))
        E, Ev = int(rng.choice([16, 40])), int(rng.choice([16, 24]))
        S_max = int(rng.integers(40, 300))
        Lnew = int(rng.choice([0, 1, 3]))
        Lq = Lnew if Lnew else int(rng.choice([1, 2, 20]))
        lens = rng.integers(0, S_max - Lnew + 1, size=B).astype(np.int32)
        kc = rng.standard_normal((B, S_max, Hkv, E)).astype(dtype)
        vc = rng.standard_normal((B, S_max, Hkv, Ev)).astype(dtype)
        q = rng.standard_normal((B, Lq, Hq, E)).astype(dtype)
        k = rng.standard_normal((B, Lnew, Hkv, E)).astype(dtype) if Lnew else None
        v = rng.standard_normal((B, Lnew, Hkv, Ev)).astype(dtype) if Lnew else None
        opts = _random_options(rng, B, Hq, Lnew)
        kcs, vcs, where = _store(rng, kc, vc, layout, page)
        out, lse = fa.attention_with_kvcache(q, kcs, vcs, k, v, cache_seqlens=lens,
                                             return_lse=True, backend=backend, **where, **opts)
        if Lnew:                                   # what the cache holds now, as sequences
            for b in range(B):
                kc[b, lens[b]:lens[b] + Lnew], vc[b, lens[b]:lens[b] + Lnew] = k[b], v[b]
        want_out, want_lse = _dense_batch(q, kc, vc, lens + Lnew, opts)
        t = tol(dtype)
        what = (trial, B, Hq, Hkv, Lq, Lnew, lens.tolist(), sorted(opts))
        np.testing.assert_allclose(out, want_out, rtol=t, atol=t, err_msg=str(what))
        np.testing.assert_allclose(lse, want_lse,
                                   rtol=t, atol=t, err_msg=str(what))


@pytest.mark.parametrize("paged", [False, True])
def test_a_cache_in_the_other_byte_order_takes_the_new_tokens(rng, paged):
    """A big-endian (non-native) cache is read through a converted copy; the new tokens must
    still land in the caller's array (they were written into the copy only and lost: the next
    step did not see them), and the step after attends them."""
    B, Hkv, E, S_max, page = 2, 2, 8, 12, 4
    swapped = np.dtype(np.float32).newbyteorder("S")
    kc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    vc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    kcs, vcs, where = _store(rng, kc, vc, "paged" if paged else "contiguous", page)
    native_k, native_v = kcs.copy(), vcs.copy()
    kcs, vcs = kcs.astype(swapped), vcs.astype(swapped)
    lens = np.array([3, 5], np.int32)
    q = rng.standard_normal((B, 1, 4, E)).astype(np.float32)
    k = rng.standard_normal((B, 1, Hkv, E)).astype(np.float32)
    v = rng.standard_normal((B, 1, Hkv, E)).astype(np.float32)
    fa.attention_with_kvcache(q, native_k, native_v, k, v, cache_seqlens=lens, **where)
    fa.attention_with_kvcache(q, kcs, vcs, k, v, cache_seqlens=lens, **where)
    assert kcs.dtype == swapped
    np.testing.assert_array_equal(kcs.astype(np.float32), native_k)
    np.testing.assert_array_equal(vcs.astype(np.float32), native_v)
    want = fa.attention_with_kvcache(q, native_k, native_v, cache_seqlens=lens + 1, **where)
    got = fa.attention_with_kvcache(q, kcs, vcs, cache_seqlens=lens + 1, **where)
    np.testing.assert_array_equal(got, want)


def test_a_cache_that_is_not_an_array_is_refused_when_tokens_are_added(rng):
    kc = np.zeros((1, 6, 1, 4), np.float32)
    q = np.ones((1, 1, 2, 4), np.float32)
    k = np.ones((1, 1, 1, 4), np.float32)
    with pytest.raises(TypeError, match="k_cache must be a NumPy array"):
        fa.attention_with_kvcache(q, kc.tolist(), kc, k, k, cache_seqlens=np.array([2], np.int32))
    with pytest.raises(TypeError, match="v_cache must be a NumPy array"):
        fa.attention_with_kvcache(q, kc, kc.tolist(), k, k, cache_seqlens=np.array([2], np.int32))
    assert not kc.any()                          # nothing written before the refusal


@pytest.mark.parametrize("B", [1, 4, 5, 9])
@pytest.mark.parametrize("Lnew", [1, 4])
@pytest.mark.parametrize("layout,page", [("contiguous", None), ("rows", None), ("paged", 3),
                                         ("paged", 16)])
def test_new_tokens_land_in_the_same_slots_at_every_batch_size(rng, B, Lnew, layout, page):
    """The new keys/values go where one position-by-position write puts them, whichever way
    the call writes them (slices for up to 4 sequences that stay in a page, one indexed
    assignment otherwise; pages of 3 make 4 new tokens cross a page), and nothing else of the
    cache changes."""
    Hkv, E, S_max = 2, 8, 30
    kc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    vc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    kcs, vcs, where = _store(rng, kc, vc, layout, page)
    want_k, want_v = kcs.copy(), vcs.copy()
    lens = rng.integers(0, S_max - Lnew + 1, B).astype(np.int32)
    q = rng.standard_normal((B, 1, 4, E)).astype(np.float32)
    k = rng.standard_normal((B, Lnew, Hkv, E)).astype(np.float32)
    v = rng.standard_normal((B, Lnew, Hkv, E)).astype(np.float32)
    fa.attention_with_kvcache(q, kcs, vcs, k, v, cache_seqlens=lens, **where)
    for b in range(B):
        for i in range(Lnew):
            t = int(lens[b]) + i
            if layout == "paged":
                slot = (where["block_table"][b, t // page], t % page)
            elif layout == "rows":
                slot = (where["cache_batch_idx"][b], t)
            else:
                slot = (b, t)
            want_k[slot], want_v[slot] = k[b, i], v[b, i]
    assert kcs.tobytes() == want_k.tobytes()
    assert vcs.tobytes() == want_v.tobytes()


@pytest.mark.parametrize("Hq", [2, 8])
@pytest.mark.parametrize("layout,page", [("contiguous", None), ("paged", 256), ("paged", 100)])
def test_long_ragged_decode_matches_the_dense_reference(backend, rng, Hq, layout, page):
    """Decode (one new token) over long sequences of different lengths: keys split across
    threads (flash-decoding), MHA (Hq = Hkv, its own float32 kernel) and GQA, pages that cut
    the kernels' key blocks."""
    B, Hkv, E, S_max = 3, 2, 64, 5200
    lens = np.array([5100, 1200, 0], np.int32)
    kc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    vc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    q = rng.standard_normal((B, 1, Hq, E)).astype(np.float32)
    k = rng.standard_normal((B, 1, Hkv, E)).astype(np.float32)
    v = rng.standard_normal((B, 1, Hkv, E)).astype(np.float32)
    kcs, vcs, where = _store(rng, kc, vc, layout, page)
    out, lse = fa.attention_with_kvcache(q, kcs, vcs, k, v, cache_seqlens=lens, return_lse=True,
                                         backend=backend, **where)
    for b in range(B):
        kc[b, lens[b]], vc[b, lens[b]] = k[b, 0], v[b, 0]
    want_out, want_lse = _dense_batch(q, kc, vc, lens + 1, {})
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("Hq", [2, 8])
def test_paged_gives_the_bits_of_contiguous_of_another_capacity(rng, Hq):
    """Long ragged decode (keys split across threads when there are two): the split follows
    the longest sequence, not the cache's capacity, so a page table with spare pages gives the
    bits of the contiguous cache."""
    B, Hkv, E, S_max, page = 3, 2, 64, 5200, 256
    lens = np.array([5100, 1200, 0], np.int32)
    kc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    vc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    q = rng.standard_normal((B, 1, Hq, E)).astype(np.float32)
    used = -(-S_max // page)
    table = rng.permutation(B * (used + 2)).astype(np.int32).reshape(B, used + 2)
    kp = np.zeros((table.size, page, Hkv, E), np.float32)
    vp = np.zeros_like(kp)
    for b in range(B):
        for i in range(used):
            part = slice(i * page, min(S_max, (i + 1) * page))
            kp[table[b, i], :part.stop - part.start] = kc[b, part]
            vp[table[b, i], :part.stop - part.start] = vc[b, part]
    want = fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    got = fa.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("page", [7, 100, 256])
@pytest.mark.parametrize("Lq", [1, 4, 24])
def test_paged_gives_the_bits_of_contiguous(backend, rng, page, Lq):
    """GQA decode and prefill: a paged cache gives the same bits as the same cache stored
    contiguously (blocks that straddle pages are gathered, so the sums are the same)."""
    B, Hq, Hkv, E, S_max = 2, 8, 2, 32, 700
    lens = np.array([690 - Lq, 300], np.int32)
    kc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    vc = rng.standard_normal((B, S_max, Hkv, E)).astype(np.float32)
    q = rng.standard_normal((B, Lq, Hq, E)).astype(np.float32)
    kp, vp, where = _store(rng, kc, vc, "paged", page)
    S_cap = where["block_table"].shape[1] * page
    kc2 = np.zeros((B, S_cap, Hkv, E), np.float32)     # the same capacity: the same key chunks
    vc2 = np.zeros((B, S_cap, Hkv, E), np.float32)
    kc2[:, :S_max], vc2[:, :S_max] = kc, vc
    want = fa.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lens, backend=backend,
                                     softcap=4.0, window=(500, -1))
    got = fa.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, backend=backend,
                                    softcap=4.0, window=(500, -1), **where)
    np.testing.assert_array_equal(got, want)


def test_one_kernel_call_reads_the_cache_in_place(backend, rng, monkeypatch):
    """Every backend gets the whole batch in one call whose k/v are the caller's cache
    (strided views of it, no copy), contiguous and paged (numba did not read a cache in place
    before fastattn/_numba/_kv.py: it got each sequence through scaled_dot_product_attention)."""
    from fastattn import inference
    from fastattn._backends import registry
    q, kc, vc, k, v, lens = _case(rng, B=3, S_max=64, Lnew=1)
    be = registry[backend]
    seen = []
    real_forward = be.forward
    monkeypatch.setattr(be, "forward", lambda p: seen.append(p) or real_forward(p))
    sdpa_calls = []
    real_sdpa = inference.scaled_dot_product_attention
    monkeypatch.setattr(inference, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa_calls.append(1) or real_sdpa(*a, **kw))
    for where in ({}, dict(block_table=np.arange(12, dtype=np.int32).reshape(3, 4))):
        seen.clear()
        sdpa_calls.clear()
        kcs = kc.reshape(12, 16, *kc.shape[2:]) if where else kc
        vcs = vc.reshape(12, 16, *vc.shape[2:]) if where else vc
        fa.attention_with_kvcache(q, kcs, vcs, k, v, cache_seqlens=lens, backend=backend,
                                  **where)
        assert len(seen) == 1 and not sdpa_calls
        p = seen[0]
        assert np.shares_memory(p.k, kcs) and np.shares_memory(p.v, vcs)
        assert p.kv_strides is not None and p.seqlens.tolist() == (lens + 1).tolist()
        assert (p.block_table is None) == (not where)


def test_kernel_record_checks_the_cache_layout(rng):
    """The Cython entry refuses a record whose seqlens, pages or strides would read outside
    the arrays (ValueError, not a crash); its backward refuses a cache read in place, and the
    dispatcher does not send it one."""
    K = pytest.importorskip("fastattn._cykernels")
    from fastattn._backends import registry
    from fastattn._backends._kernel_args import forward_outputs, kernel_args
    from fastattn._inputs import make_cache_problem
    kc = rng.standard_normal((6, 8, 2, 16)).astype(np.float32)     # 6 pages of 8
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    p = make_cache_problem(q, kc.transpose(0, 2, 1, 3), kc.transpose(0, 2, 1, 3),
                           seqlens=np.array([20, 9], np.int32), block_table=table)
    out, lse = forward_outputs(p)
    a = kernel_args(p, 1)
    K.decode(a, out, lse)                                           # the record as built: fine
    bad = [(dict(seqlens=np.array([25, 9], np.int32)), "seqlens"),
           (dict(block_table=np.array([[0, 1, 9], [3, 4, 5]], np.int32)), "block_table"),
           (dict(k_strides=(256, 16, 16)), "strides"),
           (dict(page_size=4), "agree")]
    for change, words in bad:
        with pytest.raises(ValueError, match=words):
            K.decode(a._replace(**change), out, lse)
    # pages past a sequence's end are never read, so they are not checked
    K.decode(a._replace(block_table=np.array([[0, 1, 2], [3, 4, -7]], np.int32)), out, lse)
    dq = np.zeros_like(p.q)
    dk = np.zeros((6, 2, 8, 16), np.float32)
    with pytest.raises(ValueError, match="in place"):
        K.backward(a, out, out, lse, dq, dk, dk.copy(), np.zeros(1, np.float32))
    assert registry["cython"].not_supported_reasons(p, "forward") == []
    assert registry["cython"].not_supported_reasons(p, "backward")


@pytest.mark.parametrize("kernel", ["decode", "forward"])
def test_numba_kernel_record_checks_the_cache_layout(rng, kernel):
    """The numba entries read a cache in place (forward and decode) and refuse a record whose
    seqlens, pages or strides would read outside the arrays (ValueError: numba does not check
    bounds, so this is what stands between a bad record and a crash); the backward refuses a
    cache read in place, and the dispatcher does not send it one."""
    from fastattn._backends import registry
    from fastattn._backends._kernel_args import forward_outputs, kernel_args
    from fastattn._inputs import make_cache_problem
    be = registry["numba"]
    if not be.available:
        pytest.skip(be.reason)
    from fastattn._numba import backward, decode, forward
    run = decode.decode if kernel == "decode" else forward.forward
    kc = rng.standard_normal((6, 8, 2, 16)).astype(np.float32)     # 6 pages of 8
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    p = make_cache_problem(q, kc.transpose(0, 2, 1, 3), kc.transpose(0, 2, 1, 3),
                           seqlens=np.array([20, 9], np.int32), block_table=table)
    out, lse = forward_outputs(p)
    a = kernel_args(p, 1)
    run(a, out, lse)                                               # the record as built: fine
    for b, n in ((0, 20), (1, 9)):
        kb = kc[table[b]].reshape(24, 2, 16)[:n]
        want, want_lse = dense(q[b].transpose(1, 0, 2), kb, kb)
        np.testing.assert_allclose(out[b].transpose(1, 0, 2), want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse[b].T, want_lse.T, rtol=2e-5, atol=2e-5)
    bad = [(dict(seqlens=np.array([25, 9], np.int32)), "seqlens"),
           (dict(block_table=np.array([[0, 1, 9], [3, 4, 5]], np.int32)), "block_table"),
           (dict(k_strides=(256, 16, 16)), "strides"),
           (dict(page_size=4), "agree")]
    for change, words in bad:
        with pytest.raises(ValueError, match=words):
            run(a._replace(**change), out, lse)
    # pages past a sequence's end are never read, so they are not checked
    run(a._replace(block_table=np.array([[0, 1, 2], [3, 4, -7]], np.int32)), out, lse)
    dq = np.zeros_like(p.q)
    dk = np.zeros((6, 2, 8, 16), np.float32)
    with pytest.raises(ValueError, match="in place"):
        backward.backward(a, out, out, lse, dq, dk, dk.copy(), np.zeros(1, np.float32))
    assert be.not_supported_reasons(p, "forward") == []
    assert be.not_supported_reasons(p, "backward")


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


@pytest.mark.parametrize("max_len", [16, 4096])             # separate arrays / one buffer
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_kvcache_arrays_start_on_a_cache_line(max_len, dtype):
    """np.zeros of a large array starts 16 bytes into a page; the cache's K and V start on a
    64-byte boundary (fastattn/nn.py: _zeros_aligned), hold zeros, and have their own shapes
    and the requested dtype."""
    for _ in range(3):                       # a few allocations: the offset is not luck
        cache = fa.KVCache(2, max_len, 2, 64, dtype, value_dim=32)
        for arr, dim in ((cache.k, 64), (cache.v, 32)):
            assert arr.ctypes.data % 64 == 0
            assert arr.dtype == dtype and arr.shape == (2, max_len, 2, dim)
            assert arr.flags.c_contiguous and arr.flags.writeable
            assert not np.any(arr)
        assert not np.shares_memory(cache.k, cache.v)


@pytest.mark.parametrize("page_size", [None, 256])
def test_a_large_kvcache_holds_k_and_v_in_one_buffer_half_a_huge_page_apart(rng, page_size):
    """Above 2 MiB the cache's K and V are views of one buffer, V starting 1 MiB off K's
    offset within 2 MiB pages (fastattn/nn.py: with two arrays of one size the decode ran
    slower).  The views must behave as two arrays: appends, reorder and attention see each
    sequence's own tokens, and nothing is written across the gap."""
    B, Hq, Hkv, E = 2, 4, 2, 64                      # 4 MiB of keys, 4 MiB of values
    cache = fa.KVCache(B, 4096, Hkv, E, np.float32, page_size=page_size)
    assert not np.shares_memory(cache.k, cache.v)
    assert (cache.v.ctypes.data - cache.k.ctypes.data) % (2 << 20) == 1 << 20
    assert cache.k.base is cache.v.base
    buf = cache.k.base
    q = rng.standard_normal((B, 1, Hq, E)).astype(np.float32)
    k = rng.standard_normal((B, 6, Hkv, E)).astype(np.float32)
    v = rng.standard_normal((B, 6, Hkv, E)).astype(np.float32)
    got = cache.attend(q, k, v)
    seq_k = cache.k.reshape(B, -1, Hkv, E)
    seq_v = cache.v.reshape(B, -1, Hkv, E)
    np.testing.assert_array_equal(seq_k[:, :6], k)
    np.testing.assert_array_equal(seq_v[:, :6], v)
    # everything else in the buffer, the gap included, is still zero
    assert np.count_nonzero(buf) == np.count_nonzero(k) + np.count_nonzero(v)
    for b in range(B):
        want, _ = dense(q[b].astype(np.float64), k[b].astype(np.float64),
                        v[b].astype(np.float64), causal=True)
        np.testing.assert_allclose(got[b], want, rtol=2e-5, atol=2e-6)
    cache.reorder(np.array([1, 1]))
    np.testing.assert_array_equal(seq_k[:, :6], k[[1, 1]])
    np.testing.assert_array_equal(seq_v[:, :6], v[[1, 1]])
    np.testing.assert_array_equal(cache.attend(q[[1, 1]]), got[[1, 1]])


def test_a_small_kvcache_has_two_arrays():
    """Below 2 MiB, K and V are two allocations (each a 64-byte-aligned view of its own
    slightly longer array), not views of one buffer."""
    cache = fa.KVCache(2, 64, 2, 16, np.float32)
    assert cache.k.base is not None and cache.v.base is not None
    assert cache.k.base is not cache.v.base
    assert cache.k.base.size - cache.k.size <= 16 and cache.v.base.size - cache.v.size <= 16


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
