"""fastattn.torch's op against torch.nn.functional.scaled_dot_product_attention, in ONE process.

    python bench/torch_op.py [--rounds 9] [--L 2048] [--heads 16] [--d 64] [--batch-s 0.5]

Both take the same torch tensors (B=1, H=16, L=S=2048, d=64 by default, float32), causal and
not, forward and forward+backward (the backward of out.backward(grad) with every input
requiring grad). The calls alternate in batches of about --batch-s seconds, in alternating
order (fastattn.bench.latency's loop), and the ratio is the median of the per-round ratios
(< 1: fastattn faster), so both see the same load on a shared machine. torch runs with as many
threads as fastattn (the usable CPUs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys


def make_calls(torch, fat, B, H, L, d, causal: bool, backward: bool) -> dict:
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, d, generator=g) for _ in range(3))
    grad = torch.randn(B, H, L, d, generator=g)
    if backward:
        for t in (q, k, v):
            t.requires_grad_(True)

    def run(op):
        def call():
            out = op(q, k, v, is_causal=causal)
            if backward:
                out.backward(grad)
                q.grad = k.grad = v.grad = None
        return call

    return {"fastattn": run(fat.scaled_dot_product_attention),
            "torch": run(F.scaled_dot_product_attention)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--batch-s", type=float, default=0.5)
    args = ap.parse_args(argv)
    import torch

    import fastattn.torch as fat
    from fastattn.bench.latency import _interleaved
    from fastattn.bench.machine import load_average

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(f"fastattn.torch vs torch SDPA, B={args.B} H={args.heads} L=S={args.L} d={args.d} "
          f"float32, {threads} threads, {args.rounds} rounds, load {load_average()}")
    print(f"{'row':28s} {'fastattn ms':>11s} {'torch ms':>9s}  time / torch's (q1, q3)")
    for backward in (False, True):
        for causal in (False, True):
            name = f"{'fwd+bwd' if backward else 'fwd'} {'causal' if causal else 'full'}"
            fns = make_calls(torch, fat, args.B, args.heads, args.L, args.d, causal, backward)
            times = _interleaved(fns, args.rounds, args.batch_s)
            ratios = [a / b for a, b in zip(times["fastattn"], times["torch"])]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            print(f"{name:28s} {statistics.median(times['fastattn']) * 1e3:11.2f} "
                  f"{statistics.median(times['torch']) * 1e3:9.2f}  "
                  f"{statistics.median(ratios):.2f} ({q1:.2f}, {q3:.2f})", flush=True)
    print(f"load at end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
