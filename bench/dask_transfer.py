"""Bytes moved between dask workers and peak worker memory for a long causal attention; and
the speed of 1 vs 2 workers against fastattn called directly (--scaling).

    python bench/dask_transfer.py                       # L=S=65536, H=8, d=64, 2 workers
    python bench/dask_transfer.py --tokens 16384 --chunk 4096
    python bench/dask_transfer.py --scaling --tokens 16384 --chunk 4096 --rounds 3

q, k, v are made on the workers (chunks of --chunk tokens, all heads in a chunk: context
parallel), so every byte that moves is attention's own traffic. Reports, per worker, the bytes it
received from other workers (distributed's transfer log), its peak RSS, and the analytic volume
of ring attention, 2 * S * Hkv * d * bytes * (P - 1) / P per worker (each worker sees every
other worker's K and V once), and the time (meaningless on a shared machine; compare ratios).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _incoming_bytes(dask_worker) -> int:
    return int(sum(entry.get("total", 0) for entry in dask_worker.transfer_incoming_log))


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
        before = client.run(_incoming_bytes)
        t0 = time.perf_counter()
        out = client.persist(fad.scaled_dot_product_attention(q, k, v, is_causal=True))
        wait(out)
        seconds = time.perf_counter() - t0
        after = client.run(_incoming_bytes)
        peaks = client.run(_peak_rss_mib)
        P, S = args.workers, args.tokens
        ring = 2 * S * args.heads * args.head_dim * 4 * (P - 1) / P
        chunk_bytes = 3 * np.prod(shape) * 4 / (S // args.chunk)
        rows = []
        for addr in sorted(after):
            moved = after[addr] - before.get(addr, 0)
            rows.append({"worker": addr, "received_bytes": moved, "ring_bytes": ring,
                         "ratio_to_ring": moved / ring, "peak_rss_mib": peaks[addr]})
        result = {"tokens": S, "heads": args.heads, "head_dim": args.head_dim,
                  "chunk": args.chunk, "workers": P, "seconds": seconds,
                  "qkv_bytes_per_chunk": chunk_bytes, "workers_detail": rows}
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        return 0
    finally:
        client.close()
        cluster.close()


def scaling(args) -> int:
    """Median times of direct fastattn (2 threads, this process), a 1-worker and a 2-worker
    LocalCluster (1 thread each), in interleaved rounds; ratios to direct."""
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    import fastattn as fa
    import fastattn.dask as fad

    shape = (1, args.heads, args.tokens, args.head_dim)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    clusters = {n: LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                dashboard_address=":0") for n in (1, 2)}
    clients = {n: Client(c, set_as_default=False) for n, c in clusters.items()}
    chunks = (1, args.heads, args.chunk, args.head_dim)
    try:
        data = {n: c.persist([da.from_array(x, chunks=chunks) for x in (q, k, v)])
                for n, c in clients.items()}
        for n in data:
            wait(data[n])
        times = {"direct": [], 1: [], 2: []}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fa.scaled_dot_product_attention(q, k, v, is_causal=True)
            times["direct"].append(time.perf_counter() - t0)
            for n, c in clients.items():
                t0 = time.perf_counter()
                fut = c.compute(fad.scaled_dot_product_attention(*data[n], is_causal=True))
                fut.result()
                times[n].append(time.perf_counter() - t0)
        med = {key: float(np.median(t)) for key, t in times.items()}
        result = {"tokens": args.tokens, "heads": args.heads, "chunk": args.chunk,
                  "rounds": args.rounds, "median_seconds": {str(k): v for k, v in med.items()},
                  "speedup_2_over_1_worker": med[1] / med[2],
                  "1_worker_over_direct": med[1] / med["direct"],
                  "2_workers_over_direct": med[2] / med["direct"]}
        print(json.dumps(result, indent=2))
        return 0
    finally:
        for c in clients.values():
            c.close()
        for c in clusters.values():
            c.close()


if __name__ == "__main__":
    sys.exit(main())
