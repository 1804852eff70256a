/*
 * fa_decodeg.h -- decode for the R = 2..FA_DG_MAXR query rows of one KV group that share one
 * position (GQA decode: L = 1, G = Hq / Hkv rows), float32, AVX-512.  R = 1 is fa_decode1.h.
 *
 * Why: the general path (decode.pxi -> attend_block with fa_qk_dot) ran a GQA 32/8, d = 128
 * decode at ~130 cycles per key per thread with K/V in cache (Zen 4): the scores of <= 4 rows
 * were stored lane by lane into a 16-lane tile, the softmax ran over all 16 lanes, P·V over a
 * register tile with padding.  The floor is the FMAs: 2 * R * d / 16 per key (64 at R = 4,
 * d = 128).  Streaming K/V from DRAM, the compute and the memory time did not overlap well
 * enough, so the time per key was about their sum (55% of the read bandwidth).  Here, per
 * block of FA_D1_BK keys, for each row the scores of fa_decode1.h (dot products along e, 16
 * keys per horizontal sum; the K rows of a 16-key group stay in L1 across the rows), the
 * softmax along the keys per row, and one P·V pass over the block's V rows for all rows at
 * once (each V row loaded once, R x NV accumulators; chunks of FA_D1_PV_CHUNK keys summed in
 * fresh registers and then added to O, as in fa_decode1.h).
 * State in/out per row: running max m[r], sum l[r], unnormalised O[r * ldo + c], the general
 * path's, so its finish and split-merge code serve this kernel too.
 */
#ifndef FA_DECODEG_H
#define FA_DECODEG_H
#include "fa_decode1.h"

#define FA_DG_MAXR 8

#if FA_HAVE_X86_VARIANTS

/* O[r][0 : NV*16) (last vector under `last`) += sum_j P[r][j] V[j], keys in chunks of
 * FA_D1_PV_CHUNK; rows [0, npf) of Vpf are prefetched key by key meanwhile */
static inline __attribute__((always_inline)) FA_A512 void
fa_dg_pv_(const int R, const int NV, const float *P, ptrdiff_t n, const float *V, ptrdiff_t ldv,
          float *O, ptrdiff_t ldo, __mmask16 last, const float *Vpf, ptrdiff_t npf,
          ptrdiff_t Ev, int kind)
{
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_PV_CHUNK) {
        const ptrdiff_t j1 = n - j0 < FA_D1_PV_CHUNK ? n : j0 + FA_D1_PV_CHUNK;
        __m512 acc[16];
        for (int a = 0; a < R * NV; a++) acc[a] = _mm512_setzero_ps();
        for (ptrdiff_t j = j0; j < j1; j++) {
            const float *vr = V + j * ldv;
            __m512 vv[4];
            if (j < npf) fa_d1_prefetch_(Vpf, ldv, Ev, j, j + 1, kind);
            for (int v = 0; v < NV; v++)
                vv[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xFFFF, vr + 16 * v);
            for (int r = 0; r < R; r++) {
                const __m512 pj = _mm512_set1_ps(P[r * FA_D1_BK + j]);
                for (int v = 0; v < NV; v++)
                    acc[r * NV + v] = _mm512_fmadd_ps(pj, vv[v], acc[r * NV + v]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) {
                const __mmask16 mk = v == NV - 1 ? last : 0xFFFF;
                float *o = O + r * ldo + 16 * v;
                _mm512_mask_storeu_ps(o, mk, _mm512_add_ps(_mm512_maskz_loadu_ps(mk, o),
                                                           acc[r * NV + v]));
            }
    }
}

/* ... for every column (column panels of 4 vectors for R <= 4, of 2 above: R x NV <= 16
 * accumulators); the first panel also prefetches rows [0, npf) of Vpf (the next block) */
static inline __attribute__((always_inline)) FA_A512 void
fa_dg_pv_cols_(const int R, const float *P, ptrdiff_t n, const float *V, ptrdiff_t ldv,
               ptrdiff_t Ev, float *O, ptrdiff_t ldo, const float *Vpf, ptrdiff_t npf, int kind)
{
    const ptrdiff_t pw = R <= 4 ? 64 : 32;
    for (ptrdiff_t c0 = 0; c0 < Ev; c0 += pw) {
        const ptrdiff_t cols = Ev - c0 < pw ? Ev - c0 : pw;
        const int nv = (int)((cols + 15) / 16);
        const __mmask16 last = (cols & 15) ? (__mmask16)((1u << (cols & 15)) - 1) : (__mmask16)0xFFFF;
        const ptrdiff_t np = c0 ? 0 : npf;
        switch (nv) {
        case 1: fa_dg_pv_(R, 1, P, n, V + c0, ldv, O + c0, ldo, last, Vpf, np, Ev, kind); break;
        case 2: fa_dg_pv_(R, 2, P, n, V + c0, ldv, O + c0, ldo, last, Vpf, np, Ev, kind); break;
        case 3: fa_dg_pv_(R, R <= 4 ? 3 : 2, P, n, V + c0, ldv, O + c0, ldo, last, Vpf, np, Ev, kind); break;
        default: fa_dg_pv_(R, R <= 4 ? 4 : 2, P, n, V + c0, ldv, O + c0, ldo, last, Vpf, np, Ev, kind); break;
        }
    }
}

/* One block of nb <= FA_D1_BK keys for R rows; rows [0, nn) of Kpf / Vpf are prefetched
 * meanwhile (K during the first row's scores, V during the first P·V panel).  NE > 0: E = Ev
 * = 16 NE known at compile time (fa_decode1.h's fa_d1_loop_: whole-vector loads that fold
 * into the FMAs, the same bits).  Used for d = 128 only: a C harness calling the kernel (8 kv
 * heads x 1024 keys, one thread, Zen 4, arguments read at run time, best of 1000, three
 * alternating runs) went 187-189 -> 176-179 us at R = 2, 276-286 -> 263-269 at R = 4,
 * 532-541 -> 500-505 at R = 8; the d = 64 copy was 1-8% slower than the general loop (R = 2,
 * 4, 8) and is not built. */
static inline __attribute__((always_inline)) FA_A512 void
fa_dg_block_(const int R, const int NE, const float *q, ptrdiff_t ldq, const float *Kb,
             ptrdiff_t ldk, const float *Vb, ptrdiff_t ldv, ptrdiff_t nb, ptrdiff_t E_,
             ptrdiff_t Ev_, float scale, float *m, double *l, float *O, ptrdiff_t ldo, int kind,
             const float *Kpf, const float *Vpf, ptrdiff_t nn)
{
    const ptrdiff_t E = NE ? 16 * NE : E_, Ev = NE ? 16 * NE : Ev_;
    float P[FA_DG_MAXR * FA_D1_BK] __attribute__((aligned(64)));
    const int ng = (int)((nb + 15) / 16);
    for (int r = 0; r < R; r++) {
        __m512 s[FA_D1_BK / 16];
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        for (int g = 0; g < ng; g++) {
            if (r == 0 && 16 * g < nn)
                fa_d1_prefetch_(Kpf, ldk, E, 16 * g,
                                16 * g + 16 < nn ? 16 * g + 16 : nn, kind);
            s[g] = NE ? fa_d1_scores16_(NE, q + r * ldq, (__mmask16)0xFFFF, Kb, ldk, 16 * g,
                                        nb, scale)
                      : fa_d1_scores_(q + r * ldq, E, Kb, ldk, 16 * g, nb, scale);
            if (16 * g + 16 > nb)                   /* keys past the end: -inf */
                s[g] = _mm512_mask_blend_ps((__mmask16)((1u << (nb - 16 * g)) - 1),
                                            _mm512_set1_ps(-__builtin_inff()), s[g]);
            mx = _mm512_max_ps(s[g], mx);           /* NaN: see fa_decode1.h */
        }
        const float bm = _mm512_reduce_max_ps(mx);
        const float mn = bm > m[r] ? bm : m[r];
        const float mu = mn == -__builtin_inff() ? 0.0f : mn;
        const float alpha = fa_expf(m[r] - mu);
        __m512 sum = _mm512_setzero_ps();
        for (int g = 0; g < ng; g++) {
            __m512 p = fa_d1_vexp_(_mm512_sub_ps(s[g], _mm512_set1_ps(mu)));
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(P + r * FA_D1_BK + 16 * g, p);
        }
        l[r] = l[r] * alpha + (double)_mm512_reduce_add_ps(sum);
        m[r] = mn;
        if (alpha != 1.0f) {                        /* rescale O once per block */
            float *o = O + r * ldo;
            const __m512 av = _mm512_set1_ps(alpha);
            for (ptrdiff_t c = 0; c < Ev; c += 16) {
                const __mmask16 mk = Ev - c >= 16 ? (__mmask16)0xFFFF
                                                  : (__mmask16)((1u << (Ev - c)) - 1);
                _mm512_mask_storeu_ps(o + c, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, o + c), av));
            }
        }
    }
    fa_dg_pv_cols_(R, P, nb, Vb, ldv, Ev, O, ldo, Vpf, nn, kind);
}

#define FA_DG_BLOCK(RR, NE)                                                                \
    fa_dg_block_(RR, NE, q, ldq, K + j0 * ldk, ldk, V + j0 * ldv, ldv, nb, E, Ev, scale, m,  \
                 l, O, ldo, pf_kind, Kpf + j0 * ldk, Vpf + j0 * ldv, nn)
#define FA_DG_CASE(RR)                                                                     \
    case RR:                                                                               \
        if (E == 128 && Ev == 128)                                                         \
            FA_DG_BLOCK(RR, 8);                                                            \
        else                                                                               \
            FA_DG_BLOCK(RR, 0);                                                            \
        break;

/* Rows q[r * ldq], r < R (2 <= R <= FA_DG_MAXR), against keys [0, n) of K (stride ldk) and V
 * (stride ldv), updating m_io[r], l_io[r] (double, as fa_decode1_f_avx512's) and O[r * ldo + c].
 * Prefetch as fa_decode1_f_avx512:
 * block [j0, j0 + nb) prefetches rows [j0, j0 + nb) of Kpf / Vpf below npf. */
static FA_A512 void fa_decodeg_f_avx512(int R, const float *q, ptrdiff_t ldq, const float *K,
                                        ptrdiff_t ldk, const float *V, ptrdiff_t ldv,
                                        ptrdiff_t n, ptrdiff_t E, ptrdiff_t Ev,
                                        float scale, float *m_io, double *l_io, float *O,
                                        ptrdiff_t ldo, int pf_kind, const float *Kpf,
                                        const float *Vpf, ptrdiff_t npf)
{
    float m[FA_DG_MAXR];
    double l[FA_DG_MAXR];            /* one add per block: in double across blocks and calls */
    for (int r = 0; r < R; r++) {
        m[r] = m_io[r];
        l[r] = l_io[r];
    }
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_BK) {
        const ptrdiff_t nb = n - j0 < FA_D1_BK ? n - j0 : FA_D1_BK;
        const ptrdiff_t left = npf - j0;
        const ptrdiff_t nn = pf_kind && left > 0 ? (left < nb ? left : nb) : 0;
        switch (R) {
        FA_DG_CASE(2)
        FA_DG_CASE(3)
        FA_DG_CASE(4)
        FA_DG_CASE(5)
        FA_DG_CASE(6)
        FA_DG_CASE(7)
        default:
        FA_DG_CASE(8)
        }
    }
    for (int r = 0; r < R; r++) {
        m_io[r] = m[r];
        l_io[r] = l[r];
    }
}
#undef FA_DG_CASE
#undef FA_DG_BLOCK

#else
static inline void fa_decodeg_f_avx512(int R, const float *q, ptrdiff_t ldq, const float *K,
                                       ptrdiff_t ldk, const float *V, ptrdiff_t ldv,
                                       ptrdiff_t n, ptrdiff_t E, ptrdiff_t Ev,
                                       float scale, float *m_io, double *l_io, float *O,
                                       ptrdiff_t ldo, int pf_kind, const float *Kpf,
                                       const float *Vpf, ptrdiff_t npf)
{
    (void)R; (void)q; (void)ldq; (void)K; (void)ldk; (void)V; (void)ldv; (void)n; (void)npf;
    (void)E; (void)Ev; (void)scale; (void)m_io; (void)l_io; (void)O; (void)ldo; (void)pf_kind;
    (void)Kpf; (void)Vpf;
}
#endif
#endif /* FA_DECODEG_H */
