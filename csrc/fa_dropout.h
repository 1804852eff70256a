/*
 * fa_dropout.h -- the dropout hash of the kernel spec (docs/KERNELS.md), written once: every
 * ISA copy's dropout loops (fa_scores.h) and the Cython row setup (drop_row_key) use these.
 * All arithmetic is mod 2^32 on unsigned 32-bit values, so the kept set is the same in every
 * backend and the backward regenerates it.  ISA-independent: the static inline functions are
 * inlined into each copy's loops under that copy's target.
 */
#ifndef FA_DROPOUT_H
#define FA_DROPOUT_H

#include <stdint.h>

static inline uint32_t fa_mix32(uint32_t x)
{
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

/* per query row: bh = b * Hq + h (the query head), i the row */
static inline uint32_t fa_row_key(uint32_t seed, uint32_t bh, uint32_t i)
{
    return fa_mix32(fa_mix32(seed ^ fa_mix32(bh)) + i);
}

/* per key column j */
static inline uint32_t fa_drop_col(int64_t j) { return (uint32_t)j * 0x9E3779B1u; }

/* the bits of (row, column): the weight is kept iff bits >= thresh */
static inline uint32_t fa_drop_bits(uint32_t row_key, uint32_t col) { return fa_mix32(row_key ^ col); }

#endif /* FA_DROPOUT_H */
