"""Numba kernel internals: the math helpers and the GEMM micro-kernels on their own.

The backend-parametrized suites (test_forward.py, test_decode.py, test_backward.py) check the
kernels through the public API; here the pieces whose accuracy those results rest on are held to
explicit bounds, so a change of a polynomial or of a summation order is caught where it is made.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

pytest.importorskip("numba", reason="numba not installed")

from numba import njit  # noqa: E402

from fastattn._numba import _exp, _gemm  # noqa: E402


@njit
def _apply(f, x, o):
    for i in range(x.size):
        o[i] = f(x[i])


def _ulps(got, exact):
    """|got - exact| in units of the float32 spacing at exact."""
    spacing = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / spacing


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp2_special_values_and_accuracy(dtype):
    fn = _exp.exp2_f32 if dtype == np.float32 else _exp.exp2_f64
    lim, tol = (126, 1.2e-7) if dtype == np.float32 else (1022, 1e-15)
    x = np.concatenate([[-np.inf, -1e30, -lim - 5.0, 0.0, np.nan],
                        np.linspace(-lim + 1, 10, 200001)]).astype(dtype)
    o = np.empty_like(x)
    _apply(fn, x, o)
    assert o[0] == 0 and o[1] == 0 and o[2] == 0 and o[3] == 1 and np.isnan(o[4])
    exact = np.exp2(x[5:].astype(np.float64))
    assert (np.abs(o[5:] - exact) / exact).max() < tol


@njit
def _exp2_row(S, r, P, n, c, m):
    return _exp.exp2_row_sum(S, r, P, n, c, m)


@njit(fastmath={'contract'})     # t = x*c - m as one FMA, as in the row pass
def _exp2_each(x, c, m, out):
    for j in range(x.size):
        out[j] = _exp.exp2v(x[j] * c - m)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 65, 100, 130, 512])
def test_exp2_row_pass_matches_elementwise_exp2(dtype, n):
    """The softmax's row pass (for float32 on AVX-512 CPUs: vreduceps/vscalefps, see _exp.py)
    gives each weight exactly as the elementwise exp2 does where t = x*c - m >= the cutoff,
    exactly 0 below it and for -inf, NaN for NaN and >= 2**64 for overflow; it writes row r's
    first n entries only and returns their sum."""
    rng = np.random.default_rng(n)
    S = (rng.standard_normal((3, n + 5)) * 60).astype(dtype)
    row = S[1]
    row[::5] = -np.inf
    row[1::9] = np.nan
    row[2::11] = np.inf
    row[3::13] = -1e30
    finite = row[np.isfinite(row) & (np.abs(row) < 1e20)]
    c = dtype(0.3)
    m = dtype(finite.max() * c) if finite.size else dtype(0)
    P = np.full_like(S, 7.0)
    s = _exp2_row(S, 1, P, n, c, m)
    got, x = P[1, :n], row[:n]
    want = np.empty(n, dtype)
    _exp2_each(x.copy(), c, m, want)
    with np.errstate(invalid="ignore", over="ignore"):
        t = x.astype(np.float64) * np.float64(c) - np.float64(m)
    cutoff = _exp.EXP2_ROW_CUTOFF if dtype == np.float32 else -1022.0
    normal = np.isfinite(t) & (t >= cutoff) & (t < 60)
    if dtype == np.float32:
        assert np.array_equal(got[normal], want[normal])
    else:   # t may round differently (FMA or not): relative error up to |t| ln2 ulp
        np.testing.assert_allclose(got[normal], want[normal], rtol=1e-13, atol=0)
    assert np.all(got[(t < cutoff) | (t == -np.inf)] == 0)
    assert np.array_equal(np.isnan(got), np.isnan(t))
    assert np.all(got[t > 200] >= 2.0 ** 64)
    assert np.all(P[0] == 7) and np.all(P[2] == 7) and np.all(P[1, n:] == 7)
    total = got.astype(np.float64).sum()
    if np.isnan(total):
        assert np.isnan(s)
    else:
        assert s == total or abs(s - total) <= 1e-6 * abs(total)


def test_tanh_f32_accuracy_and_saturation():
    """<= 2 ulp everywhere (numpy's float32 tanh: 1.4), odd, and exactly +-1 where float32 rounds
    tanh to 1 (a clamp at 9 once returned 1 - 2**-24 for every saturated softcap score)."""
    x = np.concatenate([np.linspace(0, 12, 1200001), [1e-30, 0.55, 9.02, 50.0, 1e4, np.inf]])
    x = x.astype(np.float32)
    o = np.empty_like(x)
    _apply(_exp.tanh_f32, x, o)
    exact = np.tanh(x.astype(np.float64))
    nz = exact != 0
    assert _ulps(o[nz], exact[nz]).max() <= 2.0
    assert np.all(o[x >= 9.02] == 1.0)
    neg = np.empty_like(x)
    _apply(_exp.tanh_f32, -x, neg)
    assert np.array_equal(neg, -o)


@pytest.mark.parametrize("E", [1, 7, 8, 17, 64, 100, 128])
@pytest.mark.parametrize("S", [1, 6, 9, 63, 64, 65, 130])
def test_packs_lay_out_every_element(E, S):
    """The operand packs (8 x 8 register transposes plus loops for the edges) against numpy:
    Q rows into MR-row k-major micro-tiles with zero rows past the end, K keys into PW-key
    panels with zero keys past S; nothing written outside the packed range (NaN guards)."""
    rng = np.random.default_rng(E * 1000 + S)
    MR, PW = _gemm.MR, _gemm.PW
    x = rng.standard_normal(S * E + 5).astype(np.float32)       # rows start at offset 3
    npan = -(-S // PW)
    Kp = np.full(npan * E * PW + 2, np.nan, np.float32)
    for p in range(npan):
        _gemm.pack_k_panel(x, 3, S, E, Kp, 1, p)
    keys = np.zeros((npan * PW, E), np.float32)
    keys[:S] = x[3:3 + S * E].reshape(S, E)
    assert np.array_equal(Kp[1:-1], keys.reshape(npan, PW, E).transpose(0, 2, 1).ravel())
    assert np.isnan(Kp[0]) and np.isnan(Kp[-1])
    ntiles = -(-S // MR)
    Qp = np.full(ntiles * E * MR + 2, np.nan, np.float32)
    _gemm.pack_q_tiles(x, 3, S, E, Qp, 1, ntiles)
    rows = np.zeros((ntiles * MR, E), np.float32)
    rows[:S] = x[3:3 + S * E].reshape(S, E)
    assert np.array_equal(Qp[1:-1], rows.reshape(ntiles, MR, E).transpose(0, 2, 1).ravel())
    assert np.isnan(Qp[0]) and np.isnan(Qp[-1])


@njit
def _qk_tile(q, k):
    """Q . K^T through the forward's packing and Q.K^T driver (float32)."""
    L, E = q.shape
    S = k.shape[0]
    ntiles = (L + _gemm.MR - 1) // _gemm.MR
    Qp = np.zeros(ntiles * _gemm.MR * E, np.float32)
    _gemm.pack_q_tiles(q.reshape(-1), 0, L, E, Qp, 0, ntiles)
    npan = (S + _gemm.PW - 1) // _gemm.PW
    Kp = np.zeros(npan * E * _gemm.PW, np.float32)
    for p in range(npan):
        _gemm.pack_k_panel(k.reshape(-1), 0, S, E, Kp, 0, p)
    Sb = np.zeros((ntiles * _gemm.MR, npan * _gemm.PW), np.float32)
    _gemm.gemm_qk(Sb, npan * _gemm.PW, Qp, 0, E, ntiles, Kp, 0, 0, npan)
    return Sb[:L, :S]


@pytest.mark.parametrize("E", [1, 16, 33, 64, 128])
def test_qk_tile_exact_enough(E):
    """Scores get blocked summation over the head dim (chunks of 16): RMS error relative to
    sum|q_e k_e| must stay well below one sequential FMA chain's (2.8e-8 at E = 64/128), near
    OpenBLAS's small-matrix path (1.3e-8) that the float32 reference of the tests uses."""
    rng = np.random.default_rng(E)
    q = rng.standard_normal((61, E)).astype(np.float32)
    k = rng.standard_normal((203, E)).astype(np.float32)
    got = _qk_tile(q, k).astype(np.float64)
    exact = q.astype(np.float64) @ k.T.astype(np.float64)
    mag = np.abs(q.astype(np.float64)) @ np.abs(k.T.astype(np.float64))
    rel = (got - exact) / mag
    bound = 3.2e-8 if E <= 16 else 2.4e-8 if E < 64 else 2.0e-8   # E <= 16: a single chunk
    assert np.sqrt((rel ** 2).mean()) < bound


_ROWS_DRIVERS = {}


def _rows_driver(R, W, kind="f32"):
    from fastattn._numba import _dec_rows
    if (R, W, kind) not in _ROWS_DRIVERS:
        _ROWS_DRIVERS[R, W, kind] = _dec_rows._make_rows_driver(R, W, 16 if W == 16 else 8,
                                                                kind)
    return _ROWS_DRIVERS[R, W, kind]


@pytest.mark.parametrize("W", [16, 8])
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("E", [1, 7, 33, 64, 128])
def test_decode_rows_scores_exact_and_same_bits_anywhere(W, R, E):
    """Decode's scores of 1-8 query rows (_dec_rows.py), with AVX-512's 16 lanes and AVX2's
    8 (both built here whatever the CPU): the panel kernel's accuracy bound, nothing written
    outside the block's columns, and each score's bits the same whether its key is scored in
    a group, alone, or at another offset (a paged cache's runs, a block's tail)."""
    drive = _rows_driver(R, W)
    rng = np.random.default_rng(R * 1000 + E)
    n, ldk, ldq = 203, E + 5, E + 3      # 203 keys, as the one-row test above
    kf = rng.standard_normal(2 + n * ldk).astype(np.float32)
    q = rng.standard_normal((R, ldq)).astype(np.float32)
    Sb = np.full((R, n + 7), 7.0, np.float32)
    drive(Sb.reshape(-1), 3, n + 7, kf, 2, ldk, q.reshape(-1), ldq, E, n, kf)
    assert np.all(Sb[:, :3] == 7.0) and np.all(Sb[:, 3 + n:] == 7.0)
    K = np.stack([kf[2 + j * ldk:2 + j * ldk + E] for j in range(n)]).astype(np.float64)
    qd = q[:, :E].astype(np.float64)
    rel = (Sb[:, 3:3 + n] - qd @ K.T) / (np.abs(qd) @ np.abs(K.T))
    bound = 3.2e-8 if E <= 16 else 2.4e-8 if E < 64 else 2.0e-8
    assert np.sqrt((rel ** 2).mean()) < bound
    one = np.full((R, n), 7.0, np.float32)
    for j in range(n):                    # each key alone, from its own offset
        drive(one.reshape(-1), j, n, kf, 2 + j * ldk, ldk, q.reshape(-1), ldq, E, 1, kf)
    np.testing.assert_array_equal(one, Sb[:, 3:3 + n])


def _stored_cache(rng, kind, size):
    """`size` random elements of a low-precision cache as stored (float16 / bfloat16 bits as
    uint16, int8 codes) and the float32 values they hold (int8: float32(code), the scales
    aside). numba reads float16 in place only where the CPU has F16C: skipped elsewhere."""
    from fastattn._numba._intrinsics import HAVE_F16C
    if kind == "f16" and not HAVE_F16C:
        pytest.skip("numba reads float16 in place only where the CPU has F16C")
    x = rng.standard_normal(size).astype(np.float32)
    if kind == "f16":
        stored = x.astype(np.float16).view(np.uint16)
        values = x.astype(np.float16).astype(np.float32)
    elif kind == "bf16":
        stored = (x.view(np.uint32) >> 16).astype(np.uint16)
        values = (stored.astype(np.uint32) << 16).view(np.float32)
    else:
        stored = rng.integers(-127, 128, x.size).astype(np.int8)
        values = stored.astype(np.float32)
    return stored, values


@pytest.mark.parametrize("W", [16, 8])
@pytest.mark.parametrize("kind", ["f16", "bf16", "i8"])
@pytest.mark.parametrize("R,E", [(4, 128), (3, 33), (8, 7), (1, 64)])
def test_decode_rows_scores_of_a_low_precision_cache(W, kind, R, E):
    """The same kernel reading a float16 / bfloat16 / int8 cache in place, converting each
    vector as it loads it: bit for bit the scores of the float32 kernel on the converted keys
    (NumPy's conversion; int8: the float32 kernel on float32(code), times the key's scale, as
    float32), and a key's bits the same alone or in a group."""
    rng = np.random.default_rng(E)
    n, ldk, ldq = 61, E + 9, E
    stored, values = _stored_cache(rng, kind, 2 + n * ldk)
    scales = (rng.random(n) + 0.01).astype(np.float32)
    q = rng.standard_normal((R, ldq)).astype(np.float32)
    got = np.full((R, n), 7.0, np.float32)
    want = np.full((R, n), 7.0, np.float32)
    drive = _rows_driver(R, W, kind)
    drive(got.reshape(-1), 0, n, stored, 2, ldk, q.reshape(-1), ldq, E, n, scales)
    _rows_driver(R, W)(want.reshape(-1), 0, n, values, 2, ldk, q.reshape(-1), ldq, E, n, values)
    if kind == "i8":
        want *= scales
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    one = np.full((R, n), 7.0, np.float32)
    for j in range(n):                    # each key alone, its scale at its own offset
        drive(one.reshape(-1), j, n, stored, 2 + j * ldk, ldk, q.reshape(-1), ldq, E, 1,
              scales[j:])
    np.testing.assert_array_equal(one.view(np.uint32), got.view(np.uint32))


# ----------------------------------------------------------------------------------------------
# the forward and backward kernels with tiny blocks and key chunks: the multi-block paths
# (online rescaling, band edges inside blocks, skipped blocks, chunk partials) at test sizes
# ----------------------------------------------------------------------------------------------
CASES = {
    "plain": dict(),
    "causal_L>S": dict(is_causal=True, L=45, S=30),
    "causal_br": dict(is_causal=True, causal_alignment="bottom_right", L=20, S=61),
    "window": dict(window=(9, 4), causal_alignment="bottom_right"),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "softcap": dict(softcap=2.0, scale_q=3.0),
    "alibi": dict(alibi=True, is_causal=True),
    "dropout": dict(dropout_p=0.4),
    "empty_rows": dict(mask="rows"),
    "nan_masked_kv": dict(mask="padding", nan_tail=True),
}


def _kernel_problem(rng, dtype, case, heads=(2, 6, 2)):
    from fastattn._inputs import make_problem

    c = dict(CASES[case])
    (B, Hq, Hkv), E, Ev = heads, 24, 20
    L, S = c.pop("L", 37), c.pop("S", 53)
    q = rng.standard_normal((B, Hq, L, E)) * c.pop("scale_q", 1.0)
    k, v = rng.standard_normal((B, Hkv, S, E)), rng.standard_normal((B, Hkv, S, Ev))
    kw = dict(enable_gqa=True)
    mask = c.pop("mask", None)
    if mask == "bool":
        kw["attn_mask"] = rng.random((B, 1, L, S)) > 0.4
    elif mask == "float":
        m = rng.standard_normal((1, Hq, L, S))
        m[rng.random(m.shape) < 0.3] = -np.inf
        kw["attn_mask"] = m
    elif mask == "rows":
        m = rng.random((B, Hq, L, S)) > 0.5
        m[:, 1, 5:9] = False
        kw["attn_mask"] = m
    elif mask == "padding":
        kw["attn_mask"] = np.arange(S)[None, None, None, :] < np.array([S - 20, 7])[:, None, None, None]
    kb, vb = k.copy(), v.copy()        # what the kernel gets: NaN/Inf where always masked
    if c.pop("nan_tail", False):
        kb[0, :, S - 20:] = np.nan
        vb[1, :, 7:] = np.inf
    if c.pop("alibi", False):
        kw["alibi_slopes"] = rng.random((B, Hq))
    if c.get("dropout_p"):
        kw["rng"] = 17
    kw.update(c)
    g = rng.standard_normal((B, Hq, L, Ev))
    q, k, v, g, kb, vb = (a.astype(dtype) for a in (q, k, v, g, kb, vb))
    return q, k, v, g, kw, make_problem(q, kb, vb, **kw)


# cases whose band edge cuts through key blocks at many places: the forward's float32 products
# and softmax skip, per micro-tile, the keys past the band (forward.py, dlim)
BAND_CASES = {
    "causal": dict(is_causal=True),
    "causal_br": dict(is_causal=True, causal_alignment="bottom_right", L=150, S=400),
    "causal_L>S": dict(is_causal=True, L=400, S=170),
    "window": dict(window=(50, 20)),
    "causal_bool": dict(is_causal=True, mask="bool"),
    "causal_softcap_dropout": dict(is_causal=True, softcap=3.0, dropout_p=0.3, rng=5),
    # the score pipeline's other passes also stop at a micro-tile's columns (tile_scores, dlim)
    "causal_alibi_float_mask": dict(is_causal=True, mask="float", alibi_slopes=np.array([0.3, 0.05])),
    # NaN/Inf in V rows that only later queries attend: earlier rows must not see them
    "causal_nan_v": dict(is_causal=True, nan_v=True),
}


@pytest.mark.parametrize("blocks", [(32, 64), (128, 64), (64, 192), (256, 512)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(BAND_CASES))
def test_forward_kernel_band_edges_inside_blocks(case, dtype, blocks):
    from helpers import assert_close_to_reference

    from fastattn import reference
    from fastattn._backends._kernel_args import forward_outputs, kernel_args
    from fastattn._inputs import make_problem
    from fastattn._numba import forward as fwd
    from fastattn._tuning import tuning

    c = dict(BAND_CASES[case])
    rng = np.random.default_rng(zlib.crc32(case.encode()) % 1000)
    B, H, E = 1, 2, 40
    L, S = c.pop("L", 300), c.pop("S", 300)
    q, k, v = (rng.standard_normal((B, H, n, E)).astype(dtype) for n in (L, S, S))
    mask = c.pop("mask", None)
    if mask == "bool":
        c["attn_mask"] = rng.random((B, 1, L, S)) > 0.3
    elif mask == "float":
        c["attn_mask"] = rng.standard_normal((B, 1, L, S))
    if c.pop("nan_v", False):
        v[:, 0, 250] = np.nan
        v[:, 1, 201, 3] = np.inf
    p = make_problem(q, k, v, **c)
    out, lse = forward_outputs(p)
    with tuning(block_q=blocks[0], block_k=blocks[1]):
        fwd.forward(kernel_args(p, 2), out, lse)
    with np.errstate(invalid="ignore"):      # 0 * NaN where the reference multiplies weights
        ref_out, ref_lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **c)
        naive_out, naive_lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                                      dtype=dtype, **c)
    if case == "causal_nan_v":
        assert np.isfinite(out[:, 0, :250]).all() and np.isnan(out[:, 0, 250:]).all()
        assert np.array_equal(np.isnan(out), np.isnan(ref_out))
        assert np.array_equal(np.isposinf(out), np.isposinf(ref_out))
        # the rest is compared where the reference is finite
        out, ref_out, naive_out = (np.where(np.isfinite(ref_out), x, 0)
                                   for x in (out, ref_out, naive_out))
    assert_close_to_reference(out, ref_out, naive_out, dtype, "out")
    assert_close_to_reference(lse, ref_lse, naive_lse, dtype, "lse")


@pytest.mark.parametrize("blocks", [(7, 13, 3), (16, 64, 1), (128, 128, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_kernel_blocks_and_chunks(case, dtype, blocks):
    from helpers import assert_close_to_reference

    from fastattn import reference
    from fastattn._backends._kernel_args import kernel_args
    from fastattn._numba import backward as bwd
    from fastattn._tuning import tuning

    # a seed per case that is the same in every process (str hash() is randomized per process)
    rng = np.random.default_rng(zlib.crc32(case.encode()) % 1000)
    q, k, v, g, kw, p = _kernel_problem(rng, dtype, case)
    out, lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, dtype=dtype, **kw)
    out, lse = out.astype(dtype), lse.astype(dtype)
    bq, bk, nchunks = blocks
    res = []
    for _ in range(2):
        dq, dk, dv = np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(v, np.nan)
        with tuning(bwd_block_q=bq, bwd_block_k=bk, bwd_chunks=nchunks):
            args = kernel_args(p, 2)
        bwd.backward(args, g, out, lse, dq, dk, dv, np.zeros(p.q.shape[1], dtype))
        res.append((dq, dk, dv))
    for a, b in zip(*res):
        assert np.array_equal(a, b, equal_nan=True)          # deterministic, bit for bit
    want = reference.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    naive = reference.scaled_dot_product_attention_backward(g, q, k, v, dtype=dtype, **kw)
    for name, a, r, n in zip(("dq", "dk", "dv"), res[0], want, naive):
        assert_close_to_reference(a, r, n, dtype, name)


def _backward_path_spy(monkeypatch, bwd):
    """Records which float32 backward each call of bwd.backward takes: ("kept", plan) for the
    kept-tiles kernel (_bwd_kept.py), ("recompute", plan) for the key-block-outer one."""
    taken = []

    def spy(name, real):
        def call(*args):
            taken.append((name, args[3]))
            return real(*args)
        return call
    monkeypatch.setattr(bwd, "kept_kernel", spy("kept", bwd.kept_kernel))
    monkeypatch.setattr(bwd, "_backward_kernel", spy("recompute", bwd._backward_kernel))
    return taken


@pytest.mark.parametrize("blocks", [(7, 13), (16, 64), (128, 128)])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_kept_tiles_same_bits_as_recomputed(case, blocks, monkeypatch):
    """float32 keeps a query block's S and dP tiles between the sweeps (_bwd_kept.py); past
    tuning.bwd_keep_bytes it recomputes them, key blocks outer. The same blocks, the same score
    code and, with one unit per kv head and one key chunk, every sum in the same order: the
    same bits, NaN and all."""
    from fastattn._backends._kernel_args import kernel_args
    from fastattn._numba import backward as bwd
    from fastattn._tuning import tuning

    rng = np.random.default_rng(zlib.crc32(case.encode()) % 1000 + 7)
    q, k, v, g, kw, p = _kernel_problem(rng, np.float32, case)
    from fastattn import reference
    out, lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    out, lse = out.astype(np.float32), lse.astype(np.float32)
    taken = _backward_path_spy(monkeypatch, bwd)
    res = []
    for keep in (-1, 0):
        dq, dk, dv = np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(v, np.nan)
        with tuning(bwd_block_q=blocks[0], bwd_block_k=blocks[1], bwd_chunks=1,
                    bwd_keep_bytes=keep):
            args = kernel_args(p, 2)
        bwd.backward(args, g, out, lse, dq, dk, dv, np.zeros(p.q.shape[1], np.float32))
        res.append((dq, dk, dv))
    assert [name for name, _ in taken] == ["kept", "recompute"]
    assert taken[0][1].nqc == 1                       # B * Hkv = 4 units for <= 2 threads
    for name, a, b in zip(("dq", "dk", "dv"), *res):
        assert np.array_equal(a, b, equal_nan=True), name


@pytest.mark.parametrize("case", ["plain", "causal_L>S", "causal_br", "window", "bool_mask",
                                  "softcap", "alibi", "dropout"])
def test_backward_kept_tiles_one_kv_head(case, monkeypatch):
    """One kv head for two threads: the kept-tiles backward splits the query blocks among
    several units, each leaving dk/dv partials that are summed in unit order afterwards.
    Against the float64 reference, and the same bits twice."""
    from helpers import assert_close_to_reference

    from fastattn import reference
    from fastattn._backends._kernel_args import kernel_args
    from fastattn._numba import backward as bwd
    from fastattn._tuning import tuning

    rng = np.random.default_rng(zlib.crc32(case.encode()) % 1000 + 11)
    q, k, v, g, kw, p = _kernel_problem(rng, np.float32, case, heads=(1, 3, 1))
    out, lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    out, lse = out.astype(np.float32), lse.astype(np.float32)
    taken = _backward_path_spy(monkeypatch, bwd)
    res = []
    for _ in range(2):
        dq, dk, dv = np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(v, np.nan)
        with tuning(bwd_block_q=8, bwd_block_k=16):
            args = kernel_args(p, 2)
        bwd.backward(args, g, out, lse, dq, dk, dv, np.zeros(p.q.shape[1], np.float32))
        res.append((dq, dk, dv))
    assert [name for name, _ in taken] == ["kept", "kept"] and taken[0][1].nqc > 1
    for a, b in zip(*res):
        assert np.array_equal(a, b, equal_nan=True)
    want = reference.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    naive = reference.scaled_dot_product_attention_backward(g, q, k, v, dtype=np.float32, **kw)
    for name, a, r, n in zip(("dq", "dk", "dv"), res[0], want, naive):
        assert_close_to_reference(a, r, n, np.float32, name)


def test_backward_keep_bytes_must_not_be_below_minus_one():
    from fastattn._backends._kernel_args import kernel_args
    from fastattn._numba import backward as bwd
    from fastattn._tuning import tuning

    q, k, v, g, kw, p = _kernel_problem(np.random.default_rng(0), np.float32, "plain")
    grads = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    with tuning(bwd_keep_bytes=-2):
        args = kernel_args(p, 2)
    with pytest.raises(ValueError, match="bwd_keep_bytes must be >= 0.*got -2"):
        bwd.backward(args, g, g, g[..., 0], *grads, np.zeros(6, np.float32))


# (case, seed, blocks, gradient) where the backward kernel broke the float32 rule while it took
# P = exp(s - lse) and D = rowsum(dO * O) from the given (float32) lse and out: the lse's
# rounding scaled whole rows of P (dv 1.2-1.3x the bound), out's error reached dS through D
# (dq/dk up to 1.8x). Now Z = sum_j P and D = sum_j P dP come from the kernel's own tiles.
BACKWARD_REGRESSIONS = [
    ("dropout", 188, (7, 13, 3), "dk"),
    ("dropout", 62, (16, 64, 1), "dq"),
    ("plain", 188, (16, 64, 1), "dq"),
    ("window", 186, (16, 64, 1), "dv"),
    ("float_mask", 0, (128, 128, 2), "dv"),
    ("nan_masked_kv", 45, (7, 13, 3), "dv"),
    ("empty_rows", 68, (128, 128, 2), "dk"),
]


@pytest.mark.parametrize("case, seed, blocks, grad", BACKWARD_REGRESSIONS)
def test_backward_kernel_float32_regressions(case, seed, blocks, grad):
    from helpers import assert_close_to_reference

    from fastattn import reference
    from fastattn._backends._kernel_args import kernel_args
    from fastattn._numba import backward as bwd
    from fastattn._tuning import tuning

    dtype = np.float32
    q, k, v, g, kw, p = _kernel_problem(np.random.default_rng(seed), dtype, case)
    out, lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, dtype=dtype, **kw)
    out, lse = out.astype(dtype), lse.astype(dtype)
    bq, bk, nchunks = blocks
    dq, dk, dv = np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(v, np.nan)
    with tuning(bwd_block_q=bq, bwd_block_k=bk, bwd_chunks=nchunks):
        bwd.backward(kernel_args(p, 2), g, out, lse, dq, dk, dv, np.zeros(p.q.shape[1], dtype))
    i = ("dq", "dk", "dv").index(grad)
    want = reference.scaled_dot_product_attention_backward(g, q, k, v, **kw)[i]
    naive = reference.scaled_dot_product_attention_backward(g, q, k, v, dtype=dtype, **kw)[i]
    assert_close_to_reference((dq, dk, dv)[i], want, naive, dtype, grad)


@pytest.mark.parametrize("Ev", [7, 64, 128, 200])
def test_decode_pv_one_row_tile_same_bits(Ev):
    """MHA decode's P.V runs a 1-row tile (the MR-row tile spent its other rows on padding). It
    must give row 0 the same FMA chain, so the same bits, as the MR-row tile, and leave the
    accumulator's padding rows alone."""
    rng = np.random.default_rng(Ev)
    n, Bk = 1000, 1024
    Pb = np.zeros((_gemm.MR, Bk), np.float32)
    Pb[0, :n] = rng.random(n)
    v = rng.standard_normal(n * Ev).astype(np.float32)
    start = rng.standard_normal((_gemm.MR, Ev)).astype(np.float32)
    tile, row = start.copy(), start.copy()
    _gemm.gemm_pv_stream(tile, Ev, Pb, Bk, 0, v, 0, Ev, Ev, n, 1)
    _gemm.gemm_pv_stream_row(row, Ev, Pb, Bk, 0, v, 0, Ev, Ev, n, 1)
    assert np.array_equal(row[0], tile[0])
    assert np.array_equal(row[1:], start[1:])
    exact = start[0] + Pb[0, :n].astype(np.float64) @ v.reshape(n, Ev)
    assert np.abs(row[0] - exact).max() < 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize("kind", ["f16", "bf16", "i8"])
@pytest.mark.parametrize("R,Ev", [(1, 128), (4, 64), (6, 33), (12, 7)])
def test_decode_pv_reading_a_low_precision_cache_in_place(kind, R, Ev):
    """Decode's P.V over a float16 / bfloat16 / int8 cache's values where they are, each vector
    converted as it is loaded (every tile shape: 1 row, 4-row tiles, MR-row tiles): bit for bit
    the float32 P.V on the converted values (int8: on float32(code), the scales being the
    caller's, folded into P), continued from acc, rows ldv apart, the padding rows untouched."""
    rng = np.random.default_rng(R * 1000 + Ev)
    n, Bk, ldv, voff = 203, 256, Ev + 5, 3
    Rp = -(-R // _gemm.MR) * _gemm.MR
    Pb = np.zeros((Rp, Bk), np.float32)
    Pb[:R, :n] = rng.random((R, n))
    stored, values = _stored_cache(rng, kind, voff + n * ldv)
    start = rng.standard_normal((Rp, Ev)).astype(np.float32)
    got, want = start.copy(), start.copy()
    {"f16": _gemm.dec_pv_f16, "bf16": _gemm.dec_pv_bf16, "i8": _gemm.dec_pv_i8}[kind](
        got, Ev, Pb, Bk, 0, stored, voff, ldv, Ev, n, R)
    _gemm.dec_pv(want, Ev, Pb, Bk, 0, values, voff, ldv, Ev, n, R)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(got[R:], start[R:])
    V = np.stack([values[voff + j * ldv:voff + j * ldv + Ev] for j in range(n)])
    exact = start[:R] + Pb[:R, :n].astype(np.float64) @ V
    assert np.abs(got[:R] - exact).max() < 1e-4 * np.abs(exact).max()


# ----------------------------------------------------------------------------------------------
# attention sinks: one logit per query head in the softmax denominator only
# ----------------------------------------------------------------------------------------------
def _dense_with_sinks(q, k, v, dout, sinks, scale, softcap, keep, dt):
    """Attention with the sinks as an extra key column whose value row is zero, written densely
    in dtype dt (float64: the reference; float32: the naive computation of the tolerance rule).
    keep: bool, broadcastable to (B, Hq, L, S). Returns out, lse, dq, dk, dv, dsinks."""
    q, k, v, dout, sinks = (np.asarray(x, dt) for x in (q, k, v, dout, sinks))
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    g = Hq // Hkv
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    raw = dt(scale) * (q @ kr.swapaxes(-1, -2))
    s = dt(softcap) * np.tanh(raw / dt(softcap)) if softcap else raw
    s = np.where(keep, s, dt(-np.inf))
    col = np.broadcast_to(sinks[None, :, None, None], (B, Hq, L, 1))
    ext = np.concatenate([s, col], axis=-1)
    mx = ext.max(-1, keepdims=True)
    w = np.exp(ext - mx)
    tot = w.sum(-1, keepdims=True)
    P = w / tot
    lse = (mx + np.log(tot))[..., 0]
    out = P[..., :S] @ vr
    dP = np.concatenate([dout @ vr.swapaxes(-1, -2), np.zeros_like(col)], axis=-1)
    D = (P * dP).sum(-1, keepdims=True)
    dS = P * (dP - D)                   # the sink column: -P_sink * D
    dsinks = dS[..., S].sum(axis=(0, 2))
    dS = dS[..., :S]
    if softcap:
        dS = dS * (1 - np.tanh(raw / dt(softcap)) ** 2)
    dq = dt(scale) * (dS @ kr)
    dk = dt(scale) * (dS.swapaxes(-1, -2) @ q).reshape(B, Hkv, g, S, E).sum(2)
    dv = (P[..., :S].swapaxes(-1, -2) @ dout).reshape(B, Hkv, g, S, Ev).sum(2)
    return out, lse, dq, dk, dv, dsinks


SINK_CASES = {
    # name: (L, S, options); the forward runs with small blocks, so several key blocks per row
    "tiled": (37, 53, dict()),
    "causal_softcap": (45, 30, dict(is_causal=True, softcap=2.0)),
    "masked_rows": (29, 41, dict(mask="rows")),
    "decode": (1, 300, dict()),
    "decode_rows3_causal_br": (3, 200, dict(is_causal=True, causal_alignment="bottom_right")),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(SINK_CASES))
def test_sinks_forward_decode_backward_against_dense(case, dtype):
    """Sinks in the forward (several key blocks per row), decode (keys split in chunks) and the
    backward (key chunks) against a dense computation with the sink as a key of zero value:
    out, lse (which includes the sink), dq, dk, dv and dsinks; a fully masked row gives out 0 and
    lse = the sink exactly."""
    from helpers import assert_close_to_reference

    from fastattn._backends._kernel_args import forward_outputs, kernel_args
    from fastattn._inputs import make_problem
    from fastattn._numba import backward as bwd
    from fastattn._numba import decode as dec
    from fastattn._numba import forward as fwd
    from fastattn._tuning import tuning

    L, S, opt = SINK_CASES[case]
    opt = dict(opt)
    rng = np.random.default_rng(zlib.crc32(case.encode()) % 1000)
    B, Hq, Hkv, E, Ev = 2, 4, 2, 24, 20
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    dout = rng.standard_normal((B, Hq, L, Ev)).astype(dtype)
    # one sink far above every score (it takes nearly all the weight), one far below
    sinks = np.array([0.7, -1.3, 25.0, -40.0], dtype)
    keep = np.ones((1, 1, L, S), bool)
    kw = dict(enable_gqa=True)
    if opt.pop("mask", None) == "rows":
        m = rng.random((B, Hq, L, S)) > 0.4
        m[:, :, 3:6] = False
        kw["attn_mask"] = keep = m
    if opt.get("is_causal"):
        off = S - L if opt.get("causal_alignment") == "bottom_right" else 0
        keep = keep & (np.arange(S)[None, :] <= np.arange(L)[:, None] + off)
    kw.update(opt)
    p = make_problem(q, k, v, **kw)
    p.sinks = sinks          # what make_problem(..., sinks=) sets (its API lands separately)
    ref = _dense_with_sinks(q, k, v, dout, sinks, p.scale, p.softcap, keep, np.float64)
    naive = _dense_with_sinks(q, k, v, dout, sinks, p.scale, p.softcap, keep, dtype)

    kernels = [("forward", fwd.forward, dict(block_q=16, block_k=32))]
    if L <= 16:
        kernels.append(("decode", dec.decode, dict(decode_block_k=64)))
    for name, kernel, blocks in kernels:
        out, lse = forward_outputs(p)
        with tuning(**blocks):
            kernel(kernel_args(p, 2), out, lse)
        assert_close_to_reference(out, ref[0], naive[0], dtype, f"{name} out")
        assert_close_to_reference(lse, ref[1], naive[1], dtype, f"{name} lse")
        if case == "masked_rows":
            assert np.all(out[:, :, 3:6] == 0)
            assert np.array_equal(lse[:, :, 3:6], np.broadcast_to(sinks[None, :, None], (B, Hq, 3)))

    out, lse = ref[0].astype(dtype), ref[1].astype(dtype)
    grads = np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(v, np.nan)
    dsinks = np.zeros(Hq, dtype)
    with tuning(bwd_block_q=16, bwd_block_k=32, bwd_chunks=2):
        bwd.backward(kernel_args(p, 2), dout, out, lse, *grads, dsinks)
    for got, r, n, name in zip(grads + (dsinks,), ref[2:], naive[2:], ("dq", "dk", "dv", "dsinks")):
        assert_close_to_reference(got, r, n, dtype, name)


# ----------------------------------------------------------------------------------------------
# issue 14: large finite scores, NaN in never-attended keys under softcap, tiny softcaps
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("L", [1, 5])          # decode and the tiled forward
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_scale_gives_the_one_hot_answer(dtype, L):
    """scale=1e10 on the issue's two keys: scores 2.6e10 and -1.2e10, so all the weight sits on
    key 0. The weights were 2**(x*c - m) with x*c - m one FMA: at the row max that is the
    rounding error of m, which at |m| ~ 4e10 is up to 2**11 in log2 units, so the max's weight
    under- or overflowed (out NaN or 0, lse -inf). The weight at the max must be exactly 1."""
    import fastattn as fa

    q = np.tile(np.array([1.0, -0.62], dtype), (1, 1, L, 1))
    k = np.array([[[[1.82, -1.32], [-0.66, 0.94]]]], dtype)
    v = np.array([[[[1.0], [2.0]]]], dtype)
    out, lse = fa.scaled_dot_product_attention(q, k, v, scale=1e10, return_lse=True,
                                               backend="numba")
    assert np.all(out == 1.0)
    s0 = 1e10 * (1.82 * 1.0 + -0.62 * -1.32)
    np.testing.assert_allclose(lse, s0, rtol=1e-6)


@pytest.mark.parametrize("mag", [3e4, 1e5])
@pytest.mark.parametrize("L", [2, 40])
def test_large_float32_inputs_follow_the_tolerance_rule(L, mag):
    """float32 q, k of magnitude 3e4-1e5 (|q.k| ~ 1e9-1e11, far from overflow): finite results
    within the tolerance rule of the float64 reference (they were NaN rows, or 0 with lse -inf).
    Same for float64 at magnitude 1e10."""
    from helpers import check_sdpa

    rng = np.random.default_rng(L)
    for dtype, m in ((np.float32, mag), (np.float64, 1e10)):
        q = (rng.standard_normal((1, 2, L, 16)) * m).astype(dtype)
        k = (rng.standard_normal((1, 2, 60, 16)) * m).astype(dtype)
        v = rng.standard_normal((1, 2, 60, 8)).astype(dtype)
        out, lse = check_sdpa(q, k, v, "numba")
        assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_softcap_float64_backward_ignores_nan_in_unattended_keys():
    """Causal, L=4 < S=8: keys 4-7 are attended by no query. A NaN at key 6 went through
    softcap's derivative (1 - tanh(NaN)**2 = NaN) and 0 * NaN into dq and dk."""
    import fastattn as fa

    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 4, 8))
    k = rng.standard_normal((1, 1, 8, 8))
    v = rng.standard_normal((1, 1, 8, 8))
    k[0, 0, 6] = np.nan
    kw = dict(is_causal=True, softcap=3.0, backend="numba")
    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = fa.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse,
                                                          **kw)
    assert np.isfinite(out).all()
    assert np.isfinite(dq).all() and np.isfinite(dv).all()
    assert np.isfinite(dk).all() and np.all(dk[0, 0, 4:] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("softcap", [1e-300, 1e-40, 1e300])
def test_extreme_softcaps_compute_instead_of_raising(softcap, dtype):
    """A softcap that underflows the compute dtype (1e-300 in float32 became 0, and the kernel
    divided by it: ZeroDivisionError surfacing as SystemError) makes every score 0: uniform
    weights, as the math says. One that overflows it (1e300 in float32: inf) caps nothing.
    The kernels are called directly: the API may reject such softcaps before they get here."""
    from fastattn import reference
    from fastattn._backends._kernel_args import forward_outputs, kernel_args
    from fastattn._inputs import make_problem
    from fastattn._numba import backward as bwd
    from fastattn._numba import forward as fwd

    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(dtype) for n in (5, 9, 9))
    p = make_problem(q, k, v, softcap=1.0)
    p.softcap = softcap
    out, lse = forward_outputs(p)
    fwd.forward(kernel_args(p, 2), out, lse)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    bwd.backward(kernel_args(p, 2), np.ones_like(out), out, lse, dq, dk, dv,
                 np.zeros(2, dtype))
    if softcap < 1e-30:          # |capped score| <= softcap: every score is 0 in effect
        np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape),
                                   rtol=1e-5)
        np.testing.assert_allclose(lse, np.log(9), rtol=1e-6)
    elif softcap > 1e200:                         # no cap
        want = reference.scaled_dot_product_attention(q, k, v)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=1e-6)
    for a in (out, lse, dq, dk, dv):
        assert np.isfinite(a).all()


# ----------------------------------------------------------------------------------------------
# issue 14, the backward's formulation: each row's own max, Z and D from the kernel's tiles
# (the classes KNOWN_DEFECTS listed as large_scores, backward_one_key_not_zero,
# backward_D_cancellation, dropout_backward, softcap_swallows_nan)
# ----------------------------------------------------------------------------------------------
def _numba_grads_vs_reference(q, k, v, g, **kw):
    """numba's gradients against the float64 reference under the tolerance rule; returns them."""
    import fastattn as fa
    from fastattn import reference
    from helpers import assert_close_to_reference

    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, backend="numba", **kw)
    got = fa.scaled_dot_product_attention_backward(g, q, k, v, out, lse, backend="numba", **kw)
    low = np.float64 if q.dtype == np.float64 else np.float32
    with np.errstate(all="ignore"):
        want = reference.scaled_dot_product_attention_backward(g, q, k, v, **kw)
        naive = reference.scaled_dot_product_attention_backward(g, q, k, v, dtype=low, **kw)
    for name, a, r, n in zip(("dq", "dk", "dv"), got, want, naive):
        assert_close_to_reference(a, r, n, low, name)
    return got


@pytest.mark.parametrize("dtype,mag", [(np.float32, 3e4), (np.float32, 1e10),
                                       (np.float64, 1e10), (np.float64, 1e30)])
@pytest.mark.parametrize("L,S", [(1, 1), (3, 17), (5, 40)])
def test_backward_large_scores_follow_the_tolerance_rule(dtype, mag, L, S):
    """Scores of |q.k| ~ 1e9 and beyond (float32 q, k ~ 3e4; float64 ~ 1e10 .. 1e30, where
    |score| reaches 1e60): P = 2**(S*c - lse/kappa) with the forward's rounded lse gave whole
    rows of weights that over- or underflowed (dv off by O(1), dq of 1e7 .. 1e20 where the
    reference's is ~0). The rows are one-hot: dv = the attended rows' dout, dq = dk = 0."""
    rng = np.random.default_rng(int(L * 100 + S))
    q = (rng.standard_normal((2, 4, L, 3)) * mag).astype(dtype)
    k = (rng.standard_normal((2, 2, S, 3)) * mag).astype(dtype)
    v = rng.standard_normal((2, 2, S, 8)).astype(dtype)
    g = rng.standard_normal((2, 4, L, 8)).astype(dtype)
    for kw in ({}, dict(is_causal=True, causal_alignment="bottom_right"),
               dict(dropout_p=0.2, rng=5)):
        _numba_grads_vs_reference(q, k, v, g, enable_gqa=True, **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_rows_on_one_key_have_exactly_zero_dq_dk(dtype):
    """Where a row attends one key its weight is 1 whatever the scores: dq = dk = 0 exactly
    (the reference and torch give 0). P = 2**(x*c - lse/kappa) was 1 only up to lse's rounding,
    and D = (P dP)/P then missed dP by an ulp in float64: dq ~1e-15, times |k| and the scale,
    and ~1e-7 in float32 with dropout. Also with |v| ~ 1e30, where that ulp is ~1e14."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 6, 8)).astype(dtype)
    k = rng.standard_normal((2, 3, 7, 8)).astype(dtype)
    g = rng.standard_normal((2, 3, 6, 5)).astype(dtype)
    mask = np.zeros((6, 7), bool)
    mask[np.arange(6), rng.integers(0, 7, 6)] = True
    import fastattn as fa

    for vmag in (3.4, 1e30 if dtype == np.float64 else 1e15):
        v = (rng.standard_normal((2, 3, 7, 5)) * vmag).astype(dtype)
        for kw in (dict(attn_mask=mask), dict(attn_mask=mask, softcap=2.0),
                   dict(attn_mask=mask, dropout_p=0.3, rng=4), dict(scale=1e3, attn_mask=mask),
                   dict(is_causal=True, window=(0, 0))):
            out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, backend="numba",
                                                       **kw)
            dq, dk, dv = fa.scaled_dot_product_attention_backward(g, q, k, v, out, lse,
                                                                  backend="numba", **kw)
            assert not dq.any() and not dk.any(), (vmag, kw)
            assert np.isfinite(dv).all()


def test_known_defect_reproducers_of_the_backward():
    """The reproducers KNOWN_DEFECTS carried for numba's backward, under the tolerance rule."""
    rng = np.random.default_rng(11)
    # dropout_backward: dq ~1e13 where the reference gives 0 (rows of batch 1 attend one key)
    q = (rng.standard_normal((2, 2, 1, 1)) * 1e-10).astype(np.float32)
    k = rng.standard_normal((2, 2, 70, 1)).astype(np.float32)
    v = rng.standard_normal((2, 2, 70, 1)).astype(np.float32)
    g = rng.standard_normal((2, 2, 1, 1)).astype(np.float32)
    _numba_grads_vs_reference(q, k, v, g, is_causal=True, window=(1, None), dropout_p=0.2,
                              rng=9)
    # backward_D_cancellation: float64, |v| ~ 3e30, q, k ~ 25, scale 0.3, S = 3 (dq error 2.3e15)
    q = rng.standard_normal((1, 2, 4, 8)) * 25
    k = rng.standard_normal((1, 2, 3, 8)) * 25
    v = rng.standard_normal((1, 2, 3, 8)) * 3e30
    g = rng.standard_normal((1, 2, 4, 8))
    _numba_grads_vs_reference(q, k, v, g, scale=0.3)
    # ... and q (1,3,33,8), k (1,1,8,8), GQA, causal bottom_right, float mask (dq 2.6e-10)
    q, k, v = (rng.standard_normal(s) for s in ((1, 3, 33, 8), (1, 1, 8, 8), (1, 1, 8, 8)))
    g = rng.standard_normal((1, 3, 33, 8))
    mask = rng.standard_normal((33, 8)) * 2
    mask[rng.random((33, 8)) < 0.2] = -np.inf
    _numba_grads_vs_reference(q, k, v, g, enable_gqa=True, is_causal=True,
                              causal_alignment="bottom_right", attn_mask=mask)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("L", [1, 8])               # decode and the tiled forward
def test_softcap_keeps_nan_scores_nan(dtype, L):
    """tanh(NaN) must stay NaN: float32's tanh clamped |x| >= 10 with `ax < 10`, false for NaN,
    so a NaN in an attended q gave a finite row of +-softcap scores (the reference: NaN)."""
    import fastattn as fa

    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, L, 4)).astype(dtype)
    k = rng.standard_normal((1, 2, 5, 4)).astype(dtype)
    v = rng.standard_normal((1, 2, 5, 3)).astype(dtype)
    q[0, 1, L - 1, 2] = np.nan
    out, lse = fa.scaled_dot_product_attention(q, k, v, softcap=0.5, return_lse=True,
                                               backend="numba")
    assert np.isnan(out[0, 1, L - 1]).all() and np.isnan(lse[0, 1, L - 1])
    assert np.isfinite(np.delete(out.reshape(-1, 3), 2 * L - 1, axis=0)).all()
    k[0, 0, 3, 1] = np.nan                           # every row of head 0 attends key 3
    out = fa.scaled_dot_product_attention(q, k, v, softcap=0.5, backend="numba")
    assert np.isnan(out[0, 0]).all()


def test_tanh_f32_propagates_nan():
    x = np.array([np.nan, np.inf, -np.inf, 20.0, -0.3], np.float32)
    o = np.empty_like(x)
    _apply(_exp.tanh_f32, x, o)
    assert np.isnan(o[0]) and o[1] == 1 and o[2] == -1 and o[3] == 1
    assert abs(o[4] - np.tanh(np.float32(-0.3))) < 1e-7


# ----------------------------------------------------------------------------------------------
# issues 13/17: the dropout hash's position offsets (Problem.dropout_origin) and the partial-keys
# backward (Problem.delta) in numba's forward, decode and backward
# ----------------------------------------------------------------------------------------------
def _nb():
    """The numba backend, loaded (registry entries load on first use of `available`)."""
    from fastattn._backends import registry

    be = registry["numba"]
    assert be.available, be.reason
    return be


@pytest.mark.parametrize("L,Hq", [(3, 4), (29, 4)])     # decode (L*G <= 64) and the tiled forward
def test_dropout_origin_gives_the_pieces_kept_set(L, Hq):
    """A piece at (batch*heads 1*8+2.., rows 5.., keys 7..) of a larger problem keeps exactly the
    weights the hash gives there (V = identity exposes them); the backward regenerates the same
    set (numba's gradients equal numpy's, which reads the same offsets)."""
    from fastattn import _dropout
    from fastattn._backends import registry
    from fastattn._inputs import make_problem

    rng = np.random.default_rng(L)
    S, p_drop = 41, 0.5
    q = rng.standard_normal((2, Hq, L, 8))
    k = rng.standard_normal((2, 2, S, 8))
    v = np.broadcast_to(np.eye(S), (2, 2, S, S)).copy()
    origin = (1 * 8 + 2, 8, 5, 7)
    p = make_problem(q, k, v, dropout_p=p_drop, rng=1234, enable_gqa=True)
    p.dropout_origin = origin
    want = _dropout.piece_keep(p.seed, p_drop, origin, np.arange(2)[:, None, None, None],
                               np.arange(Hq)[None, :, None, None], np.arange(L)[:, None],
                               np.arange(S)[None, :])
    out, lse = _nb().forward(p)
    assert np.array_equal(out != 0, want)
    whole = make_problem(q, k, v, dropout_p=p_drop, rng=1234, enable_gqa=True)
    assert not np.array_equal(_nb().forward(whole)[0] != 0, want)
    # the backward's kept set: the same gradients as numpy's (within float64's 1e-10)
    v = rng.standard_normal((2, 2, S, 5))
    p = make_problem(q, k, v, dropout_p=p_drop, rng=1234, enable_gqa=True)
    p.dropout_origin = origin
    out, lse = registry["numpy"].forward(p)
    g = rng.standard_normal(out.shape)
    got = _nb().backward(p, g, out, lse)
    ref = registry["numpy"].backward(p, g, out, lse)
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], ref[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10, err_msg=name)


def _key_parts_backward(p_whole, g, out, lse, cuts, causal):
    """numba's backward of the key parts [c0, c1) of Problem p_whole, each with the whole
    problem's lse and D = rowsum(g * out) (Problem.delta) and the whole problem's band moved
    into the part (fastattn._parts, as fastattn.dask does): (dq summed, dk, dv concatenated)."""
    import dataclasses

    from fastattn import _parts

    L, S = p_whole.q.shape[2], p_whole.k.shape[2]
    band = _parts.global_band(L, S, causal, "top_left", (None, None))
    delta = _parts.row_delta(g, out, p_whole.dtype)
    dq = np.zeros_like(p_whole.q)
    dks, dvs = [], []
    for c0, c1 in zip(cuts[:-1], cuts[1:]):
        part = dataclasses.replace(p_whole, k=np.ascontiguousarray(p_whole.k[:, :, c0:c1]),
                                   v=np.ascontiguousarray(p_whole.v[:, :, c0:c1]))
        assert _parts.place(part, band, 0, c0, (0, p_whole.q.shape[1], 0, c0)) == 0
        part.delta = delta
        a, b, c, _ = _nb().backward(part, g, out, lse)
        dq += a
        dks.append(b)
        dvs.append(c)
    return dq, np.concatenate(dks, axis=2), np.concatenate(dvs, axis=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_partial_keys_backward_sums_to_the_whole(dtype, causal):
    """has_delta: k/v hold a part of the keys, lse and D belong to the whole problem, P is not
    renormalized by the part's Z. dq summed over 3 key parts and the parts' dk/dv equal the
    whole backward (float64 within 1e-10, float32 within the tolerance rule); without delta
    (each part normalized on its own) they do not."""
    import dataclasses

    from fastattn import reference
    from fastattn._inputs import make_problem
    from helpers import assert_close_to_reference

    rng = np.random.default_rng(17 + causal)
    q = rng.standard_normal((2, 4, 150, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 300, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 300, 8)).astype(dtype)
    kw = dict(enable_gqa=True, is_causal=causal, dropout_p=0.1, rng=3)
    p = make_problem(q, k, v, **kw)
    out, lse = _nb().forward(p)
    g = rng.standard_normal(out.shape).astype(dtype)
    whole = _nb().backward(p, g, out, lse)[:3]
    cuts = (0, 77, 256, 300)           # uneven, one part inside a 128-key block
    got = _key_parts_backward(p, g, out, lse, cuts, causal)
    low = np.float64 if dtype == np.float64 else np.float32
    want = reference.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    naive = reference.scaled_dot_product_attention_backward(g, q, k, v, dtype=low, **kw)
    for name, a, w, r, n in zip(("dq", "dk", "dv"), got, whole, want, naive):
        assert_close_to_reference(a, r, n, low, name)
        if dtype == np.float64:
            np.testing.assert_allclose(a, w, rtol=1e-10, atol=1e-10, err_msg=name)
    # the mode matters: a key part normalized by its own Z gives other gradients
    part = dataclasses.replace(p, k=np.ascontiguousarray(k[:, :, :77]),
                               v=np.ascontiguousarray(v[:, :, :77]))
    own = _nb().backward(part, g, out, lse)[0]
    assert np.abs(own - got[0]).max() > 1e-3


def test_partial_keys_backward_dsinks_from_the_given_lse_and_delta():
    """With sinks and has_delta (the kernel record allows it; the API passes sinks' gradient
    around the kernel), dsinks = -sum_{b,i} exp(sink - lse) * delta: the whole problem's."""
    from fastattn._backends._kernel_args import kernel_args
    from fastattn._inputs import make_problem
    from fastattn._numba import backward as bwd
    from fastattn._parts import row_delta, sink_grad

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (9, 20, 20))
    sinks = rng.standard_normal(2)
    p = make_problem(q, k, v, sinks=sinks)
    out, lse = _nb().forward(p)
    g = rng.standard_normal(out.shape)
    p.delta = row_delta(g, out, p.dtype)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    dsinks = np.zeros(2)
    bwd.backward(kernel_args(p, 2), g, out, lse, dq, dk, dv, dsinks)
    np.testing.assert_allclose(dsinks, sink_grad(sinks, lse, p.delta), rtol=1e-12)
    # with every key in the "part", the given lse and D are the kernel's own: the same gradients
    p.delta = None
    want = _nb().backward(p, g, out, lse)
    for a, b in zip((dq, dk, dv, dsinks), want):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# one parallel region a decode call: the worker finishing a (batch, kv head)'s last key chunk
# merges it (atomic_count), no second region
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["heads_apart", "heads_side_by_side"])
def test_decode_last_chunk_merges_its_group(layout, dtype):
    """Keys split in chunks across two threads: each group's chunks are merged by whichever
    worker finishes its last one. A merge that read a chunk before its partials were written
    (or counters that did not start at 0) would give wrong or varying results: 25 calls must
    give the same bits, close to the float64 reference, with lengths that leave some chunks of
    a sequence empty."""
    from helpers import assert_close_to_reference

    from fastattn import reference
    from fastattn._backends._kernel_args import forward_outputs, kernel_args
    from fastattn._inputs import make_cache_problem
    from fastattn._numba import decode as dec
    from fastattn._tuning import tuning

    rng = np.random.default_rng(11)
    # heads apart, (B, Hkv, S, E): items by kv head, and 3 groups on 2 threads split in 2
    # chunks (decode_chunks); side by side: items take every kv head, 4 chunks a sequence
    B, Hq, Hkv, L, S, E = (3, 4, 1, 2, 4200, 16) if layout == "heads_apart" else (
        3, 6, 3, 2, 4200, 16)
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    if layout == "heads_apart":
        k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
        v = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    else:                             # flash layout read in place: items take every kv head
        k = rng.standard_normal((B, S, Hkv, E)).astype(dtype).transpose(0, 2, 1, 3)
        v = rng.standard_normal((B, S, Hkv, E)).astype(dtype).transpose(0, 2, 1, 3)
    lens = np.array([S, 1500, 7], np.int32)
    p = make_cache_problem(q, k, v, seqlens=lens)
    runs = []
    for _ in range(25):
        out, lse = forward_outputs(p)
        with tuning(decode_block_k=64):
            dec.decode(kernel_args(p, 2), out, lse)
        runs.append((out, lse))
    for out, lse in runs[1:]:
        assert np.array_equal(out, runs[0][0]) and np.array_equal(lse, runs[0][1])
    for b in range(B):
        n = int(lens[b])
        kw = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True,
                  return_lse=True)
        kb, vb = k[b:b + 1, :, :n], v[b:b + 1, :, :n]
        want = reference.scaled_dot_product_attention(q[b:b + 1], kb, vb, **kw)
        naive = reference.scaled_dot_product_attention(q[b:b + 1], kb, vb, dtype=dtype, **kw)
        for got, w, nv, what in zip((runs[0][0][b:b + 1], runs[0][1][b:b + 1]), want, naive,
                                    ("out", "lse")):
            assert_close_to_reference(got, w, nv, dtype, f"{what} of sequence {b}")


def test_parallel_kernels_make_no_hidden_parallel_loops():
    """Under parallel=True numba turns np.zeros / np.ones / np.full (and their _like forms) in
    the kernel's own body into parallel loops: each one more wake and join of the thread pool
    in every call (30-50 us on two threads with the pool waiting passively; the decode kernel
    ran three regions a call for one it needed). The kernels take zeroed counters from
    _intrinsics.counters instead; this reads their source, as numba would."""
    import ast
    import inspect

    from fastattn._numba import _bwd_kept, backward, decode, forward, softmax

    creators = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like"}
    kernels = [forward._forward_kernel, decode._decode_kernel, backward._backward_kernel,
               _bwd_kept.kept_kernel, softmax._softmax_kernel]
    for kern in kernels:
        tree = ast.parse(inspect.getsource(kern.py_func).lstrip())
        fn = tree.body[0]
        assert any(isinstance(d, ast.Call) and any(kw.arg == "parallel" for kw in d.keywords)
                   for d in fn.decorator_list), kern.py_func.__name__
        found = [node.func.attr for node in ast.walk(fn)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr in creators]
        assert not found, f"{kern.py_func.__name__} calls np.{found[0]}"


def test_counters_start_at_zero():
    from fastattn._numba._intrinsics import atomic_count, counters

    @njit
    def count(n, reps):
        c = counters(n)
        last = np.empty(n, np.int64)
        for _ in range(reps):
            for i in range(n):
                last[i] = atomic_count(c, i)
        return c, last

    for n in (1, 5, 64):
        c, last = count(n, 3)
        assert np.array_equal(c, np.full(n, 3)) and np.array_equal(last, np.full(n, 2))


@pytest.mark.parametrize("Hkv", [1, 3])
def test_forward_packs_each_kv_head_where_first_needed(Hkv):
    """float32 K panels are packed by the items that first need them (_pack_head), not in a
    parallel loop of their own: with many small query blocks on few kv heads both workers
    reach a head at once, share its panels and wait for each other's. Every item must see the
    whole head packed: 30 calls give the same bits, close to the float64 reference."""
    from helpers import assert_close_to_reference

    from fastattn import reference
    from fastattn._backends._kernel_args import forward_outputs, kernel_args
    from fastattn._inputs import make_problem
    from fastattn._numba import forward as fwd
    from fastattn._tuning import tuning

    rng = np.random.default_rng(Hkv)
    B, Hq, L, S, E = 2, 6, 200, 1100, 32
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    kw = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
    p = make_problem(q, k, v, **kw)
    runs = []
    for _ in range(30):
        out, lse = forward_outputs(p)
        with tuning(block_q=16, block_k=128):
            fwd.forward(kernel_args(p, 2), out, lse)
        runs.append((out, lse))
    for out, lse in runs[1:]:
        assert np.array_equal(out, runs[0][0]) and np.array_equal(lse, runs[0][1])
    want = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    naive = reference.scaled_dot_product_attention(q, k, v, return_lse=True, dtype=np.float32,
                                                   **kw)
    for got, w, n, what in zip(runs[0], want, naive, ("out", "lse")):
        assert_close_to_reference(got, w, n, np.float32, what)


def test_info_names_the_threading_layer_in_use():
    """numba's "threadsafe" setting runs the kernels on TBB when libtbb loads, else on
    OpenMP: once a kernel has run, the backend's details name the layer numba actually uses."""
    import numba

    import fastattn as fa
    from fastattn._backends import registry

    q = np.ones((1, 2, 64, 16), np.float32)
    fa.scaled_dot_product_attention(q, q, q, backend="numba")
    layer = registry["numba"].info().details["threading_layer"]
    assert layer == numba.threading_layer() and layer in ("omp", "tbb", "workqueue")
