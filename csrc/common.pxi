# Declarations shared by the kernel families: the SIMD ops of the copy selected at import
# (fa_kernels.h, fa_ops.h), called with fused types.

from libc.stdint cimport int8_t, int32_t, int64_t, uint32_t, uint8_t
from libc.stddef cimport ptrdiff_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from libc.math cimport exp, log, INFINITY, NAN
from cython cimport floating

cdef extern from "fa_omp.h" nogil:
    int FA_OPENMP_ENABLED
    int fa_omp_max_threads()
    ctypedef struct fa_share:
        pass
    void fa_share_init(fa_share *s)
    ptrdiff_t fa_share_next(fa_share *s)

cdef extern from "fa_pool.h" nogil:
    # the kernels' thread pool: the caller runs the body at once, free helpers join it
    ctypedef void (*fa_body)(void *ctx) noexcept nogil
    int FA_POOL_ENABLED
    int fa_pool_run(int nt, fa_body fn, void *ctx, int wake)
    int fa_pool_helpers()
    int64_t fa_pool_set_spin_ns(int64_t ns)

cdef extern from "fa_scratch.h" nogil:
    void *fa_scratch_get(size_t nbytes)
    void fa_scratch_release(void *p)

cdef extern from "fa_kernels.h" nogil:
    # the ops of the SIMD copy selected at import, one declaration each (fa_ops.h explains
    # the C names); scalars of type floating are the copy's element type
    void k_qk "FA_OP(qk)"(const floating *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                          const floating *Qt, ptrdiff_t W, int pw_nv, floating *S,
                          ptrdiff_t lds, floating *cmax, floating *kpad, floating scale)
    void k_qk_dot "FA_OP(qk_dot)"(const floating *K, ptrdiff_t ldk, ptrdiff_t n, ptrdiff_t E,
                                  const floating *Qr, ptrdiff_t ldq, int R, floating *S,
                                  ptrdiff_t lds, floating scale)
    void k_colmax "FA_OP(colmax)"(const floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                  floating *cmax)
    void k_softmax "FA_OP(softmax)"(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                    const floating *cmax, floating *m, floating *l,
                                    floating *alpha)
    void k_pv_fast "FA_OP(pv)"(const floating *P, ptrdiff_t ldp, ptrdiff_t n,
                               const floating *V, ptrdiff_t ldv, ptrdiff_t Ev, floating *O,
                               ptrdiff_t ldo, const floating *alpha, ptrdiff_t rows)
    void k_pv_exact "FA_OP(pv_exact)"(const floating *P, ptrdiff_t ldp, ptrdiff_t n,
                                      const floating *V, ptrdiff_t ldv, ptrdiff_t Ev,
                                      floating *O, ptrdiff_t ldo, const floating *alpha,
                                      ptrdiff_t rows)
    int k_allfinite "FA_OP(allfinite)"(const floating *x, ptrdiff_t n)
    void k_softcap "FA_OP(softcap)"(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                    floating cap)
    void k_alibi "FA_OP(alibi)"(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                int64_t j0, const int64_t *pos, const floating *slope)
    void k_maskf "FA_OP(maskf)"(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                int64_t j0, const floating *M, const int64_t *moff,
                                int64_t msj, int uniform)
    void k_maskb "FA_OP(maskb)"(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                int64_t j0, const uint8_t *M, const int64_t *moff,
                                int64_t msj, int uniform)
    void k_window "FA_OP(window)"(floating *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                  int64_t j0, const int64_t *pos, int64_t wl, int64_t wr)
    void k_dropout "FA_OP(dropout)"(floating *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                                    int64_t j0, const uint32_t *rk, uint32_t thresh)
    void k_softmax_row "FA_OP(softmax_row)"(const floating *x, const uint8_t *mask,
                                            floating *out, ptrdiff_t n)
    void k_bwd_p "FA_OP(bwd_p)"(floating *S, const floating *dP, ptrdiff_t n, ptrdiff_t W,
                                const floating *lse, double *acc)
    void k_bwd_ds "FA_OP(bwd_ds)"(floating *S, floating *dP, const floating *G, ptrdiff_t n,
                                  ptrdiff_t W, const floating *invZ, const double *D)
    void k_ptq "FA_OP(ptq)"(const floating *Tl, ptrdiff_t n, ptrdiff_t ni, const floating *X,
                            ptrdiff_t ldx, ptrdiff_t C, floating *O, ptrdiff_t ldo)
    void k_softcap_grad "FA_OP(softcap_grad)"(floating *S, floating *G, ptrdiff_t lds,
                                              ptrdiff_t n, ptrdiff_t W, floating cap)
    void k_dropout_scale "FA_OP(dropout_scale)"(floating *P, ptrdiff_t lds, ptrdiff_t n,
                                                ptrdiff_t W, int64_t j0, const uint32_t *rk,
                                                uint32_t thresh, floating keep_scale)
    void k_transpose "FA_OP(transpose)"(const floating *src, ptrdiff_t lds, ptrdiff_t R,
                                        ptrdiff_t C, floating *dst, ptrdiff_t ldd)
    void k_scale_row "FA_OP(scale_row)"(const floating *x, floating *out, ptrdiff_t n,
                                        double s)
    # geometry of the selected copy (which: 0 lanes per vector, 1 tile rows, 2 vectors per
    # tile row, 3 has qk_dot)
    int fa_geometry(int is_float, int which)

    int FA_BWD_LDS
    int FA_BWD_MAXW
    int fa_select(int want)
    int fa_cpu_level()
    const char *fa_ops_name()
    uint32_t fa_row_key(uint32_t seed, uint32_t bh, uint32_t i)
    void fa_prefetch(const void *p, ptrdiff_t bytes, int kind)
    int fa_forked_child


# ---- geometry of the selected ops table, and P·V's two paths ------------------------------
# (sizeof(floating) is a constant of each specialization: no per-type branches here)

cdef inline int k_vw(floating *dummy) noexcept nogil:
    return fa_geometry(sizeof(floating) == 4, 0)

cdef inline int k_mr(floating *dummy) noexcept nogil:
    return fa_geometry(sizeof(floating) == 4, 1)

cdef inline int k_nv(floating *dummy) noexcept nogil:
    return fa_geometry(sizeof(floating) == 4, 2)

cdef inline int k_nr(floating *dummy) noexcept nogil:
    return k_vw(dummy) * k_nv(dummy)

cdef inline bint k_has_dot(floating *dummy) noexcept nogil:
    return fa_geometry(sizeof(floating) == 4, 3)

cdef inline void k_pv(const floating *P, ptrdiff_t ldp, ptrdiff_t n, const floating *V,
                      ptrdiff_t ldv, ptrdiff_t Ev, floating *O, ptrdiff_t ldo,
                      const floating *alpha, ptrdiff_t rows, bint exact) noexcept nogil:
    """P·V; exact: the zero-skipping variant (0 * NaN = NaN in the tile product)."""
    if exact:
        k_pv_exact(P, ldp, n, V, ldv, Ev, O, ldo, alpha, rows)
    else:
        k_pv_fast(P, ldp, n, V, ldv, Ev, O, ldo, alpha, rows)


# ---- small helpers ------------------------------------------------------------------------

cdef inline ptrdiff_t round_up(ptrdiff_t x, ptrdiff_t m) noexcept nogil:
    return (x + m - 1) // m * m

cdef inline int resolve_threads(int n_threads, ptrdiff_t n_items) noexcept nogil:
    # A forked child runs serially (the parent's helper threads do not exist there; fa_pool.h
    # would start new ones, but a child forked from a threaded parent is best kept simple).
    cdef int nt = n_threads
    if nt < 1:
        nt = 1
    if fa_forked_child or not FA_POOL_ENABLED:
        nt = 1
    if nt > n_items:
        nt = <int>n_items if n_items > 0 else 1
    return nt

cdef inline tuple shape4(Py_ssize_t *s):
    return (s[0], s[1], s[2], s[3])
