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
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._intrinsics import (
    HAVE_AVX512, HAVE_F16C, KIND_DTYPE, ir_load_stored, no_inline)
from ._transpose import make_transpose, transpose8

W = 16 if HAVE_AVX512 else 8      # float32 lanes per vector register
MR = 6                            # rows per micro-tile
# Software prefetches of the streamed operands go to L2 (llvm.prefetch locality 2, as the
# Cython decode's): held in L1's few fill buffers (locality 3) they limited the misses in
# flight; with the V prefetch below, decode ran at 0.79 of the time before (see gemm_pv_stream)
PF_LOCALITY = 2
NV = 4 if HAVE_AVX512 else 2      # vectors per row: 6x4 zmm / 6x2 ymm accumulators
PW = NV * W                       # panel width (columns per micro-tile)
transpose_q = make_transpose(MR)  # MR Q rows x 8 columns -> one packed micro-tile slice


def _make_microkernel(MR, NV, prefetch_a=False, kb=0, prefetch_b=0, kind='f32'):
    """Build the MR x (NV*W) micro-kernel intrinsic (shapes fixed at import).

    prefetch_a: A rows are contiguous (sa_t == 1) and later calls read the
    rows that follow; each k-step prefetches one 64-byte line 4 tiles ahead
    (decode streams K in this pattern; measured per 8 MB head with K in
    cache: 1.41 ms without, 1.11 ms 1 tile ahead, 0.70 ms 2-8 tiles ahead).
    prefetch_b: B rows are streamed once (decode's V); each k-step
    prefetches the NV vectors' lines of the B row prefetch_b k-steps ahead
    (past the end of B that is a hint about unmapped memory: no fault).
    kind: B holds a low-precision cache's elements ('f16', 'bf16': their bits as uint16; 'i8':
    codes, the scales applied by the caller), each vector converted to float32 as it is loaded
    (_intrinsics.ir_load_stored): the products and sums are those of the converted B."""
    @intrinsic
    def mk(typingctx, c, c_off, ldc, a, a_off, sa_r, sa_t, b, b_off, ldb, K,
           ncols, beta):
        return _mk_typer(MR, NV, prefetch_a, kb, prefetch_b, kind, c, c_off, ldc, a, a_off, sa_r,
                         sa_t, b, b_off, ldb, K, ncols, beta)
    return mk


def _mk_typer(MR, NV, prefetch_a, kb, prefetch_b, kind, c, c_off, ldc, a, a_off, sa_r, sa_t, b,
              b_off, ldb, K, ncols, beta):
    for arr, dt in ((c, types.float32), (a, types.float32), (b, KIND_DTYPE[kind])):
        if not (isinstance(arr, types.Array) and arr.dtype == dt):
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
        per_line = 64 // (4 if kind == 'f32' else 1 if kind == 'i8' else 2)   # B elements a line

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

        # accumulators live in allocas that mem2reg turns into registers
        accs = [[cgutils.alloca_once(builder, vty) for _ in range(NV)] for _ in range(MR)]
        arow = [builder.mul(sa_r_, ir.Constant(i64, r)) for r in range(MR)]
        if prefetch_a or prefetch_b:
            pf = cgutils.get_or_insert_function(
                mod, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32),
                                                     ir.IntType(32), ir.IntType(32)]),
                "llvm.prefetch.p0")
            pfbase = builder.gep(abase, [builder.mul(sa_r_, ir.Constant(i64, 4 * MR))])

        def kstep(t):
            if prefetch_b:
                ahead = builder.add(t, ir.Constant(i64, prefetch_b))
                brow_ahead = builder.gep(bbase, [builder.mul(ahead, ldb_)])
                for line in range(0, NV * W, per_line):     # each line of the panel's row once
                    addr = builder.gep(brow_ahead, [ir.Constant(i64, line)])
                    builder.call(pf, [builder.bitcast(addr, ir.IntType(8).as_pointer()),
                                      ir.Constant(ir.IntType(32), 0),
                                      ir.Constant(ir.IntType(32), PF_LOCALITY),
                                      ir.Constant(ir.IntType(32), 1)])
            if prefetch_a:
                addr = builder.gep(pfbase, [builder.mul(t, ir.Constant(i64, 16))])
                builder.call(pf, [builder.bitcast(addr, ir.IntType(8).as_pointer()),
                                  ir.Constant(ir.IntType(32), 0),
                                  ir.Constant(ir.IntType(32), PF_LOCALITY),
                                  ir.Constant(ir.IntType(32), 1)])
            brow = builder.gep(bbase, [builder.mul(t, ldb_)])
            bv = [ir_load_stored(builder, builder.gep(brow, [ir.Constant(i64, v * W)]), kind, W,
                                 masks[v]) for v in range(NV)]
            at = builder.mul(t, sa_t_)
            for r in range(MR):
                a_el = builder.load(builder.gep(abase, [builder.add(arow[r], at)]))
                asp = splat(a_el, f32)
                for v in range(NV):
                    builder.store(builder.call(fma, [asp, bv[v], builder.load(accs[r][v])]),
                                  accs[r][v])

        if kb <= 0:
            # one chain over all of K. kb == 0: the chain starts from C (beta=1)
            # or zero; kb < 0 ("end-add"): it starts from zero and C is added
            # once at the end, so repeated calls accumulating into C sum their
            # K-ranges as separate blocks (shorter rounding chains, ~1 add per
            # accumulator per call). beta=0 -> the masked load is all-false and
            # yields zeros without touching C (so C may hold garbage/NaN).
            for r in range(MR):
                for v in range(NV):
                    init = zero if kb < 0 else builder.call(
                        mload, [cptr(r, v), align, builder.and_(masks[v], bmask), zero])
                    builder.store(init, accs[r][v])
            with cgutils.for_range(builder, K_) as loop:
                kstep(loop.index)
            for r in range(MR):
                for v in range(NV):
                    res = builder.load(accs[r][v])
                    if kb < 0:
                        old = builder.call(mload, [cptr(r, v), align, builder.and_(masks[v], bmask), zero])
                        res = builder.fadd(res, old)
                    builder.call(mstore, [res, cptr(r, v), align, masks[v]])
        elif MR * NV <= 12:
            # blocked summation with the running totals in registers too
            tots = [[cgutils.alloca_once(builder, vty) for _ in range(NV)] for _ in range(MR)]
            for r in range(MR):
                for v in range(NV):
                    builder.store(zero, tots[r][v])
            kbc = ir.Constant(i64, kb)
            nch = builder.sdiv(builder.add(K_, ir.Constant(i64, kb - 1)), kbc)
            with cgutils.for_range(builder, nch) as ch:
                c0 = builder.mul(ch.index, kbc)
                rest = builder.sub(K_, c0)
                cnt = builder.select(builder.icmp_signed('<', rest, kbc), rest, kbc)
                for r in range(MR):
                    for v in range(NV):
                        builder.store(zero, accs[r][v])
                with builder.if_else(builder.icmp_signed('==', cnt, kbc)) as (full, tail):
                    with full:
                        for u in range(kb):
                            kstep(builder.add(c0, ir.Constant(i64, u)))
                    with tail:
                        with cgutils.for_range(builder, cnt) as loop:
                            kstep(builder.add(c0, loop.index))
                for r in range(MR):
                    for v in range(NV):
                        builder.store(builder.fadd(builder.load(tots[r][v]), builder.load(accs[r][v])),
                                      tots[r][v])
            for r in range(MR):
                for v in range(NV):
                    old = builder.call(mload, [cptr(r, v), align, builder.and_(masks[v], bmask), zero])
                    builder.call(mstore, [builder.fadd(builder.load(tots[r][v]), old),
                                          cptr(r, v), align, masks[v]])
        else:
            # blocked summation: each chunk of kb k-steps starts from zero and
            # is then added to C (through memory: no registers are left for a
            # second set of accumulators). See _mk_typer's caller for why.
            kbc = ir.Constant(i64, kb)
            nch = builder.sdiv(builder.add(K_, ir.Constant(i64, kb - 1)), kbc)
            one64 = ir.Constant(i64, 1)
            nch = builder.select(builder.icmp_signed('<', nch, one64), one64, nch)
            with cgutils.for_range(builder, nch) as ch:
                c0 = builder.mul(ch.index, kbc)
                rest = builder.sub(K_, c0)
                cnt = builder.select(builder.icmp_signed('<', rest, kbc), rest, kbc)
                for r in range(MR):
                    for v in range(NV):
                        builder.store(zero, accs[r][v])
                # full chunks: k-steps unrolled (a constant trip count lets
                # LLVM schedule loads across steps); the tail chunk loops
                with builder.if_else(builder.icmp_signed('==', cnt, kbc)) as (full, tail):
                    with full:
                        for u in range(kb):
                            kstep(builder.add(c0, ir.Constant(i64, u)))
                    with tail:
                        with cgutils.for_range(builder, cnt) as loop:
                            kstep(builder.add(c0, loop.index))
                later = builder.icmp_signed('>', ch.index, ir.Constant(i64, 0))
                addc = splat(builder.or_(beta_, later), ir.IntType(1))
                for r in range(MR):
                    for v in range(NV):
                        old = builder.call(mload, [cptr(r, v), align, builder.and_(masks[v], addc), zero])
                        builder.call(mstore, [builder.fadd(builder.load(accs[r][v]), old),
                                              cptr(r, v), align, masks[v]])
        return context.get_dummy_value()
    return sig, codegen


# P.V tiles: 6 x 4 vectors (24 accumulators), one FMA chain over the keys.
microkernel_f32 = _make_microkernel(MR, NV)
# Q.K^T tiles: blocked summation over the head dim, chunks of QK_KB. Scores
# are large numbers whose absolute error shifts the softmax weights; one
# sequential FMA chain over E = 64 had 2.8e-8 RMS error relative to
# sum|q_e k_e|, twice OpenBLAS's small-matrix/gemv paths (1.3e-8) that the
# float32 reference of the tests uses - so with logits x10..x100 the forward
# failed the "2 x naive float32 error" rule in ~3% of random cases. Chunks of
# 16: 1.6e-8 (E = 64), 1.3e-8 (E = 128). The running totals stay in
# registers, so the tile is 6 x 2 vectors (12 partial + 12 total
# accumulators), called twice per 64-key panel: ~8% slower than the 6 x 4
# single chain on a 256x512x64 tile (QK_KB = 8: 1.5e-8, ~11%).
QK_KB = 16
QNV = max(1, NV // 2)
QW = QNV * W                      # columns per Q.K^T micro-tile
microkernel_qk = _make_microkernel(MR, QNV, kb=QK_KB)
# decode Q.K^T as K . Q^T: many keys x one vector of query rows (R <= W) or
# two (R <= 2W); K rows are broadcast straight from the cache; blocked like
# microkernel_qk (dec2's totals go through memory: no registers left)
MR_D1 = 12
mk_dec1 = _make_microkernel(MR_D1, 1, True, kb=QK_KB)
MR_D2 = 8
mk_dec2 = _make_microkernel(MR_D2, 2, True, kb=QK_KB)


@njit
def pack_k_panel(kf, koff, S, E, Kp, poff, p):
    """Panel p (keys p*PW .. p*PW+PW-1) of one (batch, kv head)'s K ->
    Kp[poff + (p*E + t)*PW + c] = K[p*PW + c, t], zero past S, so the
    Q.K^T kernel reads each k-step's PW keys as NV contiguous vectors.
    Whole 8 x 8 blocks move through registers (_transpose.py); the keys
    past a multiple of 8 (the end of K) and the last E % 8 columns loop."""
    base = poff + p * E * PW
    zero = np.float32(0.0)
    nk = min(PW, S - p * PW)            # keys of this panel that exist
    nk8 = (nk // 8) * 8
    E8 = (E // 8) * 8
    for t0 in range(0, E8, 8):          # 8 whole rows of the panel at a time
        for c0 in range(0, nk8, 8):
            transpose8(Kp, base + t0 * PW + c0, PW, kf, koff + (p * PW + c0) * E + t0, E)
    for c in range(PW):
        j = p * PW + c
        if c >= nk:
            for t in range(E):
                Kp[base + t * PW + c] = zero
        else:
            for t in range(E8 if c < nk8 else 0, E):
                Kp[base + t * PW + c] = kf[koff + j * E + t]


@njit
def pack_q_tiles(qf, qoff, nq, E, Qp, poff, ntiles):
    """Q rows -> micro-tiles of MR rows, k-major inside a tile:
    Qp[poff + (tile*E + t)*MR + r] = Q[tile*MR + r, t] (zero rows past nq),
    so the kernel's MR broadcasts per k-step are adjacent in memory.
    Full tiles move as MR x 8 blocks through registers (_transpose.py); the
    last E % 8 columns and a partial last tile loop."""
    zero = np.float32(0.0)
    E8 = (E // 8) * 8
    for it in range(ntiles):
        r_n = min(MR, nq - it * MR)
        src = qoff + it * MR * E
        dst = poff + it * E * MR
        if r_n == MR:
            for t0 in range(0, E8, 8):
                transpose_q(Qp, dst + t0 * MR, MR, qf, src + t0, E)
            for t in range(E8, E):
                for r in range(MR):
                    Qp[dst + t * MR + r] = qf[src + r * E + t]
        else:
            for t in range(E):
                for r in range(MR):
                    Qp[dst + t * MR + r] = qf[src + r * E + t] if r < r_n else zero


# Row r of a tile needs the columns (keys) below r + dlim only: a causal or window band whose right
# edge cuts through the block (forward). dlim = NO_LIMIT: every column. The products skip, per
# micro-tile, the columns that none of its rows needs; the caller masks the rest of each row.
NO_LIMIT = 1 << 62


@njit
def tile_cols(it, mr, dlim):
    """Columns micro-tile it (rows it*mr .. it*mr+mr-1) needs: below the last row's limit."""
    return it * mr + mr - 1 + dlim


@njit
def gemm_qk(Sb, Bk, Qp, qoff, E, ntiles, Kp, kpoff, p0, p1, dlim=NO_LIMIT):
    """Sb[:ntiles*MR, (p-p0)*PW...] = Q . K^T for key panels p0..p1-1
    (panel p starts at Kp[kpoff + p*E*PW]; the packed Q tiles at Qp[qoff]),
    skipping the QW-column slices a tile does not need (dlim, above): those
    entries are left as they were.
    Panel-outer: one 16 KiB K panel stays in L1 while the packed Q tiles
    stream through in order."""
    no_inline()
    for p in range(p0, p1):
        for c in range(0, PW, QW):
            col = (p - p0) * PW + c
            for it in range(ntiles):
                if col < tile_cols(it, MR, dlim):
                    microkernel_qk(Sb, it * MR * Bk + col, Bk, Qp, qoff + it * E * MR, 1, MR,
                                   Kp, kpoff + p * E * PW + c, PW, E, QW, False)


KC = 128   # keys per k-chunk of P.V: a 128 x 64 V chunk (32 KiB) stays in L1


def _make_gemm_pv(mk, mr=MR, PW=PW):
    @njit
    def gemm_pv(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, ntiles, dlim=NO_LIMIT):
        """acc[:ntiles*mr, :Ev] += P[:, p0:p0+n] . V[voff...] (V rows ldv apart: Ev, or a
        cache's key stride). A tile's sum stops at the keys it needs (dlim, above; the weights
        past them are 0, and each sum is then the same FMA chain cut short: the same bits).
        Each element is one FMA chain over the keys in order, continued from acc, so a block
        taken in runs (the pages of a paged cache) gives the bits of the block taken whole."""
        for k0 in range(0, n, KC):
            kc = min(KC, n - k0)
            for c0 in range(0, Ev, PW):
                if Ev - c0 >= PW:     # constant ncols: the column masks fold away (gemm_acc_nn)
                    for it in range(ntiles):
                        kt = min(kc, tile_cols(it, mr, dlim) - k0)
                        if kt > 0:
                            mk(acc, it * mr * Evld + c0, Evld, Pb, it * mr * Bk + p0 + k0, Bk, 1,
                               vf, voff + k0 * ldv + c0, ldv, kt, PW, True)
                else:
                    for it in range(ntiles):
                        kt = min(kc, tile_cols(it, mr, dlim) - k0)
                        if kt > 0:
                            mk(acc, it * mr * Evld + c0, Evld, Pb, it * mr * Bk + p0 + k0, Bk, 1,
                               vf, voff + k0 * ldv + c0, ldv, kt, Ev - c0, True)
    return gemm_pv


gemm_pv = _make_gemm_pv(microkernel_f32)
# Decode's P.V reads every V row once, from DRAM: each k-step prefetches the panel's lines of
# the V row PV_PF_KEYS keys ahead. Without it P.V stalled on V and took 2/3 of decode's profile
# (the K stream already had prefetch_a). B1 Hq32 Hkv8 S16384 d128, 12 interleaved rounds of
# separate processes: time x0.79 (32 keys ahead) and x0.79 (64), Cython's x0.76 in the same run.
PV_PF_KEYS = 32
gemm_pv_stream = _make_gemm_pv(_make_microkernel(MR, NV, prefetch_b=PV_PF_KEYS))
# ... and 4-row tiles (GQA groups of 2-4 rows, or 7-8: R = 4 filled 4 of the 6 rows of an MR
# tile). The same FMA chain per element as every other tile shape.
gemm_pv_stream4 = _make_gemm_pv(_make_microkernel(4, NV, prefetch_b=PV_PF_KEYS), 4)
# ... and for one query row (MHA decode) a 1-row tile: the MR-row tile spent 5/6 of its FMAs
# on padding rows. Each sum is the same FMA chain over the keys, so the bits are the same.
# The row tile is 64 columns wide (8 ymm / 4 zmm accumulators): with AVX2's 2 ymm per row a
# key's two FMAs waited on the previous key's (4 cycles a panel, 16 a key at d = 64); 8
# independent chains keep both FMA units busy, each still one chain over the keys in order.
NV_ROW = 64 // W
gemm_pv_stream_row = _make_gemm_pv(_make_microkernel(1, NV_ROW, prefetch_b=PV_PF_KEYS), 1,
                                   NV_ROW * W)


def _make_dec_pv(row, four, six):
    @njit
    def dec_pv(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, R):
        """acc[:R] += P[:R, p0:p0+n] . V (V rows from vf[voff], ldv apart) by the tile shape
        that pads R least: one row (MHA decode), 4-row tiles (GQA groups of 2-4 or 7-8), MR."""
        if R == 1:
            row(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, 1)
        elif 4 * ((R + 3) // 4) < Pb.shape[0]:     # 4-row tiles pad less than MR's
            four(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, (R + 3) // 4)
        else:
            six(acc, Evld, Pb, Bk, p0, vf, voff, ldv, Ev, n, (R + MR - 1) // MR)
    return dec_pv


def _make_dec_pv_stored(kind):
    """dec_pv over a low-precision cache's values read in place (kind as _make_microkernel's;
    int8: the caller has multiplied P's columns by the values' scales)."""
    return _make_dec_pv(*(_make_gemm_pv(_make_microkernel(mr, nv, prefetch_b=PV_PF_KEYS,
                                                          kind=kind), mr, nv * W)
                          for mr, nv in ((1, NV_ROW), (4, NV), (MR, NV))))


dec_pv = _make_dec_pv(gemm_pv_stream_row, gemm_pv_stream4, gemm_pv_stream)
# float16 only where F16C converts it in one instruction (ir_load_stored); the decode converts
# into a float32 tile elsewhere
dec_pv_bf16 = _make_dec_pv_stored('bf16')
dec_pv_i8 = _make_dec_pv_stored('i8')
dec_pv_f16 = _make_dec_pv_stored('f16') if HAVE_F16C else dec_pv_bf16


# backward products accumulated over many tiles: end-add chains (see kb < 0)
mk_acc = _make_microkernel(MR, NV, kb=-1)


@njit
def gemm_acc_nn(C, coff, ldc, nrt, A, aoff, lda, B, boff, ldb, K, N, dlim=NO_LIMIT):
    """C[:nrt*MR, :N] += A[:nrt*MR, :K] . B[:K, :N] (row-major, strided rows).
    Used for dQ += dS . K; K is chunked by KC so a B chunk stays in L1.
    Full column panels pass the constant PW as ncols, so LLVM folds the
    column masks away (plain loads/stores); with the mask computed at run time
    this non-inlined driver ran at ~105 instead of ~154 GF/s (128x64x128).
    dlim (a band edge, see tile_cols): row r of A is zero from column r + dlim on, so each
    micro-tile's chain stops at its last row's limit (the terms left out are exact zeros)."""
    no_inline()
    for k0 in range(0, K, KC):
        kc = min(KC, K - k0)
        for c0 in range(0, N, PW):
            if N - c0 >= PW:
                for it in range(nrt):
                    kn = min(kc, tile_cols(it, MR, dlim) - k0)
                    if kn > 0:
                        mk_acc(C, coff + it * MR * ldc + c0, ldc, A, aoff + it * MR * lda + k0,
                               lda, 1, B, boff + k0 * ldb + c0, ldb, kn, PW, True)
            else:
                for it in range(nrt):
                    kn = min(kc, tile_cols(it, MR, dlim) - k0)
                    if kn > 0:
                        mk_acc(C, coff + it * MR * ldc + c0, ldc, A, aoff + it * MR * lda + k0,
                               lda, 1, B, boff + k0 * ldb + c0, ldb, kn, N - c0, True)


@njit
def gemm_acc_tn_packed(C, coff, ldc, nrt, A, aoff, B, boff, ldb, K, N, dlim=NO_LIMIT):
    """C[:nrt*MR, :N] += A^T . B[:K, :N] with A^T packed per micro-tile:
    tile it holds A^T[it*MR + r, t] at A[aoff + (it*K + t)*MR + r], so each
    k-step reads MR adjacent elements and a tile streams through K*MR
    contiguous floats. (Reading a row-major A down its columns, as before,
    walked K rows per tile and touched a new cache line every k-step: dV^T
    tile 128x64x128 ~17.6 us.)
    dlim (a band edge, see tile_cols): row t of B is zero from column t + dlim on, so the
    chain of a column panel starting at c0 skips the rows t < c0 - dlim + 1 (exact zeros:
    the chain starts from zero and C is added at its end, so the bits do not change)."""
    no_inline()
    for k0 in range(0, K, KC):
        kc = min(KC, K - k0)
        for c0 in range(0, N, PW):
            ks = max(k0, c0 - dlim + 1)
            kn = k0 + kc - ks
            if kn <= 0:
                continue
            if N - c0 >= PW:      # constant ncols: see gemm_acc_nn
                for it in range(nrt):
                    mk_acc(C, coff + it * MR * ldc + c0, ldc, A, aoff + (it * K + ks) * MR, 1,
                           MR, B, boff + ks * ldb + c0, ldb, kn, PW, True)
            else:
                for it in range(nrt):
                    mk_acc(C, coff + it * MR * ldc + c0, ldc, A, aoff + (it * K + ks) * MR, 1,
                           MR, B, boff + ks * ldb + c0, ldb, kn, N - c0, True)


@njit(fastmath={'contract'})   # FMA in the scalar tail, like the kernels
def dec_qk(Sb, c0, kf, koff, ldk, E, n, Qt, R, SbT):
    """Decode scores Sb[:R, c0:c0+n] = Q . K[koff...]^T for R query rows (K rows ldk apart),
    computed as S^T = K . Q^T (Qt: E x R). The last n % MR keys use plain
    loops (the kernel's rows are unmasked and must not read past K's end),
    summed in the kernel's blocks, so each score has the same bits wherever its key sits;
    SbT is (>= n) x R scratch, transposed into Sb at the end (n*R moves)."""
    zero = np.float32(0.0)
    if R <= W:
        full = (n // MR_D1) * MR_D1
        for j in range(0, full, MR_D1):
            mk_dec1(SbT, j * R, R, kf, koff + j * ldk, ldk, 1, Qt, 0, R, E, R, False)
    elif R <= 2 * W:
        full = (n // MR_D2) * MR_D2
        for j in range(0, full, MR_D2):
            mk_dec2(SbT, j * R, R, kf, koff + j * ldk, ldk, 1, Qt, 0, R, E, R, False)
    else:
        full = (n // MR) * MR
        for j in range(0, full, MR):
            for q0 in range(0, R, QW):
                microkernel_qk(SbT, j * R + q0, R, kf, koff + j * ldk, ldk, 1, Qt, q0, R, E,
                               min(QW, R - q0), False)
    for j in range(full, n):
        for r in range(R):
            s = zero
            for t0 in range(0, E, QK_KB):      # blocked like the kernels
                c = zero
                for t in range(t0, min(E, t0 + QK_KB)):
                    c += Qt[t * R + r] * kf[koff + j * ldk + t]
                s += c
            SbT[j * R + r] = s
    for r in range(R):
        for j in range(n):
            Sb[r, c0 + j] = SbT[j * R + r]
