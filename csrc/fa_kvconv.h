/*
 * fa_kvconv.h -- reading a low-precision KV cache (fastattn/_kvdtypes.py) as float32.
 *
 * kind 1: float16 bits, kind 2: bfloat16 bits (both uint16), kind 3: int8 codes whose row
 * (key) i reads float32(code) * scale[i].  Every conversion is exact but int8's one float32
 * multiply, which is the value the cache is defined to hold (the NumPy reference computes the
 * same product), so a converted tile gives the same bits whichever kernel reads it.
 *
 * fa_kv_rows_f32 converts rows into a float32 tile for the general (tile) path of the forward
 * and decode kernels: portable C, no ISA assumption (the compiler vectorizes the bfloat16 and
 * int8 loops; float16 with F16C when the CPU has it, chosen at run time).
 */
#ifndef FA_KVCONV_H
#define FA_KVCONV_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FA_KV_X86 1
#else
#define FA_KV_X86 0
#endif

enum { FA_KV_F16 = 1, FA_KV_BF16 = 2, FA_KV_I8 = 3 };

static inline ptrdiff_t fa_kv_item(int kind) { return kind == FA_KV_I8 ? 1 : 2; }

/* IEEE binary16 -> binary32, every value (subnormals, infinities, NaN payloads) */
static inline float fa_kv_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    float f;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        f = (float)man * 5.9604644775390625e-8f;      /* man * 2^-24: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

static inline float fa_kv_bf16_to_float(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if FA_KV_X86 && defined(__GNUC__)
__attribute__((target("f16c,avx"))) static void fa_kv_f16_row_f16c_(const uint16_t *s, float *d,
                                                                     ptrdiff_t E)
{
    ptrdiff_t e = 0;
    for (; e + 8 <= E; e += 8)
        _mm256_storeu_ps(d + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + e))));
    for (; e < E; e++) d[e] = fa_kv_half_to_float(s[e]);
}

static inline int fa_kv_has_f16c(void)
{
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    }
    return known;
}
#else
static inline int fa_kv_has_f16c(void) { return 0; }
static void fa_kv_f16_row_f16c_(const uint16_t *s, float *d, ptrdiff_t E)
{
    for (ptrdiff_t e = 0; e < E; e++) d[e] = fa_kv_half_to_float(s[e]);
}
#endif

/* dst[i * ldd + e] = row i of the stored cache, for i < n, e < E.  src: the stored elements,
 * from element offset off (rows ld elements apart); scale: row i's int8 scale at
 * scale[i * lds] (kind 3 only). */
static void fa_kv_rows_f32(int kind, const void *base, int64_t off, ptrdiff_t ld, ptrdiff_t n,
                           ptrdiff_t E, const float *scale, ptrdiff_t lds, float *dst,
                           ptrdiff_t ldd)
{
    if (kind == FA_KV_I8) {
        const int8_t *s = (const int8_t *)base + off;
        for (ptrdiff_t i = 0; i < n; i++) {
            const int8_t *r = s + i * ld;
            const float sc = scale[i * lds];
            float *d = dst + i * ldd;
            for (ptrdiff_t e = 0; e < E; e++) d[e] = (float)r[e] * sc;
        }
    } else if (kind == FA_KV_BF16) {
        const uint16_t *s = (const uint16_t *)base + off;
        for (ptrdiff_t i = 0; i < n; i++) {
            const uint16_t *r = s + i * ld;
            float *d = dst + i * ldd;
            for (ptrdiff_t e = 0; e < E; e++) d[e] = fa_kv_bf16_to_float(r[e]);
        }
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        const int f16c = fa_kv_has_f16c();
        for (ptrdiff_t i = 0; i < n; i++) {
            if (f16c) {
                fa_kv_f16_row_f16c_(s + i * ld, dst + i * ldd, E);
            } else {
                const uint16_t *r = s + i * ld;
                float *d = dst + i * ldd;
                for (ptrdiff_t e = 0; e < E; e++) d[e] = fa_kv_half_to_float(r[e]);
            }
        }
    }
}

/* Quantize n rows of E float32 values (contiguous) to int8 codes and a float32 scale per row,
 * by fastattn/_kvdtypes.py's rule, the same bits as its NumPy code: scale = max|x| / 127 in
 * float32, code = round-half-to-even(x / scale) (a float32 division) clipped to +-127, a row
 * whose scale is 0 all zeros (there max|x| <= 127 * 2^-150: x / 1 rounds to 0).  Returns 1,
 * writing nothing, if a value is NaN or Inf.  Why in C: a decode step quantizes one token per
 * kv head, and the ~12 NumPy calls of the reference took ~12 us per array for a (12, 64)
 * token, a tenth of a small cache's whole decode call. */
static int fa_kv_quantize_rows(const float *x, ptrdiff_t n, ptrdiff_t E, int8_t *codes,
                               float *scale)
{
    int bad = 0;
    for (ptrdiff_t i = 0; i < n * E; i++) bad |= !(__builtin_fabsf(x[i]) <= 3.40282347e38f);
    if (bad) return 1;
    for (ptrdiff_t r = 0; r < n; r++) {
        const float *xr = x + r * E;
        int8_t *cr = codes + r * E;
        float amax = 0.0f;
        for (ptrdiff_t e = 0; e < E; e++) {
            const float a = __builtin_fabsf(xr[e]);
            amax = a > amax ? a : amax;
        }
        const float s = amax / 127.0f;
        const float safe = s > 0.0f ? s : 1.0f;
        for (ptrdiff_t e = 0; e < E; e++) {
            float c = __builtin_rintf(xr[e] / safe);      /* the current mode: to nearest even */
            c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
            cr[e] = (int8_t)c;
        }
        scale[r] = s;
    }
    return 0;
}

#endif /* FA_KVCONV_H */
