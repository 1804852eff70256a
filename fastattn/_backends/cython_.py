"""The Cython backend: kernels compiled from csrc/ into fastattn._cykernels.

Register-blocked SIMD kernels (AVX-512 / AVX2 / baseline copies chosen at import by CPUID)
under OpenMP; no BLAS, so no BLAS thread pool to fight with. Missing in a pure-Python install
or when the compile failed: fa.backends()["cython"] then says why.
"""
from __future__ import annotations

import os

from .. import _process
from ._compiled import CompiledBackend


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_kernels():
    """Import the extension with libgomp waiting passively unless the user chose otherwise.

    libgomp reads OMP_WAIT_POLICY once, when it loads. Its default spins ~15 ms at every
    barrier; on a busy machine the spinning thread holds the core the late thread needs
    (measured: a 2.7 ms call took a median 16 ms; passive: 3.0 ms, ~10 us more when idle).
    The variable is set only for this import and removed right after.
    """
    set_here = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    if set_here:
        os.environ["OMP_WAIT_POLICY"] = "passive"
    try:
        from .. import _cykernels
    except ImportError as exc:
        if os.path.isdir(os.path.join(os.path.dirname(_PACKAGE_DIR), "csrc")):
            raise ImportError(
                f"{exc}; this fastattn is the source tree at {_PACKAGE_DIR} (imported from the "
                "current directory?), where the extension is not built: run from another "
                "directory to use the installed package, or build it here with "
                "`python setup.py build_ext --inplace`") from exc
        raise
    finally:
        if set_here:
            os.environ.pop("OMP_WAIT_POLICY", None)
    return _cykernels


class CythonBackend(CompiledBackend):
    name = "cython"

    def _load(self) -> None:
        self._k = k = _import_kernels()
        self._forward_kernel, self._decode_kernel = k.forward, k.decode
        self._backward_kernel, self._softmax_kernel = k.backward, k.softmax_rows
        if _process.forked():
            # imported first in a fork() child: the parent may have used the same libgomp
            # (source builds share the system's), so stay off the pool, as the extension's own
            # fork hook does when it was imported before the fork
            self._k._after_fork_in_child()

    def details(self) -> dict:
        k = self._k
        return {"openmp": bool(k.OPENMP_ENABLED), "simd": k.simd(), "max_threads": k.max_threads()}
