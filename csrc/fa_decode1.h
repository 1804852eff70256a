/*
 * fa_decode1.h -- decode for ONE query row per KV head (MHA decode: Hq = Hkv, L = 1),
 * float32, AVX-512; other ISAs and dtypes keep the general decode path (decode.pxi).
 *
 * Why: the general path stores scores as S[key][lane] in lane blocks one vector wide, so
 * with one real row the softmax computed 16 exps per key, P·V ran a register tile per key
 * and the per-block bookkeeping (colmax, lane setup, slices between prefetches) came every
 * 48 keys.  GPT-2-small decode (12 heads, d = 64, cache in L2/L3) ran at ~70 cycles per key,
 * compute-bound, where streaming a key's 512 bytes from L3 takes ~16.  Here, per block of
 * FA_D1_BK keys:
 *   scores   16 keys at a time as dot products along e; fa_hsum16_ sums the 16 accumulators
 *            across lanes, so a block's scores are FA_D1_BK/16 vectors in key order;
 *   softmax  along the keys: one exp per 16 keys; block max and sum are vector reductions;
 *   P·V      o += p_j * V[j], p_j broadcast, in chunks of 32 keys summed in fresh registers
 *            and then added to O (the general path's order: float32 accuracy on long caches).
 * The caller guarantees: no mask, no softcap, no ALiBi, no dropout, and every key of [0, n)
 * allowed (for one row a causal/window band is just a key range, clipped by the caller).
 * State in/out is the general path's (running max m, sum l, unnormalised O[Ev]), so the
 * caller's finish and split-merge code serve both.
 */
#ifndef FA_DECODE1_H
#define FA_DECODE1_H
#include "fa_kernels.h"

#define FA_D1_BK 64                       /* keys per block: 4 score vectors */
#define FA_D1_PV_CHUNK 32                 /* keys summed in registers before adding to O */

#if FA_HAVE_X86_VARIANTS

/* exp for x <= 0 or -inf or NaN: the AVX-512 softmax's algorithm (fa_exp.h, vscalefps;
 * lanes below FA_EXPF_LO_Z, -inf included, come out as exactly 0, NaN stays NaN) */
static inline __attribute__((always_inline)) FA_A512 __m512 fa_d1_vexp_(__m512 x)
{
    __m512 t = x * FA_LOG2E_F + FA_EXPF_MAGIC;
    __m512 n = t - FA_EXPF_MAGIC;
    __m512 r = x - n * FA_LN2HI_F;
    r = r - n * FA_LN2LO_F;
    __m512 p = FA_EXPF_POLY(r);
    return _mm512_maskz_scalef_ps(
        _mm512_cmp_ps_mask(x, _mm512_set1_ps(FA_EXPF_LO_Z), _CMP_NLT_UQ), p, n);
}

/* Prefetch rows [j0, j1) of X (row length `len`, stride ld) with prefetch kind `kind` (the
 * caller points X ahead of the rows being computed): a cache that does not fit the caches
 * streams from DRAM, and the hardware prefetcher alone left the core waiting (the general
 * path's finding, decode.pxi) */
static inline __attribute__((always_inline)) void fa_d1_prefetch_(const float *X, ptrdiff_t ld,
                                                                  ptrdiff_t len, ptrdiff_t j0,
                                                                  ptrdiff_t j1, int kind)
{
    for (ptrdiff_t j = j0; j < j1; j++) fa_prefetch(X + j * ld, len * (ptrdiff_t)sizeof(float), kind);
}

/* s = scale * K[j0 + i] . q for i < 16 (keys past n re-read key n - 1; the caller masks).
 * NE = ceil(E / 16) <= 8 vectors per key row, a compile-time constant at each call (the last
 * one under `tail`): q stays in NE registers and the loop runs key by key with one row
 * pointer.  (With the loop over e outermost, 16 live row pointers spilled registers: ~30
 * cycles per key at E = 64.) */
static inline __attribute__((always_inline)) FA_A512 __m512
fa_d1_scores16_(const int NE, const float *q, __mmask16 tail, const float *K, ptrdiff_t ldk,
                ptrdiff_t j0, ptrdiff_t n, float scale)
{
    __m512 qv[8];
    for (int v = 0; v < NE; v++) qv[v] = _mm512_maskz_loadu_ps(v == NE - 1 ? tail : 0xFFFF, q + 16 * v);
    __m512 acc[16];
    /* fa_hsum16_ puts the sum of acc[4l + c] in lane 4c + l: key kk goes to accumulator
     * a = 4 (kk & 3) + (kk >> 2), so that lane i ends up holding key i.  The keys are read in
     * their order (kk), not the accumulators': walking the accumulators read rows 0, 4, 8,
     * 12, 1, 5, ... of the group, and the kernel streamed an MHA decode's K and V from L3 at
     * 70-80 GB/s against 84-91 in key order (a C harness calling it alone, one thread, 12
     * heads x 1024 keys, d = 64, Zen 4; the same bits). */
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; kk++) {
        const int a = 4 * (kk & 3) + (kk >> 2);
        ptrdiff_t j = j0 + kk;
        const float *kr = K + (j < n ? j : n - 1) * ldk;
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(NE == 1 ? tail : 0xFFFF, kr), qv[0]);
        for (int v = 1; v < NE; v++)
            x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(v == NE - 1 ? tail : 0xFFFF, kr + 16 * v),
                                qv[v], x);
        acc[a] = x;
    }
    return _mm512_mul_ps(fa_hsum16_(acc), _mm512_set1_ps(scale));
}

/* the same for E > 128: e outermost, one q vector at a time */
static inline __attribute__((always_inline)) FA_A512 __m512
fa_d1_scores16_long_(const float *q, ptrdiff_t E, const float *K, ptrdiff_t ldk, ptrdiff_t j0,
                     ptrdiff_t n, float scale)
{
    __m512 acc[16];
    for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
    for (ptrdiff_t e0 = 0; e0 < E; e0 += 16) {
        const __mmask16 m = E - e0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (E - e0)) - 1);
        const __m512 qv = _mm512_maskz_loadu_ps(m, q + e0);
        for (int kk = 0; kk < 16; kk++) {            /* keys in order, as above */
            const int a = 4 * (kk & 3) + (kk >> 2);
            ptrdiff_t j = j0 + kk;
            acc[a] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, K + (j < n ? j : n - 1) * ldk + e0),
                                     qv, acc[a]);
        }
    }
    return _mm512_mul_ps(fa_hsum16_(acc), _mm512_set1_ps(scale));
}

static FA_A512 __m512 fa_d1_scores_(const float *q, ptrdiff_t E, const float *K, ptrdiff_t ldk,
                                    ptrdiff_t j0, ptrdiff_t n, float scale)
{
    const __mmask16 tail = (E & 15) ? (__mmask16)((1u << (E & 15)) - 1) : (__mmask16)0xFFFF;
    switch ((E + 15) / 16) {
    case 1: return fa_d1_scores16_(1, q, tail, K, ldk, j0, n, scale);
    case 2: return fa_d1_scores16_(2, q, tail, K, ldk, j0, n, scale);
    case 3: return fa_d1_scores16_(3, q, tail, K, ldk, j0, n, scale);
    case 4: return fa_d1_scores16_(4, q, tail, K, ldk, j0, n, scale);
    case 5: return fa_d1_scores16_(5, q, tail, K, ldk, j0, n, scale);
    case 6: return fa_d1_scores16_(6, q, tail, K, ldk, j0, n, scale);
    case 7: return fa_d1_scores16_(7, q, tail, K, ldk, j0, n, scale);
    case 8: return fa_d1_scores16_(8, q, tail, K, ldk, j0, n, scale);
    default: return fa_d1_scores16_long_(q, E, K, ldk, j0, n, scale);
    }
}

/* O[0 : NVX*16) (last vector under mask `last`) = alpha*O + sum_j P[j] V[j], keys in
 * chunks of FA_D1_PV_CHUNK; NVX is a compile-time constant at each call (always_inline) */
static inline __attribute__((always_inline)) FA_A512 void
fa_d1_pv_(const int NVX, const float *P, ptrdiff_t n, const float *V, ptrdiff_t ldv, float *O,
          __mmask16 last, float alpha, const float *Vpf, ptrdiff_t npf, ptrdiff_t Ev, int kind)
{
    __m512 o[8];
    const __m512 av = _mm512_set1_ps(alpha);
    for (int v = 0; v < NVX; v++)
        o[v] = _mm512_mul_ps(_mm512_maskz_loadu_ps(v == NVX - 1 ? last : 0xFFFF, O + 16 * v), av);
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_PV_CHUNK) {
        const ptrdiff_t j1 = n - j0 < FA_D1_PV_CHUNK ? n : j0 + FA_D1_PV_CHUNK;
        __m512 acc[8];
        for (int v = 0; v < NVX; v++) acc[v] = _mm512_setzero_ps();
        for (ptrdiff_t j = j0; j < j1; j++) {
            const __m512 pj = _mm512_set1_ps(P[j]);
            const float *vr = V + j * ldv;
            if (j < npf) fa_d1_prefetch_(Vpf, ldv, Ev, j, j + 1, kind);
            for (int v = 0; v < NVX; v++)
                acc[v] = _mm512_fmadd_ps(
                    pj, _mm512_maskz_loadu_ps(v == NVX - 1 ? last : 0xFFFF, vr + 16 * v), acc[v]);
        }
        for (int v = 0; v < NVX; v++) o[v] = _mm512_add_ps(o[v], acc[v]);
    }
    for (int v = 0; v < NVX; v++)
        _mm512_mask_storeu_ps(O + 16 * v, v == NVX - 1 ? last : 0xFFFF, o[v]);
}

/* ... for every column; the first pass also prefetches rows [0, npf) of Vpf (the next block) */
static FA_A512 void fa_d1_pv_cols_(const float *P, ptrdiff_t n, const float *V, ptrdiff_t ldv,
                                   ptrdiff_t Ev, float *O, float alpha, const float *Vpf,
                                   ptrdiff_t npf, int kind)
{

    for (ptrdiff_t c0 = 0; c0 < Ev; c0 += 128) {     /* up to 8 column vectors at a time */
        ptrdiff_t cols = Ev - c0 < 128 ? Ev - c0 : 128;
        int nv = (int)((cols + 15) / 16);
        __mmask16 last = (cols & 15) ? (__mmask16)((1u << (cols & 15)) - 1) : (__mmask16)0xFFFF;
        const float *Vc = V + c0;
        float *Oc = O + c0;
        switch (nv) {
        case 1: fa_d1_pv_(1, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        case 2: fa_d1_pv_(2, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        case 3: fa_d1_pv_(3, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        case 4: fa_d1_pv_(4, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        case 5: fa_d1_pv_(5, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        case 6: fa_d1_pv_(6, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        case 7: fa_d1_pv_(7, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        default: fa_d1_pv_(8, P, n, Vc, ldv, Oc, last, alpha, Vpf, c0 ? 0 : npf, Ev, kind); break;
        }
    }
}

/* One query row q[E] against keys [0, n) of K (stride ldk) and V (stride ldv), updating the
 * online-softmax state *m, *l and O[Ev] (unnormalised; l in double: the caller rounds it
 * once, after its last call, so keys walked in several calls of whole blocks sum as in one
 * call -- decode.pxi's walk of side-by-side heads gives the bits of the head-by-head walk).
 * Meanwhile the block of keys
 * [j0, j0 + nb) prefetches rows [j0, j0 + nb) of Kpf / Vpf (same strides) below npf, with
 * prefetch kind pf_kind (fa_prefetch; 0 none): the caller points them `ahead` keys on (or at
 * the next page of a paged cache).
 * NE, NV > 0: E = 16 NE and Ev = 16 NV, known at compile time (the common head dims, below),
 * so every row load is a whole vector and folds into its FMA; 0: any E, Ev (masked last
 * vectors, the per-call dispatch of fa_d1_scores_ / fa_d1_pv_cols_).  Same operations in the
 * same order either way, so the same bits. */
static inline __attribute__((always_inline)) FA_A512 void
fa_d1_loop_(const int NE, const int NV, const float *q, const float *K, ptrdiff_t ldk,
            const float *V, ptrdiff_t ldv, ptrdiff_t n, ptrdiff_t E, ptrdiff_t Ev, float scale,
            float *m_io, double *l_io, float *O, int pf_kind, const float *Kpf,
            const float *Vpf, ptrdiff_t npf)
{
    float m = *m_io;
    double l = *l_io;             /* one add per block: kept in double across blocks and calls */
    float P[FA_D1_BK] __attribute__((aligned(64)));
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_BK) {
        const ptrdiff_t nb = n - j0 < FA_D1_BK ? n - j0 : FA_D1_BK;
        const int ng = (int)((nb + 15) / 16);
        const float *Kb = K + j0 * ldk;
        __m512 s[FA_D1_BK / 16];
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        /* the next block, spread over this one: its K rows during the scores, its V rows
         * key by key during P·V (one burst per block stalled on full fill buffers) */
        const ptrdiff_t left = npf - j0;
        const ptrdiff_t nn = pf_kind && left > 0 ? (left < nb ? left : nb) : 0;
        for (int g = 0; g < ng; g++) {
            if (16 * g < nn)
                fa_d1_prefetch_(Kpf + j0 * ldk, ldk, E, 16 * g,
                                16 * g + 16 < nn ? 16 * g + 16 : nn, pf_kind);
            s[g] = NE ? fa_d1_scores16_(NE, q, (__mmask16)0xFFFF, Kb, ldk, 16 * g, nb, scale)
                      : fa_d1_scores_(q, E, Kb, ldk, 16 * g, nb, scale);
            if (16 * g + 16 > nb)                   /* keys past the end: -inf */
                s[g] = _mm512_mask_blend_ps((__mmask16)((1u << (nb - 16 * g)) - 1),
                                            _mm512_set1_ps(-__builtin_inff()), s[g]);
            /* max_ps(s, mx) returns mx where s is NaN: a NaN score is not the max, it turns
             * its exp, hence l and the row, into NaN (the general path's rule) */
            mx = _mm512_max_ps(s[g], mx);
        }
        const float bm = _mm512_reduce_max_ps(mx);
        const float mn = bm > m ? bm : m;
        const float mu = mn == -__builtin_inff() ? 0.0f : mn;   /* no key yet: exp -> 0 */
        const float alpha = fa_expf(m - mu);
        __m512 sum = _mm512_setzero_ps();
        for (int g = 0; g < ng; g++) {
            __m512 p = fa_d1_vexp_(_mm512_sub_ps(s[g], _mm512_set1_ps(mu)));
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(P + 16 * g, p);
        }
        l = l * alpha + (double)_mm512_reduce_add_ps(sum);
        m = mn;
        if (NV)
            fa_d1_pv_(NV, P, nb, V + j0 * ldv, ldv, O, (__mmask16)0xFFFF, alpha,
                      Vpf + j0 * ldv, nn, Ev, pf_kind);
        else
            fa_d1_pv_cols_(P, nb, V + j0 * ldv, ldv, Ev, O, alpha, Vpf + j0 * ldv, nn,
                           pf_kind);
    }
    *m_io = m;
    *l_io = l;
}

/* fa_d1_loop_ for d = 64 and 128 compiled for that head dim: a C harness calling the kernel
 * (12 heads x 1024 keys, d = 64, one thread, Zen 4, the extension's flags, E and the other
 * arguments read at run time) took 88.5-90 us median with the general loop and 79-80 with
 * this copy, six alternating runs: where E was a compile-time constant the harness had been
 * timing the compiler's specialised clone all along (fastattn ran the general loop). */
static FA_A512 void fa_decode1_f_avx512(const float *q, const float *K, ptrdiff_t ldk,
                                        const float *V, ptrdiff_t ldv, ptrdiff_t n,
                                        ptrdiff_t E, ptrdiff_t Ev, float scale, float *m_io,
                                        double *l_io, float *O, int pf_kind,
                                        const float *Kpf, const float *Vpf, ptrdiff_t npf)
{
    if (E == 64 && Ev == 64)
        fa_d1_loop_(4, 4, q, K, ldk, V, ldv, n, E, Ev, scale, m_io, l_io, O, pf_kind, Kpf,
                    Vpf, npf);
    else if (E == 128 && Ev == 128)
        fa_d1_loop_(8, 8, q, K, ldk, V, ldv, n, E, Ev, scale, m_io, l_io, O, pf_kind, Kpf,
                    Vpf, npf);
    else
        fa_d1_loop_(0, 0, q, K, ldk, V, ldv, n, E, Ev, scale, m_io, l_io, O, pf_kind, Kpf,
                    Vpf, npf);
}

static inline int fa_decode1_available(void) { return FA_OPS_F == &fa_ops_f_avx512; }

#else
static inline int fa_decode1_available(void) { return 0; }
static inline void fa_decode1_f_avx512(const float *q, const float *K, ptrdiff_t ldk,
                                       const float *V, ptrdiff_t ldv, ptrdiff_t n, ptrdiff_t E,
                                       ptrdiff_t Ev, float scale, float *m_io, double *l_io,
                                       float *O, int pf_kind, const float *Kpf,
                                       const float *Vpf, ptrdiff_t npf) { (void)q;
    (void)K; (void)ldk; (void)Kpf; (void)Vpf; (void)npf;
    (void)V; (void)ldv; (void)n; (void)E; (void)Ev; (void)scale; (void)m_io; (void)l_io;
    (void)O; (void)pf_kind; }
#endif
#endif /* FA_DECODE1_H */
