"""Shared @njit helpers for the fastattn Numba kernels.

Contents: LLVM intrinsics (512-bit vector hint, NaN-propagating max, bit
casts, an atomic counter); small scalar helpers that LLVM inlines and
vectorizes inside the callers' loops (exp2, tanh, the dropout hash); BLAS
tiles through Numba's numba_xxgemm and the Python-side guard that keeps BLAS
single-threaded during a call; tile-level passes shared by forward and
decode (score pipeline, lazy online softmax, dropout, finalize, non-finite V,
block mask status).

Conventions (see docs/KERNELS.md):
* Scores are kept in *log2 units* inside the kernels: s2 = log2(e) * s.
  Folding log2(e) into the Q prescale saves one multiply per score, and
  2**x is cheaper to build than e**x. lse is converted back at the end.
* fastmath is never True (it implies 'ninf'/'nnan' and breaks -inf masks);
  FM below is the safe subset.
"""
import ctypes
import math
import os
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# Safe fast-math subset: lets LLVM reassociate sums (vectorized reductions)
# and contract a*b+c into FMAs, but keeps inf/NaN semantics.
FM = {'reassoc', 'contract', 'nsz', 'arcp', 'afn'}

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Ask LLVM to auto-vectorize with 512-bit registers. On Sapphire/Emerald Rapids
# LLVM's CPU tuning says "prefer 256-bit", which halves the width of the exp
# and max loops. The attribute is a per-function hint only: on CPUs without
# AVX-512 it is ignored. FASTATTN_NUMBA_WIDE=0 turns it off (read at compile
# time; cached code keeps the choice it was compiled with).
_WIDE = os.environ.get("FASTATTN_NUMBA_WIDE", "1") != "0"


# --------------------------------------------------------------------------
# LLVM intrinsics
# --------------------------------------------------------------------------
@intrinsic
def wide_vectors(typingctx):
    """Mark the LLVM function being compiled with prefer-vector-width=512.

    Must be called in the function body that owns the hot loops (for a prange
    body: inside the prange loop, which Numba outlines into its own function).
    llvmlite's attribute set only accepts a fixed list of names, so the string
    attribute is added through set.add; if that ever stops working the call is
    a harmless no-op.
    """
    def codegen(context, builder, signature, args):
        if _WIDE:
            try:
                attrs = builder.function.attributes
                set.add(attrs, '"prefer-vector-width"="512"')
                set.add(attrs, '"min-legal-vector-width"="512"')
            except Exception:  # pragma: no cover - llvmlite internals changed
                pass
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def fmax_nan(typingctx, a, b):
    """max(a, b) that propagates NaN (llvm.maximum).

    LLVM 22 vectorizes reductions over llvm.maximum without any fast-math
    flag; a Python-style `a if a > b else b` stays scalar (measured 1.5 ns vs
    0.07-0.17 ns per element).
    """
    if not (isinstance(a, types.Float) and a == b):
        return None
    sig = a(a, b)

    def codegen(context, builder, signature, args):
        lt = context.get_value_type(signature.return_type)
        suffix = 'f32' if lt == ir.FloatType() else 'f64'
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(lt, [lt, lt]), "llvm.maximum." + suffix)
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def as_float(typingctx, x):
    """Bit-cast int32 -> float32 or int64 -> float64."""
    if x == types.int32:
        rt = types.float32
    elif x == types.int64:
        rt = types.float64
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(rt))
    return rt(x), codegen


@intrinsic
def as_int(typingctx, x):
    """Bit-cast float32 -> int32 or float64 -> int64."""
    if x == types.float32:
        rt = types.int32
    elif x == types.float64:
        rt = types.int64
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(rt))
    return rt(x), codegen


@intrinsic
def atomic_next(typingctx, counter):
    """Atomically increment counter[0] (int64 array) and return the old value.

    Used for dynamic scheduling inside prange: each worker claims the next
    item. Static chunks stall the whole call on the slowest thread, which on
    a shared machine (or under causal imbalance) is common."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw('add', ary.data, ir.Constant(ir.IntType(64), 1), 'monotonic')
    return types.int64(counter), codegen


# --------------------------------------------------------------------------
# exp2: vectorizable, -inf -> 0, very negative -> 0, NaN -> NaN
# --------------------------------------------------------------------------
# 2**t = 2**n * 2**r, n = round(t), r in [-0.5, 0.5]. 2**r by a polynomial,
# 2**n built in the exponent bits. Rounding uses the "magic number" trick:
# y = t + (1.5*2**23 + 127) rounds t to an integer held in y's low mantissa
# bits, already biased by 127, so (bits(y) << 23) is the float 2**n and
# y - magic is round(t). That is 3 vector ops where floor + convert + add
# took 5 (measured 0.48 -> 0.37 ns per element with the row max).
# The clamp to [-127, 64] makes n = -127 give the bit pattern 0 (an exact
# 0.0 for -inf and for anything below 2**-126.5, no select needed) and keeps
# the shift from wrapping for large positive t (lazy softmax lets arguments
# go slightly positive). NaN passes both clamps and propagates.
# These functions must be compiled WITHOUT 'reassoc': with it LLVM folds
# (t + magic) - magic back to t.
# float32 coefficients: relative-error minimax fit (Lawson iteration, see
# NOTES.md); 7.4e-8 max relative error measured over [-126, 0].
_P32 = (np.float32(1.0), np.float32(0.6931471824645996),
        np.float32(0.24022646248340607), np.float32(0.05550328642129898),
        np.float32(0.009618489071726799), np.float32(0.0013399930903688073),
        np.float32(0.0001534581242594868))
# float64: Taylor coefficients ln2**k / k!, degree 12: truncation
# 0.347**13/13! ~ 2e-16 relative on [-0.5, 0.5].
_P64 = tuple(LN2 ** kk / math.factorial(kk) for kk in range(13))
_MAGIC32 = np.float32(12582912.0 + 127.0)                 # 1.5*2**23 + 127
_MAGIC64 = np.float64(6755399441055744.0 + 1023.0)        # 1.5*2**52 + 1023
FM_EXP = {'contract', 'nsz', 'arcp', 'afn'}               # no 'reassoc'


@njit(fastmath=FM_EXP)
def exp2_f32(t):
    tc = t if not (t < np.float32(-127.0)) else np.float32(-127.0)
    tc = tc if not (tc > np.float32(64.0)) else np.float32(64.0)
    y = tc + _MAGIC32
    r = tc - (y - _MAGIC32)
    p = _P32[6]
    p = p * r + _P32[5]
    p = p * r + _P32[4]
    p = p * r + _P32[3]
    p = p * r + _P32[2]
    p = p * r + _P32[1]
    p = p * r + _P32[0]
    return p * as_float(np.int32(as_int(y) << np.int32(23)))


@njit(fastmath=FM_EXP)
def exp2_f64(t):
    tc = t if not (t < -1023.0) else -1023.0
    tc = tc if not (tc > 64.0) else 64.0
    y = tc + _MAGIC64
    r = tc - (y - _MAGIC64)
    p = _P64[12]
    p = p * r + _P64[11]
    p = p * r + _P64[10]
    p = p * r + _P64[9]
    p = p * r + _P64[8]
    p = p * r + _P64[7]
    p = p * r + _P64[6]
    p = p * r + _P64[5]
    p = p * r + _P64[4]
    p = p * r + _P64[3]
    p = p * r + _P64[2]
    p = p * r + _P64[1]
    p = p * r + _P64[0]
    return p * as_float(np.int64(as_int(y) << np.int64(52)))


def exp2v(t):  # pragma: no cover - typing stub, dispatched by the overload
    raise NotImplementedError


@overload(exp2v, fastmath=FM)
def _exp2v_ol(t):
    if t == types.float32:
        return lambda t: exp2_f32(t)
    if t == types.float64:
        return lambda t: exp2_f64(t)
    return None


# --------------------------------------------------------------------------
# tanh for softcap
# --------------------------------------------------------------------------
# float32: |x| < 0.25 -> odd Taylor polynomial to x**11 (truncation < 1e-9
# relative); otherwise 1 - 2/(2**(2x*log2e) + 1), whose cancellation for
# |x| >= 0.25 costs at most a factor ~4 over one ulp. Both branches are
# computed and selected, so the loop vectorizes. float64 uses libm tanh
# (scalar, exact); float64 speed is not a goal.
@njit(fastmath=FM)
def tanh_f32(x):
    ax = abs(x)
    x2 = x * x
    p = np.float32(-0.008863235529902197)      # -1382/155925
    p = p * x2 + np.float32(0.021869488536155203)  # 62/2835
    p = p * x2 + np.float32(-0.05396825396825397)  # -17/315
    p = p * x2 + np.float32(0.13333333333333333)   # 2/15
    p = p * x2 + np.float32(-0.3333333333333333)
    small = x + x * x2 * p
    # clamp to keep exp2 finite; tanh(9) == 1 in float32
    axc = ax if ax < np.float32(9.0) else np.float32(9.0)
    e = exp2_f32(axc * np.float32(2.0 * LOG2E))
    big = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    big = big if x >= np.float32(0.0) else -big
    return small if ax < np.float32(0.25) else big


def tanhv(x):  # pragma: no cover
    raise NotImplementedError


@overload(tanhv, fastmath=FM)
def _tanhv_ol(x):
    if x == types.float32:
        return lambda x: tanh_f32(x)
    if x == types.float64:
        return lambda x: math.tanh(x)
    return None


# --------------------------------------------------------------------------
# Dropout hash (docs/KERNELS.md). All values are uint64 holding 32-bit
# numbers; every product is masked back to 32 bits. Constants are typed
# uint64 explicitly: uint64 op int64 would be promoted to float64 by Numba.
# --------------------------------------------------------------------------
_M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(0x7FEB352D)
_C2 = np.uint64(0x846CA68B)
_GOLD = np.uint64(0x9E3779B1)
_S15 = np.uint64(15)
_S16 = np.uint64(16)


@njit
def mix32(x):
    x = x ^ (x >> _S16)
    x = (x * _C1) & _M32
    x = x ^ (x >> _S15)
    x = (x * _C2) & _M32
    x = x ^ (x >> _S16)
    return x


@njit
def dropout_row_key(seed, bh, i):
    s = np.uint64(seed) & _M32
    k = mix32(s ^ mix32(np.uint64(bh) & _M32))
    return mix32((k + (np.uint64(i) & _M32)) & _M32)


@njit
def dropout_bits(row_key, j):
    return mix32(row_key ^ ((np.uint64(j) * _GOLD) & _M32))


def dropout_threshold(p):
    """Python-side: min(floor(p * 2**32), 2**32 - 1) as an int."""
    return min(int(math.floor(p * 4294967296.0)), 4294967295)


@njit
def dropout_threshold_nb(p):
    t = math.floor(p * 4294967296.0)
    if t > 4294967295.0:
        t = 4294967295.0
    return np.uint64(t)


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


@intrinsic
def _addr(typingctx, arr, idx):
    """void* to arr.flat[idx] of a C-contiguous array, no view object."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.bitcast(ptr, ir.IntType(8).as_pointer())
    return types.voidptr(arr, types.intp), codegen


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


def fcast(arr, x):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(fcast)
def _fcast_ol(arr, x):
    """x converted to arr's float dtype. Mixing float64 scalars into float32
    loops makes Numba promote the whole expression to float64 and kills the
    vectorization, so every constant in a row pass goes through this."""
    if arr.dtype == types.float32:
        return lambda arr, x: np.float32(x)
    if arr.dtype == types.float64:
        return lambda arr, x: np.float64(x)
    return None


# --------------------------------------------------------------------------
# Tile passes shared by forward and decode. A score tile S is a C-contiguous
# (rows, Bk) array in log2 units; each pass works on rows r0..r1-1 and the
# first n columns. Passes take the 2-D tile and loop over rows inside:
# calling a helper per row with a row view cost ~170 ns per row (view
# refcounting + a non-inlined call with ~30 arguments), i.e. as much as the
# exp of the row itself at Bk=512.
# --------------------------------------------------------------------------
@njit(fastmath=FM)
def mask_strides(m, B, H, L, S):
    """Element strides of a broadcast mask (dims of size 1 -> stride 0)."""
    Bm, Hm, Lm, Sm = m.shape
    sS = 1 if Sm > 1 else 0
    sL = Sm if Lm > 1 else 0
    sH = Lm * Sm if Hm > 1 else 0
    sB = Hm * Lm * Sm if Bm > 1 else 0
    return sB, sH, sL, sS


@njit(fastmath=FM)
def tile_pipeline(S, r0, r1, n, j0, pos0, use_cap, softcap, has_alibi,
                  slope2, mask_kind, mbf, mff, mbase, sL, sS, mstat,
                  band_partial, win_left, win_right):
    """docs/KERNELS.md score pipeline on rows r0..r1-1 of a tile, in order:
    softcap, ALiBi, float mask, bool mask, band. Row r sits at position
    pos0 + (r - r0) and reads mask entries at mbase + (r - r0)*sL + j*sS.
    Each step is a separate vectorized loop; steps the block does not need
    are skipped. Replacement (not addition) of -inf keeps NaN scores of
    masked keys out."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    log2e = fcast(S, LOG2E)
    inv_cap = fcast(S, 1.0 / softcap) if use_cap else fcast(S, 0.0)
    c2 = fcast(S, softcap * LOG2E)
    for r in range(r0, r1):
        d = r - r0
        pos = pos0 + d
        if use_cap:
            for j in range(n):
                S[r, j] = c2 * tanhv(S[r, j] * inv_cap)
        if has_alibi:
            for j in range(n):
                S[r, j] = S[r, j] - slope2 * fcast(S, abs(pos - (j0 + j)))
        mo = mbase + d * sL
        if mask_kind == 2:
            if sS == 0:
                mv = mff[mo]
                if mv == ninf:
                    for j in range(n):
                        S[r, j] = ninf
                else:
                    add = mv * log2e
                    for j in range(n):
                        S[r, j] = S[r, j] + add
            else:
                for j in range(n):
                    mv = mff[mo + j]
                    S[r, j] = ninf if mv == ninf else S[r, j] + mv * log2e
        elif mask_kind == 1 and mstat == 2:
            if sS == 0:
                if mbf[mo] == 0:
                    for j in range(n):
                        S[r, j] = ninf
            else:
                for j in range(n):
                    S[r, j] = ninf if mbf[mo + j] == 0 else S[r, j]
        if band_partial:
            # allowed columns [a, b): j0 + j in [pos - win_left, pos + win_right]
            a = min(max(pos - win_left - j0, 0), n)
            b = min(max(pos + win_right - j0 + 1, 0), n)
            if b < a:
                b = a
            for j in range(0, a):
                S[r, j] = ninf
            for j in range(b, n):
                S[r, j] = ninf


# Lazy rescaling: once a row has a running max m, a new block is first
# exponentiated against that m in a single pass (no separate max pass). If
# the row sum stays <= 2**16 every weight is <= 2**16 - nothing can overflow
# and precision is unaffected (floating point is scale-free) - so m is kept
# and the accumulator is not rescaled. Only when the sum exceeds that (the
# max grew by > 16 in log2 units), or is inf/NaN, is the row redone with
# the exact max. lse = m + log2(l) holds for any m.
LAZY_LIMIT = 65536.0


@njit(fastmath=FM)
def tile_online(S, P, r0, r1, n, m, lsum, acc, Ev):
    """Online-softmax update of rows r0..r1-1 with their scores S[r, :n].

    Writes the unnormalized weights 2**(s - m) to P (zeros for rows with
    nothing allowed yet), updates m, lsum and rescales acc rows whose m
    moved."""
    wide_vectors()
    ninf = fcast(S, -np.inf)
    one = fcast(S, 1.0)
    zero = fcast(S, 0.0)
    lim = fcast(S, LAZY_LIMIT)
    for r in range(r0, r1):
        m_old = m[r]
        if m_old != ninf:
            s = zero
            for j in range(n):
                p = exp2v(S[r, j] - m_old)
                P[r, j] = p
                s += p
            if s <= lim:            # False for inf and NaN
                lsum[r] += s
                continue
        mx = S[r, 0]
        for j in range(1, n):
            mx = fmax_nan(mx, S[r, j])
        m_new = fmax_nan(m_old, mx)
        if m_new == ninf:
            for j in range(n):
                P[r, j] = zero
            continue
        alpha = exp2v(m_old - m_new)
        s = zero
        for j in range(n):
            p = exp2v(S[r, j] - m_new)
            P[r, j] = p
            s += p
        lsum[r] = lsum[r] * alpha + s
        m[r] = m_new
        if alpha != one:
            for t in range(Ev):
                acc[r, t] *= alpha


@njit
def tile_dropout(P, r0, r1, n, seed, bh, i0, j0, thresh, inv_keep):
    """Apply the spec's dropout to weights P[r, :n], row r = query i0 + r - r0."""
    zero = fcast(P, 0.0)
    for r in range(r0, r1):
        rk = dropout_row_key(seed, bh, i0 + (r - r0))
        for j in range(n):
            bits = dropout_bits(rk, j0 + j)
            P[r, j] = P[r, j] * inv_keep if bits >= thresh else zero


@njit
def tile_finalize(acc, m, lsum, nq, Ev, of, ooff, lse_flat, loff):
    """out rows = acc / l, lse = (m + log2 l) * ln2; rows that never saw an
    allowed key (m = -inf or l = 0) get out = 0, lse = -inf."""
    ninf = fcast(acc, -np.inf)
    zero = fcast(acc, 0.0)
    one = fcast(acc, 1.0)
    for r in range(nq):
        lr = lsum[r]
        if m[r] == ninf or lr == zero:
            for t in range(Ev):
                of[ooff + r * Ev + t] = zero
            lse_flat[loff + r] = ninf
        else:
            inv = one / lr
            for t in range(Ev):
                of[ooff + r * Ev + t] = acc[r, t] * inv
            lse_flat[loff + r] = (m[r] + np.log2(lr)) * fcast(acc, LN2)


@njit(fastmath=FM)
def block_all_finite(vflat, off, cnt):
    """True when vflat[off:off+cnt] has no NaN/Inf.

    sum(x*0) is 0 for finite x and NaN otherwise; without 'nnan'/'ninf' LLVM
    may not fold x*0 to 0, and the reduction vectorizes (cheap next to the
    block's GEMM)."""
    wide_vectors()
    z = fcast(vflat, 0.0)
    for t in range(cnt):
        z += vflat[off + t] * fcast(vflat, 0.0)
    return z == fcast(vflat, 0.0)


@njit
def pv_nonfinite(Pb, nq, n, vf, voff, Ev, Evld, Vs, acc, ab):
    """acc[:nq] += Pb[:nq,:n] . V for a V block holding NaN/Inf, exactly:
    GEMM with the non-finite entries zeroed, then add those entries back only
    for weights that are nonzero, so a masked NaN (weight 0) never leaks
    while an attended one still propagates."""
    zero = fcast(Pb, 0.0)
    for j in range(n):
        for t in range(Ev):
            x = vf[voff + j * Ev + t]
            Vs[j, t] = x if np.isfinite(x) else zero
    gemm_nn(nq, Ev, n, Pb, 0, Pb.shape[1], Vs, 0, Evld, 0, acc, 0, Evld, ab)
    for j in range(n):
        for t in range(Ev):
            x = vf[voff + j * Ev + t]
            if not np.isfinite(x):
                for r in range(nq):
                    p = Pb[r, j]
                    if p != zero:
                        acc[r, t] += p * x


@njit
def block_status_bool(mflat, base, sL, sS, nq, n):
    """0: every (row, key) of the block masked; 1: every one kept; 2: mixed.

    Reads at most nq*n mask bytes (one row when the mask broadcasts over
    queries) - far less work than the block's GEMM, and a fully masked block
    (padding, unused KV-cache tail) then skips its GEMMs entirely."""
    rows = nq if sL != 0 else 1
    cols = n if sS != 0 else 1
    nz = 0
    for r in range(rows):
        o = base + r * sL
        c = 0
        for j in range(cols):
            c += mflat[o + j * sS] != 0
        nz += c
        if nz != 0 and nz != (r + 1) * cols:
            return 2
    if nz == 0:
        return 0
    return 1


@njit
def block_status_float(mflat, base, sL, sS, nq, n):
    """0 when every entry of the block is -inf (skip it), else 2."""
    rows = nq if sL != 0 else 1
    cols = n if sS != 0 else 1
    ninf = fcast(mflat, -np.inf)
    for r in range(rows):
        o = base + r * sL
        for j in range(cols):
            if mflat[o + j * sS] != ninf:
                return 2
    return 0
