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
_pool_users: dict = {}   # pool -> calls using it (a replaced pool is shut down when it reaches 0)


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


class _Cancelled(Exception):
    """Raised inside a work item by check_cancelled() once its call was abandoned."""


_item_state = threading.local()     # .cancel: the Event of the call whose item this thread runs


def check_cancelled() -> None:
    """Called by work items between blocks: stop early when the caller has gone (Ctrl-C).

    Without it an interrupted call's items kept the pool computing for seconds after the
    KeyboardInterrupt, and the interpreter's exit waited for them.
    """
    cancel = getattr(_item_state, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise _Cancelled


def _acquire_pool(n_threads: int) -> ThreadPoolExecutor:
    """The shared pool for n_threads, counted as in use until _release_pool.

    A pool replaced because another call asked for a different size is shut down only when its
    last user is done: shutting it down under a call that had already taken it made that call's
    submit fail ("cannot schedule new futures after shutdown").
    """
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != n_threads:
            old = _pool
            _pool, _pool_size = ThreadPoolExecutor(n_threads, thread_name_prefix="fastattn"), n_threads
            if old is not None and not _pool_users.get(old):
                _pool_users.pop(old, None)
                old.shutdown(wait=False)
        pool = _pool
        _pool_users[pool] = _pool_users.get(pool, 0) + 1
    return pool


def _release_pool(pool: ThreadPoolExecutor) -> None:
    with _lock:
        _pool_users[pool] -= 1
        if not _pool_users[pool] and pool is not _pool:
            del _pool_users[pool]
            pool.shutdown(wait=False)


def parallel_map(fn, items, n_threads: int) -> None:
    """Run fn(item) for every item on up to n_threads threads; exceptions propagate.

    If the caller is interrupted (KeyboardInterrupt while waiting) or an item fails, the items
    not started are cancelled and the running ones stop at their next check_cancelled().
    """
    items = list(items)
    if n_threads <= 1 or len(items) <= 1 or not can_parallelize():
        for item in items:
            fn(item)
        return
    cancel = threading.Event()

    def run(item):
        if cancel.is_set():
            return
        _item_state.cancel = cancel
        try:
            fn(item)
        except _Cancelled:
            pass
        finally:
            _item_state.cancel = None

    pool = _acquire_pool(n_threads)
    try:
        with single_threaded_blas():
            futures = [pool.submit(run, item) for item in items]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                cancel.set()
                for future in futures:
                    future.cancel()
                raise
    finally:
        _release_pool(pool)


def _after_fork_in_child():
    # the pool's threads do not exist in a fork child: start a fresh pool when needed
    global _pool, _pool_size, _depth, _limiter, _lock, _pool_users
    _pool, _pool_size, _depth, _limiter, _lock = None, 0, 0, None, threading.Lock()
    _pool_users = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
