"""Kernel defects of issue 14 that their owners are fixing: the tests and the fuzzer keep these
input classes, and skip exactly them, by name, until the fix lands (then delete the entry).

Each entry: (backend, defect) -> why, citing the issue item.
"""
from __future__ import annotations

import pytest

KNOWN_DEFECTS = {
    ("cython", "nan_in_attended_input"):
        "issue 14 item 1: cython gives the fully-masked answer (0, lse -inf) for a row whose "
        "attended q/k holds NaN/Inf, instead of NaN",
    ("numba", "large_scores"):
        "issue 14 item 2: numba's exp2 with the scale folded into an FMA gives NaN or 0 rows for "
        "large finite scores (|scale * q.k| >~ 1e7 in float32, 1e10 in float64, or scale * log2(e) "
        "beyond the dtype's max)",
    ("numba", "softcap_backward_nan"):
        "issue 14 item 4: numba's float64 softcap backward lets a NaN in a key no query attends "
        "into dq/dk",
    ("numba", "backward_one_key_not_zero"):
        "issue 14 item 6 (found by the reliability tests, not in the issue's list): where a row "
        "attends one key, numba's backward gives dq/dk of ~1e-7 (float32 with dropout) or ~1e-15 "
        "(float64, every option) instead of exactly 0 (cython and numpy give 0)",
}


def skip_known(backend: str, defect: str) -> None:
    """pytest.skip when (backend, defect) is a listed known defect."""
    why = KNOWN_DEFECTS.get((backend, defect))
    if why is not None:
        pytest.skip(f"KNOWN_DEFECTS: {why}")
