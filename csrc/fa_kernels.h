/*
 * fa_kernels.h -- instantiates fa_kern_impl.h per (ISA, dtype) and picks one at run time.
 *
 * Wheels must run on any x86-64 (no -march=native), yet wider vectors pay off where the CPU
 * has them (zmm FMAs do twice the work of ymm ones).  So the same source is compiled three times with function-level target attributes and
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
#include "fa_dropout.h"
#include "fa_ops.h"
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#define FA_STR_(x) #x
#define FA_STR(x) FA_STR_(x)

/* Row stride (elements) of the backward's score tiles: a compile-time constant so that the
 * column broadcasts of fa_ptq are displacements from one register.  Holds
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
#define FA_OPT_qk_dot fa_qk_dot_f_avx512
#include "fa_kern_impl.h"
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

/* Geometry of the selected copy for the Cython side: 0 lanes per vector, 1 rows per tile,
 * 2 vectors per tile row, 3 whether it has qk_dot. */
static inline int fa_geometry(int is_float, int which)
{
    if (is_float)
        return which == 0 ? FA_OPS_F->vw : which == 1 ? FA_OPS_F->mr : which == 2 ? FA_OPS_F->nv
                                                                    : FA_OPS_F->qk_dot != NULL;
    return which == 0 ? FA_OPS_D->vw : which == 1 ? FA_OPS_D->mr : which == 2 ? FA_OPS_D->nv
                                                                : FA_OPS_D->qk_dot != NULL;
}
/* Prefetch [p, p + bytes) toward L2.  attend_block issues it for the NEXT key block while the
 * current one is computed: the decode path streams K/V from DRAM and stalls on it otherwise.
 *
 * On x86 with GCC/clang the prefetch is a volatile asm statement, not __builtin_prefetch: gcc
 * 12 -O3 deleted the whole __builtin_prefetch loop once it was inlined through
 * prefetch_keys/prefetch_rows (forward.pxi) into attend_block (a loop whose only statements are
 * prefetches counts as removable there; reproduced in a 15-line file), which made the GQA
 * decode (32/8 heads, d=128, S=16384) 1.4x slower with no other sign.  A volatile asm is never
 * removed; objdump of the built extension shows the prefetcht1 in attend_block again. */
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define FA_PREFETCH_L2(addr) __asm__ __volatile__("prefetcht1 %0" : : "m"(*(const char *)(addr)))
#else
#define FA_PREFETCH_L2(addr) __builtin_prefetch((addr), 0, 2)
#endif
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define FA_PREFETCH_ASM(ins, addr) __asm__ __volatile__(ins " %0" : : "m"(*(const char *)(addr)))
#define FA_PREFETCH_T0(addr) FA_PREFETCH_ASM("prefetcht0", addr)
#define FA_PREFETCH_NTA(addr) FA_PREFETCH_ASM("prefetchnta", addr)
#else
#define FA_PREFETCH_T0(addr) __builtin_prefetch((addr), 0, 3)
#define FA_PREFETCH_NTA(addr) __builtin_prefetch((addr), 0, 0)
#endif
/* kind: 1 prefetcht0, 2 prefetcht1, 3 prefetchnta, else none */
static inline void fa_prefetch(const void *p, ptrdiff_t bytes, int kind)
{
    const char *c = (const char *)p;
    if (kind == 1)
        for (ptrdiff_t o = 0; o < bytes; o += 64) FA_PREFETCH_T0(c + o);
    else if (kind == 2)
        for (ptrdiff_t o = 0; o < bytes; o += 64) FA_PREFETCH_L2(c + o);
    else if (kind == 3)
        for (ptrdiff_t o = 0; o < bytes; o += 64) FA_PREFETCH_NTA(c + o);
}

/* set from os.register_at_fork(after_in_child=...): libgomp's thread pool does not survive
 * fork, so a child runs every kernel on its calling thread instead of hanging. */
static int fa_forked_child = 0;

#endif /* FA_KERNELS_H */
