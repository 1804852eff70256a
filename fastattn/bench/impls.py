"""The implementations the benchmark can time; each call is built inside its worker process.

Every builder allocates its inputs (and, for the backward, runs the forward once) before it
returns, so a timed call does only the operation itself. Inputs are float32, in the layout each
library wants (jax is (B, L, H, D)), made from the same seeded NumPy arrays.
"""
from __future__ import annotations

import importlib.util

import numpy as np

from .cases import Case

FASTATTN_PREFIX = "fastattn-"
TORCH, JAX, SEED = "torch", "jax", "seed-numpy"


def implementations() -> dict[str, str]:
    """{name: "" if it can run here, else why not}, in a stable order.

    torch and jax are only looked up (importing torch in the parent would cost ~2 s and start
    its thread pool); a broken install then shows up as a failed run in every case.
    """
    import fastattn as fa

    found = {f"{FASTATTN_PREFIX}{n}": ("" if info.available else info.reason)
             for n, info in fa.backends().items()}
    found[TORCH] = "" if importlib.util.find_spec("torch") else "torch is not installed"
    found[JAX] = "" if importlib.util.find_spec("jax") else "jax is not installed"
    found[SEED] = ""
    return found


def unsupported_reason(impl: str, case: Case) -> str:
    """Why `impl` cannot run `case` at all (not a failure: a missing feature), or ""."""
    if case.kind == "bwd" and impl.startswith(FASTATTN_PREFIX):
        import fastattn as fa

        if not hasattr(fa, "scaled_dot_product_attention_backward"):
            return "not available: fastattn has no scaled_dot_product_attention_backward yet"
    return ""


def _inputs(case: Case):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((case.B, case.Hq, case.L, case.D), dtype=np.float32)
    k = rng.standard_normal((case.B, case.Hkv, case.S, case.D), dtype=np.float32)
    v = rng.standard_normal((case.B, case.Hkv, case.S, case.D), dtype=np.float32)
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    return q, k, v, dout


def make_call(impl: str, case: Case, threads: int):
    """A zero-argument callable that runs `case` with `impl` and returns its (finished) result."""
    q, k, v, dout = _inputs(case)
    # Decode cases are not causal: the single query sits after the whole cache and sees all of it
    # (torch's is_causal is top-left aligned, so passing it for L=1 would mean "see key 0 only").
    causal = case.causal and not case.is_decode
    if impl.startswith(FASTATTN_PREFIX):
        return _fastattn(impl[len(FASTATTN_PREFIX):], case, q, k, v, dout, causal)
    if impl == TORCH:
        return _torch(case, q, k, v, dout, causal, threads)
    if impl == JAX:
        return _jax(case, q, k, v, dout, causal)
    if impl == SEED:
        return _seed(case, q, k, v, dout, causal)
    raise ValueError(f"unknown implementation {impl!r}")


def _fastattn(backend: str, case: Case, q, k, v, dout, causal):
    import fastattn as fa

    opts = dict(is_causal=causal, enable_gqa=case.Hq != case.Hkv, backend=backend)
    if case.kind == "fwd":
        return lambda: fa.scaled_dot_product_attention(q, k, v, **opts)
    out, lse = fa.scaled_dot_product_attention(q, k, v, return_lse=True, **opts)
    return lambda: fa.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **opts)


def _torch(case: Case, q, k, v, dout, causal, threads):
    import torch

    torch.set_num_threads(threads)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    opts = dict(is_causal=causal, enable_gqa=case.Hq != case.Hkv)
    if case.kind == "fwd":
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

        def forward():
            with torch.no_grad():
                return sdpa(tq, tk, tv, **opts)
        return forward
    # Backward = autograd through SDPA; the forward runs once here, and retain_graph lets every
    # timed call run only the backward kernels on the saved tensors.
    tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
    out = sdpa(tq, tk, tv, **opts)
    tdout = torch.from_numpy(dout)
    return lambda: torch.autograd.grad(out, (tq, tk, tv), tdout, retain_graph=True)


def _jax(case: Case, q, k, v, dout, causal):
    import jax

    # jax's layout is (B, L, H, D); the transposes happen here, outside the timed call.
    jq, jk, jv, jdout = (jax.device_put(np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
                         for a in (q, k, v, dout))

    def attend(a, b, c):
        return jax.nn.dot_product_attention(a, b, c, is_causal=causal)

    if case.kind == "fwd":
        fwd = jax.jit(attend)
        return lambda: fwd(jq, jk, jv).block_until_ready()
    # The vjp closure holds the forward's residuals; it is a pytree, so it can be passed to a jitted
    # function and the timed call runs only the backward.
    _, vjp = jax.vjp(attend, jq, jk, jv)
    bwd = jax.jit(lambda f, g: f(g))
    return lambda: jax.block_until_ready(bwd(vjp, jdout))


def seed_attention(q, k, v, is_causal=False):
    """The classic NumPy attention the seed tutorials write: full (L, S) scores, no tiling."""
    d = q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / np.asarray(np.sqrt(d), dtype=q.dtype)
    if is_causal:
        L, S = s.shape[-2:]
        s = np.where(np.tril(np.ones((L, S), bool)), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def seed_attention_backward(dout, q, k, v, p):
    """The textbook dense backward, given the forward's weights p (what an autograd would keep)."""
    scale = np.asarray(1 / np.sqrt(q.shape[-1]), dtype=q.dtype)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = (ds @ k) * scale
    dk = (np.swapaxes(ds, -1, -2) @ q) * scale
    return dq, dk, dv


def _seed(case: Case, q, k, v, dout, causal):
    if case.Hq != case.Hkv:          # the seed code has no GQA: repeat K and V, as it would have to
        k, v = (np.repeat(a, case.Hq // case.Hkv, axis=1) for a in (k, v))
    if case.kind == "fwd":
        return lambda: seed_attention(q, k, v, is_causal=causal)
    s = q @ np.swapaxes(k, -1, -2) / np.asarray(np.sqrt(case.D), dtype=q.dtype)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    del s
    return lambda: seed_attention_backward(dout, q, k, v, p)
