# Declarations shared by the kernel families, and thin fused wrappers that route a
# float/double call to the SIMD ops table selected at import (fa_kernels.h).

from libc.stdint cimport int64_t, uint32_t, uint8_t
from libc.stddef cimport ptrdiff_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from libc.math cimport exp, log, INFINITY, NAN
from cython cimport floating
from cython.parallel cimport prange, parallel

cdef extern from "fa_omp.h" nogil:
    int FA_OPENMP_ENABLED
    int fa_omp_max_threads()

cdef extern from "fa_scratch.h" nogil:
    void *fa_scratch_get(size_t nbytes)
    void fa_scratch_release(void *p)

cdef extern from "fa_kernels.h" nogil:
    ctypedef struct fa_ops_f:
        int vw, mr, nv
        const char *name
        void (*qk)(const float *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E, const float *Qt,
                   ptrdiff_t W, int pw_nv, float *S, ptrdiff_t lds, float *cmax,
                   float *kpad, float scale) noexcept nogil
        void (*colmax)(const float *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                       float *cmax) noexcept nogil
        void (*softmax)(float *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, const float *cmax,
                        float *m, float *l, float *alpha) noexcept nogil
        void (*pv)(const float *P, ptrdiff_t ldp, ptrdiff_t n, const float *V, ptrdiff_t ldv,
                   ptrdiff_t Ev, float *O, ptrdiff_t ldo, const float *alpha,
                   ptrdiff_t rows) noexcept nogil
        void (*pv_exact)(const float *P, ptrdiff_t ldp, ptrdiff_t n, const float *V,
                         ptrdiff_t ldv, ptrdiff_t Ev, float *O, ptrdiff_t ldo,
                         const float *alpha, ptrdiff_t rows) noexcept nogil
        int (*allfinite)(const float *x, ptrdiff_t n) noexcept nogil
        void (*softcap)(float *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                        float cap) noexcept nogil
        void (*alibi)(float *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                      const int64_t *pos, const float *slope) noexcept nogil
        void (*maskf)(float *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                      const float *M, const int64_t *moff, int64_t msj,
                      int uniform) noexcept nogil
        void (*maskb)(float *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                      const uint8_t *M, const int64_t *moff, int64_t msj,
                      int uniform) noexcept nogil
        void (*window)(float *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                       const int64_t *pos, int64_t wl, int64_t wr) noexcept nogil
        void (*dropout)(float *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const uint32_t *rk, uint32_t thresh) noexcept nogil
        void (*softmax_row)(const float *x, const uint8_t *mask, float *out,
                            ptrdiff_t n) noexcept nogil
        void (*qk_dot)(const float *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                       const float *Qr, ptrdiff_t ldq, int R, float *S,
                       ptrdiff_t lds, float scale) noexcept nogil
        void (*qkt)(const float *Kt, ptrdiff_t ldkt, ptrdiff_t n, ptrdiff_t E,
                    const float *Qt, ptrdiff_t W, int pw_nv, float *S,
                    float scale) noexcept nogil
        void (*bwd_p)(float *S, const float *dP, ptrdiff_t n, ptrdiff_t W, const float *lse,
                      double *acc) noexcept nogil
        void (*bwd_ds)(float *S, float *dP, const float *G, ptrdiff_t n, ptrdiff_t W,
                       const float *invZ, const double *D) noexcept nogil
        void (*ptq)(const float *Tl, ptrdiff_t n, ptrdiff_t ni, const float *X, ptrdiff_t ldx,
                    ptrdiff_t C, float *O, ptrdiff_t ldo) noexcept nogil
        void (*softcap_grad)(float *S, float *G, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                             float cap) noexcept nogil
        void (*dropout_scale)(float *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                              const uint32_t *rk, uint32_t thresh,
                              float keep_scale) noexcept nogil
        void (*transpose)(const float *src, ptrdiff_t lds, ptrdiff_t R, ptrdiff_t C, float *dst,
                          ptrdiff_t ldd) noexcept nogil
        void (*scale_row)(const float *x, float *out, ptrdiff_t n, double s) noexcept nogil

    ctypedef struct fa_ops_d:
        int vw, mr, nv
        const char *name
        void (*qk)(const double *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E, const double *Qt,
                   ptrdiff_t W, int pw_nv, double *S, ptrdiff_t lds, double *cmax,
                   double *kpad, double scale) noexcept nogil
        void (*colmax)(const double *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                       double *cmax) noexcept nogil
        void (*softmax)(double *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                        const double *cmax, double *m, double *l,
                        double *alpha) noexcept nogil
        void (*pv)(const double *P, ptrdiff_t ldp, ptrdiff_t n, const double *V,
                   ptrdiff_t ldv, ptrdiff_t Ev, double *O, ptrdiff_t ldo,
                   const double *alpha, ptrdiff_t rows) noexcept nogil
        void (*pv_exact)(const double *P, ptrdiff_t ldp, ptrdiff_t n, const double *V,
                         ptrdiff_t ldv, ptrdiff_t Ev, double *O, ptrdiff_t ldo,
                         const double *alpha, ptrdiff_t rows) noexcept nogil
        int (*allfinite)(const double *x, ptrdiff_t n) noexcept nogil
        void (*softcap)(double *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                        double cap) noexcept nogil
        void (*alibi)(double *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                      const int64_t *pos, const double *slope) noexcept nogil
        void (*maskf)(double *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                      const double *M, const int64_t *moff, int64_t msj,
                      int uniform) noexcept nogil
        void (*maskb)(double *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                      const uint8_t *M, const int64_t *moff, int64_t msj,
                      int uniform) noexcept nogil
        void (*window)(double *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                       const int64_t *pos, int64_t wl, int64_t wr) noexcept nogil
        void (*dropout)(double *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const uint32_t *rk, uint32_t thresh) noexcept nogil
        void (*softmax_row)(const double *x, const uint8_t *mask, double *out,
                            ptrdiff_t n) noexcept nogil
        void (*qk_dot)(const double *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                       const double *Qr, ptrdiff_t ldq, int R, double *S,
                       ptrdiff_t lds, double scale) noexcept nogil
        void (*qkt)(const double *Kt, ptrdiff_t ldkt, ptrdiff_t n, ptrdiff_t E,
                    const double *Qt, ptrdiff_t W, int pw_nv, double *S,
                    double scale) noexcept nogil
        void (*bwd_p)(double *S, const double *dP, ptrdiff_t n, ptrdiff_t W, const double *lse,
                      double *acc) noexcept nogil
        void (*bwd_ds)(double *S, double *dP, const double *G, ptrdiff_t n, ptrdiff_t W,
                       const double *invZ, const double *D) noexcept nogil
        void (*ptq)(const double *Tl, ptrdiff_t n, ptrdiff_t ni, const double *X, ptrdiff_t ldx,
                    ptrdiff_t C, double *O, ptrdiff_t ldo) noexcept nogil
        void (*softcap_grad)(double *S, double *G, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                             double cap) noexcept nogil
        void (*dropout_scale)(double *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                              const uint32_t *rk, uint32_t thresh,
                              double keep_scale) noexcept nogil
        void (*transpose)(const double *src, ptrdiff_t lds, ptrdiff_t R, ptrdiff_t C, double *dst,
                          ptrdiff_t ldd) noexcept nogil
        void (*scale_row)(const double *x, double *out, ptrdiff_t n, double s) noexcept nogil

    const fa_ops_f *FA_OPS_F
    int FA_BWD_LDS
    int FA_BWD_MAXW
    const fa_ops_d *FA_OPS_D
    int fa_select(int want)
    int fa_cpu_level()
    const char *fa_ops_name()
    uint32_t fa_row_key(uint32_t seed, uint32_t bh, uint32_t i)
    void fa_prefetch(const void *p, ptrdiff_t bytes)
    int fa_forked_child


# ---- geometry of the selected ops table -------------------------------------------------

cdef inline int k_vw(floating *dummy) noexcept nogil:
    if floating is float:
        return FA_OPS_F.vw
    else:
        return FA_OPS_D.vw

cdef inline int k_nr(floating *dummy) noexcept nogil:
    if floating is float:
        return FA_OPS_F.vw * FA_OPS_F.nv
    else:
        return FA_OPS_D.vw * FA_OPS_D.nv

cdef inline int k_mr(floating *dummy) noexcept nogil:
    if floating is float:
        return FA_OPS_F.mr
    else:
        return FA_OPS_D.mr

cdef inline int k_nv(floating *dummy) noexcept nogil:
    if floating is float:
        return FA_OPS_F.nv
    else:
        return FA_OPS_D.nv


# ---- fused wrappers (one branch, resolved at Cython compile time) ------------------------

cdef inline void k_qk(const floating *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                      const floating *Qt, ptrdiff_t W, int pw_nv, floating *S, ptrdiff_t lds,
                      floating *cmax, floating *kpad, double scale) noexcept nogil:
    if floating is float:
        FA_OPS_F.qk(K, ldk, n, E, Qt, W, pw_nv, S, lds, cmax, kpad, <float>scale)
    else:
        FA_OPS_D.qk(K, ldk, n, E, Qt, W, pw_nv, S, lds, cmax, kpad, scale)

cdef inline bint k_has_dot(floating *dummy) noexcept nogil:
    if floating is float:
        return FA_OPS_F.qk_dot != NULL
    else:
        return FA_OPS_D.qk_dot != NULL

cdef inline void k_qk_dot(const floating *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                          const floating *Qr, ptrdiff_t ldq, int R, floating *S,
                          ptrdiff_t lds, double scale) noexcept nogil:
    if floating is float:
        FA_OPS_F.qk_dot(K, ldk, n, E, Qr, ldq, R, S, lds, <float>scale)
    else:
        FA_OPS_D.qk_dot(K, ldk, n, E, Qr, ldq, R, S, lds, scale)

cdef inline void k_colmax(const floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                          floating *cmax) noexcept nogil:
    if floating is float:
        FA_OPS_F.colmax(S, lds, n, W, cmax)
    else:
        FA_OPS_D.colmax(S, lds, n, W, cmax)

cdef inline void k_softmax(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                           const floating *cmax, floating *m, floating *l,
                           floating *alpha) noexcept nogil:
    if floating is float:
        FA_OPS_F.softmax(S, lds, n, W, cmax, m, l, alpha)
    else:
        FA_OPS_D.softmax(S, lds, n, W, cmax, m, l, alpha)

cdef inline void k_pv(const floating *P, ptrdiff_t ldp, ptrdiff_t n, const floating *V,
                      ptrdiff_t ldv, ptrdiff_t Ev, floating *O, ptrdiff_t ldo,
                      const floating *alpha, ptrdiff_t rows, bint exact) noexcept nogil:
    if floating is float:
        if exact:
            FA_OPS_F.pv_exact(P, ldp, n, V, ldv, Ev, O, ldo, alpha, rows)
        else:
            FA_OPS_F.pv(P, ldp, n, V, ldv, Ev, O, ldo, alpha, rows)
    else:
        if exact:
            FA_OPS_D.pv_exact(P, ldp, n, V, ldv, Ev, O, ldo, alpha, rows)
        else:
            FA_OPS_D.pv(P, ldp, n, V, ldv, Ev, O, ldo, alpha, rows)

cdef inline int k_allfinite(const floating *x, ptrdiff_t n) noexcept nogil:
    if floating is float:
        return FA_OPS_F.allfinite(x, n)
    else:
        return FA_OPS_D.allfinite(x, n)

cdef inline void k_softcap(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                           double cap) noexcept nogil:
    if floating is float:
        FA_OPS_F.softcap(S, lds, n, W, <float>cap)
    else:
        FA_OPS_D.softcap(S, lds, n, W, cap)

cdef inline void k_alibi(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                         const int64_t *pos, const floating *slope) noexcept nogil:
    if floating is float:
        FA_OPS_F.alibi(S, lds, n, W, j0, pos, slope)
    else:
        FA_OPS_D.alibi(S, lds, n, W, j0, pos, slope)

cdef inline void k_maskf(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                         const floating *M, const int64_t *moff, int64_t msj,
                         int uniform) noexcept nogil:
    if floating is float:
        FA_OPS_F.maskf(S, lds, n, W, j0, M, moff, msj, uniform)
    else:
        FA_OPS_D.maskf(S, lds, n, W, j0, M, moff, msj, uniform)

cdef inline void k_maskb(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                         const uint8_t *M, const int64_t *moff, int64_t msj,
                         int uniform) noexcept nogil:
    if floating is float:
        FA_OPS_F.maskb(S, lds, n, W, j0, M, moff, msj, uniform)
    else:
        FA_OPS_D.maskb(S, lds, n, W, j0, M, moff, msj, uniform)

cdef inline void k_window(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                          const int64_t *pos, int64_t wl, int64_t wr) noexcept nogil:
    if floating is float:
        FA_OPS_F.window(S, lds, n, W, j0, pos, wl, wr)
    else:
        FA_OPS_D.window(S, lds, n, W, j0, pos, wl, wr)

cdef inline void k_dropout(floating *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                           const uint32_t *rk, uint32_t thresh) noexcept nogil:
    if floating is float:
        FA_OPS_F.dropout(P, lds, n, W, j0, rk, thresh)
    else:
        FA_OPS_D.dropout(P, lds, n, W, j0, rk, thresh)

cdef inline void k_softmax_row(const floating *x, const uint8_t *mask, floating *out,
                               ptrdiff_t n) noexcept nogil:
    if floating is float:
        FA_OPS_F.softmax_row(x, mask, out, n)
    else:
        FA_OPS_D.softmax_row(x, mask, out, n)


cdef inline void k_qkt(const floating *Kt, ptrdiff_t ldkt, ptrdiff_t n, ptrdiff_t E,
                       const floating *Qt, ptrdiff_t W, int pw_nv, floating *S,
                       double scale) noexcept nogil:
    if floating is float:
        FA_OPS_F.qkt(Kt, ldkt, n, E, Qt, W, pw_nv, S, <float>scale)
    else:
        FA_OPS_D.qkt(Kt, ldkt, n, E, Qt, W, pw_nv, S, scale)

cdef inline void k_bwd_p(floating *S, const floating *dP, ptrdiff_t n, ptrdiff_t W,
                         const floating *lse, double *acc) noexcept nogil:
    if floating is float:
        FA_OPS_F.bwd_p(S, dP, n, W, lse, acc)
    else:
        FA_OPS_D.bwd_p(S, dP, n, W, lse, acc)

cdef inline void k_bwd_ds(floating *S, floating *dP, const floating *G, ptrdiff_t n,
                          ptrdiff_t W, const floating *invZ, const double *D) noexcept nogil:
    if floating is float:
        FA_OPS_F.bwd_ds(S, dP, G, n, W, invZ, D)
    else:
        FA_OPS_D.bwd_ds(S, dP, G, n, W, invZ, D)

cdef inline void k_ptq(const floating *T, ptrdiff_t n, ptrdiff_t ni, const floating *X,
                       ptrdiff_t ldx, ptrdiff_t C, floating *O, ptrdiff_t ldo) noexcept nogil:
    if floating is float:
        FA_OPS_F.ptq(T, n, ni, X, ldx, C, O, ldo)
    else:
        FA_OPS_D.ptq(T, n, ni, X, ldx, C, O, ldo)

cdef inline void k_softcap_grad(floating *S, floating *G, ptrdiff_t lds, ptrdiff_t n,
                                ptrdiff_t W, double cap) noexcept nogil:
    if floating is float:
        FA_OPS_F.softcap_grad(S, G, lds, n, W, <float>cap)
    else:
        FA_OPS_D.softcap_grad(S, G, lds, n, W, cap)

cdef inline void k_dropout_scale(floating *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                 int64_t j0, const uint32_t *rk, uint32_t thresh,
                                 double keep_scale) noexcept nogil:
    if floating is float:
        FA_OPS_F.dropout_scale(P, lds, n, W, j0, rk, thresh, <float>keep_scale)
    else:
        FA_OPS_D.dropout_scale(P, lds, n, W, j0, rk, thresh, keep_scale)


cdef inline void k_transpose(const floating *src, ptrdiff_t lds, ptrdiff_t R, ptrdiff_t C,
                             floating *dst, ptrdiff_t ldd) noexcept nogil:
    if floating is float:
        FA_OPS_F.transpose(src, lds, R, C, dst, ldd)
    else:
        FA_OPS_D.transpose(src, lds, R, C, dst, ldd)


cdef inline void k_scale_row(const floating *x, floating *out, ptrdiff_t n,
                             double s) noexcept nogil:
    if floating is float:
        FA_OPS_F.scale_row(x, out, n, s)
    else:
        FA_OPS_D.scale_row(x, out, n, s)


# ---- small helpers ------------------------------------------------------------------------

cdef inline ptrdiff_t round_up(ptrdiff_t x, ptrdiff_t m) noexcept nogil:
    return (x + m - 1) // m * m

cdef inline int resolve_threads(int n_threads, ptrdiff_t n_items) noexcept nogil:
    # A forked child of a process that already used libgomp must not enter a parallel region
    # with > 1 thread (the pool's threads do not exist in the child): run serially there.
    cdef int nt = n_threads
    if nt < 1:
        nt = 1
    if fa_forked_child or not FA_OPENMP_ENABLED:
        nt = 1
    if nt > n_items:
        nt = <int>n_items if n_items > 0 else 1
    return nt

cdef inline tuple shape4(Py_ssize_t *s):
    return (s[0], s[1], s[2], s[3])
