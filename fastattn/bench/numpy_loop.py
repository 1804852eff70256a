"""--preset numpy-loop: fastattn inside a NumPy model's loop, in a process without torch.

A NumPy model calls `x @ W` (NumPy's BLAS) and then attention, in every layer. Each row here
is timed twice, interleaved round by round: alone (after 0.2 s idle, every pool asleep) and
right after the BLAS call a layer would make before it (a 1x768 @ 768x768 gemv before a
decode step, a 2048^3 sgemm before a prefill), the BLAS call itself untimed. Reported per
row: both medians, the extra time after BLAS (after / alone - 1, median of the rounds), and
each as a share of the row's own limit measured in the same run:

- forward / backward: GF/s over NumPy's float32 GEMM rate on 2048^3 (FA-2 counts: forward
  4*B*H*L*S*d, causal half, backward 2.5x the forward),
- MHA decode (one query row per head): K and V bytes / time over a float32 gemv reading the
  same bytes (NumPy's BLAS, best of 1 and all threads).

fastattn's backends (cython, numba) each get their rows; torch is never imported (the point:
NumPy's BLAS pool and fastattn's are the only ones here). Writes numpy_loop.json and
numpy_loop.md to --out.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

from .latency import gemv_bandwidth
from .machine import describe, load_average

SETTLE_S = 0.2          # idle before an "alone" batch: OpenBLAS's workers go to sleep
GEMM_N = 2048


def _cases(rng, quick: bool, small: bool = False):
    """(name, kind, make(backend) -> call, BLAS call before it, work units, limit kind)."""
    def mk(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    n = 128 if small else GEMM_N            # small: the tests' plumbing run
    L = 128 if small else 2048
    x, W = mk(1, 768), mk(768, 768) * np.float32(0.03)
    A, Bm = mk(n, n), mk(n, n)
    gemv, sgemm = (lambda: x @ W), (lambda: A @ Bm)
    import fastattn as fa

    out = []
    for S in ((64,) if small else (1024, 4096) if quick else (1024, 4096, 16384)):
        q, k, v = mk(1, 12, 1, 64), mk(1, 12, S, 64), mk(1, 12, S, 64)
        out.append((f"MHA decode B1 H12 d64 S={S}",
                    lambda be, q=q, k=k, v=v: (lambda: fa.scaled_dot_product_attention(
                        q, k, v, backend=be)),
                    gemv, float(k.nbytes + v.nbytes), "read"))
    shapes = [(64, False), (64, True)] if quick else [(64, False), (64, True), (128, False),
                                                      (128, True)]
    for d, causal in shapes:
        q, k, v = mk(1, 8, L, d), mk(1, 8, L, d), mk(1, 8, L, d)
        flop = 4.0 * 8 * L * L * d * (0.5 if causal else 1.0)
        out.append((f"fwd B1 H8 L=S={L} d{d}{' causal' if causal else ''}",
                    lambda be, q=q, k=k, v=v, c=causal: (lambda: fa.scaled_dot_product_attention(
                        q, k, v, is_causal=c, backend=be)),
                    sgemm, flop, "gemm"))
    for causal in ((False,) if quick else (False, True)):
        d = 64
        q, k, v = mk(1, 4, L, d), mk(1, 4, L, d), mk(1, 4, L, d)
        o, lse = fa.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
        g = mk(1, 4, L, d)
        flop = 2.5 * 4.0 * 4 * L * L * d * (0.5 if causal else 1.0)
        out.append((f"bwd B1 H4 L=S={L} d{d}{' causal' if causal else ''}",
                    lambda be, q=q, k=k, v=v, o=o, lse=lse, g=g, c=causal: (
                        lambda: fa.scaled_dot_product_attention_backward(
                            g, q, k, v, o, lse, is_causal=c, backend=be)),
                    sgemm, flop, "gemm"))
    return out


def _batch(call, blas, n: int) -> float:
    """Mean seconds of `call` over n calls, each right after `blas` when it is given."""
    total = 0.0
    for _ in range(n):
        if blas is not None:
            blas()
        t = time.perf_counter()
        call()
        total += time.perf_counter() - t
    return total / n


def _row(name, call, blas, rounds: int, target_s: float) -> dict:
    for _ in range(2):
        call()
        blas()
    t = time.perf_counter()
    call()
    n = max(1, min(500, int(target_s / max(time.perf_counter() - t, 1e-6))))
    alone, after = [], []
    for _ in range(rounds):
        time.sleep(SETTLE_S)
        alone.append(_batch(call, None, n))
        time.sleep(SETTLE_S)
        after.append(_batch(call, blas, n))
    return {"alone_s": statistics.median(alone), "after_s": statistics.median(after),
            "extra": statistics.median(b / a - 1 for a, b in zip(alone, after)), "calls": n}


def gemm_rate(seconds: float = 1.0, n: int = GEMM_N) -> float:
    """NumPy's float32 GEMM rate on n^3 (GF/s), best over `seconds`."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best / 1e9


def run(threads: int, rounds: int = 5, backends=("cython", "numba"), quick: bool = False,
        target_s: float = 0.1, small: bool = False) -> dict:
    if "torch" in sys.modules:
        raise RuntimeError("the numpy-loop preset measures a process without torch; torch is "
                           "already imported here")
    import fastattn as fa

    avail = [b for b in backends if fa.backends()[b].available]
    meta = describe(threads, sys.argv)
    rng = np.random.default_rng(0)
    cases = _cases(rng, quick, small)
    time.sleep(SETTLE_S)
    gemm = gemm_rate(0.2 if small else 1.0, 128 if small else GEMM_N)
    reads = {}
    rows = []
    for name, make, blas, work, limit in cases:
        if limit == "read" and work not in reads:
            time.sleep(SETTLE_S)
            reads[work] = gemv_bandwidth(int(work), threads, 0.05 if small else 0.5)
        for be in avail:
            r = _row(name, make(be), blas, rounds, target_s)
            if limit == "read":
                share = lambda t, w=work: w / t / 1e9 / reads[w]      # noqa: E731
            else:
                share = lambda t, w=work: w / t / 1e9 / gemm           # noqa: E731
            r.update(name=name, backend=be, limit=limit, share_alone=share(r["alone_s"]),
                     share_after=share(r["after_s"]))
            rows.append(r)
            print(f"  {name:34s} {be:7s} alone {r['alone_s'] * 1e3:9.3f} ms "
                  f"after BLAS {r['after_s'] * 1e3:9.3f} ms  extra {r['extra']:+.2f}  "
                  f"share {r['share_alone']:.2f} / {r['share_after']:.2f}", flush=True)
    meta.update(preset="numpy-loop", rounds=rounds, gemm_gflops=gemm,
                read_gbs={str(int(k)): v for k, v in reads.items()},
                openblas_thread_timeout=os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                blas_on_fastattn_pool=bool(fa.blas_threads_shared()),
                torch_in_process="torch" in sys.modules, load_end=load_average())
    return {"meta": meta, "rows": rows}


def markdown(data: dict) -> str:
    m = data["meta"]
    head = (f"numpy-loop preset (`python -m fastattn.bench --preset numpy-loop`), "
            f"{m.get('date', '')}, fastattn commit {m.get('fastattn_commit') or '?'}; {m.get('cpu', '')}, "
            f"**{m.get('threads')} threads**; no torch in the process; {m['rounds']} rounds, "
            f"medians. NumPy sgemm 2048^3: {m['gemm_gflops']:.0f} GF/s. "
            f"OPENBLAS_THREAD_TIMEOUT={m.get('openblas_thread_timeout') or 'unset'}. "
            f"BLAS's parallel regions on "
            f"{'fastattn' if m.get('blas_on_fastattn_pool') else 'OpenBLAS'}'s threads"
            f"{' (FASTATTN_SHARE_BLAS_THREADS=1)' if m.get('blas_on_fastattn_pool') else ''}. "
            f"Load average start/end {m.get('load_average_start')} / {m.get('load_end')}.")
    lines = [head, "",
             "| row | backend | alone | after BLAS | extra | share of limit alone | after | limit |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        lim = "read probe" if r["limit"] == "read" else "sgemm"
        lines.append(f"| {r['name']} | {r['backend']} | {r['alone_s'] * 1e3:.3f} ms | "
                     f"{r['after_s'] * 1e3:.3f} ms | {r['extra']:+.2f} | {r['share_alone']:.2f} | "
                     f"{r['share_after']:.2f} | {lim} |")
    return "\n".join(lines) + "\n"


def main(threads: int, rounds: int | None, out_dir: str, quick: bool = False,
         small: bool = False) -> int:
    data = run(threads, rounds or 5, quick=quick, small=small,
               target_s=0.002 if small else 0.1)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "numpy_loop.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(os.path.join(out_dir, "numpy_loop.md"), "w") as f:
        f.write(text)
    print(text)
    return 0
