"""Environment settings read by fastattn (one place, so they are easy to find).

FASTATTN_BACKEND      default backend name ("auto", "cython", "numba", "numpy")
FASTATTN_NUM_THREADS  threads the kernels use, 1..65536 (default: the CPUs this process may run on)
FASTATTN_REQUIRE      comma-separated backend names that must be available; a missing one is an
                      error instead of a silent fallback (CI sets it)

They are read once, at the first call that needs them, not per call: reading os.environ three
times and the CPU affinity once cost ~3 us of a ~10 us decode step. A program (or test) that
changes them afterwards calls `fastattn.reload_environment()`; `fastattn.set_backend()` re-reads
them too. An invalid value raises at every call that needs it, with the same message, until it
is fixed and re-read.
"""
from __future__ import annotations

import os

BACKEND_NAMES = ("cython", "numba", "numpy")
# The kernels take the thread count as a C int (2**31 overflowed there, naming nothing) and no
# machine runs more threads usefully: a larger FASTATTN_NUM_THREADS is a mistake, so say so.
MAX_THREADS = 1 << 16


class _Settings:
    """One reading of the environment: the raw strings, and the thread count (or its error)."""

    __slots__ = ("backend", "require", "threads", "threads_error")

    def __init__(self):
        raw = os.environ.get("FASTATTN_BACKEND", "").strip().lower()
        self.backend = raw or None
        raw = os.environ.get("FASTATTN_REQUIRE", "")
        self.require = tuple(name.strip().lower() for name in raw.split(",") if name.strip())
        self.threads, self.threads_error = _parse_threads(
            os.environ.get("FASTATTN_NUM_THREADS", "").strip())


_settings: _Settings | None = None


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _parse_threads(raw: str):
    if not raw:
        return _cpu_count(), None
    try:
        n = int(raw)
    except ValueError:
        return 0, f"FASTATTN_NUM_THREADS must be a positive integer, got {raw!r}"
    if not 1 <= n <= MAX_THREADS:
        return 0, (f"FASTATTN_NUM_THREADS must be a positive integer <= {MAX_THREADS}, "
                   f"got {raw!r}")
    return n, None


def reload_environment() -> None:
    """Re-read FASTATTN_BACKEND, FASTATTN_NUM_THREADS, FASTATTN_REQUIRE and the CPU affinity."""
    global _settings
    _settings = _Settings()


def settings() -> _Settings:
    s = _settings
    if s is None:
        reload_environment()
        s = _settings
    return s


def num_threads() -> int:
    """Threads for the compiled kernels: FASTATTN_NUM_THREADS, else the usable CPU count."""
    s = _settings or settings()
    if s.threads_error:
        raise ValueError(s.threads_error)
    return s.threads


def env_backend() -> str | None:
    return (_settings or settings()).backend


def required_backends() -> list[str]:
    return list((_settings or settings()).require)
