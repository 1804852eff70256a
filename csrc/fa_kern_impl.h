/*
 * fa_kern_impl.h -- SIMD primitives of the attention kernels, written ONCE with GCC/clang
 * vector extensions and instantiated by fa_kernels.h for every (ISA, dtype) pair:
 *
 *   FA_T     float | double          FA_VW   lanes per vector
 *   FA_MR    key rows per QK tile, query rows per PV tile (register blocking)
 *   FA_NV    vectors per tile row    FA_SFX  name suffix       FA_ISF  1 for float
 *   FA_ATTR  function attribute selecting the ISA (target("avx512f,...")) or nothing
 *
 * The primitives live in one header per concern, included below in this order:
 *   fa_scores.h      score modifiers (softcap, ALiBi, masks, window) and dropout
 *   fa_gemm_tiles.h  the forward's Q·Kᵀ and P·V register tiles, transpose
 *   fa_softmax.h     online softmax, row softmax, output rescale
 *   fa_bwd_tiles.h   the backward's tiles
 * and the ops table of the copy is filled from FA_OPS_LIST (fa_ops.h).
 *
 * No include guard on purpose.  Every function carries FA_ATTR, so one extension module holds
 * an AVX-512, an AVX2 and a baseline copy and picks one at import (fa_kernels.h).
 *
 * Layout ("transposed scores"): a work item is a block of W query rows ("lanes") against a
 * block of n keys.  Scores are stored S[j][lane] (row j = key, stride lds), so
 *   - Q·Kᵀ broadcasts K[j][e] straight from the caller's K (no packing of K, which is the
 *     big operand), against Qt, the query block packed once per item as panels
 *     Qt[panel][e][pw] (pw = nv*VW lanes);
 *   - the online softmax works down columns: running max/sum/rescale are per-lane vectors
 *     and need no horizontal reductions;
 *   - P·V broadcasts P[j][lane] and loads V rows straight from the caller's V.
 */

#define FA_CAT_(a, b) a##b
#define FA_CAT(a, b) FA_CAT_(a, b)
#define FN(name) FA_CAT(name, FA_SFX)
#define VT FA_CAT(fa_vt_, FA_SFX)
#define VTU FA_CAT(fa_vtu_, FA_SFX)
#define VI FA_CAT(fa_vi_, FA_SFX)
#define NR (FA_NV * FA_VW)
#define MRT (FA_MR / 3)          /* query rows per PV tile for the row tail */
#define FA_INL static inline __attribute__((always_inline)) FA_ATTR
#define FA_FN static FA_ATTR

typedef FA_T VT __attribute__((vector_size(FA_VW * sizeof(FA_T))));
/* same vector, element alignment only: dereferencing it is an unaligned load/store */
typedef FA_T VTU __attribute__((vector_size(FA_VW * sizeof(FA_T)), aligned(sizeof(FA_T)), may_alias));
typedef __typeof__((VT){0} < (VT){0}) VI;

#define LD(p) ((VT)(*(const VTU *)(p)))
#define ST(p, v) (*(VTU *)(p) = (v))
/* x - 0 (not 0 + x): x - (+0) == x for every x incl. -0, so the compiler folds it into a
 * plain broadcast; 0 + x would cost a real add per broadcast. */
#define BC(x) ((FA_T)(x) - (VT){0})
#define SEL(m, a, b) FA_VSEL(VT, VI, m, a, b)

/* VMAX(a, b) = a < b ? b : a lane-wise.  It ignores a NaN in b (a < NaN is false): a NaN
 * score then shows up in the exp and turns the row into NaN, as the dense reference does,
 * instead of poisoning the max.  FA_HWMAX: the ISA's single max instruction with exactly
 * these semantics (x86 maxps(b, a) returns a when either is NaN). */
#ifdef FA_HWMAX
FA_INL VT FN(fa_vmax_)(VT a, VT b) { return (VT)FA_HWMAX(b, a); }
#else
FA_INL VT FN(fa_vmax_)(VT a, VT b) { VI m = a < b; return SEL(m, b, a); }
#endif
#define VMAX FN(fa_vmax_)

#if FA_ISF
#define SEXP fa_expf
#define T_NEG_INF (-__builtin_inff())
#ifdef FA_HWSCALEF
FA_DEFINE_VEXP_SCALEF(FN(fa_vexp_), FA_ATTR, VT, float, FA_HWSCALEF, FA_EXPF_MAGIC,
                      FA_LOG2E_F, FA_LN2HI_F, FA_LN2LO_F, FA_EXPF_POLY)
#else
FA_DEFINE_VEXP(FN(fa_vexp_), FA_ATTR, VT, VI, float, VMAX, FA_EXPF_LO, FA_EXPF_MAGIC,
               FA_EXPF_MAGIC_BITS, FA_LOG2E_F, FA_LN2HI_F, FA_LN2LO_F, FA_EXPF_POLY, 127, 23)
#endif
#else
#define SEXP fa_expd
#define T_NEG_INF (-__builtin_inf())
#ifdef FA_HWSCALEF
FA_DEFINE_VEXP_SCALEF(FN(fa_vexp_), FA_ATTR, VT, double, FA_HWSCALEF, FA_EXPD_MAGIC,
                      FA_LOG2E_D, FA_LN2HI_D, FA_LN2LO_D, FA_EXPD_POLY)
#else
FA_DEFINE_VEXP(FN(fa_vexp_), FA_ATTR, VT, VI, double, VMAX, FA_EXPD_LO, FA_EXPD_MAGIC,
               FA_EXPD_MAGIC_BITS, FA_LOG2E_D, FA_LN2HI_D, FA_LN2LO_D, FA_EXPD_POLY, 1023, 52)
#endif
#endif
#define VEXP FN(fa_vexp_)

#include "fa_scores.h"
#include "fa_gemm_tiles.h"
#include "fa_softmax.h"
#include "fa_bwd_tiles.h"

/* ---------------------------------------------------------------- ops table ------------- */
/* One designated initializer per entry of FA_OPS_LIST: op `name` is FN(fa_<name>); the
 * optional ones (FA_OPS_LIST's XO entries) are FA_OPT_<name>, NULL unless the copy defines it
 * (fa_kernels.h). */
#ifndef FA_OPT_qk_dot
#define FA_OPT_qk_dot NULL
#endif
#define FA_OP_INIT(ret, name, params) .name = FN(fa_##name),
#define FA_OP_INIT_OPT(ret, name, params) .name = FA_OPT_##name,
static const FA_CAT(fa_ops_, FA_TS) FA_CAT(fa_ops_, FA_SFX) = {
    .vw = FA_VW, .mr = FA_MR, .nv = FA_NV, .name = FA_STR(FA_SFX),
    FA_OPS_LIST(FA_OP_INIT, FA_OP_INIT_OPT, FA_T)
};
#undef FA_OP_INIT
#undef FA_OP_INIT_OPT
#undef FA_OPT_qk_dot

#undef FN
#undef VT
#undef VTU
#undef VI
#undef NR
#undef MRT
#undef FA_PV_CHUNK
#undef FA_QK_CHUNK
#undef VTH
#undef VD
#undef FA_LOHALF
#undef FA_HIHALF
#undef FA_TOD
#undef FA_CVTLO
#undef FA_CVTHI
#undef FA_CONCAT
#undef FA_INL
#undef FA_FN
#undef LD
#undef ST
#undef BC
#undef SEL
#undef SEXP
#undef T_NEG_INF
#undef VEXP
#undef VMAX
