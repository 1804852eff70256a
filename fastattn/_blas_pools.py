"""What `python -m fastattn info` says about the BLAS pools that share the cores with fastattn.

A NumPy model calls `x @ W` (NumPy's BLAS) and then attention, in every layer. OpenBLAS's
pthreads workers busy-wait after each call (for 2**OPENBLAS_THREAD_TIMEOUT TSC ticks, 2**28
by default: ~0.1 s), so an attention call made then shares a core with a spinning thread.
fastattn's own pool does not wait for a helper that has not started (csrc/fa_pool.h), which
removes most of that cost, but a helper that does run on the spinner's core gets half of it.
The setting that removes the rest is the user's to make (fastattn never changes a BLAS setting
behind the user's back): OPENBLAS_THREAD_TIMEOUT=4, read when OpenBLAS loads, i.e. before
numpy is imported. Measurements: bench/results/numpy_loop.md.
"""
from __future__ import annotations

import os

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
        if name == "openblas" and layer == "pthreads" and (p.get("num_threads") or 1) > 1:
            if exponent is not None and exponent <= _QUICK_SLEEP_EXPONENT:
                lines.append(f"    idle workers sleep at once (OPENBLAS_THREAD_TIMEOUT={exponent})")
            else:
                now = "unset" if exponent is None else f"={exponent}"
                lines.append(f"    idle workers spin for 2**{exponent or 28} cycles after each call "
                             f"(OPENBLAS_THREAD_TIMEOUT {now}): fastattn called right after a "
                             f"NumPy matmul shares a core with them; OPENBLAS_THREAD_TIMEOUT=4 in "
                             f"the environment before numpy loads stops that (README)")
    return lines
