"""The backward kernel's products, dispatched on the dtype at compile time.

float32: operands laid out for the register-blocked kernels of _gemm.py (Q and
dO blocks packed k-major per MR rows, K and V blocks as PW-key panels; the
accumulating products read the original row-major arrays). float64: BLAS
through numba_xxgemm on the arrays as they are (the pack calls do nothing).
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from ._blas import gemm_nn, gemm_nt, gemm_tn
from ._gemm import MR, PW, gemm_acc_nn, gemm_acc_tn_packed, gemm_qk, pack_k_panel, pack_q_tiles
from ._intrinsics import fcast


def packed(arr):  # pragma: no cover - typing stubs below
    raise NotImplementedError


def b_pack_a(af, aoff, nq, D, Ap, poff):  # pragma: no cover
    raise NotImplementedError


def b_pack_b(bf, boff, n, D, Bp):  # pragma: no cover
    raise NotImplementedError


def b_qk(Sb, ld, Ap, apoff, af, aoff, D, ntiles, nq, Bp, bf, boff, n, ab):  # pragma: no cover
    raise NotImplementedError


def b_pack_rows(af, aoff, nq, D, Dp, Ar, roff):  # pragma: no cover
    raise NotImplementedError


def b_tn(C, ldc, nrt, M, Ar, aroff, ldar, af, aoff, lda, B, ldb, K, N, ab):  # pragma: no cover
    raise NotImplementedError


def b_nn(C, coff, ldc, nrt, nq, A, lda, Bf, boff, ldb, K, N, ab):  # pragma: no cover
    raise NotImplementedError


@overload(packed)
def _packed_ol(arr):
    f32 = arr.dtype == types.float32
    return lambda arr: f32


@overload(b_pack_a)
def _b_pack_a_ol(af, aoff, nq, D, Ap, poff):
    """Rows aoff.. (nq of them, D wide) -> packed MR-row tiles at Ap[poff]."""
    if af.dtype == types.float32:
        def impl(af, aoff, nq, D, Ap, poff):
            pack_q_tiles(af, aoff, nq, D, Ap, poff, (nq + MR - 1) // MR)
    else:
        def impl(af, aoff, nq, D, Ap, poff):
            pass
    return impl


@overload(b_pack_b)
def _b_pack_b_ol(bf, boff, n, D, Bp):
    """n rows at bf[boff] (D wide) -> PW-row panels in Bp, zero past n."""
    if bf.dtype == types.float32:
        def impl(bf, boff, n, D, Bp):
            for p in range((n + PW - 1) // PW):
                pack_k_panel(bf, boff, n, D, Bp, 0, p)
    else:
        def impl(bf, boff, n, D, Bp):
            pass
    return impl


@overload(b_pack_rows)
def _b_pack_rows_ol(af, aoff, nq, D, Dp, Ar, roff):
    """nq rows at af[aoff] (D wide) -> the A operand of b_tn at Ar[roff],
    packed per micro-tile of the transposed block (gemm_acc_tn_packed):
    Ar[roff + (it*nq + i)*MR + r] = X[i, it*MR + r], zero for columns >= D;
    Dp (a multiple of MR) / MR tiles, nq*Dp floats in all."""
    if af.dtype == types.float32:
        def impl(af, aoff, nq, D, Dp, Ar, roff):
            zero = np.float32(0.0)
            for i in range(nq):
                for it in range(Dp // MR):
                    dst = roff + (it * nq + i) * MR
                    for r in range(MR):
                        t = it * MR + r
                        Ar[dst + r] = af[aoff + i * D + t] if t < D else zero
    else:
        def impl(af, aoff, nq, D, Dp, Ar, roff):
            pass
    return impl


@overload(b_qk)
def _b_qk_ol(Sb, ld, Ap, apoff, af, aoff, D, ntiles, nq, Bp, bf, boff, n, ab):
    """Sb[:nq, :n] = A . B^T over D (S = Q K^T, Z = dO V^T); float32 writes
    whole MR x PW micro-tiles (pad rows/columns hold garbage)."""
    if Sb.dtype == types.float32:
        def impl(Sb, ld, Ap, apoff, af, aoff, D, ntiles, nq, Bp, bf, boff, n, ab):
            gemm_qk(Sb, ld, Ap, apoff, D, ntiles, Bp, 0, 0, (n + PW - 1) // PW)
    else:
        def impl(Sb, ld, Ap, apoff, af, aoff, D, ntiles, nq, Bp, bf, boff, n, ab):
            gemm_nt(nq, n, D, af, aoff, D, bf, boff, D, 1, Sb, 0, ld, ab)
    return impl


@overload(b_tn)
def _b_tn_ol(C, ldc, nrt, M, Ar, aroff, ldar, af, aoff, lda, B, ldb, K, N, ab):
    """C[:M, :N] += A[:K, :M]^T . B[:K, :N]: dV^T += dO^T Pd, dK^T += Q^T dS,
    with the (K x N) tile B read row by row, as tile_grad wrote it. (The
    other orientation, dV += Pd^T dO, read the tile down its columns and ran
    2-3x slower than the other products right after tile_grad.) float32 reads
    A from its tile-packed copy Ar (see b_pack_rows), float64 from af itself."""
    if C.dtype == types.float32:
        def impl(C, ldc, nrt, M, Ar, aroff, ldar, af, aoff, lda, B, ldb, K, N, ab):
            gemm_acc_tn_packed(C, 0, ldc, nrt, Ar, aroff, B, 0, ldb, K, N)
    else:
        def impl(C, ldc, nrt, M, Ar, aroff, ldar, af, aoff, lda, B, ldb, K, N, ab):
            gemm_tn(M, N, K, af, aoff, lda, B, 0, ldb, 0, C, 0, ldc, ab)
    return impl


@overload(b_nn)
def _b_nn_ol(C, coff, ldc, nrt, nq, A, lda, Bf, boff, ldb, K, N, ab):
    """C[coff.., :N] += A[:nq, :K] . B[:K, :N] (dQ += dS K)."""
    if C.dtype == types.float32:
        def impl(C, coff, ldc, nrt, nq, A, lda, Bf, boff, ldb, K, N, ab):
            gemm_acc_nn(C, coff, ldc, nrt, A, 0, lda, Bf, boff, ldb, K, N)
    else:
        def impl(C, coff, ldc, nrt, nq, A, lda, Bf, boff, ldb, K, N, ab):
            gemm_nn(nq, N, K, A, 0, lda, Bf, boff, ldb, 0, C, coff, ldc, ab)
    return impl


@njit
def dq_nonfinite(C, coff, ldc, nq, A, n, kf, koff, E, Ks, ab):
    """dQ += dS . K for a K block holding NaN/Inf, exactly: the product with
    those entries zeroed, then each one added back where its dS is nonzero,
    so a masked key's NaN (dS = 0) never reaches dq while an attended one
    still propagates (as the forward's pv_nonfinite)."""
    zero = fcast(C, 0.0)
    for j in range(n):
        for t in range(E):
            x = kf[koff + j * E + t]
            Ks[j, t] = x if np.isfinite(x) else zero
    gemm_nn(nq, E, n, A, 0, A.shape[1], Ks, 0, Ks.shape[1], 0, C, coff, ldc, ab)
    for j in range(n):
        for t in range(E):
            x = kf[koff + j * E + t]
            if not np.isfinite(x):
                for r in range(nq):
                    d = A[r, j]
                    if d != zero:
                        C[coff + r * ldc + t] += d * x
