/*
 * fa_ops.h -- the operation table of the SIMD copies, as ONE list.
 *
 * FA_OPS_LIST(X, XO, T) names every operation with its return type and parameters for
 * element type T; X marks the required ones, XO the optional ones (NULL in copies without
 * them).  From it:
 *   - fa_kernels.h declares the table types fa_ops_f / fa_ops_d (FA_DECLARE_OPS);
 *   - fa_kern_impl.h fills one table per (ISA, dtype) with designated initializers, op
 *     `name` being that copy's FN(fa_<name>);
 *   - the Cython side calls op `name` as FA_OP(name) on the table selected at import (see the
 *     end of this file), declared once in common.pxi with fused types.
 * Adding an operation: one line here, its function in the copy's header, one declaration in
 * common.pxi.
 */
#ifndef FA_OPS_H
#define FA_OPS_H

#define FA_OPS_LIST(X, XO, T)                                                               \
    X(void, qk, (const T *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E, const T *Qt,          \
                 ptrdiff_t W, int pw_nv, T *S, ptrdiff_t lds, T *cmax, T *kpad, T scale))   \
    X(void, colmax, (const T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, T *cmax))         \
    X(void, softmax, (T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, const T *cmax, T *m,   \
                      T *l, T *alpha))                                                      \
    X(void, pv, (const T *P, ptrdiff_t ldp, ptrdiff_t n, const T *V, ptrdiff_t ldv,         \
                 ptrdiff_t Ev, T *O, ptrdiff_t ldo, const T *alpha, ptrdiff_t rows))        \
    X(void, pv_exact, (const T *P, ptrdiff_t ldp, ptrdiff_t n, const T *V, ptrdiff_t ldv,   \
                       ptrdiff_t Ev, T *O, ptrdiff_t ldo, const T *alpha, ptrdiff_t rows))  \
    X(int, allfinite, (const T *x, ptrdiff_t n))                                            \
    X(void, softcap, (T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, T cap))                \
    X(void, alibi, (T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,              \
                    const int64_t *pos, const T *slope))                                    \
    X(void, maskf, (T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0, const T *M,  \
                    const int64_t *moff, int64_t msj, int uniform))                         \
    X(void, maskb, (T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,              \
                    const uint8_t *M, const int64_t *moff, int64_t msj, int uniform))       \
    X(void, window, (T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,             \
                     const int64_t *pos, int64_t wl, int64_t wr))                           \
    X(void, dropout, (T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,            \
                      const uint32_t *rk, uint32_t thresh))                                 \
    X(void, softmax_row, (const T *x, const uint8_t *mask, T *out, ptrdiff_t n))            \
    /* scores for <= 4 query rows by dot products (decode); NULL: use qk */                 \
    XO(void, qk_dot, (const T *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E, const T *Qr,     \
                      ptrdiff_t ldq, int R, T *S, ptrdiff_t lds, T scale))                  \
    /* backward (tiles with row stride FA_BWD_LDS) */                                       \
    X(void, bwd_p, (T *S, const T *dP, ptrdiff_t n, ptrdiff_t W, const T *lse,              \
                    double *acc))                                                           \
    X(void, bwd_ds, (T *S, T *dP, const T *G, ptrdiff_t n, ptrdiff_t W, const T *invZ,      \
                     const double *D))                                                      \
    X(void, ptq, (const T *Tl, ptrdiff_t n, ptrdiff_t ni, const T *X, ptrdiff_t ldx,        \
                  ptrdiff_t C, T *O, ptrdiff_t ldo))                                        \
    X(void, softcap_grad, (T *S, T *G, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, T cap))     \
    X(void, dropout_scale, (T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,      \
                            const uint32_t *rk, uint32_t thresh, T keep_scale))             \
    X(void, transpose, (const T *src, ptrdiff_t lds, ptrdiff_t R, ptrdiff_t C, T *dst,      \
                        ptrdiff_t ldd))                                                     \
    X(void, scale_row, (const T *x, T *out, ptrdiff_t n, double s))

#define FA_OP_FIELD(ret, name, params) ret (*name) params;
#define FA_DECLARE_OPS(TS, T)                                                               \
    typedef struct {                                                                        \
        int vw, mr, nv;           /* lanes per vector, tile rows, vectors per tile row */   \
        const char *name;                                                                   \
        FA_OPS_LIST(FA_OP_FIELD, FA_OP_FIELD, T)                                            \
    } fa_ops_##TS;

/* The Cython side declares every op once, with fused types (floating = float, double), as
 * the C name "FA_OP(<name>)".  Cython calls the float and the double specialization of such
 * a declaration __pyx_fuse_0<C name> and __pyx_fuse_1<C name>; these two macros turn them
 * into the op of the table selected at import.  Should a Cython release name them otherwise,
 * the build fails on the undefined names (and mixing up float and double fails on the
 * pointer types, -Werror=incompatible-pointer-types in setup.py), never silently. */
#define __pyx_fuse_0FA_OP(name) (FA_OPS_F->name)
#define __pyx_fuse_1FA_OP(name) (FA_OPS_D->name)

#endif /* FA_OPS_H */
