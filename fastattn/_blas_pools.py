"""What `python -m fastattn info` says about the BLAS pools that share the cores with fastattn.

A NumPy model calls `x @ W` (NumPy's BLAS) and then attention, in every layer. OpenBLAS's
pthreads workers busy-wait after each call (for 2**OPENBLAS_THREAD_TIMEOUT TSC ticks, 2**28
by default: ~0.1 s), so an attention call made then shares a core with a spinning thread.
fastattn's own pool does not wait for a helper that has not started (csrc/fa_pool.h), which
removes most of that cost, but a helper that does run on the spinner's core gets half of it.
The setting that removes the rest is the user's to make (fastattn never changes a BLAS setting
behind the user's back): OPENBLAS_THREAD_TIMEOUT=4, read when OpenBLAS loads, i.e. before
numpy is imported. Measurements: bench/results/numpy_loop.md.

Or, asked for (`fastattn.share_blas_threads()`, or FASTATTN_SHARE_BLAS_THREADS=1 in the
environment when fastattn is imported): OpenBLAS >= 0.3.27 runs its parallel regions on
fastattn's pool through its threads callback (csrc/fa_blaspool.h), so a matmul and the
attention call after it share one set of threads and nothing spins on a core either needs.
The same jobs with the same partitioning: the same bits.
"""
from __future__ import annotations

import os
import threading

# OpenBLAS's setter, by the symbol suffixes its builds use (plain, numpy's scipy-openblas
# 64-bit-integer and 32-bit-integer builds)
_SETTERS = ("openblas_set_threads_callback_function",
            "scipy_openblas_set_threads_callback_function64_",
            "scipy_openblas_set_threads_callback_function")
_lock = threading.Lock()
_shared: dict = {}              # library path -> its setter (a ctypes function), while shared


def _loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process (/proc/self/maps: no
    threadpoolctl needed, nothing loaded that is not already)."""
    try:
        with open("/proc/self/maps") as f:
            fields = (line.split(None, 5) for line in f)
            paths = {x[5].strip() for x in fields if len(x) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if "openblas" in os.path.basename(p).lower()
                  and ".so" in os.path.basename(p))


def _setter(path: str):
    import ctypes                  # here, not at import: `import fastattn` stays light
    lib = ctypes.CDLL(path)                       # already loaded: the same handle
    for name in _SETTERS:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p]
            fn.restype = None
            return fn
    return None


def share_blas_threads(enable: bool = True) -> list[str]:
    """Run OpenBLAS's parallel regions on fastattn's thread pool (enable=False: give them back
    to OpenBLAS's own threads). Returns the OpenBLAS libraries that now do so.

    Why: after every call OpenBLAS's idle workers busy-wait ~0.1 s on the other cores, and an
    attention call made then waits for a core it cannot get (README, "Threads"). On the pool,
    the BLAS call and the attention call share the same threads. Results are unchanged (the
    same jobs, partitioned as before). Needs OpenBLAS >= 0.3.27 with pthreads (numpy's wheels)
    and the compiled kernels; a library without the setter is left as it is. Calls from
    several Python threads at once go through one at a time. Process-wide, like every BLAS
    setting: call it once, early (no BLAS call may be running in another thread meanwhile).
    It covers every OpenBLAS loaded at the time (NumPy's, SciPy's own); one loaded later
    keeps its threads until this is called again."""
    try:
        from ._backends.cython_ import _import_kernels
        address = _import_kernels()._blas_callback_address()
    except ImportError:                            # no compiled kernels: nothing to share
        address = 0
    with _lock:
        if not enable:
            for fn in _shared.values():
                fn(None)
            _shared.clear()
            return []
        if not address:
            return []
        for path in _loaded_openblas():
            if path in _shared:
                continue
            fn = _setter(path)
            if fn is not None:
                fn(address)
                _shared[path] = fn
        return sorted(_shared)


def blas_threads_shared() -> list[str]:
    """The OpenBLAS libraries whose parallel regions run on fastattn's pool."""
    return sorted(_shared)


def share_from_environment() -> None:
    """FASTATTN_SHARE_BLAS_THREADS=1 at import: share_blas_threads() (the user's choice, made
    where a script's code cannot, e.g. a bench or an outside harness)."""
    if os.environ.get("FASTATTN_SHARE_BLAS_THREADS", "").strip() in ("1", "true", "yes"):
        share_blas_threads(True)

# the exponent at or below which OpenBLAS's workers sleep almost at once (the variable is
# clamped to 4..30; 2**8 ticks is ~0.1 us)
_QUICK_SLEEP_EXPONENT = 8


def blas_pools() -> list[dict]:
    """threadpoolctl's view of the BLAS libraries loaded in this process (empty without it)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    return [p for p in threadpool_info() if p.get("user_api") == "blas"]


def openblas_spin_exponent() -> int | None:
    """OPENBLAS_THREAD_TIMEOUT as OpenBLAS reads it (clamped to 4..30), or None when unset
    or not a number (OpenBLAS then keeps its default, 28)."""
    raw = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "").strip()
    try:
        value = int(raw)
    except ValueError:
        return None
    return min(30, max(4, value))


def report() -> list[str]:
    """Lines for `python -m fastattn info`: each BLAS pool, and whether its idle workers spin."""
    pools = blas_pools()
    if not pools:
        return ["blas pools: none found (threadpoolctl sees no BLAS library loaded)"]
    lines = ["blas pools beside fastattn (threadpoolctl):"]
    exponent = openblas_spin_exponent()
    for p in pools:
        name = p.get("internal_api", "?")
        layer = p.get("threading_layer", "?")
        lines.append(f"  {name} {p.get('version') or ''} {layer}, {p.get('num_threads')} threads "
                     f"({os.path.basename(p.get('filepath', ''))})".replace("  ,", ","))
        if p.get("filepath") in _shared:
            lines.append("    its parallel regions run on fastattn's pool "
                         "(share_blas_threads / FASTATTN_SHARE_BLAS_THREADS=1)")
        elif name == "openblas" and layer == "pthreads" and (p.get("num_threads") or 1) > 1:
            if exponent is not None and exponent <= _QUICK_SLEEP_EXPONENT:
                lines.append(f"    idle workers sleep at once (OPENBLAS_THREAD_TIMEOUT={exponent})")
            else:
                now = "unset" if exponent is None else f"={exponent}"
                lines.append(f"    idle workers spin for 2**{exponent or 28} cycles after each call "
                             f"(OPENBLAS_THREAD_TIMEOUT {now}): fastattn called right after a "
                             f"NumPy matmul shares a core with them; OPENBLAS_THREAD_TIMEOUT=4 in "
                             f"the environment before numpy loads stops that, or "
                             f"fa.share_blas_threads() / FASTATTN_SHARE_BLAS_THREADS=1 runs "
                             f"OpenBLAS's work on fastattn's pool (README)")
    return lines
