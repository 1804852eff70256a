/*
 * fa_decode_avx2.h -- decode for R = 1..FA_DG_MAXR query rows that share one position (MHA
 * decode: R = 1; GQA decode: the G rows of a KV group), float32, AVX2 + FMA.  The AVX-512
 * kernels are fa_decode1.h / fa_decodeg.h; this is their algorithm for 8-lane vectors, for
 * the many CPUs without AVX-512 (Zen 2/3, most Intel client parts).
 *
 * Why: without it an AVX2 machine took the general path (decode.pxi -> attend_block), which
 * vectorizes over query lanes: with one real row in 8 lanes, 7/8 of the Q·Kᵀ FMAs, the exps
 * and the P·V tile were padding.  Measured on a Zen 3 guest (AMD EPYC, 2 cores), GPT-2-small
 * decode (12 heads, d = 64, S = 1024, cache in L3) ran at 1.9x torch's time, compute-bound.
 * Here, per block of FA_D1_BK keys:
 *   scores   as dot products along e, 8 accumulators summed across lanes by fa_d2_hsum8_:
 *            one row: 8 keys at a time, a block's scores are FA_D1_BK/8 vectors in key order;
 *            more rows: groups of 8/RP keys x RP = 2 or 4 rows, each K row loaded once for
 *            all of them (1.15-1.3x faster than row by row at GQA 4 rows, d = 128);
 *   softmax  per row along the keys: one exp per 8 keys; max and sum are vector reductions;
 * then one P·V pass over the block's V rows for all rows at once (each V row loaded once per
 * column panel, R x NV accumulators), in chunks of FA_D1_PV_CHUNK keys summed in fresh
 * registers and then added to O (float32 accuracy on long caches, as fa_decode1.h).
 * Head dims must be multiples of 8 (every common one is); others take the general path.
 * State in/out per row: running max m[r], sum l[r], unnormalised O[r * ldo + c], the general
 * path's, so its finish and split-merge code serve this kernel too.
 */
#ifndef FA_DECODE_AVX2_H
#define FA_DECODE_AVX2_H
#include "fa_decodeg.h"

#if FA_HAVE_X86_VARIANTS

#define FA_A2 __attribute__((target("avx2,fma")))
#define FA_D2_INL static inline __attribute__((always_inline)) FA_A2
/* Pin a loaded vector in a register.  Inlined into the big per-R block function, GCC folded
 * the V loads of the P·V loop (and the q loads of the scores) into the FMAs as memory
 * operands, re-reading each vector once per row: 12 loads per 8 FMAs instead of 6, and the
 * load ports, not the FMAs, set the pace (P·V of R = 4, d = 128: ~20 ns a key inlined, by the
 * profile's share, against 12 as a separate function, Zen 4 guest).  An empty asm that
 * "changes" the value stops it: the whole kernel went from 38.8 to 36.9 ns a key in L1. */
#define FA_D2_KEEP(x) __asm__("" : "+x"(x))

/* lane i of the result = the sum of acc[i]'s 8 lanes */
FA_D2_INL __m256 fa_d2_hsum8_(const __m256 *acc)
{
    /* hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    /* u0 = [sum of the low halves of acc 0..3 | sum of their high halves], u1: acc 4..7 */
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

FA_D2_INL float fa_d2_reduce_max_(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

FA_D2_INL float fa_d2_reduce_add_(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* s = scale * K[j0 + i] . q for i < 8 (keys past n re-read key n - 1; the caller masks).
 * E % 8 == 0.  e runs outermost: one q vector feeds 8 independent FMA chains (one per key),
 * which is what two FMA pipes of latency 4 need to stay busy. */
FA_D2_INL __m256 fa_d2_scores8_(const float *q, ptrdiff_t E, const float *K, ptrdiff_t ldk,
                                ptrdiff_t j0, ptrdiff_t n, float scale)
{
    const float *kr[8];
    for (int a = 0; a < 8; a++) kr[a] = K + (j0 + a < n ? j0 + a : n - 1) * ldk;
    __m256 acc[8];
    for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
    for (ptrdiff_t e = 0; e < E; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
#pragma GCC unroll 8
        for (int a = 0; a < 8; a++) acc[a] = _mm256_fmadd_ps(_mm256_loadu_ps(kr[a] + e), qv, acc[a]);
    }
    return _mm256_mul_ps(fa_d2_hsum8_(acc), _mm256_set1_ps(scale));
}

/* S[r * FA_D1_BK + j] = scale * K[j] . q[r] for j < nb and r < R <= RP (RP = 2 or 4): groups
 * of 8/RP keys x RP rows fill the 8 accumulators, so each K row is loaded once for all the
 * rows (row by row, a GQA block's K rows were read R times, from L2 once the block's K and V
 * outgrew L1).  Rows past R repeat row R - 1 and are dropped.  Meanwhile rows [0, nn) of Kpf
 * and (Evpf > 0) of Vpf are prefetched (kind), a key group at a time: V's too in a call of
 * one block, because with V's prefetch left to the first P·V panel (an eighth of the P·V time
 * at R = 4, d = 128) one thread read a DRAM-resident cache at 9-10 GB/s against 13-16 with it
 * here (C harness over fa_decodeg_f_avx2, 64 MB K and V, Zen 4 guest, prefetch one block
 * ahead).  Through the library (two trees interleaved in one process, 1 and 2 threads):
 * 0.70-0.90x the time of GQA 32/8 and 24/8 d = 128 S = 16384, 0.81-0.98x of 8/2 d = 64
 * S = 65536.  (Longer calls now spread V's prefetch over P·V instead: fa_d2_pv_cols_.) */
FA_D2_INL void fa_d2_scores_rows_(const int RP, const float *q, ptrdiff_t ldq, int R,
                                  ptrdiff_t E, const float *K, ptrdiff_t ldk, ptrdiff_t nb,
                                  float scale, float *S, const float *Kpf, ptrdiff_t nn, int kind,
                                  const float *Vpf, ptrdiff_t ldv, ptrdiff_t Evpf)
{
    const int KG = 8 / RP;
    const float *qr[4];
    for (int r = 0; r < RP; r++) qr[r] = q + (r < R ? r : R - 1) * ldq;
    for (ptrdiff_t j0 = 0; j0 < nb; j0 += KG) {
        if (j0 < nn) {
            fa_d1_prefetch_(Kpf, ldk, E, j0, j0 + KG < nn ? j0 + KG : nn, kind);
            fa_d1_prefetch_(Vpf, ldv, Evpf, j0, j0 + KG < nn ? j0 + KG : nn, kind);
        }
        const float *kr[4];
        for (int kk = 0; kk < KG; kk++) kr[kk] = K + (j0 + kk < nb ? j0 + kk : nb - 1) * ldk;
        __m256 acc[8];
        for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
        for (ptrdiff_t e = 0; e < E; e += 8) {
            __m256 qv[4];
            for (int r = 0; r < RP; r++) {
                qv[r] = _mm256_loadu_ps(qr[r] + e);
                FA_D2_KEEP(qv[r]);
            }
            for (int kk = 0; kk < KG; kk++) {
                const __m256 kv = _mm256_loadu_ps(kr[kk] + e);
                for (int r = 0; r < RP; r++)
                    acc[kk * RP + r] = _mm256_fmadd_ps(kv, qv[r], acc[kk * RP + r]);
            }
        }
        float buf[8];
        _mm256_storeu_ps(buf, _mm256_mul_ps(fa_d2_hsum8_(acc), _mm256_set1_ps(scale)));
        for (int kk = 0; kk < KG && j0 + kk < nb; kk++)
            for (int r = 0; r < R; r++) S[r * FA_D1_BK + j0 + kk] = buf[kk * RP + r];
    }
}

/* vectors per P·V column panel for R rows: R x NV accumulators + NV row vectors + one
 * broadcast fit the 16 ymm registers */
FA_D2_INL int fa_d2_nvmax_(int R) { return R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1; }

/* The next block's V rows to prefetch during P·V, in address order within each row: row,
 * line within the row, lines per row, rows left, lines per key step (fa_d2_pv_cols_). */
typedef struct {
    const float *row;
    ptrdiff_t ld, line, lines, rows_left;
    int per_step, kind;
} fa_d2_vpf_;

FA_D2_INL void fa_d2_vpf_step_(fa_d2_vpf_ *c)
{
    for (int u = 0; u < c->per_step && c->rows_left > 0; u++) {
        fa_prefetch(c->row + c->line * 16, 64, c->kind);
        if (++c->line == c->lines) {
            c->line = 0;
            c->row += c->ld;
            c->rows_left--;
        }
    }
}

/* O[r][0 : NV*8) += sum_j P[r * FA_D1_BK + j] V[j] for r < R, keys in chunks of
 * FA_D1_PV_CHUNK; meanwhile, key by key, pf->per_step lines of the next block's V (SPREAD) or
 * rows [0, npf) of Vpf (row length Ev).  R x NV accumulators + NV row vectors + one broadcast
 * fit the 16 ymm registers (fa_d2_nvmax_). */
FA_D2_INL void fa_d2_pv_(const int R, const int NV, const int SPREAD, const float *P,
                         ptrdiff_t n, const float *V, ptrdiff_t ldv, float *O, ptrdiff_t ldo,
                         fa_d2_vpf_ *pf, const float *Vpf, ptrdiff_t npf, ptrdiff_t Ev, int kind)
{
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_PV_CHUNK) {
        const ptrdiff_t j1 = n - j0 < FA_D1_PV_CHUNK ? n : j0 + FA_D1_PV_CHUNK;
        __m256 acc[16];
        for (int a = 0; a < R * NV; a++) acc[a] = _mm256_setzero_ps();
        for (ptrdiff_t j = j0; j < j1; j++) {
            const float *vr = V + j * ldv;
            if (SPREAD)
                fa_d2_vpf_step_(pf);
            else if (j < npf)
                fa_d1_prefetch_(Vpf, ldv, Ev, j, j + 1, kind);
            if (R == 1) {                           /* V rows straight from memory operands */
                const __m256 pj = _mm256_set1_ps(P[j]);
                for (int v = 0; v < NV; v++)
                    acc[v] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * v), acc[v]);
            } else {
                __m256 vv[4];
                for (int v = 0; v < NV; v++) {
                    vv[v] = _mm256_loadu_ps(vr + 8 * v);
                    FA_D2_KEEP(vv[v]);
                }
                for (int r = 0; r < R; r++) {
                    const __m256 pj = _mm256_set1_ps(P[r * FA_D1_BK + j]);
                    for (int v = 0; v < NV; v++)
                        acc[r * NV + v] = _mm256_fmadd_ps(pj, vv[v], acc[r * NV + v]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) {
                float *o = O + r * ldo + 8 * v;
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[r * NV + v]));
            }
    }
}

/* ... for every column: panels of 8 vectors for one row, 4 for two, 2 for three or four, 1
 * above.  Ev % 8 == 0.  Meanwhile rows [0, npf) of Vpf (the next block) are prefetched, row
 * after row: SPREAD, a few lines per key step of every panel; else whole rows, one per key
 * step of the first panel.
 * Why spread: at R = 4, d = 128 P·V takes 55-65% of a block's time (C harness, in L2), and
 * with V's prefetch in the scores (or, R <= 2, in the first panel) the core asked DRAM for
 * nothing during most of it.  The harness (64 MB K and V in one call per thread, 2 threads,
 * variants interleaved in one process, Zen 4 guest on AVX2), GB/s, for a first form that
 * prefetched each panel's own columns of every row: R = 4 22.6 -> 23.3, 28.1 -> 29.5,
 * 24.5 -> 27.9, 24.1 -> 26.3 (four processes); R = 2 26.2 -> 34.0; R = 1 29.3 -> 31.3; one
 * thread, R = 4 14.5 -> 16.2; d = 64, R = 4: 21.4 -> 21.7.  Row after row read as fast or
 * faster (R = 4: 25.9 against 23.7, 26.6 against 24.5).  Spreading K's prefetch over the
 * scores' e loop the same way was slower (R = 4: 22.3 -> 19.7).  Through the library, GQA
 * 32/8 d = 128 (bench/ab_trees.py, two trees interleaved in one process): 0.76-0.83x the time
 * at S = 16384 and 65536 on a quiet host, 0.88-0.97x under load. */
FA_D2_INL void fa_d2_pv_cols_(const int R, const int SPREAD, const float *P, ptrdiff_t n,
                              const float *V, ptrdiff_t ldv, ptrdiff_t Ev, float *O,
                              ptrdiff_t ldo, const float *Vpf, ptrdiff_t npf, int kind)
{
    const int NVMAX = fa_d2_nvmax_(R);
    const ptrdiff_t panels = (Ev + 8 * NVMAX - 1) / (8 * NVMAX);
    /* lines at byte offsets 0, 64, ... < Ev * 4 from each row's start */
    fa_d2_vpf_ pf = {Vpf, ldv, 0, (Ev * (ptrdiff_t)sizeof(float) + 63) / 64, npf, 0, kind};
    if (SPREAD && npf > 0 && n > 0)
        pf.per_step = (int)((npf * pf.lines + panels * n - 1) / (panels * n));
    for (ptrdiff_t c0 = 0; c0 < Ev; c0 += 8 * NVMAX) {
        const ptrdiff_t left = (Ev - c0) / 8;
        const int nv = left < NVMAX ? (int)left : NVMAX;
        const ptrdiff_t np = c0 ? 0 : npf;
        const float *Vc = V + c0;
        float *Oc = O + c0;
#define FA_D2_PV(NVX) fa_d2_pv_(R, NVX, SPREAD, P, n, Vc, ldv, Oc, ldo, &pf, Vpf, np, Ev, kind)
        switch (nv) {
        case 1: FA_D2_PV(1); break;
        case 2: FA_D2_PV(NVMAX >= 2 ? 2 : 1); break;
        case 3: FA_D2_PV(NVMAX >= 3 ? 3 : 1); break;
        case 4: FA_D2_PV(NVMAX >= 4 ? 4 : 1); break;
        case 5: FA_D2_PV(NVMAX >= 5 ? 5 : 1); break;
        case 6: FA_D2_PV(NVMAX >= 6 ? 6 : 1); break;
        case 7: FA_D2_PV(NVMAX >= 7 ? 7 : 1); break;
        default: FA_D2_PV(NVMAX >= 8 ? 8 : 1); break;
        }
#undef FA_D2_PV
    }
}

/* One block of nb <= FA_D1_BK keys for R rows; rows [0, nn) of Kpf / Vpf are prefetched
 * meanwhile: K's during the scores (of the first four rows); V's spread over P·V (`spread`,
 * fa_d2_pv_cols_), else as before: up to two rows, during the first P·V panel (moving them
 * to the scores was no faster there and at R = 2, d = 128 1.03-1.27x slower: those rows want
 * a key every ~20 ns, more than DRAM gives one thread, and the doubled burst of prefetches
 * only queued); three or more, with K's during the scores (fa_d2_scores_rows_). */
FA_D2_INL void fa_d2_block_(const int R, const int CE, const float *q, ptrdiff_t ldq,
                            const float *Kb, ptrdiff_t ldk, const float *Vb, ptrdiff_t ldv,
                            ptrdiff_t nb, ptrdiff_t E, ptrdiff_t Ev, float scale, float *m,
                            double *l, float *O, ptrdiff_t ldo, int kind, const float *Kpf,
                            const float *Vpf, ptrdiff_t nn, const int SPREAD)
{
    if (CE) {                         /* E = Ev = CE known at compile time (FA_D2_CASE) */
        E = CE;
        Ev = CE;
    }
    const ptrdiff_t Evpf = R > 2 && !SPREAD ? Ev : 0;      /* V's prefetch in the scores */
    float P[FA_DG_MAXR * FA_D1_BK] __attribute__((aligned(32)));
    const int ng = (int)((nb + 7) / 8);
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    if (R > 1)                                  /* all rows' scores into P, 4 rows a pass */
        for (int r0 = 0; r0 < R; r0 += 4) {
            const int rows = R - r0 < 4 ? R - r0 : 4;
            if (rows <= 2)
                fa_d2_scores_rows_(2, q + r0 * ldq, ldq, rows, E, Kb, ldk, nb, scale,
                                   P + r0 * FA_D1_BK, Kpf, r0 ? 0 : nn, kind, Vpf, ldv, Evpf);
            else
                fa_d2_scores_rows_(4, q + r0 * ldq, ldq, rows, E, Kb, ldk, nb, scale,
                                   P + r0 * FA_D1_BK, Kpf, r0 ? 0 : nn, kind, Vpf, ldv, Evpf);
        }
    for (int r = 0; r < R; r++) {
        __m256 s[FA_D1_BK / 8];
        __m256 mx = ninf;
        for (int g = 0; g < ng; g++) {
            if (R > 1) {
                s[g] = _mm256_load_ps(P + r * FA_D1_BK + 8 * g);
            } else {
                if (8 * g < nn)
                    fa_d1_prefetch_(Kpf, ldk, E, 8 * g, 8 * g + 8 < nn ? 8 * g + 8 : nn, kind);
                s[g] = fa_d2_scores8_(q, E, Kb, ldk, 8 * g, nb, scale);
            }
            if (8 * g + 8 > nb) {                   /* keys past the end: -inf */
                const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nb - 8 * g)),
                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                s[g] = _mm256_blendv_ps(ninf, s[g], _mm256_castsi256_ps(live));
            }
            /* max_ps(s, mx) returns mx where s is NaN: a NaN score is not the max, it turns
             * its exp, hence l and the row, into NaN (the general path's rule) */
            mx = _mm256_max_ps(s[g], mx);
        }
        const float bm = fa_d2_reduce_max_(mx);
        const float mn = bm > m[r] ? bm : m[r];
        const float mu = mn == -__builtin_inff() ? 0.0f : mn;   /* no key yet: exp -> 0 */
        const float alpha = fa_expf(m[r] - mu);
        __m256 sum = _mm256_setzero_ps();
        for (int g = 0; g < ng; g++) {
            const __m256 p = (__m256)fa_vexp_f_avx2(
                (fa_vt_f_avx2)_mm256_sub_ps(s[g], _mm256_set1_ps(mu)));
            sum = _mm256_add_ps(sum, p);
            _mm256_store_ps(P + r * FA_D1_BK + 8 * g, p);
        }
        l[r] = l[r] * alpha + (double)fa_d2_reduce_add_(sum);
        m[r] = mn;
        if (alpha != 1.0f) {                        /* rescale O once per block */
            float *o = O + r * ldo;
            const __m256 av = _mm256_set1_ps(alpha);
            for (ptrdiff_t c = 0; c < Ev; c += 8)
                _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), av));
        }
    }
    fa_d2_pv_cols_(R, SPREAD, P, nb, Vb, ldv, Ev, O, ldo, Vpf, Evpf ? 0 : nn, kind);
}

/* One row at d = 64 (not spread: that needs Ev > 64) runs a copy compiled for the head dim,
 * its e loops unrolled.  A C harness calling the kernel (AVX2 copy on a Zen 4 guest, one
 * thread, 1024 keys, arguments read at run time, best of 1000, alternating runs): R = 1
 * d = 64 (12 heads) 95.6-100.1 -> 77.2-90.8 us (six runs, two builds); R = 1 d = 128 no
 * change (131-132 both); with E = 64 or 128 known for R = 2, 4, 8 the copies were 1.2-1.4x
 * slower (R = 4 d = 128 251-263 -> 340-352 us: the unrolled scores spill the 16 ymm
 * registers), so only this one. */
#define FA_D2_BLOCK(RR, CE, SP)                                                            \
    fa_d2_block_(RR, CE, q, ldq, K + j0 * ldk, ldk, V + j0 * ldv, ldv, nb, E, Ev, scale, m,  \
                 l, O, ldo, pf_kind, Kpf + j0 * ldk, Vpf + j0 * ldv, nn, SP)
#define FA_D2_CASE(RR, SP)                                                                 \
    case RR:                                                                               \
        if (RR == 1 && !(SP) && E == 64 && Ev == 64)                                       \
            FA_D2_BLOCK(RR, 64, SP);                                                       \
        else                                                                               \
            FA_D2_BLOCK(RR, 0, SP);                                                        \
        break;

/* Rows q[r * ldq], r < R (1 <= R <= FA_DG_MAXR), against keys [0, n) of K (stride ldk) and V
 * (stride ldv), updating m_io[r], l_io[r] (double, as fa_decode1_f_avx512's) and O[r * ldo + c];
 * E % 8 == Ev % 8 == 0.  Prefetch
 * as fa_decode1_f_avx512: block [j0, j0 + nb) prefetches rows [j0, j0 + nb) of Kpf / Vpf
 * below npf.  V's prefetch is spread over P·V in a call longer than one block (a head's run of
 * keys) whose rows take more than one column panel.  A call of one block is the heads-group
 * walk of a flash-layout cache (decode.pxi: 8 keys of one kv head, then the next head's):
 * there spreading lost (the inference preset's ragged decode 1.03-1.18x the time, and in the
 * harness 0.85x the GB/s), and so did prefetching the next block in address order (each call
 * one whole key row of all heads, K then V: 0.82-0.9x).  With one panel (R = 1, d = 64) the
 * spread order is the old one.  Otherwise (no prefetch, a short or one-panel call) this runs
 * the old code, instantiated apart. */
static FA_A2 void fa_decodeg_f_avx2(int R, const float *q, ptrdiff_t ldq, const float *K,
                                    ptrdiff_t ldk, const float *V, ptrdiff_t ldv, ptrdiff_t n,
                                    ptrdiff_t E, ptrdiff_t Ev, float scale, float *m_io,
                                    double *l_io, float *O, ptrdiff_t ldo, int pf_kind,
                                    const float *Kpf, const float *Vpf, ptrdiff_t npf)
{
    float m[FA_DG_MAXR];
    double l[FA_DG_MAXR];            /* one add per block: in double across blocks and calls */
    const int spread = pf_kind && npf > 0 && n > FA_D1_BK && Ev > 8 * fa_d2_nvmax_(R);
    for (int r = 0; r < R; r++) {
        m[r] = m_io[r];
        l[r] = l_io[r];
    }
    for (ptrdiff_t j0 = 0; j0 < n; j0 += FA_D1_BK) {
        const ptrdiff_t nb = n - j0 < FA_D1_BK ? n - j0 : FA_D1_BK;
        const ptrdiff_t left = npf - j0;
        const ptrdiff_t nn = pf_kind && left > 0 ? (left < nb ? left : nb) : 0;
        if (spread)
            switch (R) {
            FA_D2_CASE(1, 1)
            FA_D2_CASE(2, 1)
            FA_D2_CASE(3, 1)
            FA_D2_CASE(4, 1)
            FA_D2_CASE(5, 1)
            FA_D2_CASE(6, 1)
            FA_D2_CASE(7, 1)
            default:
            FA_D2_CASE(8, 1)
            }
        else
            switch (R) {
            FA_D2_CASE(1, 0)
            FA_D2_CASE(2, 0)
            FA_D2_CASE(3, 0)
            FA_D2_CASE(4, 0)
            FA_D2_CASE(5, 0)
            FA_D2_CASE(6, 0)
            FA_D2_CASE(7, 0)
            default:
            FA_D2_CASE(8, 0)
            }
    }
    for (int r = 0; r < R; r++) {
        m_io[r] = m[r];
        l_io[r] = l[r];
    }
}
#undef FA_D2_CASE
#undef FA_D2_BLOCK

/* this kernel serves a call: the AVX2 copy is selected and both head dims are multiples of 8 */
static inline int fa_decode_avx2_available(ptrdiff_t E, ptrdiff_t Ev)
{
    return FA_OPS_F == &fa_ops_f_avx2 && E > 0 && Ev > 0 && E % 8 == 0 && Ev % 8 == 0;
}

#else
static inline int fa_decode_avx2_available(ptrdiff_t E, ptrdiff_t Ev) { (void)E; (void)Ev; return 0; }
static inline void fa_decodeg_f_avx2(int R, const float *q, ptrdiff_t ldq, const float *K,
                                     ptrdiff_t ldk, const float *V, ptrdiff_t ldv, ptrdiff_t n,
                                     ptrdiff_t E, ptrdiff_t Ev, float scale, float *m_io,
                                     double *l_io, float *O, ptrdiff_t ldo, int pf_kind,
                                     const float *Kpf, const float *Vpf, ptrdiff_t npf)
{
    (void)R; (void)q; (void)ldq; (void)K; (void)ldk; (void)V; (void)ldv; (void)n; (void)npf;
    (void)E; (void)Ev; (void)scale; (void)m_io; (void)l_io; (void)O; (void)ldo; (void)pf_kind;
    (void)Kpf; (void)Vpf;
}
#endif
#endif /* FA_DECODE_AVX2_H */
