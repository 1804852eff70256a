/*
 * fa_decode_avx512.h -- Q·Kᵀ for decode blocks with very few query rows (R <= 4 lanes),
 * float32, AVX-512 only (other ISAs use the general fa_qk).
 *
 * Why: fa_qk vectorizes over query lanes and broadcasts K[j][e]: each key costs E FMAs
 * whatever R is, so with R = 1..4 real rows in 16 lanes 75-94% of the work is padding, and
 * decode (which should be bound by DRAM bandwidth) became compute-bound (~100 cycles/key at
 * E = 128).  Here the vectors run along e instead (dot products): a group of 16/Rp keys x Rp
 * rows keeps 16 accumulators, each key row is loaded once per group and each key costs only
 * Rp*E/16 FMAs; the 16 accumulators are then summed across lanes with one 4-level shuffle
 * tree (45 instructions per 16 scores).
 */
#ifndef FA_DECODE_AVX512_H
#define FA_DECODE_AVX512_H

#define FA_A512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

/* Sum each of acc[0..15] across its 16 lanes.  Result lane 4c + l holds the sum of
 * acc[4l + c] (a 4x4 transpose of the natural order, undone by the caller's indexing). */
static inline __attribute__((always_inline)) FA_A512 __m512 fa_hsum16_(const __m512 *acc)
{
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++)      /* 256-bit halves: [a0+a2, a1+a3, b0+b2, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)      /* 128-bit chunks: one accumulator per chunk */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)      /* pairs of lanes within each chunk */
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88),
                         _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

static inline __attribute__((always_inline)) FA_A512 void
fa_qk_dot_(const int RP, const float *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
           const float *Qr, ptrdiff_t ldq, int R, float *S, ptrdiff_t lds, float scale)
{
    const int KG = 16 / RP;                       /* keys per group */
    const ptrdiff_t Ef = E & ~(ptrdiff_t)15;
    const __mmask16 tail = (__mmask16)((1u << (E & 15)) - 1);
    for (ptrdiff_t j0 = 0; j0 < n; j0 += KG) {
        const float *kr[16];
        for (int kk = 0; kk < KG; kk++)           /* past the end: re-read the last key */
            kr[kk] = K + (j0 + kk < n ? j0 + kk : n - 1) * ldk;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (ptrdiff_t e = 0; e < Ef; e += 16) {
            __m512 qv[4];
            for (int r = 0; r < RP; r++) qv[r] = _mm512_loadu_ps(Qr + r * ldq + e);
            for (int kk = 0; kk < KG; kk++) {
                __m512 kv = _mm512_loadu_ps(kr[kk] + e);
                for (int r = 0; r < RP; r++)
                    acc[kk * RP + r] = _mm512_fmadd_ps(kv, qv[r], acc[kk * RP + r]);
            }
        }
        if (Ef < E) {                              /* head dim not a multiple of 16 */
            __m512 qv[4];
            for (int r = 0; r < RP; r++) qv[r] = _mm512_maskz_loadu_ps(tail, Qr + r * ldq + Ef);
            for (int kk = 0; kk < KG; kk++) {
                __m512 kv = _mm512_maskz_loadu_ps(tail, kr[kk] + Ef);
                for (int r = 0; r < RP; r++)
                    acc[kk * RP + r] = _mm512_fmadd_ps(kv, qv[r], acc[kk * RP + r]);
            }
        }
        float buf[16];
        _mm512_storeu_ps(buf, _mm512_mul_ps(fa_hsum16_(acc), _mm512_set1_ps(scale)));
        for (int kk = 0; kk < KG && j0 + kk < n; kk++)
            for (int r = 0; r < R; r++) {
                int a = kk * RP + r;
                S[(j0 + kk) * lds + r] = buf[(a & 3) * 4 + (a >> 2)];
            }
    }
}

/* S[j][r] = scale * sum_e K[j][e] * Qr[r][e] for j < n, r < R <= 4.  Qr: R rows, stride ldq. */
static FA_A512 void fa_qk_dot_f_avx512(const float *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                                       const float *Qr, ptrdiff_t ldq, int R, float *S,
                                       ptrdiff_t lds, float scale)
{
    if (R == 1)
        fa_qk_dot_(1, K, ldk, n, E, Qr, ldq, R, S, lds, scale);
    else if (R == 2)
        fa_qk_dot_(2, K, ldk, n, E, Qr, ldq, R, S, lds, scale);
    else
        fa_qk_dot_(4, K, ldk, n, E, Qr, ldq, R, S, lds, scale);
}

#endif /* FA_DECODE_AVX512_H */
