"""Vectorizable exp2 and tanh for the Numba kernels, and the softmax's
exp2 row pass written for AVX-512.

exp2v and tanhv are plain arithmetic that LLVM inlines and vectorizes inside
the callers' loops (Numba without SVML would call scalar libm, 3-6
ns/element). exp2_row_sum is emitted as LLVM vector IR (see its comment).
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._intrinsics import (FM, HAVE_AVX512DQ, as_float, as_int, fcast, fused_mul_sub,
                          wide_vectors)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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
# float32: |x| < 0.55 -> x + x**3 * P(x**2), P of degree 4 fitted for
# relative error on [0, 0.55] (iteratively reweighted least squares,
# 1e-9 fit error; 0.79 ulp max in float32 evaluation); otherwise
# 1 - 2/(2**(2x*log2e) + 1). 0.55 is where 2/(e+1) = 1/2: below it the
# subtraction amplifies exp2's error (the earlier 0.25 switch point gave
# 5.4 ulp at x ~ 0.3, and softcap multiplies that error by the cap - enough
# to fail the float32 tolerance rule with softcap 20). Max 1.7 ulp overall
# (numpy's float32 tanh: 1.4). Both branches are computed and selected, so
# the loop vectorizes. float64 uses libm tanh (scalar, exact); float64 speed
# is not a goal.
_T32 = (np.float32(-0.33333316445350647), np.float32(0.13332585990428925),
        np.float32(-0.05385231226682663), np.float32(0.02107168175280094),
        np.float32(-0.006274242885410786))


@njit(fastmath=FM)
def tanh_f32(x):
    ax = abs(x)
    x2 = x * x
    p = _T32[4]
    p = p * x2 + _T32[3]
    p = p * x2 + _T32[2]
    p = p * x2 + _T32[1]
    p = p * x2 + _T32[0]
    small = x + x * x2 * p
    # clamp to keep exp2 finite. tanh(x) rounds to 1 in float32 from x ~ 9.01
    # on (tanh(9) = 1 - 3.05e-8 rounds down to 1 - 2**-24, which a clamp at 9
    # returned for every larger x: -1 ulp on all saturated softcap scores)
    # (`not >=`: a NaN argument passes the clamp, so tanh(NaN) = NaN; `ax < 10` clamped it to
    # 10 and a NaN score came out finite, +-softcap)
    axc = ax if not (ax >= np.float32(10.0)) else np.float32(10.0)
    e = exp2_f32(axc * np.float32(2.0 * LOG2E))
    big = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    big = big if x >= np.float32(0.0) else -big
    return small if ax < np.float32(0.55) else big


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
# exp2 row pass of the online softmax: P[r, :n] = 2**(S[r, :n]*c - m), and
# the row's sum
# --------------------------------------------------------------------------
# The forward's block pipeline is bound by vector ALU operations: per 16
# scores at d=64, Q.K^T and P.V take 128 FMAs and this pass ~20 more (13% of
# the pipeline, measured). Auto-vectorized, exp2_f32 compiles to that: its
# NaN-keeping two-sided clamp becomes compare+blend pairs (with mask
# registers spilled to the stack), then the magic-number rounding, a shift
# and a multiply. AVX-512 has the pieces as single instructions:
#   r = vreduceps(t)    t - round(t), exact, in [-0.5, 0.5]; -inf gives 0
#   p = 2**r            the same polynomial (_P32) as exp2_f32
#   vscalefps(p, t - r) p * 2**round(t): 0 for t = -inf, inf on overflow
# That is 12 operations plus one compare: lanes with t < EXP2_ROW_CUTOFF
# (or -inf) come out as exactly 0 through the scalef's zero mask, so no
# weight is a denormal; NaN compares unordered and propagates. Per weight the
# result is exp2_f32's (same r, same polynomial, exact scaling) wherever
# t >= EXP2_ROW_CUTOFF; exp2_f32 flushes below -126.5 instead and saturates
# at 2**64 where this gives inf (the lazy softmax sends both to its exact
# path). One 256 x 512 tile, interleaved in one process: 0.72x the time of
# the auto-vectorized loop.
EXP2_ROW_CUTOFF = -125.0
_ROW_UNROLL = 4        # vectors per loop step, each with its own partial sum


@intrinsic
def _exp2_row_avx512(typingctx, S, soff, P, poff, n, c, m):
    """sum_j of P[poff + j] = 2**(S[soff + j]*c - m), j < n (flat offsets
    into float32 C-contiguous arrays). Full vectors run _ROW_UNROLL at a
    time into separate partial sums (added pairwise at the end); the last
    partial vector loads -inf in its dead lanes (weight 0) and stores
    masked."""
    for arr in (S, P):
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32
                and arr.layout == 'C'):
            return None
    sig = types.float32(S, soff, P, poff, n, c, m)

    def codegen(context, builder, signature, args):
        try:
            set.add(builder.function.attributes, '"min-legal-vector-width"="512"')
        except Exception:  # pragma: no cover - llvmlite internals changed
            pass
        tys = signature.args
        W = 16
        i1, i16, i32, i64 = (ir.IntType(b) for b in (1, 16, 32, 64))
        f32 = ir.FloatType()
        vty = ir.VectorType(f32, W)
        vptr = vty.as_pointer()
        mty = ir.VectorType(i1, W)
        mod = builder.module

        def fn(name, ret, argt):
            return cgutils.get_or_insert_function(mod, ir.FunctionType(ret, argt), name)
        vreduce = fn("llvm.x86.avx512.mask.reduce.ps.512", vty, [vty, i32, vty, i16, i32])
        vscalef = fn("llvm.x86.avx512.mask.scalef.ps.512", vty, [vty, vty, vty, i16, i32])
        fma = fn("llvm.fma.v16f32", vty, [vty, vty, vty])
        mload = fn("llvm.masked.load.v16f32.p0", vty, [vptr, i32, mty, vty])
        mstore = fn("llvm.masked.store.v16f32.p0", ir.VoidType(), [vty, vptr, i32, mty])

        def arg(k, ty):
            return context.cast(builder, args[k], tys[k], ty)
        sbase = builder.gep(context.make_array(tys[0])(context, builder, args[0]).data,
                            [arg(1, types.intp)])
        pbase = builder.gep(context.make_array(tys[2])(context, builder, args[2]).data,
                            [arg(3, types.intp)])
        n_ = arg(4, types.intp)

        def splat(val, ty):
            vt = ir.VectorType(ty, W)
            u = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(i32, 0))
            return builder.shuffle_vector(u, ir.Constant(vt, ir.Undefined),
                                          ir.Constant(ir.VectorType(i32, W), [0] * W))
        cv = splat(arg(5, types.float32), f32)
        neg_m = splat(builder.fneg(arg(6, types.float32)), f32)
        coef = [ir.Constant(vty, [float(x)] * W) for x in _P32]
        zero = ir.Constant(vty, [0.0] * W)
        cutoff = ir.Constant(vty, [EXP2_ROW_CUTOFF] * W)
        all_lanes = ir.Constant(i16, -1)
        round_nearest = ir.Constant(i32, 0x08)    # M = 0 fraction bits, nearest, no #PE
        cur_direction = ir.Constant(i32, 4)

        def exp2_vec(x):
            t = builder.call(fma, [x, cv, neg_m])
            r = builder.call(vreduce, [t, round_nearest, zero, all_lanes, cur_direction])
            k = builder.fsub(t, r)
            p = coef[6]
            for j in (5, 4, 3, 2, 1, 0):
                p = builder.call(fma, [p, r, coef[j]])
            keep = builder.bitcast(builder.fcmp_unordered('>=', t, cutoff), i16)
            return builder.call(vscalef, [p, k, zero, keep, cur_direction])

        def vec_at(base, o):
            return builder.bitcast(builder.gep(base, [o]), vptr)
        U = _ROW_UNROLL
        parts = [cgutils.alloca_once_value(builder, zero) for _ in range(U)]
        nsteps = builder.sdiv(n_, ir.Constant(i64, W * U))
        with cgutils.for_range(builder, nsteps) as loop:
            o0 = builder.mul(loop.index, ir.Constant(i64, W * U))
            for u in range(U):
                o = builder.add(o0, ir.Constant(i64, u * W))
                p = exp2_vec(builder.load(vec_at(sbase, o), align=4))
                builder.store(p, vec_at(pbase, o), align=4)
                builder.store(builder.fadd(builder.load(parts[u]), p), parts[u])
        done = builder.mul(nsteps, ir.Constant(i64, W * U))
        nvec = builder.sdiv(builder.add(builder.sub(n_, done), ir.Constant(i64, W - 1)),
                            ir.Constant(i64, W))
        lanes = ir.Constant(ir.VectorType(i64, W), list(range(W)))
        ninf = ir.Constant(vty, [float('-inf')] * W)
        align = ir.Constant(i32, 4)
        with cgutils.for_range(builder, nvec) as loop:
            o = builder.add(done, builder.mul(loop.index, ir.Constant(i64, W)))
            live = builder.icmp_signed('<', lanes, splat(builder.sub(n_, o), i64))
            p = exp2_vec(builder.call(mload, [vec_at(sbase, o), align, live, ninf]))
            builder.call(mstore, [p, vec_at(pbase, o), align, live])
            builder.store(builder.fadd(builder.load(parts[0]), p), parts[0])
        tot = builder.fadd(builder.fadd(builder.load(parts[0]), builder.load(parts[1])),
                           builder.fadd(builder.load(parts[2]), builder.load(parts[3])))
        w = W
        while w > 1:     # lanes pairwise: [0, w/2) += [w/2, w)
            h = w // 2
            hi = builder.shuffle_vector(tot, ir.Constant(vty, ir.Undefined),
                                        ir.Constant(ir.VectorType(i32, W),
                                                    list(range(h, w)) + list(range(W - h))))
            tot = builder.fadd(tot, hi)
            w = h
        return builder.extract_element(tot, ir.Constant(i32, 0))
    return sig, codegen


def exp2_row_sum(S, r, P, n, c, m):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(exp2_row_sum, fastmath=FM)
def _exp2_row_sum_ol(S, r, P, n, c, m):
    """Sets P[r, j] = 2**(S[r, j]*c - m) for j < n and returns their sum
    (S, P: 2-D tiles of one dtype, c and m in that dtype)."""
    if (HAVE_AVX512DQ and S.dtype == types.float32 and P.dtype == types.float32
            and S.layout == 'C' and P.layout == 'C'):
        def impl(S, r, P, n, c, m):
            return _exp2_row_avx512(S, r * S.shape[1], P, r * P.shape[1], n, c, m)
        return impl

    def impl(S, r, P, n, c, m):
        wide_vectors()
        s = fcast(P, 0.0)
        for j in range(n):
            p = exp2v(fused_mul_sub(S[r, j], c, m))     # one rounding, as the AVX-512 pass
            P[r, j] = p
            s += p
        return s
    return impl
