"""What the numbers were measured on: machine, CPU, versions, threads, date, command line."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import time
from importlib import metadata

PACKAGES = ("fastattn", "numpy", "scipy", "numba", "torch", "jax", "jaxlib", "matplotlib")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The commit of the fastattn source tree, when it runs from a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        res = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (res.stdout.strip() or None) if res.returncode == 0 else None


def load_average() -> list | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def describe(threads: int, argv: list[str]) -> dict:
    import fastattn as fa

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": "python -m fastattn.bench " + " ".join(shlex.quote(a) for a in argv),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": memory_gib(),
        "threads": threads,
        "versions": versions(),
        "fastattn_commit": git_commit(),
        "backends": {n: str(info) for n, info in fa.backends().items()},
        "load_average_start": load_average(),
    }
