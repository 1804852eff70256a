"""BLAS tiles for the float64 paths, and the thread settings around a call.

gemm_nt/gemm_nn call Numba's numba_xxgemm directly; _BlasGuard keeps scipy's
OpenBLAS single-threaded during a kernel call; numba_threads sets Numba's
(thread-local) thread count for one call.
"""
import ctypes
import os
import threading

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._intrinsics import _addr

# --------------------------------------------------------------------------
# BLAS tiles: Numba's own C helper numba_xxgemm (the function np.dot lowers
# to) takes alpha, beta and leading dimensions. Calling it directly gives
# beta=1 accumulation and strided operands with no temporaries, and being a
# named symbol (not a ctypes pointer) it keeps cache=True working. It is an
# internal Numba helper: present in 0.5x-0.68; if a future Numba drops it,
# fall back to np.dot into a temporary.
# --------------------------------------------------------------------------
_gemm_sig = types.intc(
    types.char, types.char, types.char,            # kind, transa, transb
    types.intp, types.intp, types.intp,            # m, n, k
    types.voidptr, types.voidptr, types.intp,      # alpha, a, lda
    types.voidptr, types.intp, types.voidptr,      # b, ldb, beta
    types.voidptr, types.intp)                     # c, ldc
_xxgemm = types.ExternalFunction("numba_xxgemm", _gemm_sig)

_N = ord('n')
_T = ord('t')


def _kind(arr):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_kind)
def _kind_ol(arr):
    # BLAS type letter, resolved at compile time
    if arr.dtype == types.float32:
        return lambda arr: ord('s')
    if arr.dtype == types.float64:
        return lambda arr: ord('d')
    return None


@njit
def gemm_nt(M, N, K, A, a_off, lda, B, b_off, ldb, beta_arr, C, c_off, ldc, ab):
    """Row-major C[M,N] = A[M,K] . B[N,K]^T + beta*C.

    ab is a 2-element scratch array of the dtype holding (alpha=1, beta);
    BLAS is column-major, so compute C^T = B . A^T.
    """
    _xxgemm(_kind(A), _T, _N, N, M, K, _addr(ab, 0), _addr(B, b_off), ldb,
            _addr(A, a_off), lda, _addr(ab, beta_arr), _addr(C, c_off), ldc)


@njit
def gemm_nn(M, N, K, A, a_off, lda, B, b_off, ldb, beta_arr, C, c_off, ldc, ab):
    """Row-major C[M,N] = A[M,K] . B[K,N] + beta*C (beta = ab[beta_arr])."""
    _xxgemm(_kind(A), _N, _N, N, M, K, _addr(ab, 0), _addr(B, b_off), ldb,
            _addr(A, a_off), lda, _addr(ab, beta_arr), _addr(C, c_off), ldc)


@njit
def gemm_tn(M, N, K, A, a_off, lda, B, b_off, ldb, beta_arr, C, c_off, ldc, ab):
    """Row-major C[M,N] = A[K,M]^T . B[K,N] + beta*C (beta = ab[beta_arr])."""
    _xxgemm(_kind(A), _N, _T, N, M, K, _addr(ab, 0), _addr(B, b_off), ldb,
            _addr(A, a_off), lda, _addr(ab, beta_arr), _addr(C, c_off), ldc)


@njit(cache=True)
def _prime_blas(a, b, c):
    # First use of numba_xxgemm looks the BLAS pointer up under the GIL;
    # do it once from a serial function so no worker thread ever has to.
    ab = np.zeros(3, a.dtype)
    ab[0] = 1.0
    gemm_nn(1, 1, 1, a, 0, 1, b, 0, 1, 1, c, 0, 1, ab)


_primed = False


def prime_blas():
    global _primed
    if not _primed:
        import scipy.linalg.cython_blas  # noqa: F401  (Numba's BLAS provider)
        for dt in (np.float32, np.float64):
            a = np.ones((1, 1), dt)
            _prime_blas(a, a, np.zeros((1, 1), dt))
        _primed = True


# --------------------------------------------------------------------------
# BLAS thread guard (Python side)
# --------------------------------------------------------------------------
# numba_xxgemm reaches scipy's OpenBLAS (libscipy_openblas, not NumPy's
# libscipy_openblas64_), whose pthread pool defaults to all cores. Called from
# inside prange that oversubscribes badly, so the kernels run it with one
# thread. openblas_set_num_threads is process-global (not thread-local in
# 0.3.30/0.3.31), so concurrent fastattn calls share one reference count:
# the first one in saves the user's value and sets 1, the last one out
# restores it. Calling the symbol through ctypes costs ~1 us per call pair;
# threadpoolctl.threadpool_limits costs ~100s of us (it re-scans the loaded
# libraries) and is documented as main-thread-only.
class _BlasGuard:
    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = None
        self._set = None
        self._get = None
        self._found = False

    def _find(self):
        self._found = True
        try:
            import scipy.linalg.cython_blas  # noqa: F401
            from threadpoolctl import ThreadpoolController
            for lib in ThreadpoolController().lib_controllers:
                if lib.internal_api == 'openblas' and 'scipy' in lib.filepath \
                        and 'openblas64' not in os.path.basename(lib.filepath):
                    dll = ctypes.CDLL(lib.filepath)
                    # scipy's wheels build OpenBLAS with a "scipy_" symbol prefix
                    for pre in ('scipy_', ''):
                        try:
                            st = getattr(dll, pre + 'openblas_set_num_threads')
                            gt = getattr(dll, pre + 'openblas_get_num_threads')
                        except AttributeError:
                            continue
                        st.argtypes = [ctypes.c_int]
                        st.restype = None
                        gt.argtypes = []
                        gt.restype = ctypes.c_int
                        self._set, self._get = st, gt
                        break
                    break
        except Exception:
            self._set = self._get = None

    def __enter__(self):
        with self._lock:
            if not self._found:
                self._find()
            if self._depth == 0 and self._set is not None:
                self._saved = self._get()
                if self._saved != 1:
                    self._set(1)
            self._depth += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._set is not None and self._saved is not None:
                if self._saved != 1:
                    self._set(self._saved)
                self._saved = None
        return False


blas_single_thread = _BlasGuard()


class numba_threads:
    """Set Numba's thread count for this Python thread (thread-local in Numba)."""

    def __init__(self, n):
        import numba
        self.n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))

    def __enter__(self):
        import numba
        self.prev = numba.get_num_threads()
        numba.set_num_threads(self.n)
        return self.n

    def __exit__(self, *exc):
        import numba
        numba.set_num_threads(self.prev)
        return False

