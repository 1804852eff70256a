/*
 * fa_gemm_tiles.h -- the forward's register-blocked GEMM tiles (Q·Kᵀ into transposed score
 * tiles, P·V into the accumulator), the finiteness check that picks P·V's exact path, and the
 * 4x4-blocked transpose the packings use; once per (ISA, dtype) copy (included by
 * fa_kern_impl.h; no include guard on purpose).
 */

/* ------------------------------------------------------------------ Q·Kᵀ ---------------- */
/* One register tile: MRX key rows x (NVX*VW) query lanes, reduction over e.  MRX and NVX are
 * compile-time constants at every call site (always_inline), so acc[][] lives in registers:
 * on the 32-register (AVX-512) copies fa_qk uses 6 keys x 4 vectors (two adjacent panels) =
 * 24 zmm accumulators + 4 loads + 1 broadcast per step; the 16-register copies 6 x 2.
 * The reduction runs in chunks of FA_QK_CHUNK terms whose partial sums meet in S (as P·V
 * does): one sequential chain over all of E=128 left the scores, and with large logits the
 * outputs, up to 1.4x further from the float64 result than NumPy's (2-4 ulp on lse).  Costs
 * one load/add/store per accumulator per extra chunk (~1.5% at E=64). */
#define FA_QK_CHUNK 32
FA_INL void FN(fa_qk_tile_)(const int MRX, const int NVX, const FA_T *Ks, ptrdiff_t ldk,
                            const FA_T *Qp, ptrdiff_t E, FA_T *S, ptrdiff_t lds, FA_T *cmax,
                            int jn, FA_T scale)
{
    /* NVX <= FA_NV: one panel of NVX vectors.  NVX = 2 * FA_NV: two adjacent FA_NV-vector
     * panels (the second starts pw*E elements later), i.e. 2*pw lanes in one tile. */
    VT acc[FA_MR][2 * FA_NV];
    /* scale waits in memory, not in a vector register: live across the loop (it arrives in
     * xmm0), it left the 6 x 4 tile one register short and GCC kept a Q vector on the stack,
     * reloading it for 6 of every 24 FMAs (perf annotate of the forward) */
    volatile FA_T scale_mem = scale;
    ptrdiff_t e0 = 0;
    do {
        const ptrdiff_t e1 = E - e0 < FA_QK_CHUNK ? E : e0 + FA_QK_CHUNK;
#pragma GCC unroll 16
        for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++) acc[r][v] = BC(0);
        for (ptrdiff_t e = e0; e < e1; e++) {
            VT b[2 * FA_NV];
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++)
                b[v] = NVX <= FA_NV ? LD(Qp + e * (NVX * FA_VW) + v * FA_VW)
                                    : LD(Qp + (v / FA_NV) * (FA_NV * FA_VW) * E
                                         + e * (FA_NV * FA_VW) + (v % FA_NV) * FA_VW);
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++) {
                VT a = BC(Ks[r * ldk + e]);
#pragma GCC unroll 8
                for (int v = 0; v < NVX; v++) acc[r][v] += a * b[v];
            }
        }
        if (e1 < E) {                          /* park this chunk's partial sums in S */
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++)
#pragma GCC unroll 4
                for (int v = 0; v < NVX; v++) {
                    FA_T *dst = S + r * lds + v * FA_VW;
                    ST(dst, e0 ? LD(dst) + acc[r][v] : acc[r][v]);
                }
        } else if (e0) {                       /* last chunk: add the parked sums */
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++)
#pragma GCC unroll 4
                for (int v = 0; v < NVX; v++) acc[r][v] += LD(S + r * lds + v * FA_VW);
        }
        e0 = e1;
    } while (e0 < E);
    /* s = scale * (q . k), in that order (as the spec and a dense reference round it):
     * folding the scale into Q instead added a rounding per term.  One multiply per
     * accumulator. */
    const VT sc = BC((FA_T)scale_mem);
#pragma GCC unroll 16
    for (int r = 0; r < MRX; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NVX; v++) {
            acc[r][v] *= sc;
            ST(S + r * lds + v * FA_VW, acc[r][v]);
        }
    if (cmax) {
        /* fused column max over the valid key rows (jn <= FA_MR): saves a pass over S; read
         * back from the rows just stored (L1), so the accumulators need not stay live */
#pragma GCC unroll 4
        for (int v = 0; v < NVX; v++) {
            VT mx = LD(cmax + v * FA_VW);
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++)
                if (r < jn) mx = VMAX(mx, LD(S + r * lds + v * FA_VW));
            ST(cmax + v * FA_VW, mx);
        }
    }
}

/* The 6-key tiles fa_qk runs, one call each: a clean register allocation whatever fa_qk's
 * loops keep live.  The call costs ~20 cycles against the tile's E x 24 FMAs. */
#if FA_MR == 12
static __attribute__((noinline)) FA_ATTR void FN(fa_qk_pair_)(const FA_T *Ks, ptrdiff_t ldk,
                                                             const FA_T *Qp, ptrdiff_t E,
                                                             FA_T *S, ptrdiff_t lds, FA_T *cmax,
                                                             int jn, FA_T scale)
{
    FN(fa_qk_tile_)(6, 2 * FA_NV, Ks, ldk, Qp, E, S, lds, cmax, jn, scale);
}
static __attribute__((noinline)) FA_ATTR void FN(fa_qk_half_)(const FA_T *Ks, ptrdiff_t ldk,
                                                             const FA_T *Qp, ptrdiff_t E,
                                                             FA_T *S, ptrdiff_t lds, FA_T *cmax,
                                                             int jn, FA_T scale)
{
    FN(fa_qk_tile_)(6, FA_NV, Ks, ldk, Qp, E, S, lds, cmax, jn, scale);
}
#endif

/* The key rows past the last whole strip of `strip` rows, copied into kpad (strip x E, zero
 * padded) so a tile never reads past K.  Returns the number of keys in whole strips. */
FA_INL ptrdiff_t FN(fa_qk_kpad_)(const FA_T *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                                 ptrdiff_t strip, FA_T *kpad)
{
    const ptrdiff_t nfull = n - n % strip;
    if (nfull < n)
        for (ptrdiff_t r = 0; r < strip; r++)
            for (ptrdiff_t e = 0; e < E; e++)
                kpad[r * E + e] = r < n - nfull ? K[(nfull + r) * ldk + e] : (FA_T)0;
    return nfull;
}

/* S[j][lane] = scale * sum_e K[j][e] * Qt[lane][e] for j < n and lanes < W (W multiple of pw).
 * K rows have stride ldk.  pw_nv = vectors per Qt panel (FA_NV, or 1 for narrow decode
 * blocks).  The last key strip (< FA_MR rows) is copied into kpad (FA_MR x E, zero padded)
 * so the tile never reads past K; S must have round_up(n, FA_MR) rows.  Panel-outer order:
 * the Qt panel stays in L1 while the K block streams through broadcasts. */
FA_FN void FN(fa_qk)(const FA_T *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E, const FA_T *Qt,
                     ptrdiff_t W, int pw_nv, FA_T *S, ptrdiff_t lds, FA_T *cmax, FA_T *kpad,
                     FA_T scale)
{
    const ptrdiff_t pw = (ptrdiff_t)pw_nv * FA_VW;
#if FA_MR == 12
    /* 32-register ISAs: tiles of 6 keys x 2 panels (4 vectors, 24 accumulators) where the
     * lanes allow: 10 loads per 24 FMAs instead of 14 for 12 keys x 1 panel (timings in
     * bench/results/cython_kernels.md).  Each score is the same sum in the same order: same
     * bits. */
    if (pw_nv == FA_NV && W >= 2 * pw) {
        const ptrdiff_t nf6 = FN(fa_qk_kpad_)(K, ldk, n, E, 6, kpad);
        for (ptrdiff_t p0 = 0; p0 < W; p0 += 2 * pw) {
            const FA_T *Qp = Qt + p0 * E;
            FA_T *cm = cmax ? cmax + p0 : NULL;
            for (ptrdiff_t j0 = 0; j0 < n; j0 += 6) {
                const FA_T *Ks = j0 < nf6 ? K + j0 * ldk : kpad;
                ptrdiff_t ld = j0 < nf6 ? ldk : E;
                int jn = (int)(n - j0 < 6 ? n - j0 : 6);
                if (p0 + 2 * pw <= W)
                    FN(fa_qk_pair_)(Ks, ld, Qp, E, S + j0 * lds + p0, lds, cm, jn, scale);
                else                                   /* an odd last panel */
                    FN(fa_qk_half_)(Ks, ld, Qp, E, S + j0 * lds + p0, lds, cm, jn, scale);
            }
        }
        return;
    }
#endif
    const ptrdiff_t nfull = FN(fa_qk_kpad_)(K, ldk, n, E, FA_MR, kpad);
    for (ptrdiff_t p0 = 0; p0 < W; p0 += pw) {
        const FA_T *Qp = Qt + p0 * E;
        FA_T *cm = cmax ? cmax + p0 : NULL;
        for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_MR) {
            const FA_T *Ks = j0 < nfull ? K + j0 * ldk : kpad;
            ptrdiff_t ld = j0 < nfull ? ldk : E;
            int jn = (int)(n - j0 < FA_MR ? n - j0 : FA_MR);
            if (pw_nv == FA_NV)
                FN(fa_qk_tile_)(FA_MR, FA_NV, Ks, ld, Qp, E, S + j0 * lds + p0, lds, cm, jn,
                                scale);
            else
                FN(fa_qk_tile_)(FA_MR, 1, Ks, ld, Qp, E, S + j0 * lds + p0, lds, cm, jn, scale);
        }
    }
}

/* cmax[lane] = max(cmax[lane], max_j S[j][lane]) -- used when masks/bias changed S after Q·Kᵀ */
FA_FN void FN(fa_colmax)(const FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, FA_T *cmax)
{
    for (ptrdiff_t i = 0; i < W; i += FA_VW) {
        VT mx = LD(cmax + i);
        for (ptrdiff_t j = 0; j < n; j++) mx = VMAX(mx, LD(S + j * lds + i));
        ST(cmax + i, mx);
    }
}

/* ------------------------------------------------------------------ P·V ----------------- */
/* O[r][:] += sum_{i < ni} A[i * si + r * sr] * X[i][:] for MRX rows and NVX*VW columns, the
 * register-blocked product both P·V (A = P[key][lane]: si = ldp, sr = 1) and the backward's
 * Pᵀ·X for dK/dV (A = a tile's rows: si = 1, sr = FA_BWD_LDS, fa_bwd_tiles.h) use; inlined,
 * the strides are the callers' constants or loop invariants, as in their own copies before.
 * Summation order matters for float32: one register accumulator per output running over all
 * keys made the error grow like sqrt(S) (3.4x NumPy's at S = 4096).  So the reduction is
 * summed in chunks of FA_PV_CHUNK into fresh registers and each chunk is added to O in memory:
 * ~3% more work, about half the error. */
#define FA_PV_CHUNK 32
#ifndef FA_PV_PACK_KEYS
/* keys of fa_pv's packed V strip, on the stack: at most 16 KiB (default key blocks: 192) */
#define FA_PV_PACK_KEYS 256
#endif
FA_INL void FN(fa_acc_tile_)(const int MRX, const int NVX, const FA_T *A, ptrdiff_t si,
                             ptrdiff_t sr, ptrdiff_t ni, const FA_T *X, ptrdiff_t ldx, FA_T *O,
                             ptrdiff_t ldo)
{
    for (ptrdiff_t i0 = 0; i0 < ni; i0 += FA_PV_CHUNK) {
        const ptrdiff_t i1 = ni - i0 < FA_PV_CHUNK ? ni : i0 + FA_PV_CHUNK;
        VT acc[FA_MR][2 * FA_NV];
#pragma GCC unroll 16
        for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++) acc[r][v] = BC(0);
        for (ptrdiff_t i = i0; i < i1; i++) {
            VT b[2 * FA_NV];
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++) b[v] = LD(X + i * ldx + v * FA_VW);
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++) {
                VT a = BC(A[i * si + r * sr]);
#pragma GCC unroll 8
                for (int v = 0; v < NVX; v++) acc[r][v] += a * b[v];
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++)
                ST(O + r * ldo + v * FA_VW, LD(O + r * ldo + v * FA_VW) + acc[r][v]);
    }
}

/* The same for columns [c, C) one at a time (fewer than VW left: odd head dims), in the same
 * chunked order; O[r] is first scaled by alpha[r] (alpha NULL: not scaled). */
FA_INL void FN(fa_acc_cols_)(const int MRX, const FA_T *A, ptrdiff_t si, ptrdiff_t sr,
                             ptrdiff_t ni, const FA_T *X, ptrdiff_t ldx, ptrdiff_t c,
                             ptrdiff_t C, FA_T *O, ptrdiff_t ldo, const FA_T *alpha)
{
    for (int r = 0; r < MRX; r++) {
        FA_T *o = O + r * ldo;
        for (ptrdiff_t cc = c; cc < C; cc++) {
            FA_T tot = alpha ? o[cc] * alpha[r] : o[cc];
            for (ptrdiff_t i0 = 0; i0 < ni; i0 += FA_PV_CHUNK) {
                FA_T acc = 0;
                for (ptrdiff_t i = i0; i < ni && i < i0 + FA_PV_CHUNK; i++)
                    acc += A[i * si + r * sr] * X[i * ldx + cc];
                tot += acc;
            }
            o[cc] = tot;
        }
    }
}

/* O[r][:] = alpha[r]*O[r][:] + sum_j P[j][r] * V[j][:] for MRX query rows and NVX*VW
 * columns (O rescaled by alpha first, then the chunked sums of fa_acc_tile_). */
FA_INL void FN(fa_pv_tile_)(const int MRX, const int NVX, const FA_T *P, ptrdiff_t ldp,
                            ptrdiff_t n, const FA_T *V, ptrdiff_t ldv, FA_T *O, ptrdiff_t ldo,
                            const FA_T *alpha)
{
#pragma GCC unroll 16
    for (int r = 0; r < MRX; r++) {
        VT a = BC(alpha[r]);
#pragma GCC unroll 8
        for (int v = 0; v < NVX; v++)
            ST(O + r * ldo + v * FA_VW, LD(O + r * ldo + v * FA_VW) * a);
    }
    FN(fa_acc_tile_)(MRX, NVX, P, ldp, 1, n, V, ldv, O, ldo);
}

FA_INL void FN(fa_pv_rows_)(const int MRX, const FA_T *P, ptrdiff_t ldp, ptrdiff_t n,
                            const FA_T *V, ptrdiff_t ldv, ptrdiff_t Ev, FA_T *O, ptrdiff_t ldo,
                            const FA_T *alpha)
{
    ptrdiff_t c = 0;
    for (; c + NR <= Ev; c += NR)
        FN(fa_pv_tile_)(MRX, FA_NV, P, ldp, n, V + c, ldv, O + c, ldo, alpha);
    for (; c + FA_VW <= Ev; c += FA_VW)
        FN(fa_pv_tile_)(MRX, 1, P, ldp, n, V + c, ldv, O + c, ldo, alpha);
    if (c < Ev)   /* fewer than VW columns left (odd head dims): scalar */
        FN(fa_acc_cols_)(MRX, P, ldp, 1, n, V, ldv, c, Ev, O, ldo, alpha);
}

/* Rows [0, rows) in tiles of FA_MR, then FA_MR/3.  Lanes up to round_up(rows, FA_MR/3) are
 * touched: callers size P/O/alpha with a few lanes of slack. */
FA_FN void FN(fa_pv)(const FA_T *P, ptrdiff_t ldp, ptrdiff_t n, const FA_T *V, ptrdiff_t ldv,
                     ptrdiff_t Ev, FA_T *O, ptrdiff_t ldo, const FA_T *alpha, ptrdiff_t rows)
{
    ptrdiff_t r = 0;
#if FA_MR == 12
    /* 32-register ISAs: 6 rows x 4 vectors of V columns (10 loads per 24 FMAs instead of 14
     * for 12 x 2; 2-5% faster in a harness, interleaved), then the usual tiles for the rest
     * of the columns and the last < 6 rows.  Per output element the same sum in the same
     * order (32-key chunks added to O), so the same bits. */
    const ptrdiff_t c4 = Ev - Ev % (4 * FA_VW);
    /* 32-register ISAs with >= 6 rows: key chunks outer, row tiles inner.  A 6-row tile used
     * to run over all n keys of the block, so it streamed the block's whole V (192 keys x
     * 256 B at d = 64 = 48 KiB, L1d's size) from L2 for every 6 rows, and one S line per key
     * besides: P·V ran at 142 GF/s on one core against 151 for the same-size Q·Kᵀ (C harness
     * over fa_qk/fa_softmax/fa_pv, Sapphire Rapids, 2 MiB L2, 48 KiB L1d).  Now every row
     * tile takes a chunk of FA_PV_KC keys (16 KiB of V at d = 64, 32 KiB at 128) while it
     * stays in L1: 151-152 GF/s at d = 64, 146 at d = 128 (was 128-135).  Through the library
     * (bench/ab_trees.py, 9 rounds): forward d = 64 L = 2048 0.95x the time, d = 128 0.93x;
     * with 64-byte aligned inputs (as torch allocates them) 0.965x at d = 64 H = 16 and
     * 0.98x at d = 128, the rest of the gain being the packing below.
     * A misaligned V (NumPy's allocations start 16 or 32 bytes past a line) is copied a chunk
     * at a time into aligned scratch so the V loads do not split lines.  O is rescaled by
     * alpha first, then gets the same 32-key chunk sums in the same order: the same bits.
     * Only where a tile's strip of V (n rows x 4 vectors) exceeds 32 KiB: the backward's dQ
     * product (96-key sub-blocks, 24 KiB strips) ran 1.01-1.04x the time in key chunks. */
#define FA_PV_KC 64
    if (c4 > 0 && rows >= 6 && Ev <= 256 && n * 4 * FA_VW * (ptrdiff_t)sizeof(FA_T) > 32768) {
        const ptrdiff_t kc = Ev <= 128 ? FA_PV_KC : FA_PV_KC / 2;
        const int pack = (((uintptr_t)V | (uintptr_t)(ldv * sizeof(FA_T))) & 63) != 0;
        FA_T Vp[FA_PV_KC * 128] __attribute__((aligned(64)));
        for (ptrdiff_t rr = 0; rr < rows; rr++) {
            const VT a = BC(alpha[rr]);
            FA_T *o = O + rr * ldo;
            ptrdiff_t c = 0;
            for (; c + FA_VW <= Ev; c += FA_VW) ST(o + c, LD(o + c) * a);
            for (; c < Ev; c++) o[c] *= alpha[rr];
        }
        for (ptrdiff_t i0 = 0; i0 < n; i0 += kc) {
            const ptrdiff_t ni = n - i0 < kc ? n - i0 : kc;
            const FA_T *Vc = V + i0 * ldv;
            ptrdiff_t ldc = ldv;
            if (pack) {
                for (ptrdiff_t j = 0; j < ni; j++) {
                    ptrdiff_t c = 0;
                    for (; c + FA_VW <= Ev; c += FA_VW) ST(Vp + j * Ev + c, LD(Vc + j * ldv + c));
                    for (; c < Ev; c++) Vp[j * Ev + c] = Vc[j * ldv + c];
                }
                Vc = Vp;
                ldc = Ev;
            }
            const FA_T *Pc = P + i0 * ldp;
            for (r = 0; r + 6 <= rows; r += 6) {
                ptrdiff_t c = 0;
                for (; c < c4; c += 4 * FA_VW)
                    FN(fa_acc_tile_)(6, 4, Pc + r, ldp, 1, ni, Vc + c, ldc, O + r * ldo + c, ldo);
                for (; c + NR <= Ev; c += NR)
                    FN(fa_acc_tile_)(6, FA_NV, Pc + r, ldp, 1, ni, Vc + c, ldc, O + r * ldo + c, ldo);
                for (; c + FA_VW <= Ev; c += FA_VW)
                    FN(fa_acc_tile_)(6, 1, Pc + r, ldp, 1, ni, Vc + c, ldc, O + r * ldo + c, ldo);
                if (c < Ev)
                    FN(fa_acc_cols_)(6, Pc + r, ldp, 1, ni, Vc, ldc, c, Ev, O + r * ldo, ldo, NULL);
            }
            for (; r < rows; r++) {
                ptrdiff_t c = 0;
                for (; c + NR <= Ev; c += NR)
                    FN(fa_acc_tile_)(1, FA_NV, Pc + r, ldp, 1, ni, Vc + c, ldc, O + r * ldo + c, ldo);
                for (; c + FA_VW <= Ev; c += FA_VW)
                    FN(fa_acc_tile_)(1, 1, Pc + r, ldp, 1, ni, Vc + c, ldc, O + r * ldo + c, ldo);
                if (c < Ev)
                    FN(fa_acc_cols_)(1, Pc + r, ldp, 1, ni, Vc, ldc, c, Ev, O + r * ldo, ldo, NULL);
            }
        }
        return;
    }
    if (c4 > 0 && rows >= 6) {
        for (; r + 6 <= rows; r += 6) {
            for (ptrdiff_t c = 0; c < c4; c += 4 * FA_VW)
                FN(fa_pv_tile_)(6, 4, P + r, ldp, n, V + c, ldv, O + r * ldo + c, ldo,
                                alpha + r);
            if (c4 < Ev)
                FN(fa_pv_rows_)(6, P + r, ldp, n, V + c4, ldv, Ev - c4, O + r * ldo + c4, ldo,
                                alpha + r);
        }
        for (; r + MRT <= rows; r += MRT)
            FN(fa_pv_rows_)(MRT, P + r, ldp, n, V, ldv, Ev, O + r * ldo, ldo, alpha + r);
        for (; r < rows; r++)       /* 1-3 rows: not past the lanes the old tiling touched */
            FN(fa_pv_rows_)(1, P + r, ldp, n, V, ldv, Ev, O + r * ldo, ldo, alpha + r);
        return;
    }
#else
    /* 16-register ISAs: a 6 x 2 tile reads a 2-vector strip of V's n rows; at d = 64 those
     * rows are 256 bytes apart, so the strip's lines fall in a quarter of L1's sets, and a
     * strip of more than 128 keys was refetched from L2 for every 6 rows (forward: P·V took
     * 1.27x the time of the same-size Q·Kᵀ).  With many rows, copy each strip once into
     * contiguous scratch and run every row's tiles over it.  Per output element the same
     * sum in the same order: the same bits. */
    if (rows >= 4 * FA_MR && n <= FA_PV_PACK_KEYS && Ev >= NR) {
        FA_T Vp[FA_PV_PACK_KEYS * NR] __attribute__((aligned(64)));
        const ptrdiff_t cN = Ev - Ev % NR;
        for (ptrdiff_t c = 0; c < cN; c += NR) {
            for (ptrdiff_t j = 0; j < n; j++)
#pragma GCC unroll 8
                for (int v = 0; v < FA_NV; v++)
                    ST(Vp + j * NR + v * FA_VW, LD(V + j * ldv + c + v * FA_VW));
            ptrdiff_t rr = 0;
            for (; rr + FA_MR <= rows; rr += FA_MR)
                FN(fa_pv_tile_)(FA_MR, FA_NV, P + rr, ldp, n, Vp, NR, O + rr * ldo + c, ldo,
                                alpha + rr);
            for (; rr < rows; rr += MRT)
                FN(fa_pv_tile_)(MRT, FA_NV, P + rr, ldp, n, Vp, NR, O + rr * ldo + c, ldo,
                                alpha + rr);
        }
        if (cN < Ev) {
            for (; r + FA_MR <= rows; r += FA_MR)
                FN(fa_pv_rows_)(FA_MR, P + r, ldp, n, V + cN, ldv, Ev - cN, O + r * ldo + cN,
                                ldo, alpha + r);
            for (; r < rows; r += MRT)
                FN(fa_pv_rows_)(MRT, P + r, ldp, n, V + cN, ldv, Ev - cN, O + r * ldo + cN,
                                ldo, alpha + r);
        }
        return;
    }
#endif
    for (; r + FA_MR <= rows; r += FA_MR)
        FN(fa_pv_rows_)(FA_MR, P + r, ldp, n, V, ldv, Ev, O + r * ldo, ldo, alpha + r);
    for (; r < rows; r += MRT)
        FN(fa_pv_rows_)(MRT, P + r, ldp, n, V, ldv, Ev, O + r * ldo, ldo, alpha + r);
}

/* Exact P·V for a key block whose V holds Inf/NaN: zero weights are skipped, so a NaN under
 * a masked key cannot turn into 0*NaN = NaN.  Rare and slow on purpose. */
FA_FN void FN(fa_pv_exact)(const FA_T *P, ptrdiff_t ldp, ptrdiff_t n, const FA_T *V,
                           ptrdiff_t ldv, ptrdiff_t Ev, FA_T *O, ptrdiff_t ldo,
                           const FA_T *alpha, ptrdiff_t rows)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        FA_T *o = O + r * ldo;
        for (ptrdiff_t c = 0; c < Ev; c++) {
            FA_T tot = o[c] * alpha[r];
            for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_PV_CHUNK) {
                FA_T acc = 0;
                for (ptrdiff_t j = j0; j < n && j < j0 + FA_PV_CHUNK; j++) {
                    FA_T p = P[j * ldp + r];
                    if (p != (FA_T)0) acc += p * V[j * ldv + c];
                }
                tot += acc;
            }
            o[c] = tot;
        }
    }
}

/* 1 if x[0:n] holds no Inf/NaN: x*0 is 0 for finite x and NaN otherwise. */
FA_FN int FN(fa_allfinite)(const FA_T *x, ptrdiff_t n)
{
    VT acc = BC(0);
    ptrdiff_t i = 0;
    for (; i + FA_VW <= n; i += FA_VW) acc += LD(x + i) * (FA_T)0;
    FA_T s = 0;
    for (; i < n; i++) s += x[i] * (FA_T)0;
    for (int k = 0; k < FA_VW; k++) s += acc[k];
    return s == s;
}

/* dst[c * ldd + r] = src[r * lds + c] for r < R, c < C: the backward's packing (Kᵀ/Vᵀ per
 * item, Q/dO panels per query block) in 4 x 4 register blocks; the Cython loops doing it
 * element by element ran as baseline scalar code at ~1 element per cycle. */
typedef FA_T FA_CAT(fa_v4_, FA_SFX) __attribute__((vector_size(4 * sizeof(FA_T)),
                                                   aligned(sizeof(FA_T)), may_alias));
#define V4 FA_CAT(fa_v4_, FA_SFX)
FA_FN void FN(fa_transpose)(const FA_T *src, ptrdiff_t lds, ptrdiff_t R, ptrdiff_t C,
                            FA_T *dst, ptrdiff_t ldd)
{
    ptrdiff_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) {
        const FA_T *s = src + r0 * lds;
        ptrdiff_t c0 = 0;
        for (; c0 + 4 <= C; c0 += 4) {
            V4 a = *(const V4 *)(s + c0), b = *(const V4 *)(s + lds + c0);
            V4 c = *(const V4 *)(s + 2 * lds + c0), d = *(const V4 *)(s + 3 * lds + c0);
            V4 t0 = __builtin_shufflevector(a, b, 0, 4, 1, 5);
            V4 t1 = __builtin_shufflevector(a, b, 2, 6, 3, 7);
            V4 t2 = __builtin_shufflevector(c, d, 0, 4, 1, 5);
            V4 t3 = __builtin_shufflevector(c, d, 2, 6, 3, 7);
            *(V4 *)(dst + c0 * ldd + r0) = __builtin_shufflevector(t0, t2, 0, 1, 4, 5);
            *(V4 *)(dst + (c0 + 1) * ldd + r0) = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
            *(V4 *)(dst + (c0 + 2) * ldd + r0) = __builtin_shufflevector(t1, t3, 0, 1, 4, 5);
            *(V4 *)(dst + (c0 + 3) * ldd + r0) = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
        }
        for (; c0 < C; c0++)
            for (ptrdiff_t r = r0; r < r0 + 4; r++) dst[c0 * ldd + r] = src[r * lds + c0];
    }
    for (; r0 < R; r0++)
        for (ptrdiff_t c = 0; c < C; c++) dst[c * ldd + r0] = src[r0 * lds + c];
}
#undef V4
