"""Bytes moved between dask workers and peak worker memory for a long causal attention; and
the speed of 1 vs 2 workers against fastattn called directly (--scaling).

    python bench/dask_transfer.py                       # L=S=65536, H=8, d=64, 2 workers
    python bench/dask_transfer.py --tokens 16384 --chunk 4096 --backward
    python bench/dask_transfer.py --scaling --tokens 16384 --chunk 4096 --rounds 3

q, k, v are made on the workers (chunks of --chunk tokens, all heads in a chunk: context
parallel), so every byte that moves is attention's own traffic. Reports, per worker, the bytes it
received from other workers (distributed's transfer log), its RSS when the phase began, its peak
RSS during the phase (sampled every 20 ms) and its RSS at the end (the phase's results held),
and the analytic volume of ring attention, 2 * S * Hkv * d * bytes * (P - 1) / P per worker for
the forward (each worker sees every other worker's K and V once) and twice that for the backward
(K and V, then the dK and dV accumulators, go round the ring), and the time (meaningless on a
shared machine; compare ratios). --backward measures the backward after the forward.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _start_sampler(dask_worker) -> None:
    """Sample this worker's RSS every 20 ms from now on (the phase's peak; ru_maxrss would
    include everything before)."""
    import threading

    import psutil

    proc = psutil.Process()
    state = {"peak": 0, "stop": False, "start": proc.memory_info().rss}

    def loop():
        while not state["stop"]:
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            time.sleep(0.02)

    threading.Thread(target=loop, daemon=True).start()
    dask_worker._fastattn_rss = state


def _stop_sampler(dask_worker) -> tuple[float, float, float]:
    """RSS when the phase began, its peak during the phase, and now (the phase's results held),
    MiB."""
    import psutil

    state = dask_worker._fastattn_rss
    state["stop"] = True
    now = psutil.Process().memory_info().rss
    return state["start"] / 2**20, state["peak"] / 2**20, now / 2**20


def _incoming_bytes(dask_worker) -> dict:
    """Bytes received so far, by the name of the array (or task) each key belongs to."""
    by_name: dict = {}
    for entry in dask_worker.transfer_incoming_log:
        for key, nbytes in entry.get("keys", {}).items():
            name = key[0] if isinstance(key, tuple) else key
            by_name[name] = by_name.get(name, 0) + int(nbytes)
    return by_name


def _label(name: str, arrays: dict) -> str:
    """An input's own label (q, k, ...), or a fastattn task's kind (its name after the token)."""
    if name in arrays:
        return arrays[name]
    if name.startswith("fastattn-"):                     # fastattn-sdpa[-bwd]-{kind}-{token}
        return "fastattn " + name.split("-")[-2]
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--scaling", action="store_true",
                    help="time direct fastattn, 1 worker and 2 workers, interleaved")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backward", action="store_true",
                    help="also the backward's bytes and peak memory (after the forward)")
    args = ap.parse_args(argv)
    if args.scaling:
        return scaling(args)

    import dask.array as da
    from distributed import Client, LocalCluster, wait

    import fastattn.dask as fad

    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                           dashboard_address=":0")
    client = Client(cluster)
    try:
        shape = (1, args.heads, args.tokens, args.head_dim)
        chunks = (1, args.heads, args.chunk, args.head_dim)
        gen = da.random.default_rng(0)
        q, k, v = client.persist([gen.standard_normal(shape, chunks=chunks, dtype=np.float32)
                                  for _ in range(3)])
        wait([q, k, v])
        P, S = args.workers, args.tokens
        kv_bytes = S * args.heads * args.head_dim * 4
        chunk_bytes = 3 * np.prod(shape) * 4 / (S // args.chunk)

        arrays = {q.name: "q", k.name: "k", v.name: "v"}

        def phase(make, ring):
            """Persist make()'s arrays; per worker: bytes received (in all and by array), RSS."""
            before = client.run(_incoming_bytes)
            client.run(_start_sampler)
            t0 = time.perf_counter()
            arrs = client.persist(make())
            wait(arrs)
            seconds = time.perf_counter() - t0
            after = client.run(_incoming_bytes)
            peaks = client.run(_stop_sampler)
            rows = []
            for addr in sorted(after):
                got: dict = {}
                for name, nbytes in after[addr].items():
                    label = _label(name, arrays)
                    got[label] = got.get(label, 0) + nbytes - before.get(addr, {}).get(name, 0)
                got = {label: n for label, n in sorted(got.items()) if n}
                rows.append({"worker": addr, "received_bytes": sum(got.values()),
                             "received_by_array": got, "ring_bytes": ring,
                             "ratio_to_ring": sum(got.values()) / ring,
                             "start_rss_mib": peaks[addr][0], "peak_rss_mib": peaks[addr][1],
                             "end_rss_mib": peaks[addr][2]})
            return arrs, {"seconds": seconds, "workers_detail": rows}

        # ring attention: each worker receives the others' K and V once (forward); the
        # backward's ring also passes the dK, dV accumulators around: twice that
        (out, lse), fwd = phase(lambda: fad.scaled_dot_product_attention(
            q, k, v, is_causal=True, return_lse=True), 2 * kv_bytes * (P - 1) / P)
        arrays.update({out.name: "out", lse.name: "lse"})
        result = {"tokens": S, "heads": args.heads, "head_dim": args.head_dim,
                  "chunk": args.chunk, "workers": P, "qkv_bytes_per_chunk": chunk_bytes,
                  "forward": fwd}
        if args.backward:
            g = client.persist(gen.standard_normal(shape, chunks=chunks, dtype=np.float32))
            wait(g)
            arrays[g.name] = "grad_out"
            _, result["backward"] = phase(lambda: list(fad.scaled_dot_product_attention_backward(
                g, q, k, v, out, lse, is_causal=True)), 4 * kv_bytes * (P - 1) / P)
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        return 0
    finally:
        client.close()
        cluster.close()


def scaling(args) -> int:
    """--scaling: fastattn.bench's dask preset (fastattn/bench/dask_scaling.py) at this size."""
    from fastattn.bench import dask_scaling

    res = dask_scaling.run(args.rounds, tokens=args.tokens, heads=args.heads,
                           head_dim=args.head_dim, chunk=args.chunk)
    print(dask_scaling.markdown(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
