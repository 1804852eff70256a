"""Run the workers: one process per measurement, interleaved, watched, summarized.

Interleaving: each case is measured in rounds; in every round each implementation runs once, in
an order rotated from round to round (and case to case), so slow drift of this shared machine
(another job starting, the CPU clocking down) hits all implementations alike instead of the one
that always runs last. Figures are medians over rounds of the per-process median time, and the
ratio to torch is the median of per-round ratios: each ratio compares two runs made seconds apart.

A run that fails, times out or outgrows the memory cap is recorded with the reason. After a
timeout or an out-of-memory, larger cases of the same sweep are skipped for that implementation
(recorded as skipped) rather than spending the timeout again.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from . import cases as C
from .impls import SEED, TORCH, unsupported_reason
from .probes import PREFIX as PROBE_PREFIX
from .worker import RESULT_PREFIX

# seconds a JIT warm-up process may take (Runner.warm_jit): compiling, not timed
WARM_TIMEOUT_S = 600.0


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("FASTATTN_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")        # XLA's C++ startup chatter on stderr
    return env


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _package_root() -> str:
    """The directory holding the fastattn package this process imported.

    Workers run there: `python -m` puts the working directory first on sys.path, so a worker
    started in a source checkout would import the tree's fastattn/ (without its compiled
    extension) instead of the installed package this process measures.
    """
    import fastattn

    return os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))


def run_worker(spec: dict, timeout: float, mem_limit: float) -> dict:
    """Run one worker; its result dict, or {"error": ...} saying what went wrong."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "fastattn.bench.worker", json.dumps(spec)],
                                env=worker_env(int(spec["threads"])), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, cwd=_package_root())
        start, killed = time.monotonic(), None
        # Poll rather than wait: the machine is shared, so a run that would eat all memory is
        # stopped at the cap (and recorded) before the kernel's OOM killer picks a victim.
        while proc.poll() is None:
            if time.monotonic() - start > timeout:
                killed = f"timed out after {timeout:g} s"
            elif mem_limit and _rss_bytes(proc.pid) > mem_limit:
                killed = f"out of memory: over the {mem_limit / 2**30:.1f} GiB cap"
            if killed:
                proc.kill()
                proc.wait()
                return {"error": killed}
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith(RESULT_PREFIX)]
        if proc.returncode == 0 and lines:
            res = json.loads(lines[-1][len(RESULT_PREFIX):])
            res["wall_s"] = round(time.monotonic() - start, 2)    # what the bench itself costs
            return res
        tail = " ".join((err.read().strip().splitlines() or ["no output"])[-1].split())[:300]
        if proc.returncode in (-9, 137) or "MemoryError" in tail:
            return {"error": f"out of memory: killed (exit {proc.returncode}) {tail}"}
        return {"error": f"failed: exit {proc.returncode}: {tail}"}


class Runner:
    """Runs a list of cases for a list of implementations; `progress` is told about every step."""

    def __init__(self, impls, threads, rounds, min_time, max_repeats, timeout, mem_limit,
                 seed_limit, progress=None, small_probes=False, budget_s=0.0):
        self.impls, self.threads, self.rounds = list(impls), threads, rounds
        # a shared machine can be much slower than planned; the budget keeps the run bounded
        self.budget_s, self.deadline = budget_s, (time.monotonic() + budget_s if budget_s else 0)
        self.min_time, self.max_repeats = min_time, max_repeats
        self.timeout, self.mem_limit, self.seed_limit = timeout, mem_limit, seed_limit
        self.progress = progress
        self.small_probes = small_probes
        self._gave_up: dict[tuple, str] = {}      # (sweep, impl) -> why larger cases are skipped
        self._rate: dict[tuple, tuple] = {}       # (sweep, impl) -> (GF/s, size) last measured

    def steps(self, case_list, probe_rounds: int) -> int:
        cases = self.rounds * len(case_list) * len(self.impls)
        return probe_rounds * len(self.probe_names()) + cases

    @staticmethod
    def probe_names():
        from .probes import probes
        return probes()

    def _spec(self, impl: str, case=None) -> dict:
        spec = dict(impl=impl, threads=self.threads, min_time=self.min_time,
                    max_repeats=self.max_repeats, small=self.small_probes)
        if case is not None:
            spec["case"] = case.to_dict()
        return spec

    def warm_jit(self, case_list) -> None:
        """Compile the JIT implementations' kernels before anything is timed, all at once.

        numba compiles a kernel family the first time a process calls it (15-55 s each, the
        decode family the longest) and caches it on disk; the timed workers would otherwise do
        it one after the other, in their untimed warm-up calls. One small case per kind of call
        (forward, decode, backward) compiles the same specializations: the kernels' argument
        types do not depend on the sizes. With a warm cache this costs about a second.
        These processes get WARM_TIMEOUT_S, not the timed runs' timeout: the three compile
        side by side, and on two cores the decode family's took longer than the quick preset's
        60 s (a fresh clone's README benchmark then recorded numba's decode as timed out, the
        killed compile having cached nothing).
        """
        jit = [i for i in self.impls if i == "fastattn-numba"]
        kinds = {}
        for c in case_list:
            key = (c.kind, c.is_decode)
            if key not in kinds:
                L = c.L if c.is_decode else min(c.L, 64)
                kinds[key] = dataclasses.replace(c, L=L, S=min(c.S, 128))
        jobs = [(impl, case) for impl in jit for case in kinds.values()]
        if not jobs:
            return
        print(f"compiling (or loading from cache) {', '.join(jit)}'s kernels ...", file=sys.stderr)
        warm = dict(min_time=0.0, max_repeats=1)
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: run_worker({**self._spec(job[0], job[1]), **warm},
                                                 max(self.timeout, WARM_TIMEOUT_S),
                                                 self.mem_limit), jobs))

    def _tick(self, label: str) -> None:
        if self.progress:
            self.progress.step(label)

    def run_probes(self, rounds: int, runs: dict | None = None) -> dict:
        """Add `rounds` runs of every probe to `runs` ({probe: [results]}) and return it."""
        runs = runs if runs is not None else {name: [] for name in self.probe_names()}
        for _ in range(rounds):
            for name in runs:
                self._tick(name)
                runs[name].append(run_worker(self._spec(name), self.timeout, self.mem_limit))
        return runs

    def _skip_reason(self, impl: str, case: C.Case) -> str:
        why = unsupported_reason(impl, case)
        if why:
            return why
        if impl == SEED and C.seed_bytes(case) > self.seed_limit:
            return (f"skipped: the dense scores need ~{C.seed_bytes(case) / 2**30:.1f} GiB "
                    f"(limit {self.seed_limit / 2**30:.0f} GiB)")
        if self.deadline and time.monotonic() > self.deadline:
            return f"skipped: the run's time budget ({self.budget_s / 60:.0f} min) was spent"
        if (case.sweep, impl) in self._rate:
            # a worker makes at least two calls (warm-up, timed): don't start one that the rate
            # measured on the previous size says will run into the timeout
            gflops, size = self._rate[(case.sweep, impl)]
            per_call = C.flops(case) / (gflops * 1e9)
            if 2 * per_call > self.timeout:
                return (f"skipped: at the {gflops:.1f} GF/s measured at {size} one call would take"
                        f" ~{per_call:.0f} s (timeout {self.timeout:g} s)")
        return self._gave_up.get((case.sweep, impl), "")

    def run_case(self, case: C.Case, index: int) -> dict:
        runs = {impl: [] for impl in self.impls}
        errors: dict[str, str] = {}
        for r in range(self.rounds):
            shift = (r + index) % len(self.impls)
            for impl in self.impls[shift:] + self.impls[:shift]:
                self._tick(f"{case.name}: {impl}")
                if impl in errors:
                    continue
                skip = self._skip_reason(impl, case)
                if skip:
                    errors[impl] = skip
                    continue
                res = run_worker(self._spec(impl, case), self.timeout, self.mem_limit)
                if "error" in res:
                    errors[impl] = res["error"] if not runs[impl] else (
                        f"round {r + 1}: {res['error']}")
                    if res["error"].startswith(("timed out", "out of memory")):
                        self._gave_up[(case.sweep, impl)] = (
                            f"skipped: {res['error']} at {_size(case)}")
                    continue
                res["round"] = r
                runs[impl].append(res)
                rate = C.flops(case) / min(res["times_s"]) / 1e9
                prev = self._rate.get((case.sweep, impl), (rate, ""))[0]
                self._rate[(case.sweep, impl)] = (min(rate, prev) if r else rate, _size(case))
        return summarize_case(case, runs, errors)


def _size(case: C.Case) -> str:
    return f"S={case.S}" if case.is_decode else f"L={case.L}"


def cost_order(case_list) -> list[int]:
    """Indices of the cases, cheapest first (stable): if the time budget runs out, only the
    largest cases are lost, and each sweep's sizes run in increasing order."""
    def cost(i):
        return C.flops(case_list[i]) + C.min_bytes(case_list[i])
    return sorted(range(len(case_list)), key=cost)


def summarize_probes(runs: dict) -> dict:
    """Median rate of each probe; the peaks every figure is compared to."""
    out: dict = {}
    for name, results in runs.items():
        key = name[len(PROBE_PREFIX):]
        ok = [r for r in results if "error" not in r]
        if not ok:
            out[key] = {"error": results[-1]["error"] if results else "not run"}
            continue
        t = statistics.median(statistics.median(r["times_s"]) for r in ok)
        rate = ok[0]["work"] / t / 1e9
        out[key] = {"gflops" if ok[0]["unit"] == "flop" else "gbytes_per_s": rate,
                    "rounds": len(ok)}
    sgemm = [v["gflops"] for k, v in out.items() if k.startswith("sgemm") and "gflops" in v]
    out["sgemm_peak_gflops"] = max(sgemm) if sgemm else None
    out["bandwidth_gbytes_per_s"] = out.get("bandwidth", {}).get("gbytes_per_s")
    return out


def summarize_case(case: C.Case, runs: dict, errors: dict) -> dict:
    flop, nbytes = C.flops(case), C.min_bytes(case)
    per_round = {impl: {r["round"]: statistics.median(r["times_s"]) for r in rs}
                 for impl, rs in runs.items()}
    torch_rounds = per_round.get(TORCH, {})
    results = {}
    for impl, rs in runs.items():
        entry: dict = {}
        if rs:
            t = statistics.median(per_round[impl].values())
            entry = {"time_ms": t * 1e3, "gflops": flop / t / 1e9, "gbytes_per_s": nbytes / t / 1e9,
                     "first_call_s": rs[0]["first_call_s"], "rounds": len(rs),
                     "times_s": [r["times_s"] for r in rs]}
            mems = [r["extra_mb"] for r in rs if "extra_mb" in r]
            if mems:
                entry["extra_mb"] = statistics.median(mems)
            # rounds where torch ran too: each ratio compares two runs made seconds apart
            paired = [t_r / torch_rounds[r] for r, t_r in per_round[impl].items()
                      if r in torch_rounds]
            if paired:
                entry["time_vs_torch"] = statistics.median(paired)
        if impl in errors:
            entry["error"] = errors[impl]
        results[impl] = entry
    return {"case": case.name, "sweep": case.sweep, "shape": case.to_dict(), "flops": flop,
            "bytes": nbytes, "results": results}


def add_peak_fractions(records: list[dict], probes: dict) -> None:
    """% of the measured sgemm peak and read bandwidth, once the probes are all in."""
    peak, bw = probes.get("sgemm_peak_gflops"), probes.get("bandwidth_gbytes_per_s")
    for rec in records:
        for entry in rec["results"].values():
            if "gflops" in entry and peak:
                entry["pct_sgemm"] = 100 * entry["gflops"] / peak
            if "gbytes_per_s" in entry and bw:
                entry["pct_bandwidth"] = 100 * entry["gbytes_per_s"] / bw
