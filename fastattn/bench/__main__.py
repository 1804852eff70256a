"""python -m fastattn.bench [--preset quick|full|targets|smoke|latency|dask|inference|numpy-loop]

fastattn's backends against torch's CPU SDPA, jax.nn.dot_product_attention and the seed-style
NumPy code, each measurement in its own process with the same thread count, interleaved, with
the machine's own sgemm rate and memory bandwidth measured in the same run.

Writes results.json, results.md and PNG plots to --out (default: bench/out for quick and smoke,
bench/results for full) and prints the summary table. The README section comes from
bench/results via `python -m fastattn.bench.report --readme README.md`.

--preset latency is different: microsecond calls (a decode step) and a decode loop, fastattn
and torch interleaved in one process (fastattn/bench/latency.py); it writes latency.json and
latency.md to --out (default bench/out) and with --readme its table into README.md.

--preset dask: one causal problem on 1 vs 2 dask worker processes vs fastattn called directly
(fastattn/bench/dask_scaling.py; needs the dask extra); writes dask.json and dask.md to --out.

--preset inference: ragged prefill (varlen) and decode against a ragged contiguous or paged KV
cache, against torch on the padded batch with a mask, interleaved in one process
(fastattn/bench/kvcache.py); writes inference.json and inference.md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .cases import PRESETS
from .impls import implementations
from .machine import describe, load_average
from .plots import write_plots
from .progress import Progress
from .report import SUMMARY_NOTE, markdown, summary_table
from .runner import Runner, add_peak_fractions, cost_order, summarize_probes


def parse_args(argv):
    from fastattn import _config

    ap = argparse.ArgumentParser(prog="python -m fastattn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=list(PRESETS) + ["latency", "dask", "inference",
                                                         "numpy-loop"],
                    default="quick",
                    help="which cases and how many rounds (default: quick): " + "; ".join(
                        f"{p.name}: {p.note}" for p in PRESETS.values())
                    + "; latency: decode-step calls and a decode loop against torch, "
                    "interleaved in one process (a few minutes); dask: 1 vs 2 dask workers vs "
                    "direct calls, forward and backward (a few minutes, needs the dask extra); "
                    "inference: ragged prefill and ragged/paged KV-cache decode against torch "
                    "padded, in one process; numpy-loop: each row alone and right after a "
                    "NumPy BLAS call, in a process without torch (add --quick-loop for fewer "
                    "rows)")
    ap.add_argument("--sweeps", nargs="+", metavar="TEXT",
                    help="only sweeps whose name contains one of these, e.g. decode 'fwd d=64'")
    ap.add_argument("--impls", nargs="+", help="implementations to run (default: every one "
                    "available; names as in the results, e.g. fastattn-numpy torch)")
    ap.add_argument("--threads", type=int, default=_config.num_threads(),
                    help="threads for every implementation (default: the usable CPUs)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default: the preset's)")
    ap.add_argument("--min-time", type=float, help="seconds of timed calls per process")
    ap.add_argument("--timeout", type=float, help="seconds per process before it is recorded "
                    "as timed out")
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="stop a run whose RSS passes this (default: half the machine's memory)")
    ap.add_argument("--seed-limit-gb", type=float, default=4.0,
                    help="skip the seed-style code where its dense scores would need more")
    ap.add_argument("--budget-min", type=float, help="minutes after which runs not yet made "
                    "are recorded as skipped (default: the preset's; 0 = none)")
    ap.add_argument("--out", help="output directory (default: the preset's)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--quick-loop", action="store_true", help="numpy-loop: fewer rows")
    ap.add_argument("--readme", help="also rewrite this README's benchmark section")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.preset == "latency":
        from . import latency

        return latency.main(args.threads, args.rounds, args.out or "bench/out", args.readme)
    if args.preset == "dask":
        from . import dask_scaling

        return dask_scaling.main(args.rounds, args.out or "bench/out")
    if args.preset == "numpy-loop":
        from . import numpy_loop

        return numpy_loop.main(args.threads, args.rounds, args.out or "bench/out",
                               quick=args.quick_loop)
    if args.preset == "inference":
        from . import kvcache

        return kvcache.main(args.threads, args.rounds, args.out or "bench/out")
    preset = PRESETS[args.preset]
    case_list = [c for c in preset.cases
                 if not args.sweeps or any(s in c.sweep for s in args.sweeps)]
    found = implementations()
    impls = args.impls or [name for name, why in found.items() if not why]
    unknown = [i for i in impls if i not in found]
    if unknown:
        print(f"unknown implementations {unknown}; known: {list(found)}", file=sys.stderr)
        return 2
    out_dir = args.out or preset.out_dir
    os.makedirs(out_dir, exist_ok=True)

    meta = describe(args.threads, argv)
    meta.update(preset=preset.name, impls=impls, implementations=found)
    total_mem = (meta["memory_gib"] or 16) * 2**30
    mem_limit = (args.mem_limit_gb * 2**30) if args.mem_limit_gb else total_mem / 2
    runner = Runner(impls, args.threads, args.rounds or preset.rounds,
                    preset.min_time if args.min_time is None else args.min_time,
                    preset.max_repeats, args.timeout or preset.timeout, mem_limit,
                    args.seed_limit_gb * 2**30, small_probes=preset.name == "smoke",
                    budget_s=60 * (preset.budget_min if args.budget_min is None
                                   else args.budget_min))
    meta.update(rounds=runner.rounds, probe_runs=list(preset.probes),
                min_time_s=runner.min_time, timeout_s=runner.timeout, budget_s=runner.budget_s,
                mem_limit_gib=round(mem_limit / 2**30, 1))
    print(f"fastattn bench, preset {preset.name}: {len(case_list)} cases x {len(impls)} "
          f"implementations x {runner.rounds} rounds, {args.threads} threads -> {out_dir}",
          file=sys.stderr)
    start = time.monotonic()
    runner.warm_jit(case_list)
    runner.progress = Progress(runner.steps(case_list, sum(preset.probes)))
    probe_runs = runner.run_probes(preset.probes[0])
    records = [None] * len(case_list)
    for n, i in enumerate(cost_order(case_list)):
        records[i] = runner.run_case(case_list[i], n)
    probes = summarize_probes(runner.run_probes(preset.probes[1], probe_runs))
    add_peak_fractions(records, probes)
    runner.progress.close()
    meta.update(elapsed_s=round(time.monotonic() - start, 1), load_average_end=load_average())
    data = {"meta": meta, "probes": probes, "records": records}

    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(data))
    if args.no_plots:
        written, note = [], "plots skipped: --no-plots"
    else:
        written, note = write_plots(data, out_dir)
    if args.readme:
        from .report import update_readme
        update_readme(args.readme, json_path)

    print(SUMMARY_NOTE + "\n")
    print(summary_table(data) + "\n")
    print(f"wrote {json_path}, results.md" + "".join(f", {os.path.basename(p)}" for p in written)
          + f" in {meta['elapsed_s'] / 60:.1f} min" + (f"; {note}" if note else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
