"""Kernel defects of issue 14 that their owners are fixing: the tests and the fuzzer keep these
input classes, and skip exactly them, by name, until the fix lands (then delete the entry).

Each entry: (backend, defect) -> why, citing the issue item.
"""
from __future__ import annotations

import pytest

KNOWN_DEFECTS: dict = {}


def skip_known(backend: str, defect: str) -> None:
    """pytest.skip when (backend, defect) is a listed known defect."""
    why = KNOWN_DEFECTS.get((backend, defect))
    if why is not None:
        pytest.skip(f"KNOWN_DEFECTS: {why}")
