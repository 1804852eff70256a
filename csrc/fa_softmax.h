/*
 * fa_softmax.h -- the online softmax of the score tiles, the standalone row softmax
 * (fa.softmax) and the final rescale of an output row; once per (ISA, dtype) copy (included
 * by fa_kern_impl.h; no include guard on purpose).  The exponentials are VEXP / SEXP
 * (fa_exp.h, set up by fa_kern_impl.h).
 */

/* ------------------------------------------------------------ online softmax ------------ */
/* Per lane: m_new = max(m, cmax); alpha = exp(m - m_new); P = exp(S - m_new) in place;
 * l = l*alpha + sum_j P; m = m_new.  A lane whose keys are all -inf so far keeps m = -inf:
 * it subtracts 0 instead (exp(-inf - 0) = 0, never -inf - -inf = NaN), so P = 0, l stays 0
 * and the row ends as out = 0, lse = -inf. */
/* The sum runs down a column (one lane per query row, n sequential adds), so it is
 * compensated (Kahan): a plain float32 running sum over a 1000-key row drifted ~1e-6 relative,
 * beyond the tolerance of 2x a pairwise-summing NumPy reference.  3 extra adds per vector. */
FA_INL void FN(fa_softmax_group_)(const int G, FA_T *S, ptrdiff_t lds, ptrdiff_t n,
                                  const FA_T *cmax, FA_T *m, FA_T *l, FA_T *alpha)
{
    VT mu[4], sum[4], comp[4];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
        VT mo = LD(m + g * FA_VW);
        VT mn = VMAX(mo, LD(cmax + g * FA_VW));
        ST(m + g * FA_VW, mn);
        VI dead = mn == BC(T_NEG_INF);
        mu[g] = SEL(dead, BC(0), mn);
        ST(alpha + g * FA_VW, VEXP(mo - mu[g]));
        sum[g] = BC(0);
        comp[g] = BC(0);
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        FA_T *row = S + j * lds;
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            VT p = VEXP(LD(row + g * FA_VW) - mu[g]);
            ST(row + g * FA_VW, p);
            VT y = p - comp[g];
            VT t = sum[g] + y;
            comp[g] = (t - sum[g]) - y;
            sum[g] = t;
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
        ST(l + g * FA_VW, LD(l + g * FA_VW) * LD(alpha + g * FA_VW) + (sum[g] - comp[g]));
}

FA_FN void FN(fa_softmax)(FA_T *S, ptrdiff_t lds, ptrdiff_t n, ptrdiff_t W, const FA_T *cmax,
                          FA_T *m, FA_T *l, FA_T *alpha)
{
    ptrdiff_t i = 0;
    for (; i + 4 * FA_VW <= W; i += 4 * FA_VW)
        FN(fa_softmax_group_)(4, S + i, lds, n, cmax + i, m + i, l + i, alpha + i);
    for (; i < W; i += FA_VW)
        FN(fa_softmax_group_)(1, S + i, lds, n, cmax + i, m + i, l + i, alpha + i);
}

/* --------------------------------------------------------- standalone softmax ----------- */
/* One row: out = softmax(x) over kept entries (mask NULL = all kept); masked -> 0; a row with
 * nothing kept, or only -inf, -> all zeros.  Three passes over an L1/L2 row. */
FA_FN void FN(fa_softmax_row)(const FA_T *x, const uint8_t *mask, FA_T *out, ptrdiff_t n)
{
    ptrdiff_t i;
    if (mask)
        for (i = 0; i < n; i++) out[i] = mask[i] ? x[i] : T_NEG_INF;
    else if (out != x)
        for (i = 0; i < n; i++) out[i] = x[i];
    VT mv = BC(T_NEG_INF);
    for (i = 0; i + FA_VW <= n; i += FA_VW) mv = VMAX(mv, LD(out + i));
    FA_T m = T_NEG_INF;
    for (int k = 0; k < FA_VW; k++) m = m < mv[k] ? mv[k] : m;
    for (; i < n; i++) m = m < out[i] ? out[i] : m;
    if (m == T_NEG_INF) {
        for (i = 0; i < n; i++) out[i] = 0;
        return;
    }
    VT sv = BC(0), cv = BC(0);               /* compensated, as in fa_softmax_group_ */
    for (i = 0; i + FA_VW <= n; i += FA_VW) {
        VT p = VEXP(LD(out + i) - m);
        ST(out + i, p);
        VT y = p - cv, t = sv + y;
        cv = (t - sv) - y;
        sv = t;
    }
    sv -= cv;
    FA_T s = 0;
    for (; i < n; i++) { out[i] = SEXP(out[i] - m); s += out[i]; }
    for (int k = 0; k < FA_VW; k++) s += sv[k];
    FA_T inv = (FA_T)1 / s;
    for (i = 0; i < n; i++) out[i] *= inv;
}

/* out = x * s with the product in double: one rounding per output element (the forward's
 * O / l; float32 O * (1/l) in float would round twice).  A plain loop that -O3 vectorizes
 * under this copy's target attribute; the Cython loop it replaced ran as SSE2 scalar code. */
FA_FN void FN(fa_scale_row)(const FA_T *x, FA_T *out, ptrdiff_t n, double s)
{
    for (ptrdiff_t c = 0; c < n; c++) out[c] = (FA_T)((double)x[c] * s);
}
