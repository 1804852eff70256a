"""The implementations the benchmark can time; each is built inside its worker process."""
from __future__ import annotations

import importlib.util

import numpy as np

FASTATTN_BACKENDS = ("cython", "numba", "numpy")


def seed_attention(q, k, v, is_causal=False, **_):
    """The classic NumPy attention the seed tutorials write: full (L, S) scores, no tiling."""
    d = q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / np.float32(np.sqrt(d)).astype(q.dtype)
    if is_causal:
        L, S = s.shape[-2:]
        s = np.where(np.tril(np.ones((L, S), bool)), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def available_impls() -> list[str]:
    """Every implementation this machine can run: fastattn backends, torch, seed NumPy."""
    import fastattn as fa

    names = [f"fastattn-{n}" for n, info in fa.backends().items() if info.available]
    if importlib.util.find_spec("torch") is not None:
        names.append("torch")
    names.append("seed-numpy")
    return names


def make_call(impl: str, case: dict, threads: int):
    """A zero-argument callable running `case` with `impl`, inputs already allocated."""
    rng = np.random.default_rng(0)
    B, Hq, Hkv, L, S, D = (case[k] for k in ("B", "Hq", "Hkv", "L", "S", "D"))
    causal = bool(case.get("causal", False))
    q = rng.standard_normal((B, Hq, L, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    gqa = Hq != Hkv
    # decode: the query sits at the end of the cache (bottom-right); torch has no such flag,
    # so for L == 1 causal is simply "attend everything", which is what we time for both.
    if impl.startswith("fastattn-"):
        import fastattn as fa

        backend = impl.split("-", 1)[1]
        align = "bottom_right" if L < S else "top_left"
        return lambda: fa.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=gqa, causal_alignment=align, backend=backend), (q, k, v)
    if impl == "torch":
        import torch

        torch.set_num_threads(threads)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        F = torch.nn.functional.scaled_dot_product_attention

        def run():
            with torch.no_grad():
                return F(tq, tk, tv, is_causal=causal and L > 1, enable_gqa=gqa)
        return run, (q, k, v)
    if impl == "seed-numpy":
        if gqa:
            k = np.repeat(k, Hq // Hkv, axis=1)
            v = np.repeat(v, Hq // Hkv, axis=1)
        return lambda: seed_attention(q, k, v, is_causal=causal and L > 1), (q, k, v)
    raise ValueError(f"unknown implementation {impl!r}")


def seed_bytes(case: dict) -> int:
    """Rough peak of the seed-style code: three (B, H, L, S) float32 temporaries."""
    return 3 * 4 * case["B"] * case["Hq"] * case["L"] * case["S"]
