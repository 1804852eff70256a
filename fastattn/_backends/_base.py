"""What every backend is: a name, an import that may fail, and the operations it serves."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackendInfo:
    """What fa.backends() reports for one backend."""

    name: str
    available: bool
    reason: str                      # why it is not available ("" when it is)
    details: dict = field(default_factory=dict)   # e.g. OpenMP, threading layer, versions

    def __str__(self) -> str:
        state = "available" if self.available else f"unavailable: {self.reason}"
        extra = ", ".join(f"{k}={v}" for k, v in self.details.items())
        return f"{self.name}: {state}" + (f" ({extra})" if extra else "")


class Backend:
    """Base class. Subclasses set `name` and implement `_load` and the operations.

    Operations (all arrays C-contiguous, float32 or float64, see fastattn._inputs.Problem):
      forward(problem)                         -> out (B,Hq,L,Ev), lse (B,Hq,L)
      backward(problem, grad_out, out, lse)    -> dq, dk, dv (canonical shapes), dsinks (Hq,) or None
      softmax_rows(x (R,C), keep (R,C) bool or None) -> (R,C)
    """

    name = "?"
    ops = ("forward", "softmax")

    def __init__(self):
        self._loaded = False
        self._error: str | None = None

    # -- availability --------------------------------------------------------------------------
    def _load(self) -> None:
        """Import what the backend needs; raise ImportError (or anything) when it can't."""

    def load(self) -> bool:
        if not self._loaded:
            self._loaded = True
            try:
                self._load()
            except Exception as exc:  # any failure to import is reported, never raised here
                self._error = f"{type(exc).__name__}: {exc}".strip()
        return self._error is None

    @property
    def available(self) -> bool:
        return self.load()

    @property
    def reason(self) -> str:
        self.load()
        return self._error or ""

    def details(self) -> dict:
        return {}

    def info(self) -> BackendInfo:
        ok = self.load()
        return BackendInfo(self.name, ok, self._error or "", self.details() if ok else {})

    def not_supported_reasons(self, problem, op: str) -> list[str]:
        """Plain-words reasons this backend cannot serve `op` for `problem` (empty: it can)."""
        reasons = []
        if self._loaded and self._error is None and op in self.ops:
            return reasons                       # loaded and serves op: the per-call case
        if not self.load():
            reasons.append(f"{self.name} is not available ({self._error})")
        if op not in self.ops:
            reasons.append(f"{self.name} has no {op} kernel")
        return reasons

    def __repr__(self) -> str:
        return f"<fastattn backend {self.name}>"
