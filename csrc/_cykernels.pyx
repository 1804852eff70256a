# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, embedsignature=True
# distutils: language = c
"""fastattn compiled kernels (one extension module).

Kernel interface: docs/KERNELS.md.  The SIMD work lives in csrc/fa_kernels.h
(AVX-512 / AVX2 / baseline copies, chosen at import by CPUID); this module does the
blocking, threading (OpenMP), masking decisions and bookkeeping.
"""

include "common.pxi"
include "problem.pxi"
include "softmax.pxi"
include "forward.pxi"
include "decode.pxi"
include "backward.pxi"

import os as _os

OPENMP_ENABLED = bool(FA_OPENMP_ENABLED)

_LEVELS = {"generic": 0, "avx2": 1, "avx512": 2}
_NAMES = {v: k for k, v in _LEVELS.items()}


def simd_levels():
    """SIMD copies this CPU can run, best last."""
    return [_NAMES[i] for i in range(fa_cpu_level() + 1)]


def set_simd(name=None):
    """Select the SIMD copy ("generic", "avx2", "avx512"; None = best).  Returns the level in
    use.  Global, not thread-safe: for tests and benchmarks."""
    want = -1 if name is None else _LEVELS[name]
    return _NAMES[fa_select(want)]


def simd():
    return fa_ops_name().decode()


def max_threads():
    return fa_omp_max_threads()


def _after_fork_in_child():
    global fa_forked_child
    fa_forked_child = 1


if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_after_fork_in_child)

_env = _os.environ.get("FASTATTN_SIMD", "").strip().lower()
set_simd(_env if _env in _LEVELS else None)
