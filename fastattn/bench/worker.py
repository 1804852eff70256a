"""Run one implementation on one case in this process and print one JSON line.

    python -m fastattn.bench.worker '<json: impl, case, threads, repeats>'

Peak memory: after a warm-up call (JIT compile, thread pools, caches), the kernel's peak RSS
counter is reset (Linux /proc/self/clear_refs = 5), then one call is measured; `extra_mb` is
VmHWM minus the RSS before the call, i.e. what the call itself needed beyond its inputs.
"""
from __future__ import annotations

import json
import sys
import time


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


def main(arg: str) -> dict:
    spec = json.loads(arg)
    impl, case, threads = spec["impl"], spec["case"], int(spec["threads"])
    repeats = int(spec.get("repeats", 5))
    min_time = float(spec.get("min_time", 0.0))
    from fastattn.bench.impls import make_call

    call, _inputs = make_call(impl, case, threads)
    t0 = time.perf_counter()
    call()                                          # warm-up: compile, caches, thread pools
    first = time.perf_counter() - t0
    result = {"impl": impl, "first_call_s": first}
    if _reset_peak():
        before = _status_kb("VmRSS")
        out = call()
        peak = _status_kb("VmHWM")
        del out
        if before is not None and peak is not None:
            result["extra_mb"] = max(0.0, (peak - before) / 1024)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_time and len(times) < 100):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    result["times_s"] = times
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
