"""float32 block transposes in vector registers, for packing the GEMM operands.

The forward packs every item's Q block into micro-tiles (rows interleaved,
k-major) and, when K is used by one item only, K's panels (keys interleaved).
As scalar loops these packs moved one float per load/store pair: at
B=4 H=8 L=S=256 d=64 they took 15% of the forward's profile, a quarter of
the time of the two GEMMs. An 8 x 8 block moves here as 8 row loads, three
rounds of 8 shuffles and 8 row stores (unpack 32-bit pairs, then 64-bit
pairs, then 128-bit halves: the usual AVX transpose network, written as
generic LLVM shufflevectors that the backend lowers to unpck/shuf/perm).

make_transpose(R)(dst, doff, ldd, src, soff, lds), R source rows (8, or MR for Q):
    dst[doff + j*ldd + i] = src[soff + i*lds + j]   for i < R, j < 8
Only R floats of each destination row are written (a masked store), so a
Q micro-tile of MR < 8 rows never writes past its end.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_W = 8        # one 256-bit vector of float32: the network below is for 8 lanes


def make_transpose(R):
    """The block transpose for R <= 8 source rows (shapes fixed when compiled)."""
    assert 1 <= R <= _W
    @intrinsic
    def transpose(typingctx, dst, doff, ldd, src, soff, lds):
        for arr in (dst, src):
            if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
                return None
        sig = types.void(dst, doff, ldd, src, soff, lds)

        def codegen(context, builder, signature, args):
            tys = signature.args
            i64 = ir.IntType(64)
            i32 = ir.IntType(32)
            f32 = ir.FloatType()
            vty = ir.VectorType(f32, _W)
            vptr = vty.as_pointer()

            def iarg(k):
                return context.cast(builder, args[k], tys[k], types.intp)

            doff_, ldd_, soff_, lds_ = iarg(1), iarg(2), iarg(4), iarg(5)
            ddat = context.make_array(tys[0])(context, builder, args[0]).data
            sdat = context.make_array(tys[3])(context, builder, args[3]).data
            sbase = builder.gep(sdat, [soff_])
            dbase = builder.gep(ddat, [doff_])
            zero = ir.Constant(vty, [0.0] * _W)
            rows = []
            for i in range(_W):
                if i < R:
                    p = builder.gep(sbase, [builder.mul(lds_, ir.Constant(i64, i))])
                    ld = builder.load(builder.bitcast(p, vptr))
                    ld.align = 4
                    rows.append(ld)
                else:
                    rows.append(zero)

            def shuf(a, b, idx):
                return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, _W), idx))

            lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
            lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
            lo128, hi128 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
            # u[2p], u[2p+1]: rows 2p and 2p+1 interleaved (columns 0,1,4,5 / 2,3,6,7)
            u = []
            for p in range(4):
                u += [shuf(rows[2 * p], rows[2 * p + 1], lo32),
                      shuf(rows[2 * p], rows[2 * p + 1], hi32)]
            # v[4h + c]: rows 4h..4h+3 of columns c and c+4 (c = 0..3)
            v = []
            for h in range(2):
                a, b = u[4 * h:4 * h + 2], u[4 * h + 2:4 * h + 4]
                v += [shuf(a[0], b[0], lo64), shuf(a[0], b[0], hi64),
                      shuf(a[1], b[1], lo64), shuf(a[1], b[1], hi64)]
            cols = [None] * _W
            for c in range(4):
                cols[c] = shuf(v[c], v[4 + c], lo128)
                cols[c + 4] = shuf(v[c], v[4 + c], hi128)
            if R < _W:
                mty = ir.VectorType(ir.IntType(1), _W)
                mstore = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(ir.VoidType(), [vty, vptr, i32, mty]),
                    "llvm.masked.store.v%df32.p0" % _W)
                mask = ir.Constant(mty, [1 if i < R else 0 for i in range(_W)])
            for j in range(_W):
                p = builder.bitcast(builder.gep(dbase, [builder.mul(ldd_, ir.Constant(i64, j))]),
                                    vptr)
                if R < _W:
                    builder.call(mstore, [cols[j], p, ir.Constant(i32, 4), mask])
                else:
                    st = builder.store(cols[j], p)
                    st.align = 4
            return context.get_dummy_value()
        return sig, codegen
    return transpose


transpose8 = make_transpose(8)
