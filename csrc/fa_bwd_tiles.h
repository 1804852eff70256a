/*
 * fa_bwd_tiles.h -- the backward's tiles: the two sweeps' per-lane reductions (P, Z, D; then
 * dS) and the Pᵀ·X products for dK/dV; once per (ISA, dtype) copy
 * (included by fa_kern_impl.h; no include guard on purpose).
 */

/* ------------------------------------------------------------------ backward ----------- */
/* The backward (backward.pxi) keeps the forward's layout: a tile is T[j][lane] (key rows,
 * query lanes contiguous), with the fixed row stride FA_BWD_LDS so that fa_ptq's broadcasts
 * down a column are constant displacements from one base register (a runtime stride would
 * need 12 row pointers, more than the free general registers). */

/* S and dP come from the forward's fa_qk (fa_gemm_tiles.h) on the K / V rows in place, with
 * the tiles' row stride FA_BWD_LDS: the scores are the forward's, bit for bit.  (A Q·Kᵀ from
 * Kᵀ packed once per work item ran 0.90-0.97x slower: each 6-key tile read E lines of Kᵀ
 * where the rows take 6 x E / 16; bench/results/cython_kernels.md.) */

/* Sweep 1 of a query block: P = exp(S - lse) in place (rows j < n, lanes < W; lse is +inf
 * on lanes whose row had no key, so P = 0 there), and per lane, compensated (sum, comp):
 *     Z += sum_j P,    D += sum_j P * dP   (in double; terms with P == 0 skipped: dP may
 *                                           be Inf/NaN under a masked key)
 * Sweep 2 then works with Phat = P / Z and D / Z, both taken from these very tiles:
 *   - D / Z is FlashAttention-2's rowsum(dO * O), but summed from the same rounded P and dP
 *     that form dS = Phat (dP - D/Z), so they cancel where attention concentrates on one key
 *     (there the true dS is ~0; D from the float32 out left ~eps*|dP| of noise);
 *   - P = exp(S - lse) carries the rounding of lse times |lse| (~15 eps for logits ~15) as a
 *     per-row factor; dividing by Z = sum P normalizes it away.
 * Together they took the float32 gradients from up to 4-15x the error of a naive float32
 * softmax backward (concentrated rows) to below 0.5x. */
#if FA_ISF
/* float lanes summed in double: a float vector splits into two double vectors */
typedef float FA_CAT(fa_vth_, FA_SFX) __attribute__((vector_size(FA_VW * 2)));
typedef double FA_CAT(fa_vd_, FA_SFX) __attribute__((vector_size(FA_VW * 4)));
#define VTH FA_CAT(fa_vth_, FA_SFX)
#define VD FA_CAT(fa_vd_, FA_SFX)
#if FA_VW == 16
#define FA_LOHALF(x) __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
#define FA_HIHALF(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15)
#define FA_CONCAT(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, \
                                                13, 14, 15)
#elif FA_VW == 8
#define FA_LOHALF(x) __builtin_shufflevector(x, x, 0, 1, 2, 3)
#define FA_HIHALF(x) __builtin_shufflevector(x, x, 4, 5, 6, 7)
#define FA_CONCAT(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7)
#else
#define FA_LOHALF(x) __builtin_shufflevector(x, x, 0, 1)
#define FA_HIHALF(x) __builtin_shufflevector(x, x, 2, 3)
#define FA_CONCAT(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3)
#endif
#define FA_TOD(h) __builtin_convertvector(h, VD)
/* low / high half of a float vector as doubles: ISA copies pass one-instruction conversions
 * (GCC assembled vcvtps2pd zmm from 128-bit pieces: ~14 instructions where 4 do) */
#ifdef FA_HWCVTLO
#define FA_CVTLO(x) ((VD)FA_HWCVTLO(x))
#define FA_CVTHI(x) ((VD)FA_HWCVTHI(x))
#else
#define FA_CVTLO(x) FA_TOD(FA_LOHALF(x))
#define FA_CVTHI(x) FA_TOD(FA_HIHALF(x))
#endif
#endif

/* acc: per lane [Z (double), D (double)], acc + 0 and acc + FA_BWD_LDS doubles.  Sums in
 * double: rounded float32 products and a float32 running sum (even compensated) left D ~2 ulp
 * off, which the cancellation above turns into ~eps*|dP| in dS. */
FA_INL void FN(fa_bwd_p_group_)(const int NG, FA_T *S, const FA_T *dP, ptrdiff_t n,
                                const FA_T *lse, double *acc)
{
    VT ls[4];
#if FA_ISF
    VD z[4][2], d[4][2];
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        ls[g] = LD(lse + g * FA_VW);
        for (int h = 0; h < 2; h++) {
            memcpy(&z[g][h], acc + g * FA_VW + h * (FA_VW / 2), sizeof(VD));
            memcpy(&d[g][h], acc + FA_BWD_LDS + g * FA_VW + h * (FA_VW / 2), sizeof(VD));
        }
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *srow = S + j * FA_BWD_LDS;
        const FA_T *drow = dP + j * FA_BWD_LDS;
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            VT p = VEXP(LD(srow + g * FA_VW) - ls[g]);
            ST(srow + g * FA_VW, p);
            VI live = p != BC(0);
            VT dp = SEL(live, LD(drow + g * FA_VW), BC(0));
            VD pl = FA_CVTLO(p), ph = FA_CVTHI(p);
            z[g][0] += pl;
            z[g][1] += ph;
            d[g][0] += pl * FA_CVTLO(dp);
            d[g][1] += ph * FA_CVTHI(dp);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++)
        for (int h = 0; h < 2; h++) {
            memcpy(acc + g * FA_VW + h * (FA_VW / 2), &z[g][h], sizeof(VD));
            memcpy(acc + FA_BWD_LDS + g * FA_VW + h * (FA_VW / 2), &d[g][h], sizeof(VD));
        }
#else
    VT z[4], d[4];
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        ls[g] = LD(lse + g * FA_VW);
        z[g] = LD(acc + g * FA_VW);
        d[g] = LD(acc + FA_BWD_LDS + g * FA_VW);
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *srow = S + j * FA_BWD_LDS;
        const FA_T *drow = dP + j * FA_BWD_LDS;
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            VT p = VEXP(LD(srow + g * FA_VW) - ls[g]);
            ST(srow + g * FA_VW, p);
            VI live = p != BC(0);
            z[g] += p;
            d[g] += p * SEL(live, LD(drow + g * FA_VW), BC(0));
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        ST(acc + g * FA_VW, z[g]);
        ST(acc + FA_BWD_LDS + g * FA_VW, d[g]);
    }
#endif
}

FA_FN void FN(fa_bwd_p)(FA_T *S, const FA_T *dP, ptrdiff_t n, ptrdiff_t W, const FA_T *lse,
                        double *acc)
{
    ptrdiff_t i = 0;
    for (; i + 2 * FA_VW <= W; i += 2 * FA_VW)
        FN(fa_bwd_p_group_)(2, S + i, dP + i, n, lse + i, acc + i);
    for (; i < W; i += FA_VW)
        FN(fa_bwd_p_group_)(1, S + i, dP + i, n, lse + i, acc + i);
}

/* Sweep 2: Phat = P * invZ in place of P, and dS = Phat * (dP - D) [* G] in place of dP
 * (rows j < n, lanes < W), dS forced to 0 where P == 0: a masked key whose V holds Inf/NaN
 * gives dP = Inf/NaN, and 0 * Inf must not reach dQ/dK.  A NaN P (NaN in an allowed key)
 * still propagates.  D stays in double through dP - D (float: the halves are converted), so
 * the difference, which is small exactly where it matters, is rounded once. */
FA_INL void FN(fa_bwd_ds_group_)(const int NG, FA_T *S, FA_T *dP, const FA_T *Gs,
                                 ptrdiff_t n, const FA_T *invZ, const double *D)
{
    VT iz[4];
#if FA_ISF
    VD dd[4][2];
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        iz[g] = LD(invZ + g * FA_VW);
        memcpy(&dd[g][0], D + g * FA_VW, sizeof(VD));
        memcpy(&dd[g][1], D + g * FA_VW + FA_VW / 2, sizeof(VD));
    }
#else
    VT dd[4];
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        iz[g] = LD(invZ + g * FA_VW);
        dd[g] = LD(D + g * FA_VW);
    }
#endif
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *srow = S + j * FA_BWD_LDS;
        FA_T *drow = dP + j * FA_BWD_LDS;
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            VT p = LD(srow + g * FA_VW) * iz[g];
            ST(srow + g * FA_VW, p);
            VT dp = LD(drow + g * FA_VW);
#if FA_ISF
            VTH lo = __builtin_convertvector(FA_CVTLO(dp) - dd[g][0], VTH);
            VTH hi = __builtin_convertvector(FA_CVTHI(dp) - dd[g][1], VTH);
            VT diff = FA_CONCAT(lo, hi);
#else
            VT diff = dp - dd[g];
#endif
            VT ds = p * diff;
            if (Gs) ds *= LD(Gs + j * FA_BWD_LDS + g * FA_VW);
            VI live = p != BC(0);
            ST(drow + g * FA_VW, SEL(live, ds, BC(0)));
        }
    }
}

FA_FN void FN(fa_bwd_ds)(FA_T *S, FA_T *dP, const FA_T *Gs, ptrdiff_t n, ptrdiff_t W,
                         const FA_T *invZ, const double *D)
{
    ptrdiff_t i = 0;
    if (Gs) {
        for (; i + 4 * FA_VW <= W; i += 4 * FA_VW)
            FN(fa_bwd_ds_group_)(4, S + i, dP + i, Gs + i, n, invZ + i, D + i);
        for (; i < W; i += FA_VW)
            FN(fa_bwd_ds_group_)(1, S + i, dP + i, Gs + i, n, invZ + i, D + i);
    } else {
        for (; i + 4 * FA_VW <= W; i += 4 * FA_VW)
            FN(fa_bwd_ds_group_)(4, S + i, dP + i, NULL, n, invZ + i, D + i);
        for (; i < W; i += FA_VW)
            FN(fa_bwd_ds_group_)(1, S + i, dP + i, NULL, n, invZ + i, D + i);
    }
}

/* O[r][:] += sum_{i < ni} T[r * FA_BWD_LDS + i] * X[i][:] for MRX key rows: dV += Pᵀ·dO and
 * dK += dSᵀ·Q with the tile's lanes as the reduction, fa_acc_tile_ (fa_gemm_tiles.h) with the
 * tile's row stride. */
FA_INL void FN(fa_ptq_rows_)(const int MRX, const FA_T *T, ptrdiff_t ni, const FA_T *X,
                             ptrdiff_t ldx, ptrdiff_t C, FA_T *O, ptrdiff_t ldo)
{
    ptrdiff_t c = 0;
    for (; c + NR <= C; c += NR)
        FN(fa_acc_tile_)(MRX, FA_NV, T, 1, FA_BWD_LDS, ni, X + c, ldx, O + c, ldo);
    for (; c + FA_VW <= C; c += FA_VW)
        FN(fa_acc_tile_)(MRX, 1, T, 1, FA_BWD_LDS, ni, X + c, ldx, O + c, ldo);
    if (c < C)    /* fewer than VW columns left: scalar, same chunked order */
        FN(fa_acc_cols_)(MRX, T, 1, FA_BWD_LDS, ni, X, ldx, c, C, O, ldo, NULL);
}

/* O[j][0:C] += sum_{i < ni} T[j][i] * X[i][0:C] for exactly the rows j < n (O rows are the
 * caller's dk/dv rows: nothing past row n is touched; the row tail runs in tiles of 8/4/2/1). */
FA_FN void FN(fa_ptq)(const FA_T *T, ptrdiff_t n, ptrdiff_t ni, const FA_T *X, ptrdiff_t ldx,
                      ptrdiff_t C, FA_T *O, ptrdiff_t ldo)
{
    ptrdiff_t r = 0;
#if FA_MR == 12
    /* 32-register ISAs: 6 rows x 4 vectors where the columns allow (as fa_pv: fewer loads
     * per FMA, the same sums in the same order); the row tail below then starts < 6 rows
     * from n. */
    const ptrdiff_t c4 = C - C % (4 * FA_VW);
    if (c4 > 0)
        for (; r + 6 <= n; r += 6) {
            for (ptrdiff_t c = 0; c < c4; c += 4 * FA_VW)
                FN(fa_acc_tile_)(6, 4, T + r * FA_BWD_LDS, 1, FA_BWD_LDS, ni, X + c, ldx,
                                 O + r * ldo + c, ldo);
            if (c4 < C)
                FN(fa_ptq_rows_)(6, T + r * FA_BWD_LDS, ni, X + c4, ldx, C - c4,
                                 O + r * ldo + c4, ldo);
        }
#endif
    for (; r + FA_MR <= n; r += FA_MR)
        FN(fa_ptq_rows_)(FA_MR, T + r * FA_BWD_LDS, ni, X, ldx, C, O + r * ldo, ldo);
    if (FA_MR > 8 && n - r >= 8) {
        FN(fa_ptq_rows_)(FA_MR > 8 ? 8 : 1, T + r * FA_BWD_LDS, ni, X, ldx, C, O + r * ldo, ldo);
        r += 8;
    }
    if (n - r >= 4) {
        FN(fa_ptq_rows_)(4, T + r * FA_BWD_LDS, ni, X, ldx, C, O + r * ldo, ldo);
        r += 4;
    }
    if (n - r >= 2) {
        FN(fa_ptq_rows_)(2, T + r * FA_BWD_LDS, ni, X, ldx, C, O + r * ldo, ldo);
        r += 2;
    }
    if (n - r >= 1)
        FN(fa_ptq_rows_)(1, T + r * FA_BWD_LDS, ni, X, ldx, C, O + r * ldo, ldo);
}
