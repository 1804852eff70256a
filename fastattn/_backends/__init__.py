"""Backend registry and dispatch.

Which backend serves a call, first match wins:
  1. the call's `backend=` argument
  2. `with fastattn.use_backend(name):` (a contextvar, so threads and tasks don't leak into each other)
  3. `fastattn.set_backend(name)` (process-wide)
  4. the FASTATTN_BACKEND environment variable (read once: see fastattn._config)
  5. "auto": the fastest backend that can serve this shape; it never fails for a missing backend
     (numpy is always there)

A backend named explicitly that cannot serve the call raises BackendUnavailableError listing why.
FASTATTN_REQUIRE=cython,numba makes a missing backend an error even under auto.
Compiled backends are imported lazily, on first use (importing numba alone costs ~0.5 s).
"""
from __future__ import annotations

import contextlib
import contextvars

from .. import _config
from ._base import Backend, BackendInfo
from .cython_ import CythonBackend
from .numba_ import NumbaBackend
from .numpy_ import NumpyBackend

__all__ = ["Backend", "BackendInfo", "BackendUnavailableError", "backends", "get_backend",
           "set_backend", "use_backend", "reload_environment", "resolve", "registry"]

registry: dict[str, Backend] = {b.name: b for b in (CythonBackend(), NumbaBackend(), NumpyBackend())}
assert tuple(registry) == _config.BACKEND_NAMES

_context_choice: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fastattn_backend", default=None)
_process_choice: str | None = None
_required_checked: tuple | None = None


class BackendUnavailableError(RuntimeError):
    """An explicitly requested (or FASTATTN_REQUIRE'd) backend cannot serve the call."""


def _check_name(name, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a backend name (str), got {type(name).__name__} {name!r}")
    key = name.strip().lower()
    if key not in registry and key != "auto":
        raise ValueError(
            f"{what}: unknown backend {name!r}; choose one of 'auto', " +
            ", ".join(repr(n) for n in registry))
    return key


def backends() -> dict[str, BackendInfo]:
    """{name: BackendInfo} for every backend, trying to load each (imports numba if installed)."""
    return {name: b.info() for name, b in registry.items()}


def get_backend() -> str:
    """The backend name in effect for calls without `backend=` ("auto" unless set)."""
    name = _context_choice.get() or _process_choice
    if name:
        return name
    env = _config.env_backend()
    return _check_name(env, "FASTATTN_BACKEND") if env else "auto"


def set_backend(name: str | None) -> None:
    """Set the process-wide default backend ("auto", a backend name, or None to clear).

    Also re-reads the FASTATTN_* environment variables (see reload_environment)."""
    global _process_choice
    _process_choice = None if name is None else _check_name(name, "set_backend")
    _config.reload_environment()


def reload_environment() -> None:
    """Re-read FASTATTN_BACKEND, FASTATTN_NUM_THREADS and FASTATTN_REQUIRE.

    fastattn reads them once, at its first call, so that a call does not pay for environment
    lookups; a program that changes them later calls this (set_backend does it too)."""
    _config.reload_environment()


@contextlib.contextmanager
def use_backend(name: str):
    """Use `name` for calls inside the block (in this thread/task only)."""
    token = _context_choice.set(_check_name(name, "use_backend"))
    try:
        yield registry.get(name.strip().lower())
    finally:
        _context_choice.reset(token)


def _check_required() -> None:
    """FASTATTN_REQUIRE: fail loudly when a backend that must be there isn't."""
    global _required_checked
    required = _config.settings().require
    if required is _required_checked:         # the same reading of the environment: checked
        return
    for name in required:
        key = _check_name(name, "FASTATTN_REQUIRE")
        if key != "auto" and not registry[key].available:
            raise BackendUnavailableError(
                f"FASTATTN_REQUIRE lists {key!r} but it is not available: {registry[key].reason}")
    _required_checked = required


def auto_order(problem, op: str) -> tuple[str, ...]:
    """Backends to try under "auto", fastest first, for this op and shape.

    The order comes from side-by-side measurements, recorded in bench/results/auto_order.md:
    cython was as fast as or faster than numba in every shape class measured (decode, backward,
    small batches; long forward within noise either way) and has no JIT wait, so one order
    serves every op and shape. The function stays per (problem, op) so a
    shape class that measures differently can get its own order here.
    """
    return _AUTO_ORDER


_AUTO_ORDER = ("cython", "numba", "numpy")


def resolve(problem, op: str, backend=None) -> Backend:
    """The backend that will run `op` on `problem`."""
    name = _check_name(backend, "backend") if backend is not None else get_backend()
    _check_required()
    if name != "auto":
        chosen = registry[name]
        reasons = chosen.not_supported_reasons(problem, op)
        if reasons:
            raise BackendUnavailableError(
                f"backend {name!r} cannot run {op}: " + "; ".join(reasons))
        return chosen
    for candidate in auto_order(problem, op):
        b = registry[candidate]
        if not b.not_supported_reasons(problem, op):
            return b
    return registry["numpy"]
