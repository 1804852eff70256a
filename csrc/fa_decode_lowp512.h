/*
 * fa_decode_lowp512.h -- fa_decode_lowp.h's decode over a low-precision KV cache (float16
 * kind 1, bfloat16 kind 2, int8 codes with per-key float32 scales kind 3) for AVX-512: the
 * same organisation with 16-lane vectors and 32 registers.  Every float32 value it computes
 * with is exactly the one the cache holds.
 *
 * Why: over an int8 cache the AVX2 copy was bound by its arithmetic, not by memory (GQA 32/8,
 * d = 128: 0.46x the float32 cache's time for a quarter of its bytes, 33% of the read
 * bandwidth): each element costs a widening and a conversion before its FMAs, in the scores
 * and again in P·V.  16 lanes halve the instructions per element, conversion included:
 *   float16   _mm512_cvtph_ps of 16 halves;
 *   bfloat16  the 16 bits shifted into the top of a 32-bit lane (exact);
 *   int8      _mm512_cvtepi8_epi32 + _mm512_cvtepi32_ps (exact); the scales factored out as
 *             in fa_decode_lowp.h: score = scale * dot(q, codes_j) * k_scale[j] and P·V adds
 *             (p_j * v_scale[j]) * codes_j, l summing the plain p_j.  The block's scales are
 *             first copied into two contiguous arrays (they lie Hkv floats apart in a
 *             flash-layout cache), so both products are one vector multiply per 16 keys.
 * Scores: groups of 16/RP keys x RP = 1, 2 or 4 rows fill 16 accumulators (each K row loaded
 * and converted once for all rows), summed across lanes by fa_hsum16_ (fa_decode_avx512.h)
 * with the accumulators numbered so that each row's keys come out in consecutive lanes.
 * Softmax per row over a block of up to FA_D1_BK keys; P·V in column panels of R x NV
 * accumulators (fa_lp5_nvmax_), summed per chunk of FA_D1_PV_CHUNK keys in fresh registers
 * and then added to O (float32 accuracy on long caches).  Head dims multiples of 16; others
 * take fa_decode_lowp.h (multiples of 8) or the general path.  State in/out per row: m[r],
 * l[r], O[r * ldo + c], the general path's, so its finish and merge serve this too.
 *
 * Measured (this 2-core AVX-512 Xeon guest; fastattn.bench.kvcache.cache_dtypes_decode, GQA
 * 32/8, d = 128, 16384 keys, 2 threads): int8 0.46x -> 0.33x the float32 cache's time (33% ->
 * ~50% of the read probe), float16 0.57x -> 0.47x (52% -> 64-73%).  What is left for int8: in
 * L2 a key of 4 rows costs ~22 ns here (64 FMAs, 16 conversions, the horizontal sums), and
 * one core streams only ~12 GB/s from DRAM (a plain read loop), ~21 ns for a key's 256 bytes,
 * so the two must overlap almost fully: one thread from DRAM took ~36 ns a key.
 */
#ifndef FA_DECODE_LOWP512_H
#define FA_DECODE_LOWP512_H
#include "fa_decode_lowp.h"

#if FA_HAVE_X86_VARIANTS

#define FA_LP5 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define FA_LP5_INL static inline __attribute__((always_inline)) FA_LP5
/* FA_D2_KEEP for any of the 32 registers ("x" would confine the value to zmm0-15) */
#define FA_LP5_KEEP(x) __asm__("" : "+v"(x))

/* 16 stored elements from e of a row, as float32 */
FA_LP5_INL __m512 fa_lp5_load16_(const int KIND, const void *row, ptrdiff_t e)
{
    if (KIND == FA_KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + e)));
    if (KIND == FA_KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + e))),
            16));
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + e))));
}

/* The accumulator of key kk of row r in a group of KG keys: fa_hsum16_ puts the sum of
 * acc[4l + c] in lane 4c + l, so this numbering leaves row r's keys in lanes
 * [r * KG, r * KG + KG), in key order. */
#define FA_LP5_ACC(KG, kk, r) (4 * (((r) * (KG) + (kk)) & 3) + (((r) * (KG) + (kk)) >> 2))

/* S[r * FA_D1_BK + j] = scale * K[j] . q[r] (int8: times the key's scale later, in the
 * softmax), j < nb rounded up to the group, r < R <= RP.  Keys past nb re-read key nb - 1
 * (the softmax masks them).  Meanwhile rows [0, nn) of Kpf (the next block) are prefetched a
 * key group at a time (V's: during P·V, fa_lp5_pv_). */
FA_LP5_INL void fa_lp5_scores_(const int KIND, const int RP, const float *q, ptrdiff_t ldq,
                               int R, ptrdiff_t E, const void *K, ptrdiff_t ldk, ptrdiff_t nb,
                               float scale, float *S, const void *Kpf, ptrdiff_t nn, int kind)
{
    const int KG = 16 / RP;
    const ptrdiff_t item = KIND == FA_KV_I8 ? 1 : 2;
    const float *qr[4];
    for (int r = 0; r < RP; r++) qr[r] = q + (r < R ? r : R - 1) * ldq;
    for (ptrdiff_t j0 = 0; j0 < nb; j0 += KG) {
        for (ptrdiff_t j = j0; j < j0 + KG && j < nn; j++)
            fa_prefetch(fa_lp_row_(KIND, Kpf, ldk, j), E * item, kind);
        const void *kr[16];
        for (int kk = 0; kk < KG; kk++)
            kr[kk] = fa_lp_row_(KIND, K, ldk, j0 + kk < nb ? j0 + kk : nb - 1);
        __m512 acc[16];
        for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
        for (ptrdiff_t e = 0; e < E; e += 16) {
            __m512 qv[4];
            for (int r = 0; r < RP; r++) {
                qv[r] = _mm512_loadu_ps(qr[r] + e);
                FA_LP5_KEEP(qv[r]);
            }
            for (int kk = 0; kk < KG; kk++) {
                const __m512 kv = fa_lp5_load16_(KIND, kr[kk], e);
                for (int r = 0; r < RP; r++)
                    acc[FA_LP5_ACC(KG, kk, r)] =
                        _mm512_fmadd_ps(kv, qv[r], acc[FA_LP5_ACC(KG, kk, r)]);
            }
        }
        float buf[16] __attribute__((aligned(64)));
        _mm512_store_ps(buf, _mm512_mul_ps(fa_hsum16_(acc), _mm512_set1_ps(scale)));
        for (int r = 0; r < R && r < RP; r++) {       /* row r: lanes [r * KG, r * KG + KG) */
            float *s = S + r * FA_D1_BK + j0;
            if (KG == 16)
                _mm512_storeu_ps(s, _mm512_load_ps(buf));
            else if (KG == 8)
                _mm256_storeu_ps(s, _mm256_load_ps(buf + 8 * r));
            else
                _mm_storeu_ps(s, _mm_load_ps(buf + 4 * r));
        }
    }
}

/* vectors per P·V column panel for R rows: R x NV accumulators + NV row vectors + one
 * broadcast fit the 32 zmm registers */
FA_LP5_INL int fa_lp5_nvmax_(int R) { return R <= 2 ? 8 : R <= 6 ? 4 : 2; }

/* O[r][c0 : c0 + NV*16) += sum_j P[r * FA_D1_BK + j] V[j][...], V converted once per key for
 * all rows.  Meanwhile the same columns of rows [0, npf) of Vpf (the next block) are
 * prefetched, a row per key: so each panel prefetches its share, and the core keeps asking
 * memory for the next block all through P·V.  (With V's prefetch in the scores, along with
 * K's, nothing was requested during P·V, ~40% of a block's time; C harness, int8, GQA 4 rows,
 * d = 128, flash layout, one thread from DRAM: see fa_lp5_block_.) */
FA_LP5_INL void fa_lp5_pv_(const int KIND, const int R, const int NV, const float *P,
                           ptrdiff_t n, const void *V, ptrdiff_t ldv, ptrdiff_t c0, float *O,
                           ptrdiff_t ldo, const void *Vpf, ptrdiff_t npf, int kind)
{
    const ptrdiff_t item = KIND == FA_KV_I8 ? 1 : 2;
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_PV_CHUNK) {
        const ptrdiff_t j1 = n - j0 < FA_D1_PV_CHUNK ? n : j0 + FA_D1_PV_CHUNK;
        __m512 acc[24];
        for (int a = 0; a < R * NV; a++) acc[a] = _mm512_setzero_ps();
        for (ptrdiff_t j = j0; j < j1; j++) {
            const void *vr = fa_lp_row_(KIND, V, ldv, j);
            if (j < npf)
                fa_prefetch((const char *)fa_lp_row_(KIND, Vpf, ldv, j) + c0 * item,
                            16 * NV * item, kind);
            __m512 vv[8];
            for (int v = 0; v < NV; v++) {
                vv[v] = fa_lp5_load16_(KIND, vr, c0 + 16 * v);
                FA_LP5_KEEP(vv[v]);
            }
            for (int r = 0; r < R; r++) {
                const __m512 pj = _mm512_set1_ps(P[r * FA_D1_BK + j]);
                for (int v = 0; v < NV; v++)
                    acc[r * NV + v] = _mm512_fmadd_ps(pj, vv[v], acc[r * NV + v]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) {
                float *o = O + r * ldo + c0 + 16 * v;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[r * NV + v]));
            }
    }
}

FA_LP5_INL void fa_lp5_pv_cols_(const int KIND, const int R, const float *P, ptrdiff_t n,
                                const void *V, ptrdiff_t ldv, ptrdiff_t Ev, float *O,
                                ptrdiff_t ldo, const void *Vpf, ptrdiff_t npf, int kind)
{
    const int NVMAX = fa_lp5_nvmax_(R);
    for (ptrdiff_t c0 = 0; c0 < Ev; c0 += 16 * NVMAX) {
        const ptrdiff_t left = (Ev - c0) / 16;
        const int nv = left < NVMAX ? (int)left : NVMAX;
#define FA_LP5_PV(NVX) fa_lp5_pv_(KIND, R, NVX, P, n, V, ldv, c0, O, ldo, Vpf, npf, kind)
        switch (nv) {
        case 1: FA_LP5_PV(1); break;
        case 2: FA_LP5_PV(NVMAX >= 2 ? 2 : 1); break;
        case 3: FA_LP5_PV(NVMAX >= 3 ? 3 : 1); break;
        case 4: FA_LP5_PV(NVMAX >= 4 ? 4 : 1); break;
        case 5: FA_LP5_PV(NVMAX >= 5 ? 5 : 1); break;
        case 6: FA_LP5_PV(NVMAX >= 6 ? 6 : 1); break;
        case 7: FA_LP5_PV(NVMAX >= 7 ? 7 : 1); break;
        default: FA_LP5_PV(NVMAX >= 8 ? 8 : 1); break;
        }
#undef FA_LP5_PV
    }
}

/* P·V as a function of its own per kind and row count: inlined into the block, it kept
 * only 15 accumulators in registers and spilled the rest (the block's constants, hoisted out
 * of the loops, held a dozen zmm registers all along) */
#define FA_LP5_PV_FN(KK, RR)                                                                 \
    static __attribute__((noinline)) FA_LP5 void fa_lp5_pv_##KK##_##RR(                      \
        const float *P, ptrdiff_t n, const void *V, ptrdiff_t ldv, ptrdiff_t Ev, float *O,    \
        ptrdiff_t ldo, const void *Vpf, ptrdiff_t npf, int kind)                              \
    {                                                                                         \
        fa_lp5_pv_cols_(KK, RR, P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind);                    \
    }
#define FA_LP5_PV_FNS(KK)                                                                    \
    FA_LP5_PV_FN(KK, 1) FA_LP5_PV_FN(KK, 2) FA_LP5_PV_FN(KK, 3) FA_LP5_PV_FN(KK, 4)          \
    FA_LP5_PV_FN(KK, 5) FA_LP5_PV_FN(KK, 6) FA_LP5_PV_FN(KK, 7) FA_LP5_PV_FN(KK, 8)
FA_LP5_PV_FNS(1)
FA_LP5_PV_FNS(2)
FA_LP5_PV_FNS(3)
#undef FA_LP5_PV_FNS
#undef FA_LP5_PV_FN

FA_LP5_INL void fa_lp5_pv_any_(const int KIND, const int R, const float *P, ptrdiff_t n,
                               const void *V, ptrdiff_t ldv, ptrdiff_t Ev, float *O,
                               ptrdiff_t ldo, const void *Vpf, ptrdiff_t npf, int kind)
{
#define FA_LP5_PV_R(KK)                                                                      \
    switch (R) {                                                                             \
    case 1: fa_lp5_pv_##KK##_1(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                             \
    case 2: fa_lp5_pv_##KK##_2(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                             \
    case 3: fa_lp5_pv_##KK##_3(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                             \
    case 4: fa_lp5_pv_##KK##_4(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                             \
    case 5: fa_lp5_pv_##KK##_5(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                             \
    case 6: fa_lp5_pv_##KK##_6(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                             \
    case 7: fa_lp5_pv_##KK##_7(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                             \
    default: fa_lp5_pv_##KK##_8(P, n, V, ldv, Ev, O, ldo, Vpf, npf, kind); break;                            \
    }
    if (KIND == 1) {
        FA_LP5_PV_R(1)
    } else if (KIND == 2) {
        FA_LP5_PV_R(2)
    } else {
        FA_LP5_PV_R(3)
    }
#undef FA_LP5_PV_R
}

/* One block of nb <= FA_D1_BK keys for R rows; meanwhile rows [0, npf) of the next block
 * (Kpf / Vpf, same strides) are prefetched with `kind` (fa_prefetch). */
FA_LP5_INL void fa_lp5_block_(const int KIND, const int R, const float *q, ptrdiff_t ldq,
                              const void *Kb, ptrdiff_t ldk, const void *Vb, ptrdiff_t ldv,
                              const float *ks, ptrdiff_t ldks, const float *vs, ptrdiff_t ldvs,
                              ptrdiff_t nb, ptrdiff_t E, ptrdiff_t Ev, float scale, float *m,
                              double *l, float *O, ptrdiff_t ldo, int kind, const void *Kpf,
                              const void *Vpf, ptrdiff_t npf)
{
    float P[FA_DG_MAXR * FA_D1_BK] __attribute__((aligned(64)));
    const int ng = (int)((nb + 15) / 16);
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int rows = R - r0 < 4 ? R - r0 : 4;
        float *S = P + r0 * FA_D1_BK;
        const ptrdiff_t nn = r0 ? 0 : npf;             /* the prefetch: in the first pass */
#define FA_LP5_SC(RPX) fa_lp5_scores_(KIND, RPX, q + r0 * ldq, ldq, rows, E, Kb, ldk, nb, \
                                      scale, S, Kpf, nn, kind)
        if (rows == 1)
            FA_LP5_SC(1);
        else if (rows == 2)
            FA_LP5_SC(2);
        else
            FA_LP5_SC(4);
#undef FA_LP5_SC
    }
    /* int8: the block's scales side by side; 0 past nb, so that the masked keys' weights
     * stay 0 (exp(-inf) * 0) */
    float ksc[FA_D1_BK] __attribute__((aligned(64))), vsc[FA_D1_BK] __attribute__((aligned(64)));
    if (KIND == FA_KV_I8) {
        for (ptrdiff_t j = 0; j < nb; j++) {
            ksc[j] = ks[j * ldks];
            vsc[j] = vs[j * ldvs];
        }
        for (ptrdiff_t j = nb; j < 16 * ng; j++) ksc[j] = vsc[j] = 0.0f;
    }
    for (int r = 0; r < R; r++) {
        __m512 s[FA_D1_BK / 16];
        __m512 mx = ninf;
        for (int g = 0; g < ng; g++) {
            s[g] = _mm512_load_ps(P + r * FA_D1_BK + 16 * g);
            if (KIND == FA_KV_I8)                   /* the keys' scales, after the dots */
                s[g] = _mm512_mul_ps(s[g], _mm512_load_ps(ksc + 16 * g));
            if (16 * g + 16 > nb)                   /* keys past the end: -inf */
                s[g] = _mm512_mask_blend_ps((__mmask16)((1u << (nb - 16 * g)) - 1), ninf, s[g]);
            mx = _mm512_max_ps(s[g], mx);           /* a NaN score is not the max (avx2's rule) */
        }
        const float bm = _mm512_reduce_max_ps(mx);
        const float mn = bm > m[r] ? bm : m[r];
        const float mu = mn == -__builtin_inff() ? 0.0f : mn;
        const float alpha = fa_expf(m[r] - mu);
        __m512 sum = _mm512_setzero_ps();
        for (int g = 0; g < ng; g++) {
            __m512 p = fa_d1_vexp_(_mm512_sub_ps(s[g], _mm512_set1_ps(mu)));
            sum = _mm512_add_ps(sum, p);
            if (KIND == FA_KV_I8)                   /* P·V weights: p_j * v_scale[j] */
                p = _mm512_mul_ps(p, _mm512_load_ps(vsc + 16 * g));
            _mm512_store_ps(P + r * FA_D1_BK + 16 * g, p);
        }
        l[r] = l[r] * alpha + (double)_mm512_reduce_add_ps(sum);
        m[r] = mn;
        if (alpha != 1.0f) {                        /* rescale O once per block */
            float *o = O + r * ldo;
            const __m512 av = _mm512_set1_ps(alpha);
            for (ptrdiff_t c = 0; c < Ev; c += 16)
                _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), av));
        }
    }
    fa_lp5_pv_any_(KIND, R, P, nb, Vb, ldv, Ev, O, ldo, Vpf, npf, kind);
}

#define FA_LP5_CASE(KK, RR)                                                                 \
    case RR:                                                                                \
        fa_lp5_block_(KK, RR, q, ldq, fa_lp_row_(KK, K, ldk, j0), ldk,                      \
                      fa_lp_row_(KK, V, ldv, j0), ldv, ks ? ks + j0 * ldks : ks, ldks,      \
                      vs ? vs + j0 * ldvs : vs, ldvs, nb, E, Ev, scale, m, l, O, ldo,       \
                      pf_kind, fa_lp_row_(KK, Kpf, ldk, j0), fa_lp_row_(KK, Vpf, ldv, j0),  \
                      nn);                                                                  \
        break;
#define FA_LP5_ROWS(KK)                                                                     \
    switch (R) {                                                                            \
    FA_LP5_CASE(KK, 1) FA_LP5_CASE(KK, 2) FA_LP5_CASE(KK, 3) FA_LP5_CASE(KK, 4)             \
    FA_LP5_CASE(KK, 5) FA_LP5_CASE(KK, 6) FA_LP5_CASE(KK, 7) default: FA_LP5_CASE(KK, 8)    \
    }

/* fa_decode_lowp_avx2's contract, E % 16 == Ev % 16 == 0 (fa_decode_lowp512_available) */
static FA_LP5 void fa_decode_lowp_avx512(int kv_kind, int R, const float *q, ptrdiff_t ldq,
                                         const void *K, ptrdiff_t ldk, const void *V,
                                         ptrdiff_t ldv, const float *ks, ptrdiff_t ldks,
                                         const float *vs, ptrdiff_t ldvs, ptrdiff_t n,
                                         ptrdiff_t E, ptrdiff_t Ev, float scale, float *m_io,
                                         float *l_io, float *O, ptrdiff_t ldo, int pf_kind,
                                         const void *Kpf, const void *Vpf, ptrdiff_t npf)
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
            FA_LP5_ROWS(FA_KV_F16)
        } else if (kv_kind == FA_KV_BF16) {
            FA_LP5_ROWS(FA_KV_BF16)
        } else {
            FA_LP5_ROWS(FA_KV_I8)
        }
    }
    for (int r = 0; r < R; r++) {
        m_io[r] = m[r];
        l_io[r] = (float)l[r];
    }
}
#undef FA_LP5_ROWS
#undef FA_LP5_CASE

/* this kernel serves a call: the AVX-512 copy is selected (FASTATTN_SIMD / set_simd may force
 * a lower one), both head dims are multiples of 16 */
static inline int fa_decode_lowp512_available(ptrdiff_t E, ptrdiff_t Ev)
{
    return FA_OPS_F == &fa_ops_f_avx512 && E > 0 && Ev > 0 && E % 16 == 0 && Ev % 16 == 0;
}

#else
static inline int fa_decode_lowp512_available(ptrdiff_t E, ptrdiff_t Ev)
{
    (void)E; (void)Ev;
    return 0;
}
static inline __attribute__((unused)) void fa_decode_lowp_avx512(int kv_kind, int R, const float *q, ptrdiff_t ldq,
                                         const void *K, ptrdiff_t ldk, const void *V,
                                         ptrdiff_t ldv, const float *ks, ptrdiff_t ldks,
                                         const float *vs, ptrdiff_t ldvs, ptrdiff_t n,
                                         ptrdiff_t E, ptrdiff_t Ev, float scale, float *m_io,
                                         float *l_io, float *O, ptrdiff_t ldo, int pf_kind,
                                         const void *Kpf, const void *Vpf, ptrdiff_t npf)
{
    (void)kv_kind; (void)R; (void)q; (void)ldq; (void)K; (void)ldk; (void)V; (void)ldv;
    (void)ks; (void)ldks; (void)vs; (void)ldvs; (void)n; (void)E; (void)Ev; (void)scale;
    (void)m_io; (void)l_io; (void)O; (void)ldo; (void)pf_kind; (void)Kpf; (void)Vpf; (void)npf;
}
#endif

/* Which copy serves a call with these head dims at the selected SIMD level: 2 this one, 1
 * fa_decode_lowp.h's AVX2 copy, 0 none (the general path converts a key block at a time). */
static inline int fa_decode_lowp_copy(ptrdiff_t E, ptrdiff_t Ev)
{
    return fa_decode_lowp512_available(E, Ev) ? 2 : fa_decode_lowp_available(E, Ev) ? 1 : 0;
}

/* fa_decode_lowp_avx2's contract; runs the copy fa_decode_lowp_copy names (not 0) */
static inline void fa_decode_lowp(int kv_kind, int R, const float *q, ptrdiff_t ldq,
                                  const void *K, ptrdiff_t ldk, const void *V, ptrdiff_t ldv,
                                  const float *ks, ptrdiff_t ldks, const float *vs,
                                  ptrdiff_t ldvs, ptrdiff_t n, ptrdiff_t E, ptrdiff_t Ev,
                                  float scale, float *m_io, float *l_io, float *O,
                                  ptrdiff_t ldo, int pf_kind, const void *Kpf, const void *Vpf,
                                  ptrdiff_t npf)
{
    if (fa_decode_lowp512_available(E, Ev))
        fa_decode_lowp_avx512(kv_kind, R, q, ldq, K, ldk, V, ldv, ks, ldks, vs, ldvs, n, E, Ev,
                              scale, m_io, l_io, O, ldo, pf_kind, Kpf, Vpf, npf);
    else
        fa_decode_lowp_avx2(kv_kind, R, q, ldq, K, ldk, V, ldv, ks, ldks, vs, ldvs, n, E, Ev,
                            scale, m_io, l_io, O, ldo, pf_kind, Kpf, Vpf, npf);
}
#endif /* FA_DECODE_LOWP512_H */
