"""Threads for the NumPy backend: a reusable pool, and BLAS held to one thread meanwhile.

The NumPy backend's GEMMs are small tiles. Left to a 2-thread BLAS, every tile pays a thread
barrier, and on a busy machine a descheduled BLAS thread stalls the other (measured: 3-6x
slower under load). Instead, tiles run in parallel in Python threads (NumPy releases the GIL
in matmul and ufuncs), each with a single-threaded BLAS. BLAS thread counts are process-wide,
so overlapping calls share one reference-counted limit: the first call in saves the user's
setting, the last one out restores it. Without threadpoolctl, everything runs serially.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_depth = 0
_limiter = None          # the active threadpoolctl limit, while _depth > 0
_controller = None       # threadpoolctl.ThreadpoolController, created once (it scans libraries)
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _get_controller():
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _controller = False
        else:
            _controller = ThreadpoolController()
    return _controller


class single_threaded_blas:
    """Context manager: BLAS libraries use one thread inside; nested/concurrent uses share it."""

    def __enter__(self):
        global _depth, _limiter
        with _lock:
            if _depth == 0:
                ctl = _get_controller()
                _limiter = ctl.limit(limits=1, user_api="blas") if ctl else None
            _depth += 1
        return self

    def __exit__(self, *exc):
        global _depth, _limiter
        with _lock:
            _depth -= 1
            if _depth == 0 and _limiter is not None:
                _limiter.restore_original_limits()
                _limiter = None
        return False


def can_parallelize() -> bool:
    return bool(_get_controller())


def parallel_map(fn, items, n_threads: int) -> None:
    """Run fn(item) for every item on up to n_threads threads; exceptions propagate."""
    global _pool, _pool_size
    items = list(items)
    if n_threads <= 1 or len(items) <= 1 or not can_parallelize():
        for item in items:
            fn(item)
        return
    with _lock:
        if _pool is None or _pool_size != n_threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(n_threads, thread_name_prefix="fastattn"), n_threads
        pool = _pool
    with single_threaded_blas():
        for future in [pool.submit(fn, item) for item in items]:
            future.result()


def _after_fork_in_child():
    # the pool's threads do not exist in a fork child: start a fresh pool when needed
    global _pool, _pool_size, _depth, _limiter, _lock
    _pool, _pool_size, _depth, _limiter, _lock = None, 0, 0, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
