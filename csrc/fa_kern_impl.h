/*
 * fa_kern_impl.h -- SIMD primitives of the attention kernels, written ONCE with GCC/clang
 * vector extensions and instantiated by fa_kernels.h for every (ISA, dtype) pair:
 *
 *   FA_T     float | double          FA_VW   lanes per vector
 *   FA_MR    key rows per QK tile, query rows per PV tile (register blocking)
 *   FA_NV    vectors per tile row    FA_SFX  name suffix       FA_ISF  1 for float
 *   FA_ATTR  function attribute selecting the ISA (target("avx512f,...")) or nothing
 *
 * No include guard on purpose.  Every function carries FA_ATTR, so one extension module holds
 * an AVX-512, an AVX2 and a baseline copy and picks one at import (fa_kernels.h).
 *
 * Layout ("transposed scores"): a work item is a block of W query rows ("lanes") against a
 * block of n keys.  Scores are stored S[j][lane] (row j = key, stride lds), so
 *   - Q·Kᵀ broadcasts K[j][e] straight from the caller's K (no packing of K, which is the
 *     big operand), against Qt, the query block packed once per item as panels
 *     Qt[panel][e][pw] (pw = nv*VW lanes);
 *   - the online softmax works down columns: running max/sum/rescale are per-lane vectors
 *     and need no horizontal reductions;
 *   - P·V broadcasts P[j][lane] and loads V rows straight from the caller's V.
 */

#define FA_CAT_(a, b) a##b
#define FA_CAT(a, b) FA_CAT_(a, b)
#define FN(name) FA_CAT(name, FA_SFX)
#define VT FA_CAT(fa_vt_, FA_SFX)
#define VTU FA_CAT(fa_vtu_, FA_SFX)
#define VI FA_CAT(fa_vi_, FA_SFX)
#define NR (FA_NV * FA_VW)
#define MRT (FA_MR / 3)          /* query rows per PV tile for the row tail */
#define FA_INL static inline __attribute__((always_inline)) FA_ATTR
#define FA_FN static FA_ATTR

typedef FA_T VT __attribute__((vector_size(FA_VW * sizeof(FA_T))));
/* same vector, element alignment only: dereferencing it is an unaligned load/store */
typedef FA_T VTU __attribute__((vector_size(FA_VW * sizeof(FA_T)), aligned(sizeof(FA_T)), may_alias));
typedef __typeof__((VT){0} < (VT){0}) VI;

#define LD(p) ((VT)(*(const VTU *)(p)))
#define ST(p, v) (*(VTU *)(p) = (v))
/* x - 0 (not 0 + x): x - (+0) == x for every x incl. -0, so the compiler folds it into a
 * plain broadcast; 0 + x would cost a real add per broadcast. */
#define BC(x) ((FA_T)(x) - (VT){0})
#define SEL(m, a, b) FA_VSEL(VT, VI, m, a, b)

/* VMAX(a, b) = a < b ? b : a lane-wise.  It ignores a NaN in b (a < NaN is false): a NaN
 * score then shows up in the exp and turns the row into NaN, as the dense reference does,
 * instead of poisoning the max.  FA_HWMAX: the ISA's single max instruction with exactly
 * these semantics (x86 maxps(b, a) returns a when either is NaN). */
#ifdef FA_HWMAX
FA_INL VT FN(fa_vmax_)(VT a, VT b) { return (VT)FA_HWMAX(b, a); }
#else
FA_INL VT FN(fa_vmax_)(VT a, VT b) { VI m = a < b; return SEL(m, b, a); }
#endif
#define VMAX FN(fa_vmax_)

#if FA_ISF
#define SEXP fa_expf
#define T_NEG_INF (-__builtin_inff())
#ifdef FA_HWSCALEF
FA_DEFINE_VEXP_SCALEF(FN(fa_vexp_), FA_ATTR, VT, float, FA_HWSCALEF, FA_EXPF_MAGIC,
                      FA_LOG2E_F, FA_LN2HI_F, FA_LN2LO_F, FA_EXPF_POLY)
#else
FA_DEFINE_VEXP(FN(fa_vexp_), FA_ATTR, VT, VI, float, VMAX, FA_EXPF_LO, FA_EXPF_MAGIC,
               FA_EXPF_MAGIC_BITS, FA_LOG2E_F, FA_LN2HI_F, FA_LN2LO_F, FA_EXPF_POLY, 127, 23)
#endif
#else
#define SEXP fa_expd
#define T_NEG_INF (-__builtin_inf())
#ifdef FA_HWSCALEF
FA_DEFINE_VEXP_SCALEF(FN(fa_vexp_), FA_ATTR, VT, double, FA_HWSCALEF, FA_EXPD_MAGIC,
                      FA_LOG2E_D, FA_LN2HI_D, FA_LN2LO_D, FA_EXPD_POLY)
#else
FA_DEFINE_VEXP(FN(fa_vexp_), FA_ATTR, VT, VI, double, VMAX, FA_EXPD_LO, FA_EXPD_MAGIC,
               FA_EXPD_MAGIC_BITS, FA_LOG2E_D, FA_LN2HI_D, FA_LN2LO_D, FA_EXPD_POLY, 1023, 52)
#endif
#endif
#define VEXP FN(fa_vexp_)

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
    const VT sc = BC(scale);
#pragma GCC unroll 16
    for (int r = 0; r < MRX; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NVX; v++) {
            acc[r][v] *= sc;
            ST(S + r * lds + v * FA_VW, acc[r][v]);
        }
    if (cmax) {
        /* fused column max over the valid key rows (jn <= FA_MR): saves a pass over S */
#pragma GCC unroll 4
        for (int v = 0; v < NVX; v++) {
            VT mx = LD(cmax + v * FA_VW);
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++)
                if (r < jn) mx = VMAX(mx, acc[r][v]);
            ST(cmax + v * FA_VW, mx);
        }
    }
}

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
     * lanes allow.  10 loads per 24 FMAs instead of 14 for 12 keys x 1 panel: 3-5% faster
     * alone on a core, 15% when the machine's other tenants load the core (measured in a
     * harness, interleaved).  Each score is the same sum in the same order: same bits. */
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
                    FN(fa_qk_tile_)(6, 2 * FA_NV, Ks, ld, Qp, E, S + j0 * lds + p0, lds, cm, jn,
                                    scale);
                else                                   /* an odd last panel */
                    FN(fa_qk_tile_)(6, FA_NV, Ks, ld, Qp, E, S + j0 * lds + p0, lds, cm, jn,
                                    scale);
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

/* ------------------------------------------------------------ online softmax ------------ */
/* Per lane: m_new = max(m, cmax); alpha = exp(m - m_new); P = exp(S - m_new) in place;
 * l = l*alpha + sum_j P; m = m_new.  A lane whose keys are all -inf so far keeps m = -inf:
 * it subtracts 0 instead (exp(-inf - 0) = 0, never -inf - -inf = NaN), so P = 0, l stays 0
 * and the row ends as out = 0, lse = -inf. */
/* The sum runs down a column (one lane per query row, n sequential adds), so it is
 * compensated (Kahan): a plain float32 running sum over a 1000-key row drifted ~1e-6 relative,
 * beyond the tolerance of 2x a pairwise-summing NumPy reference.  3 extra adds per vector. */
FA_INL void FN(fa_softmax_group_)(const int G, FA_T *S, ptrdiff_t lds, ptrdiff_t n,
                                  const FA_T *cmax, FA_T *m, FA_T *l, FA_T *alpha)
{
    VT mu[4], sum[4], comp[4];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
        VT mo = LD(m + g * FA_VW);
        VT mn = VMAX(mo, LD(cmax + g * FA_VW));
        ST(m + g * FA_VW, mn);
        VI dead = mn == BC(T_NEG_INF);
        mu[g] = SEL(dead, BC(0), mn);
        ST(alpha + g * FA_VW, VEXP(mo - mu[g]));
        sum[g] = BC(0);
        comp[g] = BC(0);
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *row = S + j * lds;
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            VT p = VEXP(LD(row + g * FA_VW) - mu[g]);
            ST(row + g * FA_VW, p);
            VT y = p - comp[g];
            VT t = sum[g] + y;
            comp[g] = (t - sum[g]) - y;
            sum[g] = t;
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
        ST(l + g * FA_VW, LD(l + g * FA_VW) * LD(alpha + g * FA_VW) + (sum[g] - comp[g]));
}

FA_FN void FN(fa_softmax)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, const FA_T *cmax,
                          FA_T *m, FA_T *l, FA_T *alpha)
{
    ptrdiff_t i = 0;
    for (; i + 4 * FA_VW <= W; i += 4 * FA_VW)
        FN(fa_softmax_group_)(4, S + i, lds, n, cmax + i, m + i, l + i, alpha + i);
    for (; i < W; i += FA_VW)
        FN(fa_softmax_group_)(1, S + i, lds, n, cmax + i, m + i, l + i, alpha + i);
}

/* ------------------------------------------------------------------ P·V ----------------- */
/* O[r][:] = alpha[r]*O[r][:] + sum_j P[j][r] * V[j][:] for MRX query rows and NVX*VW
 * columns.  Summation order matters for float32: one register accumulator per output running
 * over all keys made the error grow like sqrt(S) (3.4x NumPy's at S = 4096).  So the keys
 * are summed in chunks of FA_PV_CHUNK into fresh registers and each chunk is added to O in
 * memory (O was rescaled by alpha first): ~3% more work in P·V, about half the error. */
#define FA_PV_CHUNK 32
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
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_PV_CHUNK) {
        const ptrdiff_t j1 = n - j0 < FA_PV_CHUNK ? n : j0 + FA_PV_CHUNK;
        VT acc[FA_MR][2 * FA_NV];
#pragma GCC unroll 16
        for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++) acc[r][v] = BC(0);
        for (ptrdiff_t j = j0; j < j1; j++) {
            VT b[2 * FA_NV];
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++) b[v] = LD(V + j * ldv + v * FA_VW);
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++) {
                VT p = BC(P[j * ldp + r]);
#pragma GCC unroll 8
                for (int v = 0; v < NVX; v++) acc[r][v] += p * b[v];
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++)
                ST(O + r * ldo + v * FA_VW, LD(O + r * ldo + v * FA_VW) + acc[r][v]);
    }
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
    if (c < Ev) {  /* fewer than VW columns left (odd head dims): scalar */
        for (int r = 0; r < MRX; r++) {
            FA_T *o = O + r * ldo;
            for (ptrdiff_t cc = c; cc < Ev; cc++) {
                FA_T tot = o[cc] * alpha[r];
                for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_PV_CHUNK) {
                    FA_T acc = 0;
                    for (ptrdiff_t j = j0; j < n && j < j0 + FA_PV_CHUNK; j++)
                        acc += P[j * ldp + r] * V[j * ldv + cc];
                    tot += acc;
                }
                o[cc] = tot;
            }
        }
    }
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

/* ------------------------------------------------------- score modifiers ---------------- */
/* Plain loops over the contiguous lane dimension: the compiler vectorizes them for the
 * function's target ISA.  All of them touch only rows j < n and lanes < W. */

#if FA_ISF
/* float softcap evaluated in double, rounded once at the end: cap * tanh(s / cap) with
 * tanh = (1-e)/(1+e), e = exp(-2|x|), and x - x^3/3 near 0 where 1-e cancels.  Branch-free,
 * so the loop vectorizes. */
FA_INL float FN(fa_softcap_f_)(float sf, double cap)
{
    double x = (double)sf / cap, ax = x < 0 ? -x : x;
    double e = fa_expd(-2.0 * ax);
    double t = (1.0 - e) / (1.0 + e);
    t = ax < 1e-4 ? ax - ax * ax * ax * (1.0 / 3.0) : t;
    return (float)(cap * (x < 0 ? -t : t));
}
#endif

FA_FN void FN(fa_softcap)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, FA_T cap)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        for (ptrdiff_t i = 0; i < W; i++)
#if FA_ISF
            s[i] = FN(fa_softcap_f_)(s[i], (double)cap);
#else
            s[i] = cap * tanh(s[i] / cap);   /* libm: float64 needs full precision */
#endif
    }
}

/* s -= slope * |pos - j| */
FA_FN void FN(fa_alibi)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const int64_t *pos, const FA_T *slope)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jj = j0 + j;
        for (ptrdiff_t i = 0; i < W; i++) {
            int64_t d = pos[i] - jj;
            d = d < 0 ? -d : d;
            s[i] -= slope[i] * (FA_T)d;
        }
    }
}

/* float mask: s = -inf if mf == -inf else s + mf, mf = M[moff[lane] + (j0+j)*msj].
 * uniform: every lane reads moff[0] (mask broadcast over query rows/heads) */
FA_FN void FN(fa_maskf)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const FA_T *M, const int64_t *moff, int64_t msj, int uniform)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jo = (j0 + j) * msj;
        if (uniform) {
            FA_T mf = M[moff[0] + jo];
            if (mf == T_NEG_INF)
                for (ptrdiff_t i = 0; i < W; i++) s[i] = T_NEG_INF;
            else
                for (ptrdiff_t i = 0; i < W; i++) s[i] += mf;
        } else {
            for (ptrdiff_t i = 0; i < W; i++) {
                FA_T mf = M[moff[i] + jo];
                s[i] = mf == T_NEG_INF ? T_NEG_INF : s[i] + mf;
            }
        }
    }
}

/* bool keep-mask: s = -inf where M[...] == 0 */
FA_FN void FN(fa_maskb)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const uint8_t *M, const int64_t *moff, int64_t msj, int uniform)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jo = (j0 + j) * msj;
        if (uniform) {
            if (M[moff[0] + jo] == 0)
                for (ptrdiff_t i = 0; i < W; i++) s[i] = T_NEG_INF;
        } else {
            for (ptrdiff_t i = 0; i < W; i++)
                s[i] = M[moff[i] + jo] ? s[i] : T_NEG_INF;
        }
    }
}

/* causal / sliding window: key j allowed iff pos - wl <= j <= pos + wr */
FA_FN void FN(fa_window)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                         const int64_t *pos, int64_t wl, int64_t wr)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jj = j0 + j;
        for (ptrdiff_t i = 0; i < W; i++)
            s[i] = (jj < pos[i] - wl || jj > pos[i] + wr) ? T_NEG_INF : s[i];
    }
}

/* dropout on the weights: P = 0 where bits(seed, bh, i, j) < thresh (spec hash; rk[lane] is
 * row_key(seed, bh, i) precomputed per lane).  The 1/(1-p) factor is applied at the end. */
FA_FN void FN(fa_dropout)(FA_T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                          const uint32_t *rk, uint32_t thresh)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *p = P + j * lds;
        uint32_t jc = (uint32_t)(j0 + j) * 0x9E3779B1u;
        for (ptrdiff_t i = 0; i < W; i++) {
            uint32_t x = rk[i] ^ jc;
            x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
            p[i] = x < thresh ? (FA_T)0 : p[i];
        }
    }
}

/* --------------------------------------------------------- standalone softmax ----------- */
/* One row: out = softmax(x) over kept entries (mask NULL = all kept); masked -> 0; a row with
 * nothing kept, or only -inf, -> all zeros.  Three passes over an L1/L2 row. */
FA_FN void FN(fa_softmax_row)(const FA_T *x, const uint8_t *mask, FA_T *out, ptrdiff_t n)
{
    ptrdiff_t i;
    if (mask)
        for (i = 0; i < n; i++) out[i] = mask[i] ? x[i] : T_NEG_INF;
    else if (out != x)
        for (i = 0; i < n; i++) out[i] = x[i];
    VT mv = BC(T_NEG_INF);
    for (i = 0; i + FA_VW <= n; i += FA_VW) mv = VMAX(mv, LD(out + i));
    FA_T m = T_NEG_INF;
    for (int k = 0; k < FA_VW; k++) m = m < mv[k] ? mv[k] : m;
    for (; i < n; i++) m = m < out[i] ? out[i] : m;
    if (m == T_NEG_INF) {
        for (i = 0; i < n; i++) out[i] = 0;
        return;
    }
    VT sv = BC(0), cv = BC(0);               /* compensated, as in fa_softmax_group_ */
    for (i = 0; i + FA_VW <= n; i += FA_VW) {
        VT p = VEXP(LD(out + i) - m);
        ST(out + i, p);
        VT y = p - cv, t = sv + y;
        cv = (t - sv) - y;
        sv = t;
    }
    sv -= cv;
    FA_T s = 0;
    for (; i < n; i++) { out[i] = SEXP(out[i] - m); s += out[i]; }
    for (int k = 0; k < FA_VW; k++) s += sv[k];
    FA_T inv = (FA_T)1 / s;
    for (i = 0; i < n; i++) out[i] *= inv;
}

/* ------------------------------------------------------------------ backward ----------- */
/* The backward (backward.pxi) keeps the forward's layout: a tile is T[j][lane] (key rows,
 * query lanes contiguous), with the fixed row stride FA_BWD_LDS so that fa_ptq's broadcasts
 * down a column are constant displacements from one base register (a runtime stride would
 * need 12 row pointers, more than the free general registers). */

/* S[j][lane] = scale * sum_e Kt[e][j] * Qt[lane][e]: fa_qk with K packed transposed (row
 * stride ldkt over e, keys contiguous), so the 12 broadcasts of a step are constant
 * displacements from one pointer.  fa_qk indexes the caller's K rows through 12 index
 * registers, and GCC then spilled a Q vector (12 more loads per 24 FMAs).  The backward
 * packs Kᵀ once per work item, where every query block of the item reuses it.  Same chunked
 * summation, scale and rounding as fa_qk: the scores are the forward's, bit for bit.  Reads
 * Kt columns up to round_up(n, FA_MR) - 1: the caller pads the rows. */
FA_INL void FN(fa_qkt_tile_)(const int MRX, const int NVX, const FA_T *Kt, ptrdiff_t ldkt,
                             const FA_T *Qp, ptrdiff_t E, FA_T *S, ptrdiff_t lds, FA_T scale)
{
    /* NVX = 2 * FA_NV: two adjacent FA_NV-vector panels, as fa_qk_tile_ */
    const int PV = NVX <= FA_NV ? NVX : FA_NV;      /* vectors per panel */
    VT acc[FA_MR][2 * FA_NV];
    ptrdiff_t e0 = 0;
    do {
        const ptrdiff_t e1 = E - e0 < FA_QK_CHUNK ? E : e0 + FA_QK_CHUNK;
#pragma GCC unroll 16
        for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++) acc[r][v] = BC(0);
        const FA_T *kt = Kt + e0 * ldkt;
        const FA_T *qp = Qp + e0 * (PV * FA_VW);
        for (ptrdiff_t e = e0; e < e1; e++, kt += ldkt, qp += PV * FA_VW) {
            VT b[2 * FA_NV];
#pragma GCC unroll 8
            for (int v = 0; v < NVX; v++)
                b[v] = LD(qp + (v / PV) * (PV * FA_VW) * E + (v % PV) * FA_VW);
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++) {
                VT a = BC(kt[r]);
#pragma GCC unroll 8
                for (int v = 0; v < NVX; v++) acc[r][v] += a * b[v];
            }
        }
        if (e1 < E) {
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
                for (int v = 0; v < NVX; v++) {
                    FA_T *dst = S + r * lds + v * FA_VW;
                    ST(dst, e0 ? LD(dst) + acc[r][v] : acc[r][v]);
                }
        } else if (e0) {
#pragma GCC unroll 16
            for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
                for (int v = 0; v < NVX; v++) acc[r][v] += LD(S + r * lds + v * FA_VW);
        }
        e0 = e1;
    } while (e0 < E);
    const VT sc = BC(scale);
#pragma GCC unroll 16
    for (int r = 0; r < MRX; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NVX; v++) ST(S + r * lds + v * FA_VW, acc[r][v] * sc);
}

/* One register tile per call, S rows at the fixed stride FA_BWD_LDS: inlined into the loop
 * below, GCC parked loop variables in zmm28-31 and spilled a Q vector to the stack (12 more
 * loads per 24 FMAs); on its own the tile gets a clean allocation.  ~800 cycles per call. */
static __attribute__((noinline)) FA_ATTR void FN(fa_qkt_full_)(const FA_T *Kt, ptrdiff_t ldkt,
                                                              const FA_T *Qp, ptrdiff_t E,
                                                              FA_T *S, FA_T scale)
{
    FN(fa_qkt_tile_)(FA_MR, FA_NV, Kt, ldkt, Qp, E, S, FA_BWD_LDS, scale);
}
#if FA_MR == 12
/* 6 keys x two adjacent panels (see fa_qk) */
static __attribute__((noinline)) FA_ATTR void FN(fa_qkt_pair_)(const FA_T *Kt, ptrdiff_t ldkt,
                                                              const FA_T *Qp, ptrdiff_t E,
                                                              FA_T *S, FA_T scale)
{
    FN(fa_qkt_tile_)(6, 2 * FA_NV, Kt, ldkt, Qp, E, S, FA_BWD_LDS, scale);
}
#endif
static __attribute__((noinline)) FA_ATTR void FN(fa_qkt_one_)(const FA_T *Kt, ptrdiff_t ldkt,
                                                             const FA_T *Qp, ptrdiff_t E,
                                                             FA_T *S, FA_T scale)
{
    FN(fa_qkt_tile_)(FA_MR, 1, Kt, ldkt, Qp, E, S, FA_BWD_LDS, scale);
}

/* S (row stride FA_BWD_LDS) for keys j < n (rows up to round_up(n, FA_MR) are written) and
 * lanes < W (multiple of pw_nv * VW). */
FA_FN void FN(fa_qkt)(const FA_T *Kt, ptrdiff_t ldkt, ptrdiff_t n, ptrdiff_t E,
                      const FA_T *Qt, ptrdiff_t W, int pw_nv, FA_T *S, FA_T scale)
{
    const ptrdiff_t pw = (ptrdiff_t)pw_nv * FA_VW;
    ptrdiff_t p0 = 0;
#if FA_MR == 12
    /* panel pairs in 6-key tiles (rows up to round_up(n, 6) are written), then an odd last
     * panel in the 12-key tiles below; same sums, same bits */
    if (pw_nv == FA_NV)
        for (; p0 + 2 * pw <= W; p0 += 2 * pw)
            for (ptrdiff_t j0 = 0; j0 < n; j0 += 6)
                FN(fa_qkt_pair_)(Kt + j0, ldkt, Qt + p0 * E, E, S + j0 * FA_BWD_LDS + p0, scale);
#endif
    for (; p0 < W; p0 += pw) {
        const FA_T *Qp = Qt + p0 * E;
        for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_MR) {
            if (pw_nv == FA_NV)
                FN(fa_qkt_full_)(Kt + j0, ldkt, Qp, E, S + j0 * FA_BWD_LDS + p0, scale);
            else
                FN(fa_qkt_one_)(Kt + j0, ldkt, Qp, E, S + j0 * FA_BWD_LDS + p0, scale);
        }
    }
}

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

/* O[r][:] += sum_{i < ni} T[r * FA_BWD_LDS + i] * X[i][:] for MRX key rows and NVX*VW columns:
 * dV += Pᵀ·dO and dK += dSᵀ·Q with the tile's lanes as the reduction.  The lanes are summed in
 * chunks of FA_PV_CHUNK into fresh registers, each chunk added to O in memory (as fa_pv). */
#define FA_PTQ_MAXR 12
FA_INL void FN(fa_ptq_tile_)(const int MRX, const int NVX, const FA_T *T, ptrdiff_t ni,
                             const FA_T *X, ptrdiff_t ldx, FA_T *O, ptrdiff_t ldo)
{
    for (ptrdiff_t i0 = 0; i0 < ni; i0 += FA_PV_CHUNK) {
        const ptrdiff_t i1 = ni - i0 < FA_PV_CHUNK ? ni : i0 + FA_PV_CHUNK;
        VT acc[FA_PTQ_MAXR][2 * FA_NV];
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
                VT a = BC(T[r * FA_BWD_LDS + i]);
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

FA_INL void FN(fa_ptq_rows_)(const int MRX, const FA_T *T, ptrdiff_t ni, const FA_T *X,
                             ptrdiff_t ldx, ptrdiff_t C, FA_T *O, ptrdiff_t ldo)
{
    ptrdiff_t c = 0;
    for (; c + NR <= C; c += NR)
        FN(fa_ptq_tile_)(MRX, FA_NV, T, ni, X + c, ldx, O + c, ldo);
    for (; c + FA_VW <= C; c += FA_VW)
        FN(fa_ptq_tile_)(MRX, 1, T, ni, X + c, ldx, O + c, ldo);
    if (c < C) {  /* fewer than VW columns left: scalar, same chunked order */
        for (int r = 0; r < MRX; r++) {
            FA_T *o = O + r * ldo;
            const FA_T *t = T + r * FA_BWD_LDS;
            for (ptrdiff_t cc = c; cc < C; cc++) {
                FA_T tot = o[cc];
                for (ptrdiff_t i0 = 0; i0 < ni; i0 += FA_PV_CHUNK) {
                    FA_T acc = 0;
                    for (ptrdiff_t i = i0; i < ni && i < i0 + FA_PV_CHUNK; i++)
                        acc += t[i] * X[i * ldx + cc];
                    tot += acc;
                }
                o[cc] = tot;
            }
        }
    }
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
                FN(fa_ptq_tile_)(6, 4, T + r * FA_BWD_LDS, ni, X + c, ldx, O + r * ldo + c,
                                 ldo);
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

/* softcap with its derivative: S <- cap * tanh(S / cap) exactly as fa_softcap computes it
 * (the forward's scores, bit for bit), and G <- 1 - tanh^2 (float: from the double tanh). */
FA_FN void FN(fa_softcap_grad)(FA_T *S, FA_T *G, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                               FA_T cap)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds, *g = G + j * lds;
        for (ptrdiff_t i = 0; i < W; i++) {
#if FA_ISF
            double x = (double)s[i] / (double)cap, ax = x < 0 ? -x : x;
            double e = fa_expd(-2.0 * ax);
            double t = (1.0 - e) / (1.0 + e);
            t = ax < 1e-4 ? ax - ax * ax * ax * (1.0 / 3.0) : t;
            s[i] = (float)((double)cap * (x < 0 ? -t : t));
            g[i] = (float)(1.0 - t * t);
#else
            FA_T t = tanh(s[i] / cap);
            s[i] = cap * t;
            g[i] = 1 - t * t;
#endif
        }
    }
}

/* dropout on dP: dP <- dP * keep_scale where the spec hash keeps (i, j), 0 where it drops */
FA_FN void FN(fa_dropout_scale)(FA_T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                                const uint32_t *rk, uint32_t thresh, FA_T keep_scale)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *p = P + j * lds;
        uint32_t jc = (uint32_t)(j0 + j) * 0x9E3779B1u;
        for (ptrdiff_t i = 0; i < W; i++) {
            uint32_t x = rk[i] ^ jc;
            x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
            p[i] = x < thresh ? (FA_T)0 : p[i] * keep_scale;
        }
    }
}

/* out = x * s with the product in double: one rounding per output element (the forward's
 * O / l; float32 O * (1/l) in float would round twice).  A plain loop that -O3 vectorizes
 * under this copy's target attribute; the Cython loop it replaced ran as SSE2 scalar code. */
FA_FN void FN(fa_scale_row)(const FA_T *x, FA_T *out, ptrdiff_t n, double s)
{
    for (ptrdiff_t c = 0; c < n; c++) out[c] = (FA_T)((double)x[c] * s);
}

/* ---------------------------------------------------------------- ops table ------------- */
static const FA_CAT(fa_ops_, FA_TS) FA_CAT(fa_ops_, FA_SFX) = {
    FA_VW, FA_MR, FA_NV, FA_STR(FA_SFX),
    FN(fa_qk), FN(fa_colmax), FN(fa_softmax), FN(fa_pv), FN(fa_pv_exact), FN(fa_allfinite),
    FN(fa_softcap), FN(fa_alibi), FN(fa_maskf), FN(fa_maskb), FN(fa_window), FN(fa_dropout),
    FN(fa_softmax_row),
#ifdef FA_QK_DOT
    FA_QK_DOT,
#else
    NULL,
#endif
    FN(fa_qkt), FN(fa_bwd_p), FN(fa_bwd_ds), FN(fa_ptq), FN(fa_softcap_grad),
    FN(fa_dropout_scale), FN(fa_transpose), FN(fa_scale_row),
};

#undef FN
#undef VT
#undef VTU
#undef VI
#undef NR
#undef MRT
#undef FA_PV_CHUNK
#undef FA_QK_CHUNK
#undef FA_PTQ_MAXR
#undef VTH
#undef VD
#undef FA_LOHALF
#undef FA_HIHALF
#undef FA_TOD
#undef FA_CVTLO
#undef FA_CVTHI
#undef FA_CONCAT
#undef FA_INL
#undef FA_FN
#undef LD
#undef ST
#undef BC
#undef SEL
#undef SEXP
#undef T_NEG_INF
#undef VEXP
#undef VMAX
