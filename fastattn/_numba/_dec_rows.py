"""Decode scores for a few query rows (R = 1..8 rows of one kv group: MHA and GQA decode), as
LLVM IR.

The panel kernel of _gemm.dec_qk puts the query rows in a vector's lanes and broadcasts each
K element, so a key costs E vector FMAs whatever R is: with R = 4 rows, 12 of AVX-512's 16
lanes were padding and the numba GQA decode took ~2x Cython's time with the keys in cache.
Here the lanes run along the head dim instead: for a group of KQ keys, each of the R x KQ
(row, key) pairs has one vector accumulator of lane-wise partial sums (lane l sums the
products e = l, l + W, l + 2W, ...), E / W FMAs a pair; the R x KQ accumulators are then
reduced together by a transposing tree (two vectors' halves shuffled side by side and added,
log2(W) levels), ~3 operations a score where a reduction of its own would take ~8.

Every score is summed in the same order wherever its key sits (the lane chains, then the
tree: partials l and l + W/2, then l and l + W/4, ...), whichever group it falls in, so a key
block taken in runs (a paged cache) or keys at a block's tail (the one-key variant) give the
bits of the same keys scored in groups. The lane-wise blocked sum is also the more accurate
order (chains of E / W products, then a pairwise tree), which the 2x-naive rule needs for
large logits (see _gemm.QK_KB).

The same kernels read a float16, bfloat16 or int8 cache in place (kinds 'f16', 'bf16', 'i8'):
each key vector is converted in the registers as it is loaded (exactly, as _kvconv converts a
tile), so the scores are the float32 kernel's bits on the converted keys (int8: on the codes,
then times the key's scale) without a second pass over the cache's elements.

One row (MHA decode) runs here too, KQ = 8 keys a group on AVX-512. It replaced a dot-product
loop that LLVM vectorized (_gemm.dec_qk_dot, one array slice a key): MHA decode 12 heads d64
float32, Zen 4 guest, alternating processes, 1024 keys 164-167 against 172-173 us, 16384 keys
3.35-3.60 against 3.56-3.70 ms; and a low-precision cache's keys are then converted in the
registers for MHA as for GQA.
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._intrinsics import HAVE_AVX512, HAVE_F16C, KIND_DTYPE, ir_first_lanes, ir_load_stored

W = 16 if HAVE_AVX512 else 8          # float32 lanes per vector register
ACC_REGS = 16 if HAVE_AVX512 else 8   # accumulators a group keeps in registers (32 / 16 regs)
ROWS_MAX = ACC_REGS // 2              # rows scored here; more rows fill the panel kernel's lanes
# Keys ahead of the group whose K lines each step prefetches to L2 (decode streams K from
# DRAM once).
PF_KEYS = 16
PF_LOCALITY = 2


def keys_per_group(R, acc_regs=ACC_REGS):
    """Keys scored together for R rows: as many as keep R x KQ accumulators in registers."""
    kq = 1
    while 2 * kq * R <= acc_regs:
        kq *= 2
    return kq


def _reduce_tree(builder, vals, ids, W=W):
    """vals: vectors of W lane partials, one accumulator each (ids[i] names vals[i]) ->
    one or more vectors whose lanes hold whole sums, and each lane's id (None: padding).
    Each level pairs two vectors holding G groups of P partials and makes one of 2G groups of
    P/2: partial i and i + P/2 of every group added, the same pairs whatever the grouping."""
    f32 = ir.FloatType()
    vty = ir.VectorType(f32, W)
    zero = ir.Constant(vty, [0.0] * W)
    groups = [[i] for i in ids]
    P = W
    while P > 1:
        half = P // 2
        nvals, ngroups = [], []
        for k in range(0, len(vals), 2):
            a, ga = vals[k], groups[k]
            if k + 1 < len(vals):
                b, gb = vals[k + 1], groups[k + 1]
            else:
                b, gb = zero, [None] * len(ga)
            lo, hi = [], []
            for src, gs in ((0, ga), (W, gb)):
                for g in range(len(gs)):
                    lo += [src + g * P + i for i in range(half)]
                    hi += [src + g * P + half + i for i in range(half)]
            mask_lo = ir.Constant(ir.VectorType(ir.IntType(32), W), lo)
            mask_hi = ir.Constant(ir.VectorType(ir.IntType(32), W), hi)
            s = builder.fadd(builder.shuffle_vector(a, b, mask_lo),
                             builder.shuffle_vector(a, b, mask_hi))
            nvals.append(s)
            ngroups.append(ga + gb)
        vals, groups = nvals, ngroups
        P = half
    return vals, groups


def _make_rows_kernel(R, KQ, W=W, kind='f32'):
    """The intrinsic scoring R query rows against KQ keys:
    sb[sb_off + r*ldsb + j] = sum_e q[q_off + r*ldq + e] * key(k_off + j*ldk + e),
    with vectors of W lanes (the tests build AVX2's 8 on an AVX-512 machine too). key() is
    the stored float32, or a low-precision cache's value converted in the registers as each
    vector is loaded (_intrinsics.ir_load_stored: 'f16' fpext, 'bf16' the top half of a
    float32); for 'i8' the sum runs over float32(code) and the score is then multiplied by the
    key's scale scf[sc_off + j] (one multiply a score instead of one an element, as the Cython
    kernels do)."""
    @intrinsic
    def rows_kernel(typingctx, sb, sb_off, ldsb, kf, k_off, ldk, qf, q_off, ldq, E, scf,
                    sc_off):
        for arr, dt in ((sb, types.float32), (kf, KIND_DTYPE[kind]), (qf, types.float32),
                        (scf, types.float32)):
            if not (isinstance(arr, types.Array) and arr.dtype == dt):
                return None
        sig = types.void(sb, sb_off, ldsb, kf, k_off, ldk, qf, q_off, ldq, E, scf, sc_off)

        def codegen(context, builder, signature, args):
            try:                 # 512-bit vectors stay whole (see _gemm._mk_typer)
                set.add(builder.function.attributes, '"min-legal-vector-width"="512"')
                set.add(builder.function.attributes, '"prefer-vector-width"="512"')
            except Exception:  # pragma: no cover
                pass
            tys = signature.args
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

            def iarg(k):
                return context.cast(builder, args[k], tys[k], types.intp)
            sb_off_, ldsb_, k_off_, ldk_, q_off_, ldq_, E_, sc_off_ = [
                iarg(k) for k in (1, 2, 4, 5, 7, 8, 9, 11)]
            sdat = context.make_array(tys[0])(context, builder, args[0]).data
            kdat = context.make_array(tys[3])(context, builder, args[3]).data
            qdat = context.make_array(tys[6])(context, builder, args[6]).data
            cdat = context.make_array(tys[10])(context, builder, args[10]).data
            vty = ir.VectorType(f32, W)
            zero = ir.Constant(vty, [0.0] * W)
            mod = builder.module
            fma = cgutils.get_or_insert_function(
                mod, ir.FunctionType(vty, [vty, vty, vty]), "llvm.fmuladd.v%df32" % W)
            pf = cgutils.get_or_insert_function(
                mod, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
                "llvm.prefetch.p0")
            kbase = builder.gep(kdat, [k_off_])
            qbase = builder.gep(qdat, [q_off_])
            krow = [builder.gep(kbase, [builder.mul(ldk_, ir.Constant(i64, j))])
                    for j in range(KQ)]
            kahead = [builder.gep(kbase, [builder.mul(ldk_, ir.Constant(i64, j + PF_KEYS))])
                      for j in range(KQ)]
            qrow = [builder.gep(qbase, [builder.mul(ldq_, ir.Constant(i64, r))])
                    for r in range(R)]
            accs = [[cgutils.alloca_once(builder, vty) for _ in range(KQ)] for _ in range(R)]
            for r in range(R):
                for j in range(KQ):
                    builder.store(zero, accs[r][j])

            def kload(j, e0, mask):
                """Key j's elements e0 .. e0+W-1 as float32 (masked: the rest 0)."""
                return ir_load_stored(builder, builder.gep(krow[j], [e0]), kind, W, mask)

            def step(e0, mask, prefetch=True):
                if prefetch:
                    for j in range(KQ):
                        builder.call(pf, [builder.bitcast(builder.gep(kahead[j], [e0]),
                                                          ir.IntType(8).as_pointer()),
                                          ir.Constant(i32, 0), ir.Constant(i32, PF_LOCALITY),
                                          ir.Constant(i32, 1)])
                kv = [kload(j, e0, mask) for j in range(KQ)]
                for r in range(R):
                    qv = ir_load_stored(builder, builder.gep(qrow[r], [e0]), 'f32', W, mask)
                    for j in range(KQ):
                        builder.store(builder.call(fma, [qv, kv[j], builder.load(accs[r][j])]),
                                      accs[r][j])

            # whole cache lines first (a line holds `per_line` vectors of a narrow kind: one
            # prefetch a line, not one a vector), then the line's worth of vectors left, then
            # the masked tail
            per_line = 64 // (W * KIND_DTYPE[kind].bitwidth // 8) or 1
            wc = ir.Constant(i64, W)
            lc = ir.Constant(i64, W * per_line)
            nfull = builder.sdiv(E_, wc)
            nlines = builder.sdiv(E_, lc)
            with cgutils.for_range(builder, nlines) as loop:
                e_line = builder.mul(loop.index, lc)
                for u in range(per_line):
                    step(builder.add(e_line, ir.Constant(i64, u * W)), None, prefetch=u == 0)
            e_rest = builder.mul(nlines, lc)
            with cgutils.for_range(builder, builder.sub(nfull, builder.sdiv(e_rest, wc))) as loop:
                step(builder.add(e_rest, builder.mul(loop.index, wc)), None)
            e_tail = builder.mul(nfull, wc)
            with builder.if_then(builder.icmp_signed('<', e_tail, E_)):
                step(e_tail, ir_first_lanes(builder, builder.sub(E_, e_tail), W))

            ids = [(r, j) for r in range(R) for j in range(KQ)]
            vals, groups = _reduce_tree(builder, [builder.load(accs[r][j]) for r, j in ids], ids,
                                        W)
            sbase = builder.gep(sdat, [sb_off_])
            if kind == 'i8':        # each key's scale, once a score (the dot was on its codes)
                scale = [builder.load(builder.gep(cdat, [builder.add(sc_off_,
                                                                     ir.Constant(i64, j))]))
                         for j in range(KQ)]
            for v, g in zip(vals, groups):
                for lane, rj in enumerate(g):
                    if rj is None:
                        continue
                    r, j = rj
                    at = builder.add(builder.mul(ldsb_, ir.Constant(i64, r)), ir.Constant(i64, j))
                    score = builder.extract_element(v, ir.Constant(i32, lane))
                    if kind == 'i8':
                        score = builder.fmul(score, scale[j])
                    builder.store(score, builder.gep(sbase, [at]))
            return context.get_dummy_value()
        return sig, codegen
    return rows_kernel


def _make_rows_driver(R, W=W, acc_regs=ACC_REGS, kind='f32'):
    """njit drive(sbf, s_off, ldsb, kf, koff, ldk, qf, ldq, E, n, scf): the R rows' scores
    against n keys, KQ at a time and the last n % KQ one by one (scf: the keys' scales, for
    'i8'; any float32 array otherwise)."""
    KQ = keys_per_group(R, acc_regs)
    group = _make_rows_kernel(R, KQ, W, kind)
    one = _make_rows_kernel(R, 1, W, kind)

    @njit
    def drive(sbf, s_off, ldsb, kf, koff, ldk, qf, ldq, E, n, scf):
        full = n - n % KQ
        for j in range(0, full, KQ):
            group(sbf, s_off + j, ldsb, kf, koff + j * ldk, ldk, qf, 0, ldq, E, scf, j)
        for j in range(full, n):
            one(sbf, s_off + j, ldsb, kf, koff + j * ldk, ldk, qf, 0, ldq, E, scf, j)
    return drive


def _make_dispatch(kind):
    """njit dispatch(sbf, s_off, ldsb, kf, koff, ldk, qf, ldq, E, n, scf, R) -> the driver of
    R rows (1..8: each R is its own compiled kernel, so the branches are written out)."""
    env = {"njit": njit}
    lines = ["def dispatch(sbf, s_off, ldsb, kf, koff, ldk, qf, ldq, E, n, scf, R):"]
    for R in range(1, 9):
        env["drive%d" % R] = _make_rows_driver(R, kind=kind)
        lines.append("    %s R == %d:" % ("if" if R == 1 else "elif", R))
        lines.append("        drive%d(sbf, s_off, ldsb, kf, koff, ldk, qf, ldq, E, n, scf)" % R)
    exec("\n".join(lines), env)
    return njit(env["dispatch"])


# float32 keys on every CPU; a low-precision cache's where the conversion is one instruction
# (float16 needs F16C: without it LLVM's fpext is a libcall the JIT may not resolve)
_dispatch = {kind: _make_dispatch(kind) for kind in ('f32', 'bf16', 'i8')}
if HAVE_F16C:
    _dispatch['f16'] = _make_dispatch('f16')
_dispatch_f32, _dispatch_bf16, _dispatch_i8 = _dispatch['f32'], _dispatch['bf16'], _dispatch['i8']
_dispatch_f16 = _dispatch.get('f16', _dispatch['bf16'])    # never called without F16C


@njit
def dec_qk_rows(Sb, c0, kf, koff, ldk, E, n, Qs, R):
    """Sb[:R, c0:c0+n] = the scores of the R (1 <= R <= ROWS_MAX) query rows Qs against n
    float32 keys whose rows start at kf[koff] and lie ldk apart."""
    sbf = Sb.reshape(-1)
    _dispatch_f32(sbf, c0, Sb.shape[1], kf, koff, ldk, Qs.reshape(-1), Qs.shape[1], E, n, sbf, R)


def dec_qk_rows_stored(Sb, c0, kf, koff, ldk, E, n, Qs, R, scf, kind):  # pragma: no cover
    raise NotImplementedError


@overload(dec_qk_rows_stored, inline="always")
def _dec_qk_rows_stored_ol(Sb, c0, kf, koff, ldk, E, n, Qs, R, scf, kind):
    """dec_qk_rows on n keys of a low-precision cache read where they are (kf: its flat int8 or
    uint16 view; kind: the record's kv_kind, 1 float16, 2 bfloat16, 3 int8; scf[0:n]: the
    keys' scales for int8), each vector converted as it is loaded. float16 only where
    HAVE_F16C (the caller converts into a tile otherwise)."""
    if kf.dtype == types.int8:
        def impl(Sb, c0, kf, koff, ldk, E, n, Qs, R, scf, kind):
            _dispatch_i8(Sb.reshape(-1), c0, Sb.shape[1], kf, koff, ldk, Qs.reshape(-1),
                         Qs.shape[1], E, n, scf, R)
    else:
        def impl(Sb, c0, kf, koff, ldk, E, n, Qs, R, scf, kind):
            if kind == 2:
                _dispatch_bf16(Sb.reshape(-1), c0, Sb.shape[1], kf, koff, ldk, Qs.reshape(-1),
                               Qs.shape[1], E, n, scf, R)
            else:
                _dispatch_f16(Sb.reshape(-1), c0, Sb.shape[1], kf, koff, ldk, Qs.reshape(-1),
                              Qs.shape[1], E, n, scf, R)
    return impl
