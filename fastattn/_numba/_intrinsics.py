"""LLVM-level helpers for the Numba kernels, emitted through @intrinsic.

A 512-bit vector-width hint for the function being compiled, a NaN-propagating
max (llvm.maximum), float<->int bit casts, an atomic counter for dynamic
scheduling, a raw element address for the BLAS calls, and fcast (constants in
the array's float dtype).

fastmath is never True in these kernels (it implies 'ninf'/'nnan' and breaks
-inf masks); FM below is the safe subset.
"""
import os
import platform

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_FEATURES = llb.get_host_cpu_features()
HAVE_AVX512 = bool(_FEATURES.get('avx512f', False))
# F16C: float16 -> float32 as one instruction per vector (vcvtph2ps); without it LLVM would
# lower the conversion to a libcall the JIT may not resolve, so _kvconv keeps integer code
HAVE_F16C = bool(_FEATURES.get('f16c', False))
# vreduceps (the exp2 row pass in _exp.py) is an AVX512DQ instruction
HAVE_AVX512DQ = HAVE_AVX512 and bool(_FEATURES.get('avx512dq', False))

# Safe fast-math subset: lets LLVM reassociate sums (vectorized reductions)
# and contract a*b+c into FMAs, but keeps inf/NaN semantics.
FM = {'reassoc', 'contract', 'nsz', 'arcp', 'afn'}

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
def no_inline(typingctx):
    """Keep LLVM from inlining the function being compiled into its callers.

    For the GEMM drivers: inlined into a large item function (the backward's)
    the micro-kernel loops ran ~1.4x slower (register pressure from the
    caller's live values; measured 255 -> 181 Mcycles for B1 H8 L1024 d64 on
    one thread); a call per tile product costs nothing by comparison."""
    def codegen(context, builder, signature, args):
        try:
            builder.function.attributes.add('noinline')
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
def fused_mul_sub(typingctx, a, b, c):
    """a * b - c rounded once (llvm.fma with -c), whatever the fast-math flags around it.

    The 'contract' flag only allows the fusion: in the softmax's generic row loop (CPUs without
    AVX-512) LLVM kept a separate multiply and subtract, so t = x*c - m there was rounded twice
    (at the row max t came out 0 instead of the FMA's residual) and differed from the AVX-512
    pass and the elementwise exp2."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None
    sig = a(a, b, c)

    def codegen(context, builder, signature, args):
        lt = context.get_value_type(signature.return_type)
        suffix = 'f32' if lt == ir.FloatType() else 'f64'
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(lt, [lt, lt, lt]), "llvm.fma." + suffix)
        x, y, z = args
        return builder.call(fn, [x, y, builder.fneg(z)])
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


@njit(nogil=True, cache=True)
def counters(n):
    """n int64 zeros for atomic_next / atomic_count. Not np.zeros in the parallel kernel itself:
    under parallel=True numba makes np.zeros a parallel loop of its own, one more wake and join
    of the thread pool in every call (30-50 us on two threads of this VM with the pool waiting
    passively, as much as the whole kernel of a small decode)."""
    c = np.empty(n, np.int64)
    for i in range(n):
        c[i] = 0
    return c


def _counter_intrinsic(counter, idx, op):
    """Signature and codegen of an intrinsic on counter[idx] (an int64 array, any integer
    index): op(builder, pointer to the element) makes the atomic instruction."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64
            and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        return op(builder, builder.gep(ary.data, [i]))
    return types.int64(counter, idx), codegen


@intrinsic
def atomic_count(typingctx, counter, idx):
    """Atomically increment counter[idx] (int64 array) and return the old value, ordered
    acquire-release: the thread that sees the last count also sees every write the other
    counting threads made before they counted (a kernel's "last one to finish a group merges
    it", in place of a second parallel region)."""
    return _counter_intrinsic(counter, idx, lambda builder, ptr: builder.atomic_rmw(
        'add', ptr, ir.Constant(ir.IntType(64), 1), 'acq_rel'))


@intrinsic
def atomic_read(typingctx, counter, idx):
    """counter[idx] (int64 array) read atomically, ordered acquire: a worker that sees another's
    atomic_count sees the writes that worker made before counting."""
    return _counter_intrinsic(counter, idx,
                              lambda builder, ptr: builder.load_atomic(ptr, 'acquire', 8))


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def spin_pause(typingctx):
    """The x86 PAUSE hint in a spin-wait loop (the core's sibling and power get the cycles); no
    instruction elsewhere."""
    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


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




@intrinsic
def prefetch_l2(typingctx, arr, idx):
    """Software prefetch of the cache line holding arr.flat[idx] into L2
    (llvm.prefetch, read, locality 2). A hint only: no fault, no effect on
    results."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(arr, types.intp), codegen



def ir_splat(builder, val, W):
    """A W-lane vector of the IR scalar val in every lane."""
    vt = ir.VectorType(val.type, W)
    u = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(u, ir.Constant(vt, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), W), [0] * W))


def ir_first_lanes(builder, rest, W):
    """The W-lane mask of lanes 0 .. rest-1 (rest: an i64), for a loop's last partial vector."""
    lanes = ir.Constant(ir.VectorType(ir.IntType(64), W), list(range(W)))
    return builder.icmp_signed('<', lanes, ir_splat(builder, rest, W))


# The element type a cache of each kind is read as: float32, the bits of float16 / bfloat16
# (uint16 views), int8 codes.
KIND_DTYPE = {'f32': types.float32, 'f16': types.uint16, 'bf16': types.uint16, 'i8': types.int8}


def ir_load_stored(builder, ptr, kind, W, mask=None):
    """W stored elements from ptr (a pointer to the kind's element type) as a float32 vector,
    converted in the registers (masked: the lanes off the mask read nothing and are 0):
      'f32':  as they are;
      'f16':  the float16 whose bits they hold, by LLVM's fpext half -> float (F16C's vcvtph2ps:
              exact for every pattern, subnormals included, whatever the MXCSR's denormal
              flags; a signalling NaN comes out quiet). Only where HAVE_F16C: elsewhere LLVM
              would lower it to a libcall the JIT may not resolve;
      'bf16': the bfloat16 whose bits they hold: the top half of a float32;
      'i8':   float32(code), exact; the caller applies the scale."""
    i32 = ir.IntType(32)
    f32v = ir.VectorType(ir.FloatType(), W)
    mty = ir.VectorType(ir.IntType(1), W)
    ety = ir.FloatType() if kind == 'f32' else ir.IntType(8 if kind == 'i8' else 16)
    vty = ir.VectorType(ety, W)
    p = builder.bitcast(ptr, vty.as_pointer())
    align = 4 if kind == 'f32' else 1
    if mask is None:
        x = builder.load(p, align=align)
    else:
        name = "llvm.masked.load.v%d%s.p0" % (W, 'f32' if kind == 'f32' else 'i%d' % ety.width)
        mload = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vty, [vty.as_pointer(), i32, mty, vty]), name)
        x = builder.call(mload, [p, ir.Constant(i32, align), mask,
                                 ir.Constant(vty, [0.0 if kind == 'f32' else 0] * W)])
    if kind == 'f32':
        return x
    if kind == 'f16':
        return builder.fpext(builder.bitcast(x, ir.VectorType(ir.HalfType(), W)), f32v)
    if kind == 'bf16':
        wide = builder.zext(x, ir.VectorType(i32, W))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(i32, W), [16] * W)),
                               f32v)
    return builder.sitofp(x, f32v)


def _make_row_converter(kind):
    """An intrinsic converting n stored cache elements into float32:
    dst[dst_off + t] = value(src[src_off + t]) for t < n, value as ir_load_stored converts by
    kind ('f16', 'bf16'; 'i8': float32(code) * scale). Whole vectors of 16, the last partial
    one through masked loads and stores. Plain IR, no array views: numba's slices cost a
    reference count (an atomic) each, per cache row."""
    W = 16
    src_dtype = KIND_DTYPE[kind]

    @intrinsic
    def convert(typingctx, src, src_off, dst, dst_off, n, scale):
        if not (isinstance(src, types.Array) and src.dtype == src_dtype
                and isinstance(dst, types.Array) and dst.dtype == types.float32):
            return None

        def codegen(context, builder, signature, args):
            tys = signature.args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            so, do, n_ = [context.cast(builder, args[k], tys[k], types.intp) for k in (1, 3, 4)]
            sc = context.cast(builder, args[5], tys[5], types.float32)
            sdat = context.make_array(tys[0])(context, builder, args[0]).data
            ddat = context.make_array(tys[2])(context, builder, args[2]).data
            fv, mv = ir.VectorType(ir.FloatType(), W), ir.VectorType(ir.IntType(1), W)
            mstore = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [fv, fv.as_pointer(), i32, mv]),
                "llvm.masked.store.v%df32.p0" % W)
            sbase = builder.gep(sdat, [so])
            dbase = builder.gep(ddat, [do])
            scv = ir_splat(builder, sc, W) if kind == 'i8' else None

            def value(e, mask):
                x = ir_load_stored(builder, builder.gep(sbase, [e]), kind, W, mask)
                return builder.fmul(x, scv) if kind == 'i8' else x

            def dst_ptr(e):
                return builder.bitcast(builder.gep(dbase, [e]), fv.as_pointer())
            wc = ir.Constant(i64, W)
            nfull = builder.sdiv(n_, wc)
            with cgutils.for_range(builder, nfull) as loop:
                e = builder.mul(loop.index, wc)
                builder.store(value(e, None), dst_ptr(e), align=4)
            tail = builder.mul(nfull, wc)
            with builder.if_then(builder.icmp_signed('<', tail, n_)):
                mask = ir_first_lanes(builder, builder.sub(n_, tail), W)
                builder.call(mstore, [value(tail, mask), dst_ptr(tail), ir.Constant(i32, 4),
                                      mask])
            return context.get_dummy_value()
        return types.none(src, src_off, dst, dst_off, n, scale), codegen
    return convert


f16_to_f32 = _make_row_converter('f16')
bf16_to_f32 = _make_row_converter('bf16')
i8_to_f32 = _make_row_converter('i8')
