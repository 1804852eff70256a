"""A whole small transformers model under each attn_implementation, in ONE process.

    python bench/transformers_models.py [--rounds 7] [--prompt 1024] [--new 32] [--batch 2]

The model is examples/transformers_cpu.py's small Llama (4 layers, hidden 256, GQA 8/2, head
dim 32, float32), the same weights under "fastattn", "sdpa" and "eager". Two rows per
implementation: the forward of a left-padded batch of prompts (a prefill without cache; ms,
and its tokens/s) and greedy `generate` of --new tokens after the same prompts (new tokens/s,
prefill included). The implementations alternate in every round, in alternating order, and the
ratios are medians of the per-round ratios to sdpa (< 1: faster than sdpa).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import sys
import time


def _example():
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "transformers_cpu.py"
    spec = importlib.util.spec_from_file_location("transformers_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    import torch

    from fastattn.bench.machine import load_average

    ex = _example()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    models = ex.build_models(layers=args.layers)
    ids, mask = ex.prompts(args.batch, args.prompt, models["eager"].config.vocab_size)
    real_tokens = int(mask.sum())

    def forward(model):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)

    def generate(model):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=args.new, min_new_tokens=args.new,
                                 pad_token_id=0)
        assert out.shape == (args.batch, args.prompt + args.new), out.shape

    ex.generate_all(models, ids[:, :8], mask[:, :8], 2)       # warm-up
    print(f"small Llama ({args.layers} layers, hidden 256, GQA 8/2, d=32, float32), batch "
          f"{args.batch} x {args.prompt} prompt tokens (left-padded), {args.new} new tokens, "
          f"{threads} threads, {args.rounds} rounds, load {load_average()}")
    for row, fn in (("forward", forward), ("generate", generate)):
        times = {impl: [] for impl in models}
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for impl in order:
                t = time.perf_counter()
                fn(models[impl])
                times[impl].append(time.perf_counter() - t)
        for impl in models:
            med = statistics.median(times[impl])
            ratio = statistics.median(a / b for a, b in zip(times[impl], times["sdpa"]))
            rate = (real_tokens if row == "forward" else args.batch * args.new) / med
            unit = "prompt tokens/s" if row == "forward" else "new tokens/s"
            print(f"  {row:8s} {impl:9s} {med * 1e3:9.1f} ms {rate:9.1f} {unit:15s} "
                  f"time / sdpa's {ratio:.2f}", flush=True)
    print(f"load at end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
