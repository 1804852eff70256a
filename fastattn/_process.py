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

import os

_state = {"pool_used": False, "forked": False, "forked_after_pool_use": False}


def note_pool_used() -> None:
    _state["pool_used"] = True


def forked() -> bool:
    """This process is a fork() child of a process that had imported fastattn."""
    return _state["forked"]


def forked_after_pool_use() -> bool:
    """... and the parent had run a compiled kernel's thread pool before forking."""
    return _state["forked_after_pool_use"]


def _after_fork_in_child() -> None:
    _state["forked"] = True
    _state["forked_after_pool_use"] = _state["forked_after_pool_use"] or _state["pool_used"]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
