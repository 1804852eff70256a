"""Environment settings read by fastattn (one place, so they are easy to find).

FASTATTN_BACKEND      default backend name ("auto", "cython", "numba", "numpy")
FASTATTN_NUM_THREADS  threads the compiled kernels use (default: the CPUs this process may run on)
FASTATTN_REQUIRE      comma-separated backend names that must be available; a missing one is an
                      error instead of a silent fallback (CI sets it)
"""
from __future__ import annotations

import os

BACKEND_NAMES = ("cython", "numba", "numpy")


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def num_threads() -> int:
    """Threads for the compiled kernels: FASTATTN_NUM_THREADS, else the usable CPU count."""
    raw = os.environ.get("FASTATTN_NUM_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(
                f"FASTATTN_NUM_THREADS must be a positive integer, got {raw!r}") from None
        if n < 1:
            raise ValueError(f"FASTATTN_NUM_THREADS must be a positive integer, got {raw!r}")
        return n
    return _cpu_count()


def env_backend() -> str | None:
    raw = os.environ.get("FASTATTN_BACKEND", "").strip().lower()
    return raw or None


def required_backends() -> list[str]:
    raw = os.environ.get("FASTATTN_REQUIRE", "")
    return [name.strip().lower() for name in raw.split(",") if name.strip()]
