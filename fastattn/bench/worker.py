"""Run one implementation (or one probe) on one case in this process; print one result line.

    python -m fastattn.bench.worker '<json: impl, case, threads, min_time, max_repeats>'

A fresh process per measurement keeps one implementation's thread pools, JIT caches, allocator
state and memory peak away from the next one's.

Timing: one warm-up call (JIT compilation, thread pools, first-touch of buffers) is reported as
`first_call_s` and not timed; then timed calls until `min_time` seconds have passed (at least
one, at most `max_repeats`).

Peak memory: before the first timed call, freed heap memory is returned to the OS (malloc_trim,
else the warm-up's freed buffers would be reused without raising the RSS) and the kernel's peak
RSS counter is reset (/proc/self/clear_refs = 5); `extra_mb` is the peak RSS during that call
minus the RSS before it: what the call needed beyond its inputs, its output included.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import time

RESULT_PREFIX = "BENCH-RESULT "


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_free_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass                                      # not glibc: the peak may read a little low


def pin_threads(threads: int) -> None:
    """Run on `threads` CPUs, so libraries that size their pools by the CPUs they may use (XLA)
    use the same count as those told through environment variables and set_num_threads."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        if threads < len(cpus):
            os.sched_setaffinity(0, cpus[:threads])
    except (AttributeError, OSError):
        pass


def measure(call, min_time: float, max_repeats: int) -> dict:
    t0 = time.perf_counter()
    result = call()                                     # warm-up
    first = time.perf_counter() - t0
    del result
    gc.collect()
    _release_free_heap()
    res = {"first_call_s": first}
    before = _status_kb("VmRSS")
    peak_ok = _reset_peak()
    times = []
    t0 = time.perf_counter()
    result = call()
    times.append(time.perf_counter() - t0)
    peak = _status_kb("VmHWM")
    del result
    if peak_ok and before is not None and peak is not None:
        res["extra_mb"] = max(0.0, (peak - before) / 1024)
    start = time.perf_counter()
    while len(times) < max_repeats and time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    res["times_s"] = times
    return res


def run(spec: dict) -> dict:
    threads = int(spec["threads"])
    pin_threads(threads)
    impl = spec["impl"]
    from .probes import PREFIX, make_probe

    try:
        if impl.startswith(PREFIX):
            call, work, unit = make_probe(impl, threads, small=bool(spec.get("small")))
            res = {"work": work, "unit": unit}
        else:
            from .cases import Case
            from .impls import make_call

            call = make_call(impl, Case.from_dict(spec["case"]), threads)
            res = {}
        res.update(measure(call, float(spec.get("min_time", 0.0)), int(spec.get("max_repeats", 5))))
    except MemoryError as exc:
        return {"error": f"out of memory: MemoryError {exc}".strip()}
    except Exception as exc:       # recorded in the results, not raised: a failure is a result
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        return {"error": f"failed: {msg[:300]}"}
    return res


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
