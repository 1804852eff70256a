"""A progress bar on stderr, with no dependency (tqdm is not among fastattn's requirements).

On a terminal it redraws one line; elsewhere (CI logs, pytest's captured stderr) it prints a line
only when the label's case changes, so logs stay readable.
"""
from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class Progress:
    def __init__(self, total: int, stream=None, width: int = 24):
        self.total, self.done, self.width = max(1, total), 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.monotonic()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_group = None

    def step(self, label: str) -> None:
        """Called before each unit of work starts; `label` says what it is."""
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        frac = self.done / self.total
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        eta = f", ~{_clock(left)} left" if self.done else ""
        text = f"[{bar}] {self.done}/{self.total} {_clock(elapsed)}{eta}  {label}"
        self.done += 1
        if self.tty:
            self.stream.write("\r" + text[:118].ljust(118))
        else:
            group = label.split(":")[0]
            if group == self._last_group:
                return
            self._last_group = group
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        text = f"done: {self.done} runs in {_clock(time.monotonic() - self.start)}"
        self.stream.write(("\r" + text.ljust(118) + "\n") if self.tty else text + "\n")
        self.stream.flush()
