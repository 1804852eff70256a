"""--preset dask: one attention problem on 1 dask worker, on 2, and fastattn called directly.

    python -m fastattn.bench --preset dask [--rounds N] [--out DIR]
    python bench/dask_transfer.py --scaling --tokens 16384 --chunk 4096     # the same, sized

The problem (float32, causal, (1, heads, tokens, head_dim), chunks of `chunk` tokens along L
and S, all heads in a chunk: context parallel) runs forward and backward

- directly: fa.scaled_dot_product_attention in this process with 1 and with 2 kernel threads;
- on a LocalCluster of 1 worker process x 1 thread, and of 2 x 1 (FASTATTN_NUM_THREADS=1 in the
  workers, so the processes do not oversubscribe the cores), inputs already on the workers,
  results gathered back (that transfer counts: it is part of using the cluster).

Rounds alternate the six runs, and the report gives medians and the ratios that answer the
issue: the speedup of 2 workers over 1, the overhead of 1 worker over the direct 1-thread call
(graph, scheduling, the tiles' merges, serialization), and 2 workers against the direct
2-thread call. Only ratios mean anything on a shared machine; the load average is recorded.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time

import numpy as np

CASE = dict(tokens=8192, heads=4, head_dim=64, chunk=2048)
RUNS = ("direct, 1 thread", "direct, 2 threads", "1 worker", "2 workers")


def _direct(threads, fn):
    import fastattn as fa

    old = os.environ.get("FASTATTN_NUM_THREADS")
    os.environ["FASTATTN_NUM_THREADS"] = str(threads)
    fa.reload_environment()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        if old is None:
            os.environ.pop("FASTATTN_NUM_THREADS", None)
        else:
            os.environ["FASTATTN_NUM_THREADS"] = old
        fa.reload_environment()


def run(rounds: int = 3, tokens: int = CASE["tokens"], heads: int = CASE["heads"],
        head_dim: int = CASE["head_dim"], chunk: int = CASE["chunk"]) -> dict:
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    import fastattn as fa
    import fastattn.dask as fad

    from .machine import load_average

    shape = (1, heads, tokens, head_dim)
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    out, lse = fa.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    env = {"FASTATTN_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    clusters = {n: LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                dashboard_address=":0", env=env, silence_logs=logging.ERROR)
                for n in (1, 2)}
    clients = {n: Client(c, set_as_default=False) for n, c in clusters.items()}
    chunks = (1, heads, chunk, head_dim)
    times = {(run, op): [] for run in RUNS for op in ("forward", "backward")}
    loads = [load_average()]
    try:
        data = {}
        for n, c in clients.items():
            arrs = c.persist([da.from_array(x, chunks=chunks) for x in (q, k, v, g, out)]
                             + [da.from_array(lse, chunks=chunks[:-1])])
            with c.as_current():
                wait(arrs)
            data[n] = arrs
        direct = {
            "forward": lambda: fa.scaled_dot_product_attention(q, k, v, is_causal=True),
            "backward": lambda: fa.scaled_dot_product_attention_backward(g, q, k, v, out, lse,
                                                                         is_causal=True)}

        def on_cluster(n, op):
            dq, dk, dv, dg, do, dl = data[n]
            if op == "forward":
                work = [fad.scaled_dot_product_attention(dq, dk, dv, is_causal=True)]
            else:
                work = list(fad.scaled_dot_product_attention_backward(dg, dq, dk, dv, do, dl,
                                                                      is_causal=True))
            t0 = time.perf_counter()
            clients[n].compute(work, sync=True)
            return time.perf_counter() - t0

        for op in ("forward", "backward"):           # one untimed round: imports, numba, pools
            _direct(2, direct[op])
            for n in clients:
                on_cluster(n, op)
        for _ in range(rounds):
            for op in ("forward", "backward"):
                times[(RUNS[0], op)].append(_direct(1, direct[op]))
                times[(RUNS[1], op)].append(_direct(2, direct[op]))
                times[(RUNS[2], op)].append(on_cluster(1, op))
                times[(RUNS[3], op)].append(on_cluster(2, op))
            loads.append(load_average())
    finally:
        for c in clients.values():
            c.close()
        for c in clusters.values():
            c.close()
    med = {f"{run} / {op}": statistics.median(t) for (run, op), t in times.items()}
    ratios = {}
    for op in ("forward", "backward"):
        m = {run: statistics.median(times[(run, op)]) for run in RUNS}
        ratios[op] = {"speedup 2 workers over 1": m["1 worker"] / m["2 workers"],
                      "1 worker / direct 1 thread": m["1 worker"] / m["direct, 1 thread"],
                      "2 workers / direct 2 threads": m["2 workers"] / m["direct, 2 threads"]}
    from fastattn._backends import registry

    return {"case": dict(tokens=tokens, heads=heads, head_dim=head_dim, chunk=chunk,
                         dtype="float32", causal=True),
            "rounds": rounds, "median_seconds": med, "ratios": ratios,
            "load_average": loads,
            "partial_keys_backward_backends": [
                name for name, b in registry.items()
                if "delta" not in getattr(b, "unsupported_options", {})]}


def markdown(res: dict) -> str:
    c = res["case"]
    lines = [f"dask scaling: causal float32 (1, {c['heads']}, {c['tokens']}, {c['head_dim']}), "
             f"chunks of {c['chunk']} tokens, {res['rounds']} interleaved rounds (medians), "
             f"1-minute load average {', '.join(f'{x[0]:.1f}' for x in res['load_average'] if x)} "
             f"(before and after each round, 2 cores)",
             "", "| run | forward s | backward s |", "|---|---:|---:|"]
    for run in RUNS:
        lines.append(f"| {run} | {res['median_seconds'][run + ' / forward']:.3f} | "
                     f"{res['median_seconds'][run + ' / backward']:.3f} |")
    lines += ["", "| ratio | forward | backward |", "|---|---:|---:|"]
    for key in res["ratios"]["forward"]:
        lines.append(f"| {key} | {res['ratios']['forward'][key]:.2f} | "
                     f"{res['ratios']['backward'][key]:.2f} |")
    lines += ["", "Backends that take the partial-keys backward (the dask backward's key-chunk "
              "tiles): " + ", ".join(res["partial_keys_backward_backends"])]
    return "\n".join(lines) + "\n"


def main(rounds, out_dir: str, **case) -> int:
    res = run(rounds or 3, **case)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dask.json"), "w") as f:
        json.dump(res, f, indent=2)
    text = markdown(res)
    with open(os.path.join(out_dir, "dask.md"), "w") as f:
        f.write(text)
    print(text)
    return 0
