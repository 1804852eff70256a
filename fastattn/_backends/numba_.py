"""The Numba backend: @njit kernels in fastattn._numba, compiled on first use and cached."""
from __future__ import annotations

from ._base import Backend


class NumbaBackend(Backend):
    name = "numba"
    ops = ("forward", "softmax")

    def _load(self) -> None:
        import numba  # noqa: F401  (optional dependency: pip install fastattn[numba])
        from .._numba import forward  # noqa: F401
        self._k = forward
