"""Low-precision KV caches (fastattn/_kvdtypes.py): float16, bfloat16 and int8 with per-token,
per-kv-head scales, read in place by attention_with_kvcache and KVCache, against the cache tests'
dense float64 computation (tests/test_inference.py) over the values the cache holds (dequantized
or converted)."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn as fa
from fastattn import BackendUnavailableError
from test_inference import dense       # the dense float64 reference of the cache tests

ml_dtypes = pytest.importorskip("ml_dtypes")       # a test extra: bfloat16 runs in CI
BF16 = np.dtype(ml_dtypes.bfloat16)
KINDS = {"float16": np.dtype(np.float16), "bfloat16": BF16, "int8": np.dtype(np.int8)}
# The backends that read each kind in place; the others refuse it by name (auto skips them).
# numba reads them in its decode (up to 16 query rows per head: every case below), not in its
# tiled forward (test_numba_refuses_a_low_precision_prefill).
SERVES = {kind: {"numpy", "cython", "numba"} for kind in ("float16", "bfloat16", "int8")}
TOL = 2e-5                               # the suite's float32 tolerance (tests/test_inference.py)


# ---------------------------------------------------------------------------------------------
# an independent reading of the rule, and the values a cache holds
# ---------------------------------------------------------------------------------------------
def held(cache, scale=None):
    """The float64 values a cache holds: converted, or float32(code) * scale."""
    if cache.dtype == np.int8:
        return (cache.astype(np.float32) * scale[..., None].astype(np.float32)).astype(np.float64)
    return cache.astype(np.float64)


def expect_codes(x):
    """The issue's rule, written out element by element in float64 where float32 is exact."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(-1)
    scale = (amax / np.float32(127)).astype(np.float32)
    q = x.astype(np.float64) / np.where(scale > 0, scale, 1)[..., None].astype(np.float64)
    return scale, q


def make_cache(rng, kind, shape):
    """A cache of `kind` (B_cache, S_max, Hkv, E) filled with random normal tokens, and its
    (k_scale, v_scale) keywords for int8."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "int8":
        codes, scale = fa.quantize_kv(x)
        return codes, scale
    return x.astype(KINDS[kind]), None


def scales_kw(ks, vs):
    return {} if ks is None else dict(k_scale=ks, v_scale=vs)


# ---------------------------------------------------------------------------------------------
# quantize_kv
# ---------------------------------------------------------------------------------------------
def test_quantize_kv_follows_the_rule(rng):
    x = rng.standard_normal((5, 7, 3, 64)) * rng.uniform(1e-3, 1e3, (5, 7, 3, 1))
    codes, scale = fa.quantize_kv(x)
    assert codes.dtype == np.int8 and scale.dtype == np.float32
    assert codes.shape == x.shape and scale.shape == x.shape[:-1]
    want_scale, quot = expect_codes(x)
    np.testing.assert_array_equal(scale, want_scale)
    # float32 division rounds x / scale once; a code may differ from the float64 quotient's
    # rounding only where that quotient is within float32 rounding of a .5 tie
    diff = codes.astype(np.float64) - np.clip(np.rint(quot), -127, 127)
    near_tie = np.abs(np.abs(quot - np.floor(quot)) - 0.5) < 1e-4
    assert np.all((diff == 0) | ((np.abs(diff) == 1) & near_tie))
    assert np.abs(codes).max() == 127 and codes.min() >= -127
    back = fa.dequantize_kv(codes, scale)
    assert np.all(np.abs(back - x.astype(np.float32)) <= scale[..., None] * (0.5 + 1e-5))


def test_quantize_kv_ties_zero_rows_and_underflow():
    s = np.float32(2.0 ** -3)                     # a power of two: x / s is exact
    row = np.array([127, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 0], np.float32) * s
    codes, scale = fa.quantize_kv(row)
    assert scale == s
    assert codes.tolist() == [127, 0, 2, 2, 0, -2, 126, 0]           # half to even
    zero_codes, zero_scale = fa.quantize_kv(np.zeros((2, 4), np.float32))
    assert not zero_codes.any() and not zero_scale.any()
    tiny = np.array([[1e-45, -1e-45, 0.0]], np.float32)                # max / 127 underflows
    tc, ts = fa.quantize_kv(tiny)
    assert ts.tolist() == [0.0] and not tc.any()
    bf = np.array([1.0, -3.0, 0.25], BF16)                             # any float dtype
    np.testing.assert_array_equal(fa.quantize_kv(bf)[0], fa.quantize_kv(bf.astype(np.float32))[0])
    for bad in (np.array([1.0, np.nan]), np.array([np.inf, 0.0])):
        with pytest.raises(ValueError, match="finite"):
            fa.quantize_kv(bad)
    with pytest.raises(TypeError, match="x must have a float dtype"):
        fa.quantize_kv(np.ones(4, np.int32))


def test_quantize_kv_compiled_equals_numpy(rng):
    """The extension's quantizer (csrc/fa_kvconv.h, what quantize_kv and every int8 append
    use when it is built) gives the NumPy rule's bits: rows of every magnitude down to
    float32's subnormals (where the clip matters: max|x| = 190 * 2^-149 has scale 2^-149),
    exact .5 ties, zero and negative-zero rows; and refuses a NaN or an Inf like it."""
    from fastattn import _kvdtypes
    if _kvdtypes._compiled_quantizer() is None:
        pytest.skip("the compiled extension is not available")
    tiny = np.float32(2.0 ** -149)
    x = rng.standard_normal((40, 3, 64)).astype(np.float32)
    x *= np.logspace(-44, 30, 40, dtype=np.float64).astype(np.float32)[:, None, None]
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    x[1, 0] = 0
    x[1, 0, :3] = np.array([190, -100, 3], np.float32) * tiny
    s = np.float32(2.0 ** -3)                  # ties: x / s exact halves
    x[2, 0, :8] = np.array([127, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 0], np.float32) * s
    x[2, 0, 8:] = 0
    codes, scale = _kvdtypes._quantize(x, "x", "t")
    want_codes, want_scale = _kvdtypes._quantize_numpy(x, x, "x", "t")
    np.testing.assert_array_equal(scale.view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(codes, want_codes)
    assert codes[1, 0, 0] == 127 and codes[2, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, 126, 0]
    one = _kvdtypes._quantize(x[3, 1], "x", "t")[1]          # one row: a float32 scalar
    assert type(one) is np.float32 and one == _kvdtypes._quantize_numpy(x[3, 1], x[3, 1], "x", "t")[1]
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[5, 2, 7] = bad
        for quantize in (_kvdtypes._quantize, lambda a, n, f: _kvdtypes._quantize_numpy(a, a, n, f)):
            with pytest.raises(ValueError, match="finite"):
                quantize(y, "x", "t")


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache on each kind, every option, against the dense reference
# ---------------------------------------------------------------------------------------------
CASES = [
    dict(),
    dict(window=5, softcap=3.0),
    dict(alibi=True, sinks=True),
    dict(rotary=True),
    dict(cache_batch_idx=True, is_causal=False),
    dict(paged=True, softcap=2.0, window=9),
    dict(paged=True, rotary=True, sinks=True),
]


def _options(rng, case, Hq, E, capacity):
    kw, ref = {}, {}
    if case.get("window"):
        kw["window"] = (case["window"], -1)
        ref["window"] = (case["window"], -1)
    if case.get("softcap"):
        kw["softcap"] = ref["softcap"] = case["softcap"]
    if case.get("alibi"):
        kw["alibi_slopes"] = ref["alibi"] = rng.uniform(0.01, 0.3, Hq).astype(np.float32)
    if case.get("sinks"):
        kw["sinks"] = ref["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    if case.get("is_causal") is False:
        kw["is_causal"] = ref["causal"] = False
    if case.get("rotary"):
        ang = np.outer(np.arange(capacity + 4), 10000.0 ** (-np.arange(0, E // 2, 2) / (E // 2)))
        kw["rotary_cos"], kw["rotary_sin"] = np.cos(ang), np.sin(ang)
    return kw, ref


def _rotate_ref(x, pos, cos, sin):
    """GPT-NeoX halves on the first rotary_dim dims, in float64 (the reference's rotation)."""
    x = np.asarray(x, np.float64).copy()
    half = cos.shape[1]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
    x[..., :half], x[..., half:2 * half] = a * c - b * s, a * s + b * c
    return x


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("Lq", [1, 5])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_attention_reads_each_kind_in_place(backend, rng, kind, Lq, case):
    case = CASES[case]
    B, S_max, Hq, Hkv, E, Ev, page = 3, 48, 8, 2, 16, 24, 8
    paged, rotary = case.get("paged"), case.get("rotary")
    Lnew = Lq if rotary or Lq > 1 else 1
    lens = np.array([0, 17, 40 - Lnew], np.int32)               # ragged, one empty
    n_rows = B * S_max // page if paged else B + 1
    kc, ks = make_cache(rng, kind, (n_rows, page if paged else S_max, Hkv, E))
    vc, vs = make_cache(rng, kind, (n_rows, page if paged else S_max, Hkv, Ev))
    q = rng.standard_normal((B, Lq, Hq, E)).astype(np.float32)
    k = rng.standard_normal((B, Lnew, Hkv, E)).astype(np.float32)
    v = rng.standard_normal((B, Lnew, Hkv, Ev)).astype(np.float32)
    kw, ref = _options(rng, case, Hq, E, S_max)
    where = {}
    if paged:
        where["block_table"] = rng.permutation(n_rows).astype(np.int32).reshape(B, -1)
    if case.get("cache_batch_idx"):
        where["cache_batch_idx"] = np.array([3, 0, 2], np.int32)
    before = [a.copy() for a in (kc, vc) + ((ks, vs) if ks is not None else ())]
    call = dict(cache_seqlens=lens, return_lse=True, backend=backend, **scales_kw(ks, vs),
                **where, **kw)
    if backend not in SERVES[kind]:
        with pytest.raises(BackendUnavailableError, match="kv_kind"):
            fa.attention_with_kvcache(q, kc, vc, k, v, **call)
        for a, b in zip(before, (kc, vc, ks, vs)):
            assert a.tobytes() == b.tobytes()                  # nothing written
        return
    out, lse = fa.attention_with_kvcache(q, kc, vc, k, v, **call)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == (B, Lq, Hq, Ev) and lse.shape == (B, Hq, Lq)

    def seq(arr, b, n):                           # sequence b's first n positions
        if paged:
            pages = where["block_table"][b]
            return arr[pages].reshape((-1,) + arr.shape[2:])[:n]
        row = where["cache_batch_idx"][b] if "cache_batch_idx" in where else b
        return arr[row, :n]

    for b in range(B):
        n = int(lens[b]) + Lnew
        kb_new, vb_new = k[b], v[b]
        if rotary:
            pos = np.arange(lens[b], n)
            kb_new = _rotate_ref(k[b], pos, kw["rotary_cos"], kw["rotary_sin"])
        # the written tokens follow the rule; the held ones are untouched
        got_k, got_v = seq(kc, b, n)[lens[b]:], seq(vc, b, n)[lens[b]:]
        if kind == "int8":
            # (k rotated here in float64, there in float32: its codes may move by one)
            for got, new, sc, exact in ((got_k, kb_new, ks, not rotary), (got_v, vb_new, vs, 1)):
                codes, scale = fa.quantize_kv(np.asarray(new, np.float32))
                if exact:
                    np.testing.assert_array_equal(seq(sc, b, n)[lens[b]:], scale)
                else:
                    np.testing.assert_allclose(seq(sc, b, n)[lens[b]:], scale, rtol=1e-5)
                assert np.abs(got.astype(int) - codes).max(initial=0) <= (0 if exact else 1)
        else:
            np.testing.assert_array_equal(got_v, vb_new.astype(KINDS[kind]))
            if not rotary:
                np.testing.assert_array_equal(got_k, kb_new.astype(KINDS[kind]))
            else:                                  # rotated in float32, then rounded once
                np.testing.assert_allclose(held(got_k), kb_new, rtol=1e-2, atol=1e-2)
        keys = held(seq(kc, b, n), None if ks is None else seq(ks, b, n))
        vals = held(seq(vc, b, n), None if vs is None else seq(vs, b, n))
        qb = q[b]
        if rotary:
            qb = _rotate_ref(q[b], np.arange(lens[b], lens[b] + Lq) if Lnew == Lq
                             else np.full(Lq, lens[b]), kw["rotary_cos"], kw["rotary_sin"])
        want, want_lse = dense(qb, keys, vals, **ref)
        np.testing.assert_allclose(out[b], want, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(lse[b], want_lse, rtol=TOL, atol=TOL)
    # nothing past the new ends was written
    for b in range(B):
        n = int(lens[b]) + Lnew
        if not paged:
            row = where["cache_batch_idx"][b] if "cache_batch_idx" in where else b
            assert kc[row, n:].tobytes() == before[0][row, n:].tobytes()


# ---------------------------------------------------------------------------------------------
# the compiled decode kernels over each kind, at every SIMD level this CPU has
# ---------------------------------------------------------------------------------------------
def _simd_levels():
    try:
        from fastattn import _cykernels
    except ImportError:
        return ["none"]
    return _cykernels.simd_levels()


@pytest.fixture(params=_simd_levels())
def simd_level(request):
    """The cython extension forced to one SIMD copy (FASTATTN_SIMD's levels), reset after."""
    if request.param == "none" or not fa.backends()["cython"].available:
        pytest.skip("the cython backend is not available")
    from fastattn import _cykernels
    assert _cykernels.set_simd(request.param) == request.param
    yield request.param
    _cykernels.set_simd(None)


# The copy of the low-precision decode kernel that serves head dims (E, Ev) at each level:
# fa_decode_lowp512.h takes multiples of 16, fa_decode_lowp.h multiples of 8, the general path
# (a key block converted at a time) the rest.
LOWP_DIMS = [(64, 64), (128, 128), (128, 64), (24, 24), (20, 20)]


def _lowp_copy_expected(level, E, Ev):
    if level == "avx512" and E % 16 == 0 and Ev % 16 == 0:
        return "avx512"
    if level in ("avx2", "avx512") and E % 8 == 0 and Ev % 8 == 0:
        return "avx2"
    return None


def test_each_level_takes_its_lowp_decode_copy(simd_level):
    """Fails if the AVX-512 copy is not taken at the avx512 level (or AVX2's at avx2), or if a
    head dim it cannot take is not handed down."""
    from fastattn import _cykernels
    for E, Ev in LOWP_DIMS + [(16, 24), (8, 8), (256, 256)]:
        assert _cykernels.decode_lowp_copy(E, Ev) == _lowp_copy_expected(simd_level, E, Ev), \
            (simd_level, E, Ev)
    assert fa.backends()["cython"].details["lowp_decode"] == _lowp_copy_expected(simd_level,
                                                                                 16, 16)


def _decode_case(rng, kind, B, Hkv, G, E, Ev, S_max, page, paged):
    """One query token per sequence (groups of G rows) and a cache of `kind`, flat (B, S_max)
    or paged (pages of `page` tokens shuffled in a pool): q, kc, k_scale, vc, v_scale, and the
    call's block_table keyword."""
    n_rows = B * S_max // page if paged else B
    kc, ks = make_cache(rng, kind, (n_rows, page if paged else S_max, Hkv, E))
    vc, vs = make_cache(rng, kind, (n_rows, page if paged else S_max, Hkv, Ev))
    q = rng.standard_normal((B, 1, Hkv * G, E)).astype(np.float32)
    where = {}
    if paged:
        where["block_table"] = rng.permutation(n_rows).astype(np.int32).reshape(B, -1)
    return q, kc, ks, vc, vs, where


def _check_decode_against_dense(out, lse, q, kc, ks, vc, vs, lens, block_table):
    """Each sequence's out/lse of a decode against the dense float64 computation over the values
    its cache rows hold (block_table: the pages of a paged cache, else None)."""
    for b in range(q.shape[0]):
        n = int(lens[b])
        if block_table is not None:
            pages = block_table[b]
            sq = lambda a: None if a is None else a[pages].reshape((-1,) + a.shape[2:])[:n]
        else:
            sq = lambda a: None if a is None else a[b, :n]
        if n == 0:                       # no key: out 0, lse -inf (the cache tests' rule)
            assert not out[b].any() and np.all(lse[b] == -np.inf)
            continue
        want, want_lse = dense(q[b], held(sq(kc), sq(ks)), held(sq(vc), sq(vs)))
        np.testing.assert_allclose(out[b], want, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(lse[b], want_lse, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dims", LOWP_DIMS, ids=[f"{e}x{ev}" for e, ev in LOWP_DIMS])
@pytest.mark.parametrize("G", range(1, 9))
def test_lowp_decode_kernels_every_simd_copy(rng, simd_level, kind, dims, G):
    """One query token per sequence, GQA groups of 1..8 rows, ragged lengths (0, 1, across the
    kernels' 32- and 64-key blocks), flat (G odd) or paged (G even) caches: the cython decode
    at this SIMD level against the dense float64 computation over the values the cache
    holds."""
    from fastattn import _cykernels
    E, Ev = dims
    B, Hkv, page = 5, 2, 16
    lens = np.array([0, 1, 33, 97, 250], np.int32)
    S_max = 256
    paged = G % 2 == 0
    q, kc, ks, vc, vs, where = _decode_case(rng, kind, B, Hkv, G, E, Ev, S_max, page, paged)
    out, lse = fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True,
                                         backend="cython", **scales_kw(ks, vs), **where)
    assert _cykernels.decode_lowp_copy(E, Ev) == _lowp_copy_expected(simd_level, E, Ev)
    _check_decode_against_dense(out, lse, q, kc, ks, vc, vs, lens, where.get("block_table"))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("G", [1, 2, 3, 4, 5, 8, 9])
def test_numba_lowp_decode_every_group_size(rng, kind, G):
    """numba's decode over a low-precision cache, one query token per sequence, GQA groups of
    1 (MHA) to 8 rows (keys and values converted in its kernels' registers: _dec_rows, the P.V
    micro-kernel) and 9 (keys through a converted tile), ragged lengths across its blocks,
    flat (G odd) or paged (G even): against the dense float64 computation over the values the
    cache holds."""
    if not fa.backends()["numba"].available:
        pytest.skip("numba is not available")
    E, Ev = 64, 40
    B, Hkv, page = 4, 2, 16
    lens = np.array([0, 1, 97, 1500], np.int32)
    S_max = 1536
    paged = G % 2 == 0
    q, kc, ks, vc, vs, where = _decode_case(rng, kind, B, Hkv, G, E, Ev, S_max, page, paged)
    out, lse = fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True,
                                         backend="numba", **scales_kw(ks, vs), **where)
    _check_decode_against_dense(out, lse, q, kc, ks, vc, vs, lens, where.get("block_table"))


@pytest.mark.parametrize("threads", ["1", "2"])
def test_lowp_decode_long_cache_every_simd_copy(rng, simd_level, threads, monkeypatch):
    """Many blocks, and at 2 threads keys split across them (flash-decoding partials merged):
    an int8 and a float16 cache of up to 3000 keys, GQA 4 rows, d = 128."""
    B, Hkv, G, E, S = 2, 2, 4, 128, 3000
    lens = np.array([S, 2049], np.int32)
    q = rng.standard_normal((B, 1, Hkv * G, E)).astype(np.float32)
    monkeypatch.setenv("FASTATTN_NUM_THREADS", threads)
    fa.reload_environment()
    for kind in ("int8", "float16"):
        kc, ks = make_cache(rng, kind, (B, S, Hkv, E))
        vc, vs = make_cache(rng, kind, (B, S, Hkv, E))
        out = fa.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="cython",
                                        **scales_kw(ks, vs))
        for b in range(B):
            n = int(lens[b])
            want, _ = dense(q[b], held(kc[b, :n], None if ks is None else ks[b, :n]),
                            held(vc[b, :n], None if vs is None else vs[b, :n]))
            np.testing.assert_allclose(out[b], want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("q_dtype", [np.float64, np.float16, BF16])
def test_q_of_another_dtype_gives_out_in_its_dtype(rng, kind, q_dtype):
    """float32 compute over the cache's values: q float64 is rounded to float32 first; q
    float16/bfloat16 are exact in float32. out in q's dtype, lse float32."""
    kc, ks = make_cache(rng, kind, (2, 20, 2, 8))
    vc, vs = make_cache(rng, kind, (2, 20, 2, 8))
    q = rng.standard_normal((2, 1, 4, 8)).astype(q_dtype)
    k = rng.standard_normal((2, 1, 2, 8)).astype(q_dtype)
    lens = np.array([7, 19], np.int32)
    out, lse = fa.attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens, return_lse=True,
                                         **scales_kw(ks, vs))
    assert out.dtype == q_dtype and lse.dtype == np.float32
    for b in range(2):
        n = lens[b] + 1
        want, want_lse = dense(q[b].astype(np.float32), held(kc[b, :n], None if ks is None
                                                              else ks[b, :n]),
                               held(vc[b, :n], None if vs is None else vs[b, :n]))
        rtol = TOL if q_dtype == np.float64 else np.finfo(q_dtype).eps
        np.testing.assert_allclose(out[b].astype(np.float64), want, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(lse[b], want_lse, rtol=TOL, atol=TOL)


def test_int8_decode_is_close_to_the_float32_cache(rng):
    """Random normal data: per-row cosine >= 0.999 between the int8 cache's output and the
    float32 cache's (the same tokens, quantized)."""
    B, S, Hq, Hkv, E = 2, 512, 8, 2, 64
    kf = rng.standard_normal((B, S, Hkv, E)).astype(np.float32)
    vf = rng.standard_normal((B, S, Hkv, E)).astype(np.float32)
    q = rng.standard_normal((B, 1, Hq, E)).astype(np.float32)
    (kq, ks), (vq, vs) = fa.quantize_kv(kf), fa.quantize_kv(vf)
    lens = np.array([S, 300], np.int32)
    ref = fa.attention_with_kvcache(q, kf, vf, cache_seqlens=lens)
    got = fa.attention_with_kvcache(q, kq, vq, cache_seqlens=lens, k_scale=ks, v_scale=vs)
    a, b = ref.reshape(-1, E).astype(np.float64), got.reshape(-1, E).astype(np.float64)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() >= 0.999, cos.min()


def test_the_reference_converts_a_key_block_at_a_time(rng, monkeypatch):
    """numpy never converts the whole cache: every tile it converts is at most a key block."""
    from fastattn._backends import numpy_
    seen = []
    real = numpy_.as_compute
    monkeypatch.setattr(numpy_, "as_compute", lambda kind, t, s: seen.append(t.shape) or
                        real(kind, t, s))
    monkeypatch.setattr(numpy_, "KEY_BLOCK", 64)
    kc, ks = make_cache(rng, "int8", (1, 1000, 2, 8))
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    out = fa.attention_with_kvcache(q, kc, kc, cache_seqlens=1000, k_scale=ks, v_scale=ks,
                                    backend="numpy")
    want, _ = dense(q[0], held(kc[0], ks[0]), held(kc[0], ks[0]))
    np.testing.assert_allclose(out[0], want, rtol=TOL, atol=TOL)
    assert seen and max(s[1] for s in seen) <= 64 and sum(s[1] for s in seen) == 2 * 1000


# ---------------------------------------------------------------------------------------------
# bad input: refused by name, nothing written
# ---------------------------------------------------------------------------------------------
def _int8_setup(rng):
    kc, ks = make_cache(rng, "int8", (2, 16, 2, 8))
    vc, vs = make_cache(rng, "int8", (2, 16, 2, 8))
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    return q, kc, vc, ks, vs, k


BAD = [
    ("no scales", lambda a: a.update(k_scale=None, v_scale=None), ValueError, "needs k_scale"),
    ("no v_scale", lambda a: a.update(v_scale=None), ValueError, "needs v_scale"),
    ("scale shape", lambda a: a.update(k_scale=a["k_scale"][:, :8].copy()), ValueError,
     "k_scale must have the cache's shape"),
    ("scale dtype", lambda a: a.update(v_scale=a["v_scale"].astype(np.float64)), TypeError,
     "v_scale must be a float32"),
    ("scale order", lambda a: a.update(k_scale=a["k_scale"].astype(">f4")), TypeError,
     "k_scale must be a float32"),
    ("read-only scale", lambda a: a["v_scale"].setflags(write=False), ValueError,
     "v_scale is read-only"),
    ("scales with a float cache", lambda a: a.update(k_cache=a["k_cache"].astype(np.float16),
                                                     v_cache=a["v_cache"].astype(np.float16)),
     ValueError, "k_scale and v_scale belong to an int8 cache"),
    ("cache dtypes differ", lambda a: a.update(v_cache=a["v_cache"].astype(np.float16)),
     TypeError, "k_cache and v_cache must have the same dtype"),
    ("non-finite k", lambda a: a["k"].__setitem__((1, 0, 1, 3), np.nan), ValueError,
     "k must be finite"),
    ("q int", lambda a: a.update(q=a["q"].astype(np.int32)), TypeError, "q must have a float"),
    ("cache int16", lambda a: a.update(k_cache=a["k_cache"].astype(np.int16),
                                       v_cache=a["v_cache"].astype(np.int16)),
     TypeError, "k_cache must be a float16, bfloat16, float32, float64 or int8"),
]


@pytest.mark.parametrize("what, change, exc, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_anything_is_written(rng, what, change, exc, words):
    q, kc, vc, ks, vs, k = _int8_setup(rng)
    args = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=k.copy(), k_scale=ks, v_scale=vs)
    change(args)
    arrays = [args[n] for n in ("k_cache", "v_cache", "k_scale", "v_scale")
              if args[n] is not None]
    saved = [a.tobytes() for a in arrays]
    with pytest.raises(exc, match=words):
        fa.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                  cache_seqlens=np.array([3, 15], np.int32), **args)
    assert [a.tobytes() for a in arrays] == saved


def test_a_read_only_int8_cache_can_be_read_without_new_tokens(rng):
    q, kc, vc, ks, vs, _ = _int8_setup(rng)
    for a in (kc, vc, ks, vs):
        a.setflags(write=False)
    out = fa.attention_with_kvcache(q, kc, vc, cache_seqlens=5, k_scale=ks, v_scale=vs)
    want, _ = dense(q[1], held(kc[1, :5], ks[1, :5]), held(vc[1, :5], vs[1, :5]))
    np.testing.assert_allclose(out[1], want, rtol=TOL, atol=TOL)


# ---------------------------------------------------------------------------------------------
# KVCache(dtype=...)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("page_size", [None, 4])
def test_kvcache_of_each_kind_keeps_every_behaviour(rng, kind, page_size):
    B, Hq, Hkv, E = 3, 4, 2, 16
    cache = fa.KVCache(B, 40, Hkv, E, KINDS[kind], page_size=page_size)
    assert cache.k.dtype == KINDS[kind] and cache.v.dtype == KINDS[kind]
    assert (cache.k_scale is None) == (kind != "int8")
    if kind == "int8":
        assert cache.k_scale.shape == cache.k.shape[:3] and cache.k_scale.dtype == np.float32
    ang = np.outer(np.arange(64), 10000.0 ** (-np.arange(0, E // 2, 2) / (E // 2)))
    rot = dict(rotary_cos=np.cos(ang), rotary_sin=np.sin(ang))
    toks_k, toks_v = [], []
    for step, n in enumerate((6, 1, 1, 3, 1)):          # prefill, decode steps, a chunk
        q = rng.standard_normal((B, n, Hq, E)).astype(np.float32)
        k = rng.standard_normal((B, n, Hkv, E)).astype(np.float32)
        v = rng.standard_normal((B, n, Hkv, E)).astype(np.float32)
        out = cache.attend(q, k, v, softcap=5.0, **rot)
        toks_k.append(k)
        toks_v.append(v)
        total = int(cache.seqlens[0])
        assert cache.seqlens.tolist() == [total] * B and total == sum(t.shape[1] for t in toks_k)
        for b in range(B):
            keys, vals = _held_seq(cache, b, total)
            qb = _rotate_ref(q[b], np.arange(total - n, total), rot["rotary_cos"],
                             rot["rotary_sin"])
            want, _ = dense(qb, keys, vals, softcap=5.0)
            np.testing.assert_allclose(out[b], want, rtol=TOL, atol=TOL)
            # the values held are the new tokens in the cache's dtype (v: not rotated)
            v_all = np.concatenate([t[b] for t in toks_v])
            if kind == "int8":
                np.testing.assert_allclose(vals, v_all, atol=np.abs(v_all).max() / 127 * 0.51)
            else:
                np.testing.assert_array_equal(vals, v_all.astype(KINDS[kind]).astype(np.float64))
    before = [_held_seq(cache, b, int(cache.seqlens[b])) for b in range(B)]
    cache.reorder(np.array([2, 2, 0]))
    for b, src in enumerate((2, 2, 0)):
        for got, want in zip(_held_seq(cache, b, int(cache.seqlens[b])), before[src]):
            np.testing.assert_array_equal(got, want)
    cache.trim(np.array([5, 12, 0]))
    assert cache.seqlens.tolist() == [5, 12, 0]
    q = rng.standard_normal((B, 1, Hq, E)).astype(np.float32)
    out = cache.attend(q, is_causal=False)
    for b in range(B):
        keys, vals = _held_seq(cache, b, int(cache.seqlens[b]))
        np.testing.assert_allclose(out[b], dense(q[b], keys, vals, causal=False)[0],
                                   rtol=TOL, atol=TOL)
    cache.reset()
    assert not cache.seqlens.any()


def _held_seq(cache, b, n):
    """Sequence b's first n keys and values as the float64 values the cache holds."""
    def seq(arr):
        if arr is None:
            return None
        if cache.block_table is None:
            return arr[b, :n]
        return arr[cache.block_table[b]].reshape((-1,) + arr.shape[2:])[:n]
    return held(seq(cache.k), seq(cache.k_scale)), held(seq(cache.v), seq(cache.v_scale))


def test_kvcache_refuses_other_dtypes():
    for bad in (np.int16, np.uint8, np.dtype(">f4"), np.complex64):
        with pytest.raises(TypeError, match="dtype must be float32, float64, float16"):
            fa.KVCache(1, 8, 1, 4, bad)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("page_size", [None, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kvcache_plans_its_decode_steps_for_each_kind(rng, kind, page_size, dtype):
    """KVCache's per-token path (fastattn/_kvplan.py) serves a float16/bfloat16/int8 cache
    too (q, k, v all float32 or all float64): the same writes and the same outputs (in q's
    dtype) as the full path, step by
    step, with the plan in use; a NaN token in an int8 cache goes the full way and is refused
    with nothing written."""
    from fastattn import _kvplan
    B, Hq, Hkv, E = 2, 8, 2, 16
    ang = np.outer(np.arange(40), 10000.0 ** (-np.arange(0, E // 2, 2) / (E // 2)))
    rot = dict(rotary_cos=np.cos(ang), rotary_sin=np.sin(ang), rotary_interleaved=True)
    planned = fa.KVCache(B, 32, Hkv, E, KINDS[kind], page_size=page_size)
    full = fa.KVCache(B, 32, Hkv, E, KINDS[kind], page_size=page_size)
    served = []
    real = _kvplan.attend
    for step in range(6):
        q = rng.standard_normal((B, 1, Hq, E)).astype(dtype)
        k = rng.standard_normal((B, 1, Hkv, E)).astype(dtype)
        v = rng.standard_normal((B, 1, Hkv, E)).astype(dtype)
        res = real(planned, q, k, v, rot)
        if res is _kvplan.MISS:
            res = planned.attend(q, k, v, **rot)
        else:
            served.append(step)
        want = fa.attention_with_kvcache(q, full.k, full.v, k, v, cache_seqlens=full.seqlens,
                                         block_table=full.block_table, **rot,
                                         **scales_kw(full.k_scale, full.v_scale))
        full.seqlens += 1
        np.testing.assert_array_equal(res, want)
        assert res.dtype == dtype
        for a, b in ((planned.k, full.k), (planned.v, full.v), (planned.k_scale, full.k_scale)):
            if a is not None:
                assert a.tobytes() == b.tobytes()
    assert served == [1, 2, 3, 4, 5]                      # the first call made the plan
    if kind == "int8":
        saved = [a.tobytes() for a in (planned.k, planned.v, planned.k_scale, planned.v_scale)]
        bad = np.full((B, 1, Hkv, E), np.nan, dtype)
        with pytest.raises(ValueError, match="finite"):
            planned.attend(q, bad, v, **rot)
        assert [a.tobytes() for a in (planned.k, planned.v, planned.k_scale,
                                      planned.v_scale)] == saved
        assert planned.seqlens.tolist() == [6, 6]


def test_numba_float16_conversion_is_numpys_bit_for_bit():
    """numba's decode converts a float16 cache by bit operations (fastattn/_numba/_kvconv.py):
    every one of the 65536 patterns, subnormals, infinities and NaN payloads included, gives
    the float32 bits NumPy's astype gives."""
    if not fa.backends()["numba"].available:
        pytest.skip("numba is not available")
    from fastattn._numba._kvconv import _f16_row
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.full(1 << 16, np.nan, np.float32)
    _f16_row(bits, got, got.view(np.uint32))
    np.testing.assert_array_equal(got.view(np.uint32),
                                  bits.view(np.float16).astype(np.float32).view(np.uint32))


def test_numba_float16_conversion_with_denormals_flushed():
    """The same with denormals-are-zero on in the converting thread (what
    torch.set_flush_denormal(True) sets): float16 subnormals are normal float32 numbers and
    must keep their values (a rebias by multiplying the shifted bits by 2^112 read them as 0)."""
    torch = pytest.importorskip("torch")
    if not fa.backends()["numba"].available:
        pytest.skip("numba is not available")
    from fastattn._numba._kvconv import _f16_row
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.full(1 << 16, np.nan, np.float32)
    _f16_row(bits[:4], got[:4], got[:4].view(np.uint32))      # compiled before the switch
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert (np.array([1e-40], np.float32) * np.float32(2))[0] == 0    # DAZ is on here
        _f16_row(bits, got, got.view(np.uint32))
    finally:
        torch.set_flush_denormal(False)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  bits.view(np.float16).astype(np.float32).view(np.uint32))


def test_numba_refuses_a_low_precision_prefill(rng):
    """numba's tiled forward does not read a float16/bfloat16/int8 cache: named, it refuses
    with its reason and writes nothing; auto takes cython (or numpy) instead."""
    if not fa.backends()["numba"].available:
        pytest.skip("numba is not available")
    kc, ks = make_cache(rng, "int8", (1, 64, 2, 16))
    vc, vs = make_cache(rng, "int8", (1, 64, 2, 16))
    q = rng.standard_normal((1, 40, 4, 16)).astype(np.float32)
    k = rng.standard_normal((1, 40, 2, 16)).astype(np.float32)
    saved = [a.tobytes() for a in (kc, vc, ks, vs)]
    with pytest.raises(BackendUnavailableError, match="decode only"):
        fa.attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=3, k_scale=ks, v_scale=vs,
                                  backend="numba")
    assert [a.tobytes() for a in (kc, vc, ks, vs)] == saved
    out = fa.attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=3, k_scale=ks, v_scale=vs)
    want, _ = dense(q[0], held(kc[0, :43], ks[0, :43]), held(vc[0, :43], vs[0, :43]))
    np.testing.assert_allclose(out[0], want, rtol=TOL, atol=TOL)


def _f16c_convert(bits, flush_denormals=False):
    """bits (uint16) through numba's F16C conversion (_intrinsics.f16_to_f32), starting and
    ending off a vector's edge, with the floats around the destination checked untouched."""
    from numba import njit
    from fastattn._numba._intrinsics import f16_to_f32

    @njit
    def convert(src, dst, n):
        f16_to_f32(src, 3, dst, 1, n, np.float32(0.0))
    src = np.concatenate([np.zeros(3, np.uint16), bits])
    out = np.full(bits.size + 2, -7.0, np.float32)
    convert(src[:8], out[:8], 2)                                   # compiled before any switch
    if flush_denormals:
        torch = pytest.importorskip("torch")
        if not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush denormals")
    try:
        convert(src, out, bits.size)
    finally:
        if flush_denormals:
            torch.set_flush_denormal(False)
    assert out[0] == -7.0 and out[-1] == -7.0
    return out[1:-1]


@pytest.mark.parametrize("flush_denormals", [False, True])
@pytest.mark.parametrize("n", [1 << 16, (1 << 16) - 5, 7])
def test_numba_f16c_conversion_is_numpys(n, flush_denormals):
    """Where the CPU has F16C numba converts a float16 cache with vcvtph2ps: every pattern,
    subnormals and infinities included, gives NumPy's float32 bits, with denormals flushed or
    not; a signalling NaN comes out quiet (its payload kept, the quiet bit set: the hardware's
    rule, as in the Cython kernels), any other NaN as NumPy gives it."""
    if not fa.backends()["numba"].available:
        pytest.skip("numba is not available")
    from fastattn._numba._intrinsics import HAVE_F16C
    if not HAVE_F16C:
        pytest.skip("this CPU has no F16C: numba converts by integer operations (tested above)")
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)[-n:]
    got = _f16c_convert(bits, flush_denormals).view(np.uint32)
    want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    signalling = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x3FF) != 0) & ((bits & 0x200) == 0)
    np.testing.assert_array_equal(got[~signalling], want[~signalling])
    np.testing.assert_array_equal(got[signalling], want[signalling] | np.uint32(0x400000))
    assert (n < (1 << 16)) or signalling.sum() == 2 * 511


@pytest.mark.parametrize("n", [128, 77, 16, 5, 0])
def test_numba_bfloat16_and_int8_row_converters(n):
    """numba's bfloat16 and int8 row converters (_intrinsics.py): bfloat16 bits -> the float32
    whose top half they are (NaN payloads kept), int8 codes -> float32(code) * scale rounded
    once, as NumPy computes them; whole vectors and a masked tail, nothing written past n."""
    if not fa.backends()["numba"].available:
        pytest.skip("numba is not available")
    from numba import njit
    from fastattn._numba._intrinsics import bf16_to_f32, i8_to_f32

    @njit
    def convert(bits, codes, out_b, out_i, n, scale):
        bf16_to_f32(bits, 2, out_b, 1, n, scale)
        i8_to_f32(codes, 2, out_i, 1, n, scale)
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 1 << 16, n + 2).astype(np.uint16)
    codes = rng.integers(-127, 128, n + 2).astype(np.int8)
    out_b = np.full(n + 2, -7.0, np.float32)
    out_i = np.full(n + 2, -7.0, np.float32)
    scale = np.float32(0.0123)
    convert(bits, codes, out_b, out_i, n, scale)
    want_b = (bits[2:].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(out_b[1:n + 1].view(np.uint32), want_b.view(np.uint32))
    np.testing.assert_array_equal(out_i[1:n + 1], codes[2:].astype(np.float32) * scale)
    assert out_b[0] == out_i[0] == -7.0 and out_b[n + 1] == out_i[n + 1] == -7.0
