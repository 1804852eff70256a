"""The full preset's forward and backward rows, fastattn against torch, in ONE process.

    python bench/vs_torch_inprocess.py [--impl fastattn-cython] [--rounds 7] [--max-l 8192]
                                       [--sweeps "bwd d=64" ...] [--batch-s 0.3]

The full preset (`python -m fastattn.bench --preset full`) starts a process per measurement and
times up to 10 calls in it: right for peak memory and for keeping one library's pools away from
the other's, but on a shared 2-core guest its ratios move by +-30% from one run to the next
(fwd d=64 causal L=256 took 0.57 to 1.01 ms in four fresh processes within a minute). Here the
same calls (fastattn.bench.impls.make_call) alternate in batches of about --batch-s seconds,
in alternating order (the latency preset's timing loop), and the ratio is the median of the
per-round ratios: the two libraries see the same load. Both run with the same thread count (torch.set_num_threads, and
fastattn's default: the usable CPUs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv=None) -> int:
    from fastattn.bench import cases as C
    from fastattn.bench.impls import TORCH, make_call
    from fastattn.bench.latency import _interleaved
    from fastattn.bench.machine import load_average

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="fastattn-cython")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-l", type=int, default=8192, help="skip rows with a longer L")
    ap.add_argument("--sweeps", nargs="*", help="only sweeps whose name contains one of these")
    ap.add_argument("--batch-s", type=float, default=0.3)
    args = ap.parse_args(argv)
    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    rows = [c for c in C.PRESETS["full"].cases
            if not c.is_decode and c.L <= args.max_l
            and (not args.sweeps or any(s in c.sweep for s in args.sweeps))]
    print(f"{args.impl} vs torch, {threads} threads, {args.rounds} rounds, load "
          f"{load_average()}")
    print(f"{'case':42s} {'fastattn ms':>11s} {'torch ms':>9s}  time / torch's (q1, q3)")
    for case in rows:
        fns = {args.impl: make_call(args.impl, case, threads),
               TORCH: make_call(TORCH, case, threads)}
        times = _interleaved(fns, args.rounds, args.batch_s)
        ratios = [a / b for a, b in zip(times[args.impl], times[TORCH])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"{case.name:42s} {statistics.median(times[args.impl]) * 1e3:11.2f} "
              f"{statistics.median(times[TORCH]) * 1e3:9.2f}  {statistics.median(ratios):.2f} "
              f"({q1:.2f}, {q3:.2f})", flush=True)
    print(f"load at end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
