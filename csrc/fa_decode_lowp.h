/*
 * fa_decode_lowp.h -- decode (R = 1..FA_DG_MAXR query rows sharing one position, as
 * fa_decode_avx2.h) over a low-precision KV cache read in place: float16 (kind 1), bfloat16
 * (kind 2) or int8 codes with per-key float32 scales (kind 3; fa_kvconv.h).  AVX2 + FMA +
 * F16C; every float32 value it computes with is exactly the one the cache holds.
 *
 * Why a kernel of its own: decode is memory-bound, and reading a quarter of the bytes is only
 * a speed-up if the conversion costs less than the bytes it saves.  Converting a block into a
 * float32 tile first (the general path, block_kv) writes and re-reads every element; here the
 * conversion happens in the loads of the dot products and of P·V:
 *   float16   _mm256_cvtph_ps of 8 halves (F16C);
 *   bfloat16  the 16 bits shifted into the top of a 32-bit lane (exact);
 *   int8      sign-extended to 32 bits and converted (exact), and the scale factored out: the
 *             score of key j is scale * k_scale[j] * (q . codes_j), one multiply per key, and
 *             P·V adds (p_j * v_scale[j]) * codes_j, so l still sums the plain p_j.
 * Scores as in fa_decode_avx2.h (8 accumulators summed across lanes: groups of 8/RP keys x RP
 * rows, each K row loaded and converted once for all rows), softmax per row over a block of
 * FA_D1_BK keys, P·V in column panels that fit the 16 registers, summed per chunk of
 * FA_D1_PV_CHUNK keys in fresh registers and then added to O (float32 accuracy on long
 * caches).  Head dims multiples of 8; other calls take the general path.  State in/out per
 * row: m[r], l[r], O[r * ldo + c], the general path's, so its finish and merge serve this too.
 */
#ifndef FA_DECODE_LOWP_H
#define FA_DECODE_LOWP_H
#include "fa_decode_avx2.h"
#include "fa_kvconv.h"

#if FA_HAVE_X86_VARIANTS

#define FA_LP __attribute__((target("avx2,fma,f16c")))
#define FA_LP_INL static inline __attribute__((always_inline)) FA_LP

/* 8 stored elements from e of a row, as float32 */
FA_LP_INL __m256 fa_lp_load8_(const int KIND, const void *row, ptrdiff_t e)
{
    if (KIND == FA_KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + e)));
    if (KIND == FA_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + e))),
            16));
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + e))));
}

FA_LP_INL const void *fa_lp_row_(const int KIND, const void *base, ptrdiff_t ld, ptrdiff_t j)
{
    return (const char *)base + j * ld * (KIND == FA_KV_I8 ? 1 : 2);
}

/* S[r * FA_D1_BK + j] = scale (* ks[j * lds] for int8) * K[j] . q[r], j < nb, r < R <= RP.
 * Meanwhile rows [0, nn) of Kpf and Vpf (the next block; rows ldk / ldv apart) are
 * prefetched a key group at a time, spread over the scores as fa_decode_avx2.h does (one
 * burst per block filled the line-fill buffers and stalled the core). */
FA_LP_INL void fa_lp_scores_(const int KIND, const int RP, const float *q, ptrdiff_t ldq, int R,
                             ptrdiff_t E, const void *K, ptrdiff_t ldk, const float *ks,
                             ptrdiff_t lds, ptrdiff_t nb, float scale, float *S,
                             const void *Kpf, const void *Vpf, ptrdiff_t ldv, ptrdiff_t Ev,
                             ptrdiff_t nn, int kind)
{
    const int KG = 8 / RP;
    const ptrdiff_t item = KIND == FA_KV_I8 ? 1 : 2;
    const float *qr[4];
    for (int r = 0; r < RP; r++) qr[r] = q + (r < R ? r : R - 1) * ldq;
    for (ptrdiff_t j0 = 0; j0 < nb; j0 += KG) {
        for (ptrdiff_t j = j0; j < j0 + KG && j < nn; j++) {
            fa_prefetch(fa_lp_row_(KIND, Kpf, ldk, j), E * item, kind);
            fa_prefetch(fa_lp_row_(KIND, Vpf, ldv, j), Ev * item, kind);
        }
        const void *kr[8];
        for (int kk = 0; kk < KG; kk++)
            kr[kk] = fa_lp_row_(KIND, K, ldk, j0 + kk < nb ? j0 + kk : nb - 1);
        __m256 acc[8];
        for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
        for (ptrdiff_t e = 0; e < E; e += 8) {
            __m256 qv[4];
            for (int r = 0; r < RP; r++) {
                qv[r] = _mm256_loadu_ps(qr[r] + e);
                FA_D2_KEEP(qv[r]);
            }
            for (int kk = 0; kk < KG; kk++) {
                const __m256 kv = fa_lp_load8_(KIND, kr[kk], e);
                for (int r = 0; r < RP; r++)
                    acc[kk * RP + r] = _mm256_fmadd_ps(kv, qv[r], acc[kk * RP + r]);
            }
        }
        float buf[8];
        _mm256_storeu_ps(buf, _mm256_mul_ps(fa_d2_hsum8_(acc), _mm256_set1_ps(scale)));
        for (int kk = 0; kk < KG && j0 + kk < nb; kk++) {
            /* int8: the key's scale, after the dot product (one multiply per key) */
            const float f = KIND == FA_KV_I8 ? ks[(j0 + kk) * lds] : 1.0f;
            for (int r = 0; r < R; r++)
                S[r * FA_D1_BK + j0 + kk] = KIND == FA_KV_I8 ? buf[kk * RP + r] * f
                                                             : buf[kk * RP + r];
        }
    }
}

/* O[r][0 : NV*8) += sum_j P[r * FA_D1_BK + j] V[j][0 : NV*8), V converted on load */
FA_LP_INL void fa_lp_pv_(const int KIND, const int R, const int NV, const float *P,
                         ptrdiff_t n, const void *V, ptrdiff_t ldv, ptrdiff_t c0, float *O,
                         ptrdiff_t ldo)
{
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_PV_CHUNK) {
        const ptrdiff_t j1 = n - j0 < FA_D1_PV_CHUNK ? n : j0 + FA_D1_PV_CHUNK;
        __m256 acc[16];
        for (int a = 0; a < R * NV; a++) acc[a] = _mm256_setzero_ps();
        for (ptrdiff_t j = j0; j < j1; j++) {
            const void *vr = fa_lp_row_(KIND, V, ldv, j);
            __m256 vv[8];
            for (int v = 0; v < NV; v++) {
                vv[v] = fa_lp_load8_(KIND, vr, c0 + 8 * v);
                FA_D2_KEEP(vv[v]);
            }
            for (int r = 0; r < R; r++) {
                const __m256 pj = _mm256_set1_ps(P[r * FA_D1_BK + j]);
                for (int v = 0; v < NV; v++)
                    acc[r * NV + v] = _mm256_fmadd_ps(pj, vv[v], acc[r * NV + v]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) {
                float *o = O + r * ldo + c0 + 8 * v;
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[r * NV + v]));
            }
    }
}

FA_LP_INL void fa_lp_pv_cols_(const int KIND, const int R, const float *P, ptrdiff_t n,
                              const void *V, ptrdiff_t ldv, ptrdiff_t Ev, float *O,
                              ptrdiff_t ldo)
{
    const int NVMAX = fa_d2_nvmax_(R);
    for (ptrdiff_t c0 = 0; c0 < Ev; c0 += 8 * NVMAX) {
        const ptrdiff_t left = (Ev - c0) / 8;
        const int nv = left < NVMAX ? (int)left : NVMAX;
#define FA_LP_PV(NVX) fa_lp_pv_(KIND, R, NVX, P, n, V, ldv, c0, O, ldo)
        switch (nv) {
        case 1: FA_LP_PV(1); break;
        case 2: FA_LP_PV(NVMAX >= 2 ? 2 : 1); break;
        case 3: FA_LP_PV(NVMAX >= 3 ? 3 : 1); break;
        case 4: FA_LP_PV(NVMAX >= 4 ? 4 : 1); break;
        case 5: FA_LP_PV(NVMAX >= 5 ? 5 : 1); break;
        case 6: FA_LP_PV(NVMAX >= 6 ? 6 : 1); break;
        case 7: FA_LP_PV(NVMAX >= 7 ? 7 : 1); break;
        default: FA_LP_PV(NVMAX >= 8 ? 8 : 1); break;
        }
#undef FA_LP_PV
    }
}

/* One block of nb <= FA_D1_BK keys for R rows; meanwhile rows [0, npf) of the next block
 * (Kpf / Vpf, same strides) are prefetched with `kind` (fa_prefetch). */
FA_LP_INL void fa_lp_block_(const int KIND, const int R, const float *q, ptrdiff_t ldq,
                            const void *Kb, ptrdiff_t ldk, const void *Vb, ptrdiff_t ldv,
                            const float *ks, ptrdiff_t ldks, const float *vs, ptrdiff_t ldvs,
                            ptrdiff_t nb, ptrdiff_t E, ptrdiff_t Ev, float scale, float *m,
                            double *l, float *O, ptrdiff_t ldo, int kind, const void *Kpf,
                            const void *Vpf, ptrdiff_t npf)
{
    float P[FA_DG_MAXR * FA_D1_BK] __attribute__((aligned(32)));
    const int ng = (int)((nb + 7) / 8);
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int rows = R - r0 < 4 ? R - r0 : 4;
        float *S = P + r0 * FA_D1_BK;
        const ptrdiff_t nn = r0 ? 0 : npf;             /* the prefetch: in the first pass */
#define FA_LP_SC(RPX) fa_lp_scores_(KIND, RPX, q + r0 * ldq, ldq, rows, E, Kb, ldk, ks, ldks, \
                                    nb, scale, S, Kpf, Vpf, ldv, Ev, nn, kind)
        if (rows == 1)
            FA_LP_SC(1);
        else if (rows == 2)
            FA_LP_SC(2);
        else
            FA_LP_SC(4);
#undef FA_LP_SC
    }
    float vsc[FA_D1_BK] __attribute__((aligned(32)));
    if (KIND == FA_KV_I8)
        for (ptrdiff_t j = 0; j < nb; j++) vsc[j] = vs[j * ldvs];
    for (int r = 0; r < R; r++) {
        __m256 s[FA_D1_BK / 8];
        __m256 mx = ninf;
        for (int g = 0; g < ng; g++) {
            s[g] = _mm256_load_ps(P + r * FA_D1_BK + 8 * g);
            if (8 * g + 8 > nb) {                   /* keys past the end: -inf */
                const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nb - 8 * g)),
                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                s[g] = _mm256_blendv_ps(ninf, s[g], _mm256_castsi256_ps(live));
            }
            mx = _mm256_max_ps(s[g], mx);           /* a NaN score is not the max (avx2's rule) */
        }
        const float bm = fa_d2_reduce_max_(mx);
        const float mn = bm > m[r] ? bm : m[r];
        const float mu = mn == -__builtin_inff() ? 0.0f : mn;
        const float alpha = fa_expf(m[r] - mu);
        __m256 sum = _mm256_setzero_ps();
        for (int g = 0; g < ng; g++) {
            __m256 p = (__m256)fa_vexp_f_avx2(
                (fa_vt_f_avx2)_mm256_sub_ps(s[g], _mm256_set1_ps(mu)));
            sum = _mm256_add_ps(sum, p);
            if (KIND == FA_KV_I8) {                 /* P·V weights: p_j * v_scale[j] */
                const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nb - 8 * g)),
                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                p = _mm256_mul_ps(p, _mm256_blendv_ps(_mm256_setzero_ps(),
                                                      _mm256_load_ps(vsc + 8 * g),
                                                      _mm256_castsi256_ps(live)));
            }
            _mm256_store_ps(P + r * FA_D1_BK + 8 * g, p);
        }
        l[r] = l[r] * alpha + (double)fa_d2_reduce_add_(sum);
        m[r] = mn;
        if (alpha != 1.0f) {
            float *o = O + r * ldo;
            const __m256 av = _mm256_set1_ps(alpha);
            for (ptrdiff_t c = 0; c < Ev; c += 8)
                _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), av));
        }
    }
    fa_lp_pv_cols_(KIND, R, P, nb, Vb, ldv, Ev, O, ldo);
}

#define FA_LP_CASE(KK, RR)                                                                  \
    case RR:                                                                                \
        fa_lp_block_(KK, RR, q, ldq, fa_lp_row_(KK, K, ldk, j0), ldk,                       \
                     fa_lp_row_(KK, V, ldv, j0), ldv, ks ? ks + j0 * ldks : ks, ldks,       \
                     vs ? vs + j0 * ldvs : vs, ldvs, nb, E, Ev, scale, m, l, O, ldo, pf_kind, \
                     fa_lp_row_(KK, Kpf, ldk, j0), fa_lp_row_(KK, Vpf, ldv, j0), nn);        \
        break;
#define FA_LP_ROWS(KK)                                                                      \
    switch (R) {                                                                            \
    FA_LP_CASE(KK, 1) FA_LP_CASE(KK, 2) FA_LP_CASE(KK, 3) FA_LP_CASE(KK, 4)                 \
    FA_LP_CASE(KK, 5) FA_LP_CASE(KK, 6) FA_LP_CASE(KK, 7) default: FA_LP_CASE(KK, 8)        \
    }

/* Rows q[r * ldq], r < R, against keys [0, n) stored at K / V (rows ldk / ldv stored elements
 * apart, kind `kv_kind`; int8: key j's scales ks[j * ldks], vs[j * ldvs]), updating m_io[r],
 * l_io[r], O[r * ldo + c]; E % 8 == Ev % 8 == 0.  Block [j0, j0 + nb) prefetches rows
 * [j0, j0 + nb) of Kpf / Vpf below npf (pf_kind 0: none). */
static FA_LP void fa_decode_lowp_avx2(int kv_kind, int R, const float *q, ptrdiff_t ldq,
                                      const void *K, ptrdiff_t ldk, const void *V, ptrdiff_t ldv,
                                      const float *ks, ptrdiff_t ldks, const float *vs,
                                      ptrdiff_t ldvs, ptrdiff_t n, ptrdiff_t E, ptrdiff_t Ev,
                                      float scale, float *m_io, float *l_io, float *O,
                                      ptrdiff_t ldo, int pf_kind, const void *Kpf,
                                      const void *Vpf, ptrdiff_t npf)
{
    float m[FA_DG_MAXR];
    double l[FA_DG_MAXR];
    for (int r = 0; r < R; r++) {
        m[r] = m_io[r];
        l[r] = l_io[r];
    }
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_BK) {
        const ptrdiff_t nb = n - j0 < FA_D1_BK ? n - j0 : FA_D1_BK;
        const ptrdiff_t left = npf - j0;
        const ptrdiff_t nn = pf_kind && left > 0 ? (left < nb ? left : nb) : 0;
        if (kv_kind == FA_KV_F16) {
            FA_LP_ROWS(FA_KV_F16)
        } else if (kv_kind == FA_KV_BF16) {
            FA_LP_ROWS(FA_KV_BF16)
        } else {
            FA_LP_ROWS(FA_KV_I8)
        }
    }
    for (int r = 0; r < R; r++) {
        m_io[r] = m[r];
        l_io[r] = (float)l[r];
    }
}
#undef FA_LP_ROWS
#undef FA_LP_CASE

/* this kernel serves a call: a SIMD copy is selected (not the generic one, which a test or
 * FASTATTN_SIMD may force), the CPU has F16C, both head dims are multiples of 8 */
static inline int fa_decode_lowp_available(ptrdiff_t E, ptrdiff_t Ev)
{
    return FA_OPS_F != &fa_ops_f_generic && fa_kv_has_f16c() && E > 0 && Ev > 0 && E % 8 == 0
           && Ev % 8 == 0;
}

#else
static inline int fa_decode_lowp_available(ptrdiff_t E, ptrdiff_t Ev)
{
    (void)E; (void)Ev;
    return 0;
}
static inline void fa_decode_lowp_avx2(int kv_kind, int R, const float *q, ptrdiff_t ldq,
                                       const void *K, ptrdiff_t ldk, const void *V,
                                       ptrdiff_t ldv, const float *ks, ptrdiff_t ldks,
                                       const float *vs, ptrdiff_t ldvs, ptrdiff_t n, ptrdiff_t E,
                                       ptrdiff_t Ev, float scale, float *m_io, float *l_io,
                                       float *O, ptrdiff_t ldo, int pf_kind, const void *Kpf,
                                       const void *Vpf, ptrdiff_t npf)
{
    (void)kv_kind; (void)R; (void)q; (void)ldq; (void)K; (void)ldk; (void)V; (void)ldv;
    (void)ks; (void)ldks; (void)vs; (void)ldvs; (void)n; (void)E; (void)Ev; (void)scale;
    (void)m_io; (void)l_io; (void)O; (void)ldo; (void)pf_kind; (void)Kpf; (void)Vpf; (void)npf;
}
#endif
#endif /* FA_DECODE_LOWP_H */
