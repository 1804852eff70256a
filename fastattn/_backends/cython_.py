"""The Cython backend: kernels compiled from csrc/ into fastattn._cykernels (OpenMP + BLAS tiles)."""
from __future__ import annotations

from ._base import Backend


class CythonBackend(Backend):
    name = "cython"
    ops = ("forward", "softmax")

    def _load(self) -> None:
        from .. import _cykernels  # noqa: F401  (built by setup.py; missing in a pure-Python install)
        self._k = _cykernels
