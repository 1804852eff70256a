"""The forward kernel family, every backend, against the float64 reference (the tolerance rule of helpers.py)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import check_sdpa, max_err, randn

import fastattn as fa
from fastattn import reference

SIZES = [(1, 1), (3, 17), (17, 3), (113, 203), (203, 113), (129, 129), (1, 300)]
HEAD_DIMS = [(1, 1), (8, 8), (33, 17), (64, 64), (128, 128)]


def qkv(rng, B=2, Hq=3, Hkv=None, L=17, S=29, E=16, Ev=None, dtype=np.float32, batch=None):
    Hkv = Hq if Hkv is None else Hkv
    Ev = E if Ev is None else Ev
    lead = (B,) if batch is None else batch
    return (randn(rng, lead + (Hq, L, E), dtype), randn(rng, lead + (Hkv, S, E), dtype),
            randn(rng, lead + (Hkv, S, Ev), dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("L,S", SIZES)
def test_sizes(backend, rng, L, S, dtype):
    q, k, v = qkv(rng, L=L, S=S, E=24, Ev=20, dtype=dtype)
    check_sdpa(q, k, v, backend)
    check_sdpa(q, k, v, backend, is_causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("E,Ev", HEAD_DIMS)
def test_head_dims(backend, rng, E, Ev, dtype):
    q, k, v = qkv(rng, B=1, Hq=2, L=70, S=130, E=E, Ev=Ev, dtype=dtype)
    check_sdpa(q, k, v, backend)


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 1), (8, 8), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(backend, rng, Hq, Hkv, causal):
    q, k, v = qkv(rng, Hq=Hq, Hkv=Hkv, L=33, S=65, E=32)
    check_sdpa(q, k, v, backend, enable_gqa=True, is_causal=causal)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(40, 40), (16, 80), (80, 16), (1, 257), (257, 1), (100, 300)])
def test_causal_alignments(backend, rng, alignment, L, S):
    q, k, v = qkv(rng, L=L, S=S, E=32)
    out, _ = check_sdpa(q, k, v, backend, is_causal=True, causal_alignment=alignment)
    # the same thing spelled as an explicit mask
    mask = fa.causal_mask(L, S, alignment=alignment)
    explicit = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    np.testing.assert_allclose(out, explicit, rtol=0, atol=2e-6)


@pytest.mark.parametrize("window", [(0, 0), (5, 0), (7, 3), (None, 4), (10, None), (-1, 2)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_sliding_window(backend, rng, window, alignment):
    q, k, v = qkv(rng, L=90, S=150, E=16)
    check_sdpa(q, k, v, backend, window=window, causal_alignment=alignment)
    check_sdpa(q, k, v, backend, window=window, causal_alignment=alignment, is_causal=True)


def _masks(rng, B, H, L, S):
    return {
        "bool_full": rng.random((B, H, L, S)) > 0.3,
        "bool_LS": rng.random((L, S)) > 0.5,
        "bool_heads": rng.random((1, H, 1, S)) > 0.4,
        "bool_rows": rng.random((B, 1, L, 1)) > 0.2,
        "padding": fa.padding_mask(np.array([S - 5, 1][:B]), S),
        "float_full": rng.standard_normal((B, H, L, S)),
        "float_LS": rng.standard_normal((L, S)),
        "float_neginf": np.where(rng.random((B, 1, L, S)) > 0.5, 0.0, -np.inf),
        "float32": rng.standard_normal((1, S)).astype(np.float32),
    }


@pytest.mark.parametrize("kind", list(_masks(np.random.default_rng(0), 2, 3, 4, 5)))
@pytest.mark.parametrize("causal", [False, True])
def test_masks(backend, rng, kind, causal):
    B, H, L, S = 2, 3, 37, 71
    q, k, v = qkv(rng, B=B, Hq=H, L=L, S=S, E=16)
    mask = _masks(rng, B, H, L, S)[kind]
    check_sdpa(q, k, v, backend, attn_mask=mask, is_causal=causal)


def test_mask_with_extra_batch_dims(backend, rng):
    q, k, v = qkv(rng, Hq=2, L=19, S=23, E=8, batch=(2, 3))
    check_sdpa(q, k, v, backend, attn_mask=rng.random((2, 1, 1, 19, 23)) > 0.3)
    check_sdpa(q, k, v, backend, attn_mask=rng.random((3, 2, 19, 23)) > 0.3)
    check_sdpa(q, k, v, backend, attn_mask=rng.standard_normal((2, 3, 2, 1, 23)))


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
def test_softcap(backend, rng, softcap):
    q, k, v = qkv(rng, L=50, S=64, E=32)
    check_sdpa(q * 3, k * 3, v, backend, softcap=softcap)
    check_sdpa(q, k, v, backend, softcap=softcap, is_causal=True, attn_mask=rng.random((50, 64)) > 0.2)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_alibi(backend, rng, per_batch, alignment):
    B, H = 2, 4
    q, k, v = qkv(rng, B=B, Hq=H, Hkv=2, L=45, S=77, E=16)
    slopes = 2.0 ** -np.arange(1, H + 1) if not per_batch else rng.random((B, H))
    check_sdpa(q, k, v, backend, alibi_slopes=slopes, causal_alignment=alignment, enable_gqa=True)
    check_sdpa(q, k, v, backend, alibi_slopes=slopes, causal_alignment=alignment, enable_gqa=True,
               is_causal=True, softcap=3.0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_matches_reference(backend, rng, p):
    q, k, v = qkv(rng, Hq=4, Hkv=2, L=40, S=90, E=16)
    check_sdpa(q, k, v, backend, dropout_p=p, rng=1234, enable_gqa=True)
    check_sdpa(q, k, v, backend, dropout_p=p, rng=99, is_causal=True, enable_gqa=True)


def test_dropout_statistics_and_determinism(backend, rng):
    """The kept fraction is 1-p, the same seed gives the same bits, a different one differs."""
    L = S = 64
    q = np.zeros((1, 1, L, 4), np.float32)          # uniform weights 1/S
    k = np.zeros((1, 1, S, 4), np.float32)
    v = np.eye(S, dtype=np.float32)[None, None]     # out[i, j] = kept_ij / ((1-p) S)
    p = 0.3
    a = fa.scaled_dot_product_attention(q, k, v, dropout_p=p, rng=7, backend=backend)
    b = fa.scaled_dot_product_attention(q, k, v, dropout_p=p, rng=7, backend=backend)
    c = fa.scaled_dot_product_attention(q, k, v, dropout_p=p, rng=8, backend=backend)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    kept = a[0, 0] > 0
    np.testing.assert_allclose(a[0, 0][kept], 1.0 / ((1 - p) * S), rtol=1e-5)
    assert abs(kept.mean() - (1 - p)) < 0.03


def test_fully_masked_rows(backend, rng):
    B, H, L, S = 2, 2, 12, 20
    q, k, v = qkv(rng, B=B, Hq=H, L=L, S=S, E=8)
    mask = rng.random((B, H, L, S)) > 0.5
    mask[0, 1, 3] = False
    mask[1, :, 7:] = False
    out, lse = check_sdpa(q, k, v, backend, attn_mask=mask)
    assert np.all(out[0, 1, 3] == 0) and np.all(out[1, :, 7:] == 0)
    assert np.isneginf(lse[0, 1, 3]) and np.all(np.isneginf(lse[1, :, 7:]))
    fmask = np.where(mask, 0.0, -np.inf)
    out2, lse2 = check_sdpa(q, k, v, backend, attn_mask=fmask)
    assert np.all(out2[1, :, 7:] == 0) and not np.isnan(out2).any()
    # bottom-right causal with L > S: the top rows see no key
    q2, k2, v2 = qkv(rng, L=30, S=10, E=8)
    out3, lse3 = check_sdpa(q2, k2, v2, backend, is_causal=True, causal_alignment="bottom_right")
    assert np.all(out3[:, :, :20] == 0) and np.all(np.isneginf(lse3[:, :, :20]))


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_nonfinite_in_masked_keys_does_not_leak(backend, rng, poison):
    """A KV cache whose unused tail holds garbage: padding masks it for every query."""
    B, H, L, S, valid = 2, 2, 9, 150, 100
    q, k, v = qkv(rng, B=B, Hq=H, L=L, S=S, E=16)
    k[:, :, valid:] = poison
    v[:, :, valid:] = poison
    mask = fa.padding_mask(np.array([valid, valid - 30]), S)
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    assert np.isfinite(out).all()
    ref = reference.scaled_dot_product_attention(q[..., :valid, :], k[..., :valid, :], v[..., :valid, :],
                                                    attn_mask=mask[..., :valid])
    np.testing.assert_allclose(out, ref, atol=2e-6)
    # bottom-right causal decode over a cache with a poisoned future
    out2 = fa.scaled_dot_product_attention(q[:, :, :1], k, v, attn_mask=mask, backend=backend,
                                           is_causal=True, causal_alignment="bottom_right")
    assert np.isfinite(out2).all()


def test_nan_in_an_attended_key_propagates(backend, rng):
    q, k, v = qkv(rng, B=1, Hq=1, L=5, S=8, E=4)
    v[0, 0, 3, 1] = np.nan
    out = fa.scaled_dot_product_attention(q, k, v, backend=backend, is_causal=True)
    assert np.isnan(out[0, 0, 3:, 1]).all()       # rows 3.. attend key 3
    assert np.isfinite(out[0, 0, :3]).all() and np.isfinite(out[0, 0, :, [0, 2, 3]]).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes(backend, rng, dtype):
    q, k, v = qkv(rng, L=31, S=47, E=16, dtype=dtype)
    out, lse = check_sdpa(q, k, v, backend, is_causal=True)
    assert out.dtype == dtype


def test_float16_large_logits_do_not_overflow(backend, rng):
    q = randn(rng, (1, 2, 16, 256), np.float16, scale=12)
    k = randn(rng, (1, 2, 16, 256), np.float16, scale=12)
    v = randn(rng, (1, 2, 16, 256), np.float16)
    out = fa.scaled_dot_product_attention(q, k, v, backend=backend)
    assert np.isfinite(out).all()


def test_bfloat16(backend, rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes not installed")
    bf16 = ml_dtypes.bfloat16
    q, k, v = (a.astype(bf16) for a in qkv(rng, L=20, S=33, E=16))
    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, backend=backend)
    assert out.dtype == bf16 and lse.dtype == np.float32
    ref = reference.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)))
    assert np.abs(out.astype(np.float64) - ref).max() < 2e-2


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("L", [1, 3, 40])
@pytest.mark.parametrize("S,E", [(1, 1), (1, 8), (3, 1)])
def test_kv_broadcast_over_the_batch(backend, rng, dtype, L, S, E):
    """One K/V shared by every batch element, np.broadcast_to(k[:1], ...) (a shared prompt's
    cache): a stride-0 batch axis, and numpy gives the axes of length 1 stride 0 too. The second
    call of a kind runs through its call plan (_fastpath), which hands such views to the kernels
    as they are; numba's float64 kernels then passed that 0 (the key axis of a one-key cache) to
    BLAS as a leading dimension: DGEMM refused it and left the scores unwritten (out off by 1)."""
    q, k, v = qkv(rng, B=3, Hq=2, L=L, S=S, E=E, Ev=2, dtype=dtype)
    k, v = (np.broadcast_to(x[:1], x.shape) for x in (k, v))
    assert k.strides[0] == 0
    for _ in range(2):
        check_sdpa(q, k, v, backend)
        check_sdpa(q, k, v, backend, is_causal=True, causal_alignment="bottom_right")


def test_large_values_stay_finite(backend, rng):
    q, k, v = qkv(rng, L=20, S=40, E=16)
    check_sdpa(q * 100, k * 100, v, backend)


def test_float32_error_with_large_logits_and_dropout_sweep(backend):
    """Over 48 fixed random configurations with large logits (q and k x3 or x10), dropout 0 / 0.5
    / 0.9, GQA, causal, forward and decode shapes, a float32 backend's error must stay at the level
    of the naive float32 computation: geometric mean of err / naive_err <= 1.15 for out and for
    lse, and err > 2 x naive_err in at most 1/8 of the cases.

    Why statistics and not the per-case rule: with scores in the hundreds, a float32 GEMM's
    rounding error (~1e-7 x sum|q_e k_e|) is a random draw that differs between any two
    summation orders, and the naive side sometimes draws an exceptionally small one; every
    backend then fails the per-case 2x rule in a few % of random cases. A systematic extra error
    does not hide in the mean: numba's former Q prescale by scale*log2(e) (an extra rounding per
    q element) gave geometric means 1.14 (out) / 1.39 (lse) and 23% of cases above 2x here."""
    ratios = {"out": [], "lse": []}
    for seed in range(48):
        rng = np.random.default_rng(5000 + seed)
        B, Hkv, G = 2, int(rng.choice([1, 2])), int(rng.choice([1, 2]))
        L, S = int(rng.choice([1, 3, 20, 40, 130])), int(rng.choice([5, 40, 90, 600]))
        E = int(rng.choice([16, 64]))
        mult = np.float32(rng.choice([3.0, 10.0]))
        kw = dict(dropout_p=float(rng.choice([0.0, 0.5, 0.9])), rng=seed, enable_gqa=True,
                  is_causal=bool(rng.integers(2)))
        q, k, v = qkv(rng, B=B, Hq=Hkv * G, Hkv=Hkv, L=L, S=S, E=E)
        q, k = q * mult, k * mult
        got = fa.scaled_dot_product_attention(q, k, v, return_lse=True, backend=backend, **kw)
        ref = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        naive = reference.scaled_dot_product_attention(q, k, v, return_lse=True, dtype=np.float32, **kw)
        for name, g, r, n in zip(("out", "lse"), got, ref, naive):
            # 1e-7 on both sides: the naive error is exactly 0 when a row's weight is exactly 1
            ratios[name].append((max_err(g, r) + 1e-7) / (max_err(n, r) + 1e-7))
    for name, rs in ratios.items():
        rs = np.array(rs)
        geomean = float(np.exp(np.log(rs).mean()))
        assert geomean <= 1.15, f"{name}: geometric mean of err/naive_err {geomean:.3f} > 1.15"
        assert (rs > 2).sum() <= len(rs) // 8, f"{name}: {(rs > 2).sum()} of {len(rs)} cases above 2x naive"


def test_long_keys_cross_many_blocks(backend, rng):
    q, k, v = qkv(rng, B=1, Hq=2, L=70, S=3000, E=32)
    check_sdpa(q, k, v, backend, is_causal=True, causal_alignment="bottom_right")
    check_sdpa(q, k, v, backend, window=(700, 100))


def test_results_do_not_depend_on_thread_count(backend, rng, monkeypatch):
    q, k, v = qkv(rng, B=1, Hq=3, L=300, S=300, E=32)
    monkeypatch.setenv("FASTATTN_NUM_THREADS", "1")
    fa.reload_environment()
    one = fa.scaled_dot_product_attention(q, k, v, backend=backend, is_causal=True)
    monkeypatch.setenv("FASTATTN_NUM_THREADS", "2")
    fa.reload_environment()
    two = fa.scaled_dot_product_attention(q, k, v, backend=backend, is_causal=True)
    np.testing.assert_allclose(one, two, rtol=0, atol=1e-6)
