"""A 128k-token causal attention on a dask.distributed cluster, with a progress bar.

    python examples/dask_long_context.py                      # a LocalCluster of 2 processes
    python examples/dask_long_context.py --scheduler tcp://host:8786 --tokens 1048576

q, k and v are made on the workers (nothing of size L travels from here), cut into chunks of
`--chunk` tokens; fastattn.dask computes the causal half of the (query chunk, key chunk) tiles
and merges each query chunk's partial results by log-sum-exp. Prints the time, the error of a
few output rows against a direct computation of just those rows, and each worker's peak memory.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--scheduler", default=None, help="address of an existing scheduler")
    args = ap.parse_args(argv)

    import dask.array as da
    from distributed import Client, LocalCluster, progress

    import fastattn as fa
    import fastattn.dask as fad

    cluster = None
    if args.scheduler:
        client = Client(args.scheduler)
    else:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                               dashboard_address=":0")
        client = Client(cluster)
    try:
        shape = (1, args.heads, args.tokens, args.head_dim)
        chunks = (1, 1, args.chunk, args.head_dim)
        gen = da.random.default_rng(0)
        q, k, v = (gen.standard_normal(shape, chunks=chunks, dtype=np.float32) for _ in range(3))
        q, k, v = client.persist([q, k, v])
        progress(q, k, v)
        out = fad.scaled_dot_product_attention(q, k, v, is_causal=True)
        print(f"\ncausal attention, {args.tokens} tokens, {args.heads} head(s) of "
              f"{args.head_dim}, chunks of {args.chunk}, {len(client.scheduler_info()['workers'])}"
              f" workers")
        t0 = time.perf_counter()
        future = client.compute(out)
        progress(future)
        result = future.result()
        seconds = time.perf_counter() - t0
        flops = 2 * args.heads * args.tokens ** 2 * args.head_dim      # causal half of 4 L S d
        print(f"\n{seconds:.1f} s, {flops / seconds / 1e9:.0f} GFLOP/s")
        # check a few rows against fastattn on one machine, each row with only its keys
        rows = np.unique(np.linspace(0, args.tokens - 1, 5).astype(int))
        qr = q[0, :, rows].compute()
        err = 0.0
        for i, r in enumerate(rows):
            kr, vr = k[0, :, :r + 1].compute(), v[0, :, :r + 1].compute()
            want = fa.scaled_dot_product_attention(qr[:, i:i + 1], kr, vr)
            err = max(err, float(np.abs(result[0, :, r:r + 1] - want).max()))
        print(f"max error of rows {rows.tolist()} against a direct computation: {err:.2e}")
        peaks = client.run(peak_rss_mib)
        for addr, mib in sorted(peaks.items()):
            print(f"worker {addr}: peak memory {mib:.0f} MiB")
        return 0 if err < 1e-4 else 1
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    sys.exit(main())
