"""Command line of the benchmark: python -m fastattn.bench [--cases ...] [--impls ...]."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from .impls import available_impls, seed_bytes

CASES = {
    # name: shape (B, Hq, Hkv, L, S, D) and causal
    "fwd-2048-d64": dict(B=1, Hq=8, Hkv=8, L=2048, S=2048, D=64, causal=False),
    "fwd-2048-d64-causal": dict(B=1, Hq=8, Hkv=8, L=2048, S=2048, D=64, causal=True),
    "fwd-2048-d128": dict(B=1, Hq=8, Hkv=8, L=2048, S=2048, D=128, causal=False),
    "fwd-256-b4": dict(B=4, Hq=8, Hkv=8, L=256, S=256, D=64, causal=False),
    "decode-16k-gqa": dict(B=1, Hq=32, Hkv=8, L=1, S=16384, D=128, causal=False),
    "long-32k-causal": dict(B=1, Hq=4, Hkv=4, L=32768, S=32768, D=64, causal=True),
    "tiny": dict(B=1, Hq=2, Hkv=2, L=64, S=64, D=32, causal=False),
}
SEED_MEMORY_LIMIT = 6 << 30      # the seed-style code needs O(L*S); don't run it past this


def flops(case: dict) -> float:
    f = 4.0 * case["B"] * case["Hq"] * case["L"] * case["S"] * case["D"]
    return f / 2 if case.get("causal") and case["L"] > 1 else f


def kv_bytes(case: dict) -> float:
    return 2.0 * 4 * case["B"] * case["Hkv"] * case["S"] * case["D"]


def run_worker(impl: str, case: dict, threads: int, repeats: int, timeout: float) -> dict:
    env = dict(os.environ)
    env.update(FASTATTN_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    spec = json.dumps(dict(impl=impl, case=case, threads=threads, repeats=repeats))
    try:
        res = subprocess.run([sys.executable, "-m", "fastattn.bench.worker", spec], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"timed out after {timeout:.0f} s"}
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1]
        kind = "out of memory" if "MemoryError" in res.stderr or res.returncode == -9 else "failed"
        return {"impl": impl, "error": f"{kind}: {tail[:200]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(case_name: str, impls: list[str], threads: int, rounds: int, repeats: int,
            timeout: float, log=print) -> dict:
    case = CASES[case_name]
    rows = {impl: {"rounds": []} for impl in impls}
    for r in range(rounds):
        order = impls[r % len(impls):] + impls[:r % len(impls)]      # rotate: no fixed first slot
        for impl in order:
            if impl == "seed-numpy" and seed_bytes(case) > SEED_MEMORY_LIMIT:
                rows[impl]["error"] = f"skipped: needs ~{seed_bytes(case) / 2**30:.0f} GiB (O(L*S))"
                continue
            if "error" in rows[impl]:
                continue
            res = run_worker(impl, case, threads, repeats, timeout)
            if "error" in res:
                rows[impl]["error"] = res["error"]
                log(f"  {case_name} {impl}: {res['error']}")
                continue
            rows[impl]["rounds"].append(res)
    summary = {}
    torch_rounds = rows.get("torch", {}).get("rounds", [])
    for impl, row in rows.items():
        if not row["rounds"]:
            summary[impl] = {"error": row.get("error", "no result")}
            continue
        medians = [statistics.median(r["times_s"]) for r in row["rounds"]]
        t = statistics.median(medians)
        entry = {"time_ms": t * 1e3, "gflops": flops(case) / t / 1e9,
                 "gbytes_per_s": kv_bytes(case) / t / 1e9,
                 "extra_mb": statistics.median([r.get("extra_mb", float("nan")) for r in row["rounds"]]),
                 "first_call_s": row["rounds"][0]["first_call_s"]}
        if torch_rounds and len(torch_rounds) == len(row["rounds"]):
            ratios = [statistics.median(tr["times_s"]) / m for tr, m in zip(torch_rounds, medians)]
            entry["speedup_vs_torch"] = statistics.median(ratios)
        summary[impl] = entry
    return {"case": case_name, "shape": case, "results": summary}


def table(records: list[dict]) -> str:
    lines = ["| case | implementation | ms | GF/s | GB/s (K+V) | × torch | extra MB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for rec in records:
        for impl, e in rec["results"].items():
            if "error" in e:
                lines.append(f"| {rec['case']} | {impl} | {e['error']} | | | | |")
                continue
            vs = f"{e['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in e else ""
            lines.append(f"| {rec['case']} | {impl} | {e['time_ms']:.2f} | {e['gflops']:.1f} | "
                         f"{e['gbytes_per_s']:.2f} | {vs} | {e['extra_mb']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastattn.bench", description=__doc__)
    ap.add_argument("--cases", nargs="+", default=["fwd-2048-d64", "fwd-2048-d64-causal", "tiny"],
                    choices=sorted(CASES), help="cases to run")
    ap.add_argument("--impls", nargs="+", default=None, help="default: every available one")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one process each)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per process")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    impls = args.impls or available_impls()
    records = []
    for name in args.cases:
        print(f"# {name} {CASES[name]}", flush=True)
        records.append(measure(name, impls, args.threads, args.rounds, args.repeats, args.timeout))
    print(table(records))
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(),
                "processor": platform.processor(), "python": platform.python_version(),
                "threads": args.threads, "impls": impls}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
