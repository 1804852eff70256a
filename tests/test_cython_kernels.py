"""The Cython extension below the API: every SIMD copy the CPU can run (generic, AVX2,
AVX-512), both attention kernels (forward, and decode, which must be right for any L even if
only used for small L), 1 and 2 threads, against the float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close_to_reference, randn

import fastattn as fa
from fastattn import reference
from fastattn._backends._kernel_args import forward_inputs, forward_outputs
from fastattn._inputs import make_problem


@pytest.fixture(scope="module")
def K():
    info = fa.backends()["cython"]
    if not info.available:
        from conftest import required
        if "cython" in required():
            pytest.fail(f"cython required but unavailable: {info.reason}")
        pytest.skip(f"cython unavailable: {info.reason}")
    from fastattn import _cykernels
    return _cykernels


def levels():
    try:
        from fastattn import _cykernels
    except ImportError:
        return ["none"]
    return _cykernels.simd_levels()


@pytest.fixture(params=levels())
def level(request, K):
    K.set_simd(request.param)
    yield request.param
    K.set_simd(None)


def run_kernel(K, kernel, p, threads):
    out, lse = forward_outputs(p)
    getattr(K, kernel)(*forward_inputs(p), out, lse, threads)
    return out, lse


def check(K, kernel, threads, q, k, v, **kw):
    p = make_problem(q, k, v, enable_gqa=True, **kw)
    out, lse = run_kernel(K, kernel, p, threads)
    ref_out, ref_lse = reference.forward(p)
    low = np.float64 if q.dtype == np.float64 else np.float32
    naive_out, naive_lse = reference.forward(p, dtype=low)
    assert_close_to_reference(out, ref_out, naive_out, low, f"{kernel} out")
    assert_close_to_reference(lse, ref_lse, naive_lse, low, f"{kernel} lse")


OPTIONS = {
    "plain": {},
    "causal_br": dict(is_causal=True, causal_alignment="bottom_right"),
    "window": dict(window=(9, 3)),
    "bool_mask": "bool",
    "float_mask": "float",
    "softcap_alibi": dict(softcap=4.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4])),
    "dropout": dict(dropout_p=0.3, rng=17),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", ["forward", "decode"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("L,S", [(1, 300), (3, 17), (40, 129), (129, 40)])
def test_every_simd_copy(K, level, threads, kernel, dtype, option, L, S):
    rng = np.random.default_rng(L * 1000 + S)
    q, k, v = randn(rng, (2, 4, L, 33), dtype), randn(rng, (2, 2, S, 33), dtype), randn(rng, (2, 2, S, 20), dtype)
    kw = OPTIONS[option]
    if kw == "bool":
        kw = dict(attn_mask=rng.random((2, 1, L, S)) > 0.3)
    elif kw == "float":
        kw = dict(attn_mask=rng.standard_normal((4, 1, S)))
    check(K, kernel, threads, q, k, v, **kw)


@pytest.mark.parametrize("seed", range(30))
def test_random_configurations(K, seed):
    """Random shapes x options x SIMD copies x kernels with fixed seeds: the float32 rule must
    hold beyond the hand-picked cases (logits up to 3x larger than randn)."""
    rng = np.random.default_rng(1000 + seed)
    K.set_simd(str(rng.choice(K.simd_levels())))
    try:
        B, Hkv, G = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
        L, S = int(rng.choice([1, 2, 3, 17, 113, 203])), int(rng.choice([1, 17, 129, 203, 700]))
        E, Ev = int(rng.choice([1, 8, 33, 64, 128])), int(rng.choice([8, 24, 64]))
        q = randn(rng, (B, Hkv * G, L, E), np.float64) * float(rng.choice([1.0, 3.0]))
        k, v = randn(rng, (B, Hkv, S, E), np.float64), randn(rng, (B, Hkv, S, Ev), np.float64)
        kw = {}
        if rng.random() < 0.3:
            kw["alibi_slopes"] = rng.random((B, Hkv * G)) * 0.2
        if rng.random() < 0.3:
            kw["softcap"] = float(rng.choice([5.0, 30.0]))
        if rng.random() < 0.3:
            kw.update(dropout_p=0.3, rng=int(rng.integers(0, 2**32)))
        if rng.random() < 0.3:
            kw["attn_mask"] = rng.random((B, 1, L, S)) < 0.7
        elif rng.random() < 0.3:
            kw["attn_mask"] = rng.standard_normal((1, Hkv * G, 1, S))
        if rng.random() < 0.3:
            kw.update(is_causal=True, causal_alignment="bottom_right")
        kernel = str(rng.choice(["forward", "decode"]))
        for dtype in (np.float32, np.float64):
            check(K, kernel, 2, q.astype(dtype), k.astype(dtype), v.astype(dtype), **kw)
    finally:
        K.set_simd(None)


@pytest.mark.parametrize("L,S,E", [(64, 8192, 64), (256, 4096, 128), (33, 16384, 64)])
def test_float32_long_rows(K, L, S, E):
    """Long key ranges stress float32 accumulation (compensated sums, per-block P.V)."""
    rng = np.random.default_rng(L + S)
    q, k, v = randn(rng, (1, 2, L, E)) * 2, randn(rng, (1, 2, S, E)), randn(rng, (1, 2, S, E))
    for kernel in ("forward", "decode"):
        check(K, kernel, 2, q, k, v)
        check(K, kernel, 2, q, k, v, alibi_slopes=np.full(2, 0.01), is_causal=True,
              causal_alignment="bottom_right")


def test_exp_accuracy(K):
    """The polynomial exp, read back through softmax_rows on rows [x, 0]: e^x / (1 + e^x)."""
    x = np.concatenate([-np.logspace(-8, 1.94, 4000), [0.0, -87.0, -87.3, -88.0, -100.0, -np.inf]])
    for dtype in (np.float32, np.float64):
        rows = np.stack([x, np.zeros_like(x)], 1).astype(dtype)
        out = np.empty_like(rows)
        K.softmax_rows(rows, 0, np.ones((1, 1), np.uint8), out, 1)
        xr = rows[:, 0].astype(np.float64)
        ref = np.exp(xr) / (1 + np.exp(xr))
        tiny = np.finfo(dtype).tiny                      # below it: flushed to 0 by design
        tol = 6e-7 if dtype == np.float32 else 1e-15
        e = np.abs(out[:, 0] - ref)
        assert np.all(e <= np.where(ref > 2 * tiny, tol * ref, 2 * tiny))
        assert out[-1, 0] == 0 and out[-1, 1] == 1       # exp(-inf) is exactly 0


def test_info(K):
    assert K.simd_levels()[0] == "generic"
    assert isinstance(K.OPENMP_ENABLED, bool)
    assert fa.backends()["cython"].details["openmp"] == K.OPENMP_ENABLED
