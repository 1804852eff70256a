/*
 * fa_kernels.h -- instantiates fa_kern_impl.h per (ISA, dtype) and picks one at run time.
 *
 * Wheels must run on any x86-64 (no -march=native), yet the AVX-512 copy is ~2x the AVX2
 * one on this Sapphire Rapids box (measured FMA peak per core: 136 GF/s zmm vs 70 GF/s ymm).
 * So the same source is compiled three times with function-level target attributes and
 * fa_select() chooses by CPUID (__builtin_cpu_supports also checks that the OS saves the
 * zmm/ymm state).  FASTATTN_SIMD=generic|avx2|avx512 forces a level (tests use it to run
 * every copy this CPU can execute).
 */
#ifndef FA_KERNELS_H
#define FA_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "fa_exp.h"
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#define FA_STR_(x) #x
#define FA_STR(x) FA_STR_(x)

#define FA_DECLARE_OPS(TS, T)                                                               \
typedef struct {                                                                            \
    int vw, mr, nv;                                                                         \
    const char *name;                                                                       \
    void (*qk)(const T *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E, const T *Qt,            \
               ptrdiff_t W, int pw_nv, T *S, ptrdiff_t lds, T *cmax, T *kpad, T scale);     \
    void (*colmax)(const T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, T *cmax);           \
    void (*softmax)(T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, const T *cmax, T *m,     \
                    T *l, T *alpha);                                                        \
    void (*pv)(const T *P, ptrdiff_t ldp, ptrdiff_t n, const T *V, ptrdiff_t ldv,           \
               ptrdiff_t Ev, T *O, ptrdiff_t ldo, const T *alpha, ptrdiff_t rows);          \
    void (*pv_exact)(const T *P, ptrdiff_t ldp, ptrdiff_t n, const T *V, ptrdiff_t ldv,     \
                     ptrdiff_t Ev, T *O, ptrdiff_t ldo, const T *alpha, ptrdiff_t rows);    \
    int (*allfinite)(const T *x, ptrdiff_t n);                                              \
    void (*softcap)(T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, T cap);                  \
    void (*alibi)(T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,                \
                  const int64_t *pos, const T *slope);                                      \
    void (*maskf)(T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0, const T *M,    \
                  const int64_t *moff, int64_t msj, int uniform);                           \
    void (*maskb)(T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,                \
                  const uint8_t *M, const int64_t *moff, int64_t msj, int uniform);         \
    void (*window)(T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,               \
                   const int64_t *pos, int64_t wl, int64_t wr);                             \
    void (*dropout)(T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,              \
                    const uint32_t *rk, uint32_t thresh);                                   \
    void (*softmax_row)(const T *x, const uint8_t *mask, T *out, ptrdiff_t n);              \
    /* optional: scores for <= 4 query rows by dot products (decode); NULL = use qk */       \
    void (*qk_dot)(const T *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E, const T *Qr,        \
                   ptrdiff_t ldq, int R, T *S, ptrdiff_t lds, T scale);                     \
    /* backward (tiles with row stride FA_BWD_LDS) */                                       \
    void (*qkt)(const T *Kt, ptrdiff_t ldkt, ptrdiff_t n, ptrdiff_t E, const T *Qt,         \
                ptrdiff_t W, int pw_nv, T *S, T scale);                                     \
    void (*bwd_p)(T *S, const T *dP, ptrdiff_t n, ptrdiff_t W, const T *lse, double *acc);  \
    void (*bwd_ds)(T *S, T *dP, const T *G, ptrdiff_t n, ptrdiff_t W, const T *invZ,         \
                   const double *D);                                                        \
    void (*ptq)(const T *Tl, ptrdiff_t n, ptrdiff_t ni, const T *X, ptrdiff_t ldx,          \
                ptrdiff_t C, T *O, ptrdiff_t ldo);                                          \
    void (*softcap_grad)(T *S, T *G, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, T cap);       \
    void (*dropout_scale)(T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,        \
                          const uint32_t *rk, uint32_t thresh, T keep_scale);               \
    void (*transpose)(const T *src, ptrdiff_t lds, ptrdiff_t R, ptrdiff_t C, T *dst,         \
                      ptrdiff_t ldd);                                                       \
    void (*scale_row)(const T *x, T *out, ptrdiff_t n, double s);                          \
} fa_ops_##TS;

/* Row stride (elements) of the backward's score tiles: a compile-time constant so that the
 * column broadcasts of fa_ptq and fa_qkt's stores are displacements from one register.  Holds
 * up to 96 lanes (= lcm of the register tiles, 12 rows x 32 lanes); +16 keeps consecutive
 * rows off the same 4 KiB alias. */
#define FA_BWD_LDS 112
#define FA_BWD_MAXW 96

FA_DECLARE_OPS(f, float)
FA_DECLARE_OPS(d, double)

/* ---- baseline copy: 128-bit vectors (SSE2 on x86-64, NEON on arm64), 16 registers ---- */
#define FA_ATTR
#define FA_MR 6
#define FA_NV 2
#define FA_T float
#define FA_TS f
#define FA_ISF 1
#define FA_VW 4
#define FA_SFX f_generic
#include "fa_kern_impl.h"
#undef FA_T
#undef FA_TS
#undef FA_ISF
#undef FA_VW
#undef FA_SFX
#define FA_T double
#define FA_TS d
#define FA_ISF 0
#define FA_VW 2
#define FA_SFX d_generic
#include "fa_kern_impl.h"
#undef FA_T
#undef FA_TS
#undef FA_ISF
#undef FA_VW
#undef FA_SFX
#undef FA_ATTR
#undef FA_MR
#undef FA_NV

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FA_HAVE_X86_VARIANTS 1
#include "fa_decode_avx512.h"
/* ---- AVX2 + FMA: 256-bit, 16 registers -> 6 x 2 tiles (12 accumulators) ---- */
#define FA_ATTR __attribute__((target("avx2,fma")))
#define FA_MR 6
#define FA_NV 2
#define FA_HWMAX(a, b) _mm256_max_ps((__m256)(a), (__m256)(b))
#define FA_HWCVTLO(x) _mm256_cvtps_pd(_mm256_castps256_ps128((__m256)(x)))
#define FA_HWCVTHI(x) _mm256_cvtps_pd(_mm256_extractf128_ps((__m256)(x), 1))
#define FA_T float
#define FA_TS f
#define FA_ISF 1
#define FA_VW 8
#define FA_SFX f_avx2
#include "fa_kern_impl.h"
#undef FA_HWMAX
#undef FA_HWCVTLO
#undef FA_HWCVTHI
#define FA_HWMAX(a, b) _mm256_max_pd((__m256d)(a), (__m256d)(b))
#undef FA_T
#undef FA_TS
#undef FA_ISF
#undef FA_VW
#undef FA_SFX
#define FA_T double
#define FA_TS d
#define FA_ISF 0
#define FA_VW 4
#define FA_SFX d_avx2
#include "fa_kern_impl.h"
#undef FA_HWMAX
#undef FA_T
#undef FA_TS
#undef FA_ISF
#undef FA_VW
#undef FA_SFX
#undef FA_ATTR
#undef FA_MR
#undef FA_NV
/* ---- AVX-512 (F/BW/VL/DQ, x86-64-v4): 512-bit, 32 registers -> 12 x 2 tiles ---- */
#define FA_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define FA_MR 12
#define FA_NV 2
#define FA_HWMAX(a, b) _mm512_max_ps((__m512)(a), (__m512)(b))
#define FA_HWSCALEF(x, p, n) _mm512_maskz_scalef_ps(                                   \
    _mm512_cmp_ps_mask((__m512)(x), _mm512_set1_ps(FA_EXPF_LO_Z), _CMP_NLT_UQ),             \
    (__m512)(p), (__m512)(n))
#define FA_HWCVTLO(x) _mm512_cvtps_pd(_mm512_castps512_ps256((__m512)(x)))
#define FA_HWCVTHI(x) _mm512_cvtps_pd(_mm512_extractf32x8_ps((__m512)(x), 1))
#define FA_T float
#define FA_TS f
#define FA_ISF 1
#define FA_VW 16
#define FA_SFX f_avx512
#define FA_QK_DOT fa_qk_dot_f_avx512
#include "fa_kern_impl.h"
#undef FA_QK_DOT
#undef FA_HWMAX
#undef FA_HWSCALEF
#undef FA_HWCVTLO
#undef FA_HWCVTHI
#define FA_HWMAX(a, b) _mm512_max_pd((__m512d)(a), (__m512d)(b))
#define FA_HWSCALEF(x, p, n) _mm512_maskz_scalef_pd(                                   \
    _mm512_cmp_pd_mask((__m512d)(x), _mm512_set1_pd(FA_EXPD_LO_Z), _CMP_NLT_UQ),            \
    (__m512d)(p), (__m512d)(n))
#undef FA_T
#undef FA_TS
#undef FA_ISF
#undef FA_VW
#undef FA_SFX
#define FA_T double
#define FA_TS d
#define FA_ISF 0
#define FA_VW 8
#define FA_SFX d_avx512
#include "fa_kern_impl.h"
#undef FA_HWMAX
#undef FA_HWSCALEF
#undef FA_T
#undef FA_TS
#undef FA_ISF
#undef FA_VW
#undef FA_SFX
#undef FA_ATTR
#undef FA_MR
#undef FA_NV
#else
#define FA_HAVE_X86_VARIANTS 0
#endif

static const fa_ops_f *FA_OPS_F = &fa_ops_f_generic;
static const fa_ops_d *FA_OPS_D = &fa_ops_d_generic;

/* level: 0 generic, 1 avx2, 2 avx512.  Returns the level actually selected. */
static int fa_cpu_level(void)
{
#if FA_HAVE_X86_VARIANTS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

static int fa_select(int want)
{
    int have = fa_cpu_level();
    int lvl = want < 0 || want > have ? have : want;
#if FA_HAVE_X86_VARIANTS
    if (lvl == 2) { FA_OPS_F = &fa_ops_f_avx512; FA_OPS_D = &fa_ops_d_avx512; return 2; }
    if (lvl == 1) { FA_OPS_F = &fa_ops_f_avx2; FA_OPS_D = &fa_ops_d_avx2; return 1; }
#endif
    FA_OPS_F = &fa_ops_f_generic;
    FA_OPS_D = &fa_ops_d_generic;
    return 0;
}

static const char *fa_ops_name(void) { return FA_OPS_F->name; }
/* Prefetch [p, p + bytes) toward L2.  attend_rows issues it for the NEXT key block (K and V
 * rows of consecutive keys are contiguous) while the current one is computed: the decode
 * path streams K/V from DRAM and was stalling on it (125 ns per key -> see NOTES.md). */
static inline void fa_prefetch(const void *p, ptrdiff_t bytes)
{
    const char *c = (const char *)p;
    for (ptrdiff_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

/* dropout hash of the kernel spec (all arithmetic mod 2^32) */
static inline uint32_t fa_mix32(uint32_t x)
{
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}
static inline uint32_t fa_row_key(uint32_t seed, uint32_t bh, uint32_t i)
{
    return fa_mix32(fa_mix32(seed ^ fa_mix32(bh)) + i);
}

/* set from os.register_at_fork(after_in_child=...): libgomp's thread pool does not survive
 * fork, so a child runs every kernel on its calling thread instead of hanging. */
static int fa_forked_child = 0;

#endif /* FA_KERNELS_H */
