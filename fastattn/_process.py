"""Process state the compiled backends must respect: OpenMP thread pools do not survive fork.

libgomp keeps its thread pool across fork() although the threads are gone, so a child entering
a parallel region after the parent used one hangs or is terminated ("fork() called from a process
already using GNU OpenMP"). Backends record that they used a pool; after a fork, the child
knows whether that happened in the parent and avoids the pool (Cython runs its kernels on the
calling thread; Numba, whose kernels always enter the pool, declines and auto falls back).
Both compiled backends may share one libgomp (the system's, in source builds), so the record is
shared too.
"""
from __future__ import annotations

import contextlib
import os

_state = {"pool_used": False, "forked": False, "forked_after_pool_use": False,
          "openmp_passive": None}


def openmp_passive() -> bool | None:
    """Whether the libgomp the compiled backends run on sleeps between parallel regions: True
    when it was loaded under passive_openmp_wait's setting (or the user's OMP_WAIT_POLICY=
    passive), False when it spins: the user asked for it, or the extension bound to a libgomp
    another library had loaded with libgomp's default (torch's, when fastattn is built against
    the system's libgomp.so.1; a repaired wheel carries its own).  None before a backend loaded
    it, or where it cannot be told.  A sleeping pool costs a wake-up per parallel call: tens of
    microseconds on a VM."""
    return _state["openmp_passive"]


def _libgomps_loaded() -> set | None:
    """The libgomp files loaded in this process (Linux: /proc/self/maps); None: unknown."""
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None


def note_pool_used() -> None:
    _state["pool_used"] = True


def forked() -> bool:
    """This process is a fork() child of a process that had imported fastattn."""
    return _state["forked"]


def forked_after_pool_use() -> bool:
    """... and the parent had run a compiled kernel's thread pool before forking."""
    return _state["forked_after_pool_use"]


@contextlib.contextmanager
def passive_openmp_wait():
    """Have a libgomp that loads inside this block wait passively, unless the user chose.

    libgomp reads OMP_WAIT_POLICY once, when it loads. Its default spins at every barrier and
    after every parallel region, burning CPU between calls; on a busy machine the spinning
    thread holds the core that the late thread needs, and a short call takes several times as
    long (measurements: bench/results/openmp_wait.md). The variable is set only for the block,
    so the user's environment is unchanged.
    """
    set_here = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    users_passive = (os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
                     and "GOMP_SPINCOUNT" not in os.environ)
    before = _libgomps_loaded()
    if set_here:
        os.environ["OMP_WAIT_POLICY"] = "passive"
    try:
        yield
    finally:
        if set_here:
            os.environ.pop("OMP_WAIT_POLICY", None)
        after = _libgomps_loaded()
        if before is not None and after:
            if after - before:      # the import loaded one: under this block's setting
                _state["openmp_passive"] = set_here or users_passive
            elif _state["openmp_passive"] is None:
                # it bound to one loaded before, by someone else (torch's, in a source build
                # that links the system's libgomp.so.1), with the environment of then: guess
                # that it was this one
                _state["openmp_passive"] = users_passive


def _after_fork_in_child() -> None:
    _state["forked"] = True
    _state["forked_after_pool_use"] = _state["forked_after_pool_use"] or _state["pool_used"]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
