/*
 * fa_scores.h -- the score pipeline's modifiers and the dropout on the weights, once per
 * (ISA, dtype) copy (included by fa_kern_impl.h, which defines FA_T, FN, ...; no include
 * guard on purpose).  The forward (attend_rows) and the backward (bwd_sweep1) apply them in
 * the spec's order: softcap, ALiBi, float mask, bool mask, window; the last three replace by
 * -inf, so NaN scores of masked keys cannot survive.  A new score option is one function here,
 * one entry of FA_OPS_LIST (fa_ops.h), and its call in the pipeline of forward.pxi and
 * backward.pxi.
 */

/* ------------------------------------------------------- score modifiers ---------------- */
/* Plain loops over the contiguous lane dimension: the compiler vectorizes them for the
 * function's target ISA.  All of them touch only rows j < n and lanes < W. */

#if FA_ISF
/* The float softcap is evaluated in double and rounded once at the end: tanh|x| =
 * (1-e)/(1+e), e = exp(-2|x|), and |x| - |x|^3/3 near 0 where 1-e cancels.  Branch-free, so
 * the loops vectorize.  The forward (fa_softcap) and the backward (fa_softcap_grad) both use
 * it: the backward's scores are the forward's, bit for bit. */
FA_INL double FN(fa_tanh_abs_)(double ax)
{
    double e = fa_expd(-2.0 * ax);
    double t = (1.0 - e) / (1.0 + e);
    return ax < 1e-4 ? ax - ax * ax * ax * (1.0 / 3.0) : t;
}
FA_INL float FN(fa_softcap_f_)(float sf, double cap)
{
    double x = (double)sf / cap, ax = x < 0 ? -x : x;
    double t = FN(fa_tanh_abs_)(ax);
    return (float)(cap * (x < 0 ? -t : t));
}
#endif

FA_FN void FN(fa_softcap)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, FA_T cap)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        for (ptrdiff_t i = 0; i < W; i++)
#if FA_ISF
            s[i] = FN(fa_softcap_f_)(s[i], (double)cap);
#else
            s[i] = cap * tanh(s[i] / cap);   /* libm: float64 needs full precision */
#endif
    }
}

/* s -= slope * |pos - j| */
FA_FN void FN(fa_alibi)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const int64_t *pos, const FA_T *slope)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jj = j0 + j;
        for (ptrdiff_t i = 0; i < W; i++) {
            int64_t d = pos[i] - jj;
            d = d < 0 ? -d : d;
            s[i] -= slope[i] * (FA_T)d;
        }
    }
}

/* float mask: s = -inf if mf == -inf else s + mf, mf = M[moff[lane] + (j0+j)*msj].
 * uniform: every lane reads moff[0] (mask broadcast over query rows/heads) */
FA_FN void FN(fa_maskf)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const FA_T *M, const int64_t *moff, int64_t msj, int uniform)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jo = (j0 + j) * msj;
        if (uniform) {
            FA_T mf = M[moff[0] + jo];
            if (mf == T_NEG_INF)
                for (ptrdiff_t i = 0; i < W; i++) s[i] = T_NEG_INF;
            else
                for (ptrdiff_t i = 0; i < W; i++) s[i] += mf;
        } else {
            for (ptrdiff_t i = 0; i < W; i++) {
                FA_T mf = M[moff[i] + jo];
                s[i] = mf == T_NEG_INF ? T_NEG_INF : s[i] + mf;
            }
        }
    }
}

/* bool keep-mask: s = -inf where M[...] == 0 */
FA_FN void FN(fa_maskb)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                        const uint8_t *M, const int64_t *moff, int64_t msj, int uniform)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jo = (j0 + j) * msj;
        if (uniform) {
            if (M[moff[0] + jo] == 0)
                for (ptrdiff_t i = 0; i < W; i++) s[i] = T_NEG_INF;
        } else {
            for (ptrdiff_t i = 0; i < W; i++)
                s[i] = M[moff[i] + jo] ? s[i] : T_NEG_INF;
        }
    }
}

/* causal / sliding window: key j allowed iff pos - wl <= j <= pos + wr */
FA_FN void FN(fa_window)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                         const int64_t *pos, int64_t wl, int64_t wr)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds;
        int64_t jj = j0 + j;
        for (ptrdiff_t i = 0; i < W; i++)
            s[i] = (jj < pos[i] - wl || jj > pos[i] + wr) ? T_NEG_INF : s[i];
    }
}

/* softcap with its derivative: S <- cap * tanh(S / cap) exactly as fa_softcap computes it
 * (the forward's scores, bit for bit), and G <- 1 - tanh^2 (float: from the double tanh). */
FA_FN void FN(fa_softcap_grad)(FA_T *S, FA_T *G, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W,
                               FA_T cap)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *s = S + j * lds, *g = G + j * lds;
        for (ptrdiff_t i = 0; i < W; i++) {
#if FA_ISF
            double x = (double)s[i] / (double)cap, ax = x < 0 ? -x : x;
            double t = FN(fa_tanh_abs_)(ax);
            s[i] = (float)((double)cap * (x < 0 ? -t : t));
            g[i] = (float)(1.0 - t * t);
#else
            FA_T t = tanh(s[i] / cap);
            s[i] = cap * t;
            g[i] = 1 - t * t;
#endif
        }
    }
}

/* ---------------------------------------------------------- dropout ------------------ */
/* dropout on the weights: P = 0 where bits(seed, bh, i, j) < thresh (fa_dropout.h; rk[lane]
 * is fa_row_key(seed, bh, i) precomputed per lane).  The 1/(1-p) factor is applied at the end. */
FA_FN void FN(fa_dropout)(FA_T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                          const uint32_t *rk, uint32_t thresh)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *p = P + j * lds;
        uint32_t jc = fa_drop_col(j0 + j);
        for (ptrdiff_t i = 0; i < W; i++) {
            uint32_t x = fa_drop_bits(rk[i], jc);
            p[i] = x < thresh ? (FA_T)0 : p[i];
        }
    }
}

/* dropout on dP: dP <- dP * keep_scale where the spec hash keeps (i, j), 0 where it drops */
FA_FN void FN(fa_dropout_scale)(FA_T *P, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, int64_t j0,
                                const uint32_t *rk, uint32_t thresh, FA_T keep_scale)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *p = P + j * lds;
        uint32_t jc = fa_drop_col(j0 + j);
        for (ptrdiff_t i = 0; i < W; i++) {
            uint32_t x = fa_drop_bits(rk[i], jc);
            p[i] = x < thresh ? (FA_T)0 : p[i] * keep_scale;
        }
    }
}
