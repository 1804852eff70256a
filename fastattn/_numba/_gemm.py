"""float32 GEMM micro-kernel for the attention tiles, written as LLVM vector IR.

Why not BLAS for float32: scipy's OpenBLAS packs both operands on every
call, and at attention tile shapes (256x512x64, 256x64x512) it ran at
~75-90 GF/s per core here, while this register-blocked kernel, fed with
operands laid out for it, reaches ~100+ (see NOTES.md). float64 keeps BLAS.

The kernel computes an MR x (NV*W) tile of C (+)= A . B where
  A[r, t] = a[a_off + r*sa_r + t*sa_t]   (broadcast one element per row and k)
  B[t, c] = b[b_off + t*ldb + c]         (NV vector loads per k)
  C[r, c] = c[c_off + r*ldc + c]
with 6x4 zmm accumulators on AVX-512 (6x2 ymm on AVX2). Columns >= ncols
are masked (never read or written), so operands need no column padding;
rows are not masked: callers pad A and C to a multiple of MR rows.
It is emitted through a Numba @intrinsic (plain IR, no ctypes pointers), so
functions using it stay cacheable.
"""
import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_FEATURES = llb.get_host_cpu_features()
HAVE_AVX512 = bool(_FEATURES.get('avx512f', False))
W = 16 if HAVE_AVX512 else 8      # float32 lanes per vector register
MR = 6                            # rows per micro-tile
NV = 4 if HAVE_AVX512 else 2      # vectors per row: 6x4 zmm / 6x2 ymm accumulators
PW = NV * W                       # panel width (columns per micro-tile)


def _make_microkernel(MR, NV, prefetch_a=False):
    """Build the MR x (NV*W) micro-kernel intrinsic (shapes fixed at import).

    prefetch_a: A rows are contiguous (sa_t == 1) and later calls read the
    rows that follow; each k-step prefetches one 64-byte line 4 tiles ahead
    (decode streams K in this pattern; measured per 8 MB head with K in
    cache: 1.41 ms without, 1.11 ms 1 tile ahead, 0.70 ms 2-8 tiles ahead)."""
    @intrinsic
    def mk(typingctx, c, c_off, ldc, a, a_off, sa_r, sa_t, b, b_off, ldb, K,
           ncols, beta):
        return _mk_typer(MR, NV, prefetch_a, c, c_off, ldc, a, a_off, sa_r, sa_t,
                         b, b_off, ldb, K, ncols, beta)
    return mk


def _mk_typer(MR, NV, prefetch_a, c, c_off, ldc, a, a_off, sa_r, sa_t, b, b_off, ldb, K,
              ncols, beta):
    for arr in (c, a, b):
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
            return None
    sig = types.void(c, c_off, ldc, a, a_off, sa_r, sa_t, b, b_off, ldb, K, ncols, beta)

    def codegen(context, builder, signature, args):
        # explicit 512-bit vectors are split in two unless the function allows
        # 512-bit legal width (LLVM's Sapphire Rapids tuning prefers 256)
        try:
            set.add(builder.function.attributes, '"min-legal-vector-width"="512"')
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        except Exception:  # pragma: no cover
            pass
        tys = signature.args
        i64 = ir.IntType(64)

        def iarg(k):
            return context.cast(builder, args[k], tys[k], types.intp)
        c_off_, ldc_, a_off_, sa_r_, sa_t_, b_off_, ldb_, K_, ncols_ = [
            iarg(k) for k in (1, 2, 4, 5, 6, 8, 9, 10, 11)]
        beta_ = context.cast(builder, args[12], tys[12], types.boolean)
        cdat = context.make_array(tys[0])(context, builder, args[0]).data
        adat = context.make_array(tys[3])(context, builder, args[3]).data
        bdat = context.make_array(tys[7])(context, builder, args[7]).data
        f32 = ir.FloatType()
        vty = ir.VectorType(f32, W)
        mty = ir.VectorType(ir.IntType(1), W)
        vptr = vty.as_pointer()
        zero = ir.Constant(vty, [0.0] * W)
        mod = builder.module
        mload = cgutils.get_or_insert_function(
            mod, ir.FunctionType(vty, [vptr, ir.IntType(32), mty, vty]),
            "llvm.masked.load.v%df32.p0" % W)
        mstore = cgutils.get_or_insert_function(
            mod, ir.FunctionType(ir.VoidType(), [vty, vptr, ir.IntType(32), mty]),
            "llvm.masked.store.v%df32.p0" % W)
        # fmuladd: fused where the CPU has FMA, mul+add elsewhere (never a libcall)
        fma = cgutils.get_or_insert_function(
            mod, ir.FunctionType(vty, [vty, vty, vty]), "llvm.fmuladd.v%df32" % W)
        align = ir.Constant(ir.IntType(32), 4)

        def splat(val, ty):
            vt = ir.VectorType(ty, W)
            u = builder.insert_element(ir.Constant(vt, ir.Undefined), val,
                                       ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(u, ir.Constant(vt, ir.Undefined),
                                          ir.Constant(ir.VectorType(ir.IntType(32), W), [0] * W))

        lanes = ir.Constant(ir.VectorType(i64, W), list(range(W)))
        ncv = splat(ncols_, i64)
        masks = [builder.icmp_signed('<', builder.add(lanes, splat(ir.Constant(i64, v * W), i64)), ncv)
                 for v in range(NV)]
        bmask = splat(beta_, ir.IntType(1))
        cbase = builder.gep(cdat, [c_off_])
        abase = builder.gep(adat, [a_off_])
        bbase = builder.gep(bdat, [b_off_])

        def cptr(r, v):
            row = builder.gep(cbase, [builder.mul(ldc_, ir.Constant(i64, r))])
            return builder.bitcast(builder.gep(row, [ir.Constant(i64, v * W)]), vptr)

        # accumulators live in allocas that mem2reg turns into registers;
        # beta=0 -> the masked load is all-false and yields zeros without
        # touching C (so C may hold garbage/NaN)
        accs = [[cgutils.alloca_once(builder, vty) for _ in range(NV)] for _ in range(MR)]
        for r in range(MR):
            for v in range(NV):
                builder.store(builder.call(mload, [cptr(r, v), align,
                                                   builder.and_(masks[v], bmask), zero]),
                              accs[r][v])
        arow = [builder.mul(sa_r_, ir.Constant(i64, r)) for r in range(MR)]
        if prefetch_a:
            pf = cgutils.get_or_insert_function(
                mod, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32),
                                                     ir.IntType(32), ir.IntType(32)]),
                "llvm.prefetch.p0")
            pfbase = builder.gep(abase, [builder.mul(sa_r_, ir.Constant(i64, 4 * MR))])
        with cgutils.for_range(builder, K_) as loop:
            t = loop.index
            if prefetch_a:
                addr = builder.gep(pfbase, [builder.mul(t, ir.Constant(i64, 16))])
                builder.call(pf, [builder.bitcast(addr, ir.IntType(8).as_pointer()),
                                  ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 3),
                                  ir.Constant(ir.IntType(32), 1)])
            brow = builder.gep(bbase, [builder.mul(t, ldb_)])
            bv = [builder.call(mload, [builder.bitcast(builder.gep(brow, [ir.Constant(i64, v * W)]), vptr),
                                       align, masks[v], zero]) for v in range(NV)]
            at = builder.mul(t, sa_t_)
            for r in range(MR):
                a_el = builder.load(builder.gep(abase, [builder.add(arow[r], at)]))
                asp = splat(a_el, f32)
                for v in range(NV):
                    builder.store(builder.call(fma, [asp, bv[v], builder.load(accs[r][v])]),
                                  accs[r][v])
        for r in range(MR):
            for v in range(NV):
                builder.call(mstore, [builder.load(accs[r][v]), cptr(r, v), align, masks[v]])
        return context.get_dummy_value()
    return sig, codegen


# forward tiles: 6 x 4 vectors (24 accumulators)
microkernel_f32 = _make_microkernel(MR, NV)
# decode Q.K^T as K . Q^T: many keys x one vector of query rows (R <= W) or
# two (R <= 2W); K rows are broadcast straight from the cache
MR_D1 = 12
mk_dec1 = _make_microkernel(MR_D1, 1, True)
MR_D2 = 8
mk_dec2 = _make_microkernel(MR_D2, 2, True)


@njit
def pack_k_panel(kf, koff, S, E, Kp, poff, p):
    """Panel p (keys p*PW .. p*PW+PW-1) of one (batch, kv head)'s K ->
    Kp[poff + (p*E + t)*PW + c] = K[p*PW + c, t], zero past S, so the
    Q.K^T kernel reads each k-step's PW keys as NV contiguous vectors."""
    base = poff + p * E * PW
    zero = np.float32(0.0)
    for c in range(PW):
        j = p * PW + c
        if j < S:
            for t in range(E):
                Kp[base + t * PW + c] = kf[koff + j * E + t]
        else:
            for t in range(E):
                Kp[base + t * PW + c] = zero


@njit
def pack_q_tiles(qf, qoff, nq, E, qscale, Qp, ntiles):
    """Q rows (scaled) -> micro-tiles of MR rows, k-major inside a tile:
    Qp[(tile*E + t)*MR + r] = scale * Q[tile*MR + r, t] (zero rows past nq),
    so the kernel's MR broadcasts per k-step are adjacent in memory.
    Writes are sequential and the MR source rows are read in parallel (the
    other loop order, stride-MR writes, cost ~2 ns per element)."""
    zero = np.float32(0.0)
    for it in range(ntiles):
        r_n = min(MR, nq - it * MR)
        src = qoff + it * MR * E
        dst = it * E * MR
        if r_n == MR:
            for t in range(E):
                for r in range(MR):
                    Qp[dst + t * MR + r] = qf[src + r * E + t] * qscale
        else:
            for t in range(E):
                for r in range(MR):
                    Qp[dst + t * MR + r] = qf[src + r * E + t] * qscale if r < r_n else zero


@njit
def gemm_qk(Sb, Bk, Qp, E, ntiles, Kp, kpoff, p0, p1):
    """Sb[:ntiles*MR, (p-p0)*PW...] = Q . K^T for key panels p0..p1-1
    (panel p starts at Kp[kpoff + p*E*PW]). Panel-outer: one 16 KiB K panel
    stays in L1 while the packed Q tiles stream through in order."""
    for p in range(p0, p1):
        col = (p - p0) * PW
        for it in range(ntiles):
            microkernel_f32(Sb, it * MR * Bk + col, Bk, Qp, it * E * MR, 1, MR,
                            Kp, kpoff + p * E * PW, PW, E, PW, False)


KC = 128   # keys per k-chunk of P.V: a 128 x 64 V chunk (32 KiB) stays in L1


@njit
def gemm_pv(acc, Evld, Pb, Bk, vf, voff, Ev, n, ntiles):
    """acc[:ntiles*MR, :Ev] += P[:, :n] . V[voff...] (V rows of Ev floats)."""
    for k0 in range(0, n, KC):
        kc = min(KC, n - k0)
        for c0 in range(0, Ev, PW):
            nc = min(PW, Ev - c0)
            for it in range(ntiles):
                microkernel_f32(acc, it * MR * Evld + c0, Evld, Pb, it * MR * Bk + k0, Bk, 1,
                                vf, voff + k0 * Ev + c0, Ev, kc, nc, True)


@njit
def dec_qk(Sb, kf, koff, E, n, Qt, R, SbT):
    """Decode scores Sb[:R, :n] = Q . K[koff...]^T for R query rows, computed
    as S^T = K . Q^T (Qt: E x R, scaled). The last n % MR keys use plain
    loops (the kernel's rows are unmasked and must not read past K's end);
    SbT is (>= n) x R scratch, transposed into Sb at the end (n*R moves)."""
    zero = np.float32(0.0)
    if R <= W:
        full = (n // MR_D1) * MR_D1
        for j in range(0, full, MR_D1):
            mk_dec1(SbT, j * R, R, kf, koff + j * E, E, 1, Qt, 0, R, E, R, False)
    elif R <= 2 * W:
        full = (n // MR_D2) * MR_D2
        for j in range(0, full, MR_D2):
            mk_dec2(SbT, j * R, R, kf, koff + j * E, E, 1, Qt, 0, R, E, R, False)
    else:
        full = (n // MR) * MR
        for j in range(0, full, MR):
            for c0 in range(0, R, PW):
                microkernel_f32(SbT, j * R + c0, R, kf, koff + j * E, E, 1, Qt, c0, R, E,
                                min(PW, R - c0), False)
    for j in range(full, n):
        for r in range(R):
            s = zero
            for t in range(E):
                s += Qt[t * R + r] * kf[koff + j * E + t]
            SbT[j * R + r] = s
    for r in range(R):
        for j in range(n):
            Sb[r, j] = SbT[j * R + r]
