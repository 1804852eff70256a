# FlashAttention-2 backward (docs/KERNELS.md, last section).
#
# Work item = (batch, kv head, chunk of query blocks).  An item owns the dk/dv rows of its kv
# head (or, when there are too few kv heads to keep the threads busy, a private partial copy
# summed afterwards in a fixed order), and every query block belongs to exactly one item, so
# nothing is shared between threads: no atomics, and the same bits on every run whatever the
# schedule.  Per query block (W rows of one query head, Q and dO packed as the forward packs Q):
#   sweep 1, for each key sub-block [ja, jb) of the band (touching lanes [lo, hi)):
#         S  = K·Qᵀ, dPᵀ = V·dOᵀ          (the forward's fa_qk on the K/V rows in place; tiles
#                                          T[key][lane] as in the forward, kept for sweep 2)
#         softcap (+ its derivative), ALiBi, masks, window edge: the forward's score pipeline
#         dP *= keep/(1-p);  P = exp(S - lse);  Z += sum_j P,  D += sum_j P dP   (fa_bwd_p)
#   sweep 2, over the kept tiles:
#         P /= Z;  dS = P (dP - D/Z) [* softcap'];  Pd = P * keep          (fa_bwd_ds)
#         dV[ja:jb] += Pdᵀ·dO,  dK[ja:jb] += dSᵀ·Q                          (fa_ptq)
#         dQ_blk    += dS·K                                                 (fa_pv)
#     dq rows = scale * dQ_blk
# then dk *= scale, dv *= 1/(1-p).
# In exact arithmetic Z = 1 and D/Z is the spec's rowsum(dO * O).  In floating point, taking
# both from the tiles that form dS keeps float32 gradients within the tolerance where a row's
# attention sits on one key (fa_bwd_p says why); `out` is not read.  The price is keeping a
# block's tiles between the sweeps: W x band x 8 bytes per thread (0.9 MB at S = 1024, 15 MB
# at S = 16384 for float32), or, past BWD_KEEP_BYTES, recomputing them in sweep 2 (same code,
# same bits).
# Sub-blocks are Bk keys where the band covers every lane of the block and DB keys where its
# edge cuts through, so a causal diagonal costs little more than its triangle.  Keys outside
# the band are never read.

from libc.string cimport memcpy
from libc.stdlib cimport calloc
from libc.math cimport ldexp

# Block sizes: AttnProblem.tune (problem.pxi; defaults 96 query rows per block, 96 keys per
# interior sub-block, 24 per band-edge sub-block).


ctypedef struct BwdArgs:
    const char *dout
    const char *flse                 # the forward's lse
    char *dq
    char *dk
    char *dv
    char *dsinks                     # (Hq,) T, has_sinks only
    double *rowsink                  # has_sinks: per query row, P_sink * D (summed at the end)
    char *kpart                      # C > 1: [C-1][B*Hkv][S][E] partial dk of chunks 1.. (chunk
    char *vpart                      #        0 writes dk/dv itself), [C-1][B*Hkv][S][Ev] dv
    ptrdiff_t W, Bk, DB              # block sizes
    ptrdiff_t nqb                    # query blocks per head
    ptrdiff_t U                      # units = (query head of the group, query block) per kv head
    ptrdiff_t C                      # chunks of units per kv head
    ptrdiff_t *ubound                # [C + 1] unit boundaries of the chunks (cost-balanced)
    ptrdiff_t ldq                    # row stride of the dQ block accumulator
    ptrdiff_t trows                  # rows of the tiles: longest band (or sub-block) + slack
    bint keep                        # tiles kept between the sweeps (else recomputed)


ctypedef struct BwdWork:             # per-thread scratch
    char *base                       # small buffers (fa_scratch.h, kept between calls)
    char *big                        # O(S) buffers, malloc'ed per call: S, dP, G
    const char *K                    # the item's kv head's K rows, [S][E] (the caller's)
    const char *V                    #                      V rows, [S][Ev]
    char *S                          # the block's band: S, then P, then Pd  [trows][FA_BWD_LDS]
    char *dP                         #                   dP, then dS
    char *G                          #                   softcap derivative (softcap only)
    char *Qt                         # packed query block, panels [W/pw][E][pw]
    char *dOt                        # packed dO block, panels [W/pw][Ev][pw]
    char *dQ                         # dQ of the block, [W + 16][ldq]
    char *kpad                       # fa_qk's zero-padded last key strip, [FA_MR][max(E, Ev)]
    char *lse                        # per lane: lse (+inf for rows without keys)
    double *acc                      #           sweep-1 sums Z, D (double), FA_BWD_LDS apart
    double *acc2                     #           the same, discarded (sweep 2 recomputing)
    char *invZ                       #           1 / sum_j P
    double *D                        #           sum_j P dP / sum_j P (double: see fa_bwd_ds)
    char *slope                      #           ALiBi slope
    char *ones                       #           1 (fa_pv's rescale factor)
    int64_t *pos                     #           query position i + q_offset
    int64_t *moff                    #           mask offset of row (b, h, i)
    uint32_t *rk                     #           dropout row key


cdef BwdWork *bwd_work_new(AttnProblem *p, BwdArgs *a, floating *dummy) noexcept nogil:
    cdef size_t t = sizeof(floating)
    cdef ptrdiff_t wcap = a.W + 16
    cdef size_t sz[15]
    sz[0] = _al(a.W * p.E * t + t)
    sz[1] = _al(a.W * p.Ev * t + t)
    sz[2] = _al(wcap * a.ldq * t)
    sz[3] = sz[4] = sz[6] = sz[7] = _al(wcap * t)
    sz[5] = sz[8] = sz[9] = _al(wcap * 8)
    sz[10] = _al(wcap * 4)
    sz[11] = _al(sizeof(BwdWork))
    sz[12] = _al(2 * FA_BWD_LDS * 8)
    sz[13] = _al(k_mr(dummy) * max(p.E, p.Ev) * t + t)
    cdef size_t total = 64 + sz[12], i
    for i in range(14):
        total += sz[i]
    cdef char *base = <char *>fa_scratch_get(total)
    if base == NULL:
        return NULL
    cdef char *c = <char *>(((<size_t>base) + 63) & ~(<size_t>63))
    cdef BwdWork *w = <BwdWork *>c
    c += sz[11]
    w.base = base
    w.Qt = c; c += sz[0]
    w.dOt = c; c += sz[1]
    w.dQ = c; c += sz[2]
    w.lse = c; c += sz[3]
    w.invZ = c; c += sz[4]
    w.D = <double *>c; c += sz[5]
    w.slope = c; c += sz[6]
    w.ones = c; c += sz[7]
    w.pos = <int64_t *>c; c += sz[8]
    w.moff = <int64_t *>c; c += sz[9]
    w.rk = <uint32_t *>c; c += sz[10]
    w.acc = <double *>c; c += sz[12]
    w.acc2 = <double *>c; c += sz[12]
    w.kpad = c
    # Lanes past the block's rows are read by the tile kernels (whole panels): keep every
    # per-lane array finite and defined.
    memset(w.lse, 0, sz[3] + sz[4] + sz[5] + sz[6] + sz[7] + sz[8] + sz[9] + sz[10] + 2 * sz[12])
    for i in range(<size_t>wcap):
        (<floating *>w.ones)[i] = 1
    # The O(S) part: own malloc, freed after the call (the TLS scratch is kept between calls).
    # Tiles are written before being read (fa_qk, fa_softcap_grad); nothing past a
    # sub-block's rows or lanes is read.
    cdef size_t tile = _al(a.trows * FA_BWD_LDS * t)
    w.big = <char *>malloc((3 if p.softcap > 0 else 2) * tile + 64)
    if w.big == NULL:
        return NULL
    c = <char *>(((<size_t>w.big) + 63) & ~(<size_t>63))
    w.S = c; c += tile
    w.dP = c; c += tile
    w.G = c if p.softcap > 0 else NULL
    return w


cdef inline void bwd_work_free(BwdWork *w) noexcept nogil:
    if w != NULL:
        free(w.big)
        fa_scratch_release(w.base)


cdef void pack_panels(const floating *X, ptrdiff_t rows, ptrdiff_t W, ptrdiff_t pw,
                      ptrdiff_t E, floating *Xt) noexcept nogil:
    """The forward's Q packing: panels [W/pw][E][pw], lanes r < rows from the rows of X,
    zero lanes past them."""
    cdef ptrdiff_t p0 = 0, n, e, r
    while p0 < W:
        n = min(pw, rows - p0) if rows > p0 else 0
        if n > 0:
            k_transpose(X + p0 * E, E, n, E, Xt + p0 * E, pw)
        if n < pw:
            for e in range(E):
                for r in range(n, pw):
                    Xt[p0 * E + e * pw + r] = 0
        p0 += pw


ctypedef struct SubBlock:            # one key sub-block of a query block's band
    int64_t ja, jb                   # keys
    ptrdiff_t lo, hi, Wt             # lanes [lo, hi) may attend them; tiles cover [lo, lo + Wt)
    ptrdiff_t r0                     # first tile row (ja - jlo)
    bint win_partial                 # the band edge cuts through the tile


cdef inline bint next_sub(AttnProblem *p, BwdArgs *a, ptrdiff_t pw, ptrdiff_t i0,
                          ptrdiff_t rows, int64_t jlo, int64_t jhi, int64_t ja,
                          SubBlock *sb) noexcept nogil:
    """The sub-block starting at key ja (< jhi); False if no lane of the block needs it."""
    cdef int64_t pmin = i0 + p.q_offset, pmax = i0 + rows - 1 + p.q_offset
    cdef int64_t full_lo = pmax - p.wl, full_hi = pmin + p.wr   # inside the band for all rows
    cdef int64_t jb
    cdef ptrdiff_t lo, hi, last
    if full_lo <= ja <= full_hi:
        jb = min(ja + a.Bk, full_hi + 1, jhi)
    else:
        jb = min(ja + a.DB, jhi)
        if ja < full_lo < jb:
            jb = full_lo
    sb.ja = ja
    sb.jb = jb
    # rows that may attend some key of [ja, jb): pos - wl <= jb - 1 and pos + wr >= ja
    lo = <ptrdiff_t>max(<int64_t>0, ja - p.wr - p.q_offset - i0)
    hi = <ptrdiff_t>min(<int64_t>rows, jb - 1 + p.wl - p.q_offset - i0 + 1)
    if lo >= hi:
        return False
    lo = lo // pw * pw
    sb.lo = lo
    sb.hi = hi
    sb.Wt = round_up(hi, pw) - lo
    sb.r0 = ja - jlo if a.keep else 0
    last = (lo + sb.Wt if lo + sb.Wt < rows else rows) - 1
    sb.win_partial = (ja < i0 + last + p.q_offset - p.wl or
                      jb - 1 > i0 + lo + p.q_offset + p.wr)
    return True


cdef void bwd_scores(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy,
                     SubBlock *sb) noexcept nogil:
    """S of a sub-block into its tile, through the forward's score pipeline (and the softcap
    derivative into G)."""
    cdef ptrdiff_t lo = sb.lo, Wt = sb.Wt, m = sb.jb - sb.ja, ldt = FA_BWD_LDS
    cdef floating *S = <floating *>w.S + sb.r0 * ldt + lo
    k_qk(<const floating *>w.K + sb.ja * p.E, p.E, m, p.E, <const floating *>w.Qt + lo * p.E,
         Wt, k_nv(dummy), S, FA_BWD_LDS, NULL, <floating *>w.kpad, <floating>p.scale)
    # the forward's score pipeline, in its order (softcap, ALiBi, float mask, bool mask, band)
    if p.softcap > 0:
        k_softcap_grad(S, <floating *>w.G + sb.r0 * ldt + lo, ldt, m, Wt, p.softcap)
    if p.has_alibi:
        k_alibi(S, ldt, m, Wt, sb.ja, w.pos + lo, <const floating *>w.slope + lo)
    if p.mask_kind == 2:
        k_maskf(S, ldt, m, Wt, sb.ja, <const floating *>p.mask_f, w.moff + lo, p.msj,
                p.msi == 0)
    elif p.mask_kind == 1:
        k_maskb(S, ldt, m, Wt, sb.ja, p.mask_b, w.moff + lo, p.msj, p.msi == 0)
    if sb.win_partial:
        k_window(S, ldt, m, Wt, sb.ja, w.pos + lo, p.wl, p.wr)


cdef void bwd_sweep1(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy,
                     SubBlock *sb, double *acc) noexcept nogil:
    """S and dP of a sub-block into the tiles; the score pipeline; P; (Z, D) += sums."""
    cdef ptrdiff_t lo = sb.lo, Wt = sb.Wt, m = sb.jb - sb.ja, ldt = FA_BWD_LDS
    cdef floating *S = <floating *>w.S + sb.r0 * ldt + lo
    cdef floating *dP = <floating *>w.dP + sb.r0 * ldt + lo
    bwd_scores(p, a, w, dummy, sb)
    k_qk(<const floating *>w.V + sb.ja * p.Ev, p.Ev, m, p.Ev,
         <const floating *>w.dOt + lo * p.Ev, Wt, k_nv(dummy), dP, FA_BWD_LDS, NULL,
         <floating *>w.kpad, 1.0)
    if p.has_dropout:
        k_dropout_scale(dP, ldt, m, Wt, sb.ja + p.drop_col0, w.rk + lo, p.thresh, p.keep_scale)
    k_bwd_p(S, dP, m, Wt, <const floating *>w.lse + lo, acc + lo)


cdef void bwd_sweep2(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy, ptrdiff_t b,
                     ptrdiff_t hk, ptrdiff_t row0, SubBlock *sb, floating *dk_t,
                     floating *dv_t) noexcept nogil:
    """dS from the kept tiles; dV, dK of the sub-block's keys and dQ of the block."""
    cdef ptrdiff_t lo = sb.lo, Wt = sb.Wt, m = sb.jb - sb.ja, ldt = FA_BWD_LDS
    cdef ptrdiff_t E = p.E, Ev = p.Ev
    cdef floating *S = <floating *>w.S + sb.r0 * ldt + lo
    cdef floating *dP = <floating *>w.dP + sb.r0 * ldt + lo
    cdef const floating *K = <const floating *>p.k + ((b * p.Hkv + hk) * p.S + sb.ja) * E
    k_bwd_ds(S, dP, <floating *>w.G + sb.r0 * ldt + lo if p.softcap > 0 else NULL, m, Wt,
             <const floating *>w.invZ + lo, w.D + lo)
    if p.has_dropout:
        k_dropout(S, ldt, m, Wt, sb.ja + p.drop_col0, w.rk + lo, p.thresh)
    k_ptq(S, m, sb.hi - lo, <const floating *>a.dout + (row0 + lo) * Ev, Ev, Ev,
          dv_t + sb.ja * Ev, Ev)
    k_ptq(dP, m, sb.hi - lo, <const floating *>p.q + (row0 + lo) * E, E, E, dk_t + sb.ja * E, E)
    # dS is 0 on masked keys, but 0 * NaN = NaN: a K block with Inf/NaN takes the exact path
    cdef bint exact = ((p.mask_kind != 0 or sb.win_partial) and
                       not k_allfinite(K, m * E))
    k_pv(dP, ldt, m, K, E, E, <floating *>w.dQ + lo * a.ldq, a.ldq,
         <const floating *>w.ones, Wt, exact)


cdef void bwd_sink_rows(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy,
                        ptrdiff_t h, ptrdiff_t row0, ptrdiff_t rows) noexcept nogil:
    """Sinks: the weights of a row sum to Z + P_sink = 1 (P_sink = exp(sink - lse)), not Z,
    so normalize by Z + P_sink; and the row's share of dsinks[h], -P_sink * D, goes to
    a.rowsink (summed in a fixed order after the parallel loop).  P and P_sink share the
    shift w.lse, so Z + P_sink normalizes both whatever the shift."""
    cdef double sink = (<const floating *>p.sinks)[h], z, ps, lv
    cdef ptrdiff_t r
    for r in range(rows):
        lv = (<const floating *>w.lse)[r]        # the forward's lse, or bwd_rescue's shift
        ps = exp(sink - lv) if lv != INFINITY else 0
        z = w.acc[r] + ps
        (<floating *>w.invZ)[r] = <floating>(1.0 / z) if z > 0 else 0
        w.D[r] = w.acc[FA_BWD_LDS + r] / z if z > 0 else 0
        a.rowsink[row0 + r] = -(ps / z) * w.D[r] if z > 0 else 0


# A row's P = exp(S - lse) assumes that the backward's scores and the forward's lse agree to
# well within 1: normalizing by Z = sum P absorbs any per-row error short of exp's range.  Where
# |S| is so large that one rounding of lse is beyond that range (float32 scores ~1e20, where
# the decode path's dot products and these tiles round differently by ulp(1e20) ~ 1e13), P
# overflowed (Z = inf, dq NaN) or vanished (Z = 0, dv 0).  Such rows are shifted by their own
# largest score instead (P_max = 1), which every other row never sees: same bits there.
cdef enum:
    BWD_Z_LOG2_RANGE = 40            # Z + P_sink within 2**+-40 of 1: the forward's lse holds


cdef inline bint bwd_row_off(AttnProblem *p, BwdWork *w, floating *dummy, double sink,
                             ptrdiff_t r) noexcept nogil:
    """Row r's Z (+ P_sink) is far from 1 though its lse is finite."""
    cdef double lv = (<const floating *>w.lse)[r], z = w.acc[r]
    if not (-INFINITY < lv < INFINITY):
        return False
    if p.has_sinks:
        z += exp(sink - lv)
    return not (ldexp(1.0, -BWD_Z_LOG2_RANGE) <= z <= ldexp(1.0, BWD_Z_LOG2_RANGE))


cdef void bwd_rescue(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy, ptrdiff_t h,
                     ptrdiff_t i0, ptrdiff_t rows, int64_t jlo, int64_t jhi) noexcept nogil:
    """After sweep 1: rows whose Z is off get their largest score (or their sink, if larger)
    as the shift, and sweep 1 runs again (the other rows' tiles and sums come out the same)."""
    cdef double sink = (<const floating *>p.sinks)[h] if p.has_sinks else 0
    cdef ptrdiff_t r, pw = k_nr(dummy), ldt = FA_BWD_LDS
    cdef bint any_off = False
    for r in range(rows):
        if bwd_row_off(p, w, dummy, sink, r):
            any_off = True
            break
    if not any_off:
        return
    cdef floating *mx = <floating *>w.invZ         # scratch here: invZ is set after this
    cdef floating *lse = <floating *>w.lse
    cdef double c
    for r in range(a.W + 16):
        mx[r] = -INFINITY
    cdef int64_t ja = jlo
    cdef SubBlock sb
    while ja < jhi:
        if next_sub(p, a, pw, i0, rows, jlo, jhi, ja, &sb):
            bwd_scores(p, a, w, dummy, &sb)
            k_colmax(<const floating *>w.S + sb.r0 * ldt + sb.lo, ldt, sb.jb - sb.ja, sb.Wt,
                     mx + sb.lo)
        ja = sb.jb
    for r in range(rows):
        if bwd_row_off(p, w, dummy, sink, r):
            c = mx[r]
            if p.has_sinks and sink > c:
                c = sink
            if -INFINITY < c < INFINITY:
                lse[r] = <floating>c
    memset(w.acc, 0, 2 * FA_BWD_LDS * sizeof(double))
    ja = jlo
    while ja < jhi:
        if next_sub(p, a, pw, i0, rows, jlo, jhi, ja, &sb):
            bwd_sweep1(p, a, w, dummy, &sb, w.acc)
        ja = sb.jb


cdef void bwd_delta_rows(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy,
                         ptrdiff_t h, ptrdiff_t row0, ptrdiff_t rows) noexcept nogil:
    """The partial-keys form (has_delta): k/v are a part of the keys and lse, delta belong to
    the whole problem, so P = exp(S - lse) stays as it is (invZ = 1: these weights sum to the
    part's share of the row, not to 1) and D = delta; sweep 1 is not needed.  With sinks, the
    row's share of dsinks is -P_sink * delta (lse already includes the sink)."""
    cdef const floating *delta = <const floating *>p.delta
    cdef floating *invZ = <floating *>w.invZ
    cdef double sink = (<const floating *>p.sinks)[h] if p.has_sinks else 0, lv, ps
    cdef ptrdiff_t r
    for r in range(a.W + 16):
        invZ[r] = 1
        w.D[r] = delta[row0 + r] if r < rows else 0
    if p.has_sinks:
        for r in range(rows):
            lv = (<const floating *>w.lse)[r]
            ps = exp(sink - lv) if lv != INFINITY else 0
            a.rowsink[row0 + r] = -ps * w.D[r] if lv != INFINITY else 0


cdef void bwd_block(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy, ptrdiff_t b,
                    ptrdiff_t h, ptrdiff_t hk, ptrdiff_t i0, floating *dk_t,
                    floating *dv_t) noexcept nogil:
    """Query rows [i0, i0 + W) of head (b, h) against every key of their band."""
    cdef ptrdiff_t rows = a.W if p.L - i0 > a.W else p.L - i0
    cdef ptrdiff_t pw = k_nr(dummy)
    cdef ptrdiff_t W = round_up(rows, pw)
    cdef ptrdiff_t E = p.E, Ev = p.Ev, r, e, bh = b * p.Hq + h
    cdef ptrdiff_t row0 = bh * p.L + i0
    cdef floating *lse = <floating *>w.lse
    cdef double *D = w.D
    cdef floating *invZ = <floating *>w.invZ
    cdef double *acc = w.acc
    cdef double z
    cdef floating *slope = <floating *>w.slope
    cdef floating *dQ = <floating *>w.dQ
    cdef floating *Qt = <floating *>w.Qt
    cdef floating *dOt = <floating *>w.dOt
    cdef const floating *flse = <const floating *>a.flse
    cdef floating lv
    for r in range(rows):
        w.pos[r] = i0 + r + p.q_offset
        w.moff[r] = b * p.msb + h * p.msh + (i0 + r) * p.msi
        if p.has_alibi:
            slope[r] = (<const floating *>p.alibi)[b * p.alibi_bs + h]
        if p.has_dropout:
            w.rk[r] = drop_row_key(p, b, h, i0 + r)
        lv = flse[row0 + r]
        lse[r] = INFINITY if lv == -INFINITY else lv
    for r in range(rows, a.W + 16):
        w.pos[r] = w.pos[0]
        w.moff[r] = w.moff[0]
        slope[r] = slope[0]
        w.rk[r] = w.rk[0]
        lse[r] = INFINITY
    memset(acc, 0, 2 * FA_BWD_LDS * sizeof(double))
    # pack Q and dO as the forward packs Q: panels [W/pw][E][pw], zero lanes past the rows
    pack_panels(<const floating *>p.q + row0 * E, rows, W, pw, E, Qt)
    pack_panels(<const floating *>a.dout + row0 * Ev, rows, W, pw, Ev, dOt)
    memset(dQ, 0, W * a.ldq * sizeof(floating))

    cdef int64_t jlo = i0 + p.q_offset - p.wl, jhi = i0 + rows - 1 + p.q_offset + p.wr + 1
    if jlo < 0:
        jlo = 0
    if jhi > p.S:
        jhi = p.S
    cdef int64_t ja = jlo
    cdef SubBlock sb
    if p.has_delta:
        bwd_delta_rows(p, a, w, dummy, h, row0, rows)
    else:
        while ja < jhi:
            if next_sub(p, a, pw, i0, rows, jlo, jhi, ja, &sb):
                bwd_sweep1(p, a, w, dummy, &sb, w.acc)
            ja = sb.jb
        bwd_rescue(p, a, w, dummy, h, i0, rows, jlo, jhi)
        for r in range(W):
            z = acc[r]
            invZ[r] = <floating>(1.0 / z) if z > 0 else 0
            D[r] = acc[FA_BWD_LDS + r] / z if z > 0 else 0
        if p.has_sinks:
            bwd_sink_rows(p, a, w, dummy, h, row0, rows)
    ja = jlo
    while ja < jhi:
        if next_sub(p, a, pw, i0, rows, jlo, jhi, ja, &sb):
            if not a.keep:       # the same code again: the same bits as in sweep 1
                                 # (has_delta: the only time)
                bwd_sweep1(p, a, w, dummy, &sb, w.acc2)
            bwd_sweep2(p, a, w, dummy, b, hk, row0, &sb, dk_t, dv_t)
        ja = sb.jb

    cdef floating sc = <floating>p.scale
    cdef floating *out
    for r in range(rows):
        out = <floating *>a.dq + (row0 + r) * E
        for e in range(E):
            out[e] = dQ[r * a.ldq + e] * sc


cdef void bwd_item(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy,
                   ptrdiff_t it) noexcept nogil:
    cdef ptrdiff_t nbh = p.B * p.Hkv
    cdef ptrdiff_t c = it // nbh, bhk = it % nbh
    cdef ptrdiff_t b = bhk // p.Hkv, hk = bhk % p.Hkv, u, g, x
    cdef ptrdiff_t nk = p.S * p.E, nv = p.S * p.Ev
    cdef floating *dk_t
    cdef floating *dv_t
    if c == 0:
        dk_t = <floating *>a.dk + bhk * nk
        dv_t = <floating *>a.dv + bhk * nv
    else:
        dk_t = <floating *>a.kpart + ((c - 1) * nbh + bhk) * nk
        dv_t = <floating *>a.vpart + ((c - 1) * nbh + bhk) * nv
    memset(dk_t, 0, nk * sizeof(floating))
    memset(dv_t, 0, nv * sizeof(floating))
    w.K = <const char *>(<const floating *>p.k + bhk * nk)
    w.V = <const char *>(<const floating *>p.v + bhk * nv)
    for u in range(a.ubound[c], a.ubound[c + 1]):
        g = u // a.nqb
        bwd_block(p, a, w, dummy, b, hk * p.G + g, hk, (u % a.nqb) * a.W, dk_t, dv_t)
    cdef floating sc = <floating>p.scale, ks = <floating>p.keep_scale
    if a.C == 1:
        for x in range(nk):
            dk_t[x] = dk_t[x] * sc
        if p.has_dropout:
            for x in range(nv):
                dv_t[x] = dv_t[x] * ks


cdef void bwd_reduce(AttnProblem *p, BwdArgs *a, floating *dummy, ptrdiff_t it,
                     ptrdiff_t rows_per) noexcept nogil:
    """C > 1: dk/dv rows of one (b, kv head, row range) += the partials of chunks 1.. in
    chunk order, then scaled."""
    cdef ptrdiff_t nbh = p.B * p.Hkv, nrb = (p.S + rows_per - 1) // rows_per
    cdef ptrdiff_t bhk = it // nrb, j0 = (it % nrb) * rows_per
    cdef ptrdiff_t j1 = min(p.S, j0 + rows_per), c, x
    cdef floating sc = <floating>p.scale, ks = <floating>p.keep_scale
    cdef floating *dst
    cdef const floating *src
    cdef ptrdiff_t n, off
    n = (j1 - j0) * p.E
    off = bhk * p.S * p.E + j0 * p.E
    dst = <floating *>a.dk + off
    for c in range(1, a.C):
        src = <const floating *>a.kpart + (c - 1) * nbh * p.S * p.E + off
        for x in range(n):
            dst[x] = dst[x] + src[x]
    for x in range(n):
        dst[x] = dst[x] * sc
    n = (j1 - j0) * p.Ev
    off = bhk * p.S * p.Ev + j0 * p.Ev
    dst = <floating *>a.dv + off
    for c in range(1, a.C):
        src = <const floating *>a.vpart + (c - 1) * nbh * p.S * p.Ev + off
        for x in range(n):
            dst[x] = dst[x] + src[x]
    if p.has_dropout:
        for x in range(n):
            dst[x] = dst[x] * ks


cdef void bwd_sinks_sum(AttnProblem *p, BwdArgs *a, floating *dummy) noexcept nogil:
    """dsinks[h] = sum over batches and rows of the rows' shares, in one fixed order."""
    cdef ptrdiff_t b, h, i
    cdef double acc
    cdef const double *src
    for h in range(p.Hq):
        acc = 0
        for b in range(p.B):
            src = a.rowsink + (b * p.Hq + h) * p.L
            for i in range(p.L):
                acc += src[i]
        (<floating *>a.dsinks)[h] = <floating>acc


ctypedef struct BwdJob:                  # one backward pass as the pool's threads see it
    AttnProblem *p
    BwdArgs *a
    ptrdiff_t n_items, rows_per
    int fail
    fa_share share


cdef void bwd_job_body(BwdJob *j, floating *dummy) noexcept nogil:
    """One thread's part of the items: its scratch, then items until none is left."""
    cdef BwdWork *w = bwd_work_new(j.p, j.a, dummy)
    cdef ptrdiff_t it
    if w == NULL:
        j.fail = 1
    it = fa_share_next(&j.share)
    while it < j.n_items:
        if w != NULL:
            bwd_item(j.p, j.a, w, dummy, it)
        it = fa_share_next(&j.share)
    bwd_work_free(w)


cdef void bwd_red_job_body(BwdJob *j, floating *dummy) noexcept nogil:
    """One thread's part of the chunk reduction."""
    cdef ptrdiff_t it = fa_share_next(&j.share)
    while it < j.n_items:
        bwd_reduce(j.p, j.a, dummy, it, j.rows_per)
        it = fa_share_next(&j.share)


cdef void bwd_job_f(void *ctx) noexcept nogil:
    bwd_job_body(<BwdJob *>ctx, <float *>NULL)


cdef void bwd_job_d(void *ctx) noexcept nogil:
    bwd_job_body(<BwdJob *>ctx, <double *>NULL)


cdef void bwd_red_job_f(void *ctx) noexcept nogil:
    bwd_red_job_body(<BwdJob *>ctx, <float *>NULL)


cdef void bwd_red_job_d(void *ctx) noexcept nogil:
    bwd_red_job_body(<BwdJob *>ctx, <double *>NULL)


cdef int run_backward(AttnProblem *p, BwdArgs *a, floating *dummy) noexcept nogil:
    cdef ptrdiff_t nbh = p.B * p.Hkv, i, u, c, it, n_items
    cdef int fail = 0
    cdef BwdJob job
    cdef BwdWork *w = NULL
    cdef ptrdiff_t mr = k_mr(dummy)
    a.W = p.tune.bwd_w
    a.Bk = p.tune.bwd_bk
    a.DB = p.tune.bwd_db
    a.ldq = round_up(p.E, k_vw(dummy)) if p.E > 0 else 1
    a.nqb = (p.L + a.W - 1) // a.W
    # band tiles: the longest band of a block, plus a strip of slack (fa_qk writes whole
    # strips of MR rows)
    a.trows = round_up(min(<int64_t>p.S, a.W - 1 + p.wl + p.wr + 1), mr) + mr
    # has_delta has no sweep 1: the tiles are made where sweep 2 uses them
    a.keep = not p.has_delta and <size_t>a.trows * FA_BWD_LDS * sizeof(floating) * (3 if p.softcap > 0 else 2) <= <size_t>p.tune.bwd_keep_bytes
    if not a.keep:
        a.trows = round_up(max(a.Bk, a.DB), mr) + mr
    a.U = p.G * a.nqb
    a.kpart = a.vpart = NULL
    a.ubound = NULL
    if nbh == 0:
        return 0
    cdef int nt = resolve_threads(p.n_threads, nbh * a.U)
    cdef double band = <double>min(p.S, p.wl + p.wr + 1)
    if <double>p.B * p.Hq * p.L * band * (3 * p.E + 2 * p.Ev) * 2 < 8e6:
        nt = 1
    # Chunks of a kv head's query blocks: each chunk past the first costs a private dk/dv, a
    # second packing of Kᵀ/Vᵀ and a reduction pass, so split only as far as it takes for the
    # items to divide evenly among the threads (B*Hkv = 1 or odd with 2 threads: C = 2).
    # Beyond 4 items per thread the dynamic schedule evens things out well enough.
    a.C = 1
    if nt > 1 and nbh < 4 * nt:
        while a.C < a.U and ((a.C * nbh) % nt != 0 or a.C * nbh < p.tune.bwd_items_per_thread * nt):
            a.C += 1
    a.ubound = <ptrdiff_t *>malloc((a.C + 1) * sizeof(ptrdiff_t))
    if a.ubound == NULL:
        return -1
    if p.has_sinks:
        a.rowsink = <double *>calloc(p.B * p.Hq * p.L, sizeof(double))
        if a.rowsink == NULL:
            free(a.ubound)
            return -1
    # cost-balanced chunk boundaries: a unit (query block) costs rows x keys of its band
    cdef double total = 0, acc = 0, cost
    cdef int64_t pmin, pmax, jl, jh
    cdef ptrdiff_t rows
    for i in range(2):
        c = 1
        acc = 0
        a.ubound[0] = 0
        for u in range(a.U):
            rows = min(a.W, p.L - (u % a.nqb) * a.W)
            pmin = (u % a.nqb) * a.W + p.q_offset
            pmax = pmin + rows - 1
            jl = max(<int64_t>0, pmin - p.wl)
            jh = min(<int64_t>p.S, pmax + p.wr + 1)
            cost = <double>rows * <double>(jh - jl if jh > jl else 0) + 1.0
            acc += cost
            if i == 1:
                while c < a.C and acc >= total * c / a.C:
                    a.ubound[c] = u + 1
                    c += 1
        total = acc
    for c in range(1, a.C):      # a chunk may come out empty: boundaries stay monotone
        if a.ubound[c] < a.ubound[c - 1]:
            a.ubound[c] = a.ubound[c - 1]
    a.ubound[a.C] = a.U
    if a.C > 1:
        a.kpart = <char *>malloc(max(<size_t>1, <size_t>((a.C - 1) * nbh * p.S * p.E * sizeof(floating))))
        a.vpart = <char *>malloc(max(<size_t>1, <size_t>((a.C - 1) * nbh * p.S * p.Ev * sizeof(floating))))
        if a.kpart == NULL or a.vpart == NULL:
            free(a.kpart)
            free(a.vpart)
            free(a.ubound)
            free(a.rowsink)
            return -1
    n_items = a.C * nbh
    cdef ptrdiff_t rows_per = 256, n_red = nbh * ((p.S + rows_per - 1) // rows_per)
    if nt == 1:
        w = bwd_work_new(p, a, dummy)
        if w == NULL:
            fail = 1
        else:
            for it in range(n_items):
                bwd_item(p, a, w, dummy, it)
            bwd_work_free(w)
    else:
        # items from a shared counter, run by the caller and whichever pool helpers are free
        # (csrc/fa_pool.h): nobody waits for a thread that has not started
        job.p = p
        job.a = a
        job.n_items = n_items
        job.fail = 0
        fa_share_init(&job.share)
        if floating is double:
            fa_pool_run(nt, bwd_job_d, &job, 1)
        else:
            fa_pool_run(nt, bwd_job_f, &job, 1)
        fail = job.fail
    if p.has_sinks and not fail:
        bwd_sinks_sum(p, a, dummy)
    if a.C > 1 and not fail:
        if nt == 1:
            for it in range(n_red):
                bwd_reduce(p, a, dummy, it, rows_per)
        else:
            job.n_items = n_red
            job.rows_per = rows_per
            fa_share_init(&job.share)
            if floating is double:
                fa_pool_run(nt, bwd_red_job_d, &job, 1)
            else:
                fa_pool_run(nt, bwd_red_job_f, &job, 1)
    free(a.kpart)
    free(a.vpart)
    free(a.ubound)
    free(a.rowsink)
    return -fail


# ---- Python entry ---------------------------------------------------------------------------

def backward(args, const floating[:, :, :, ::1] dout, const floating[:, :, :, ::1] out,
             const floating[:, :, ::1] lse, floating[:, :, :, ::1] dq,
             floating[:, :, :, ::1] dk, floating[:, :, :, ::1] dv, floating[::1] dsinks):
    """FlashAttention-2 backward of the record `args` (docs/KERNELS.md); fills dq, dk, dv
    (every element) and, when args.has_sinks, dsinks (Hq,)."""
    cdef AttnProblem p
    cdef BwdArgs a
    fill_problem(&p, args, <floating *>NULL, out.shape, lse.shape)
    require_dense_kv(&p, "backward")
    if shape4(dout.shape) != shape4(out.shape):
        raise ValueError(f"attention backward: dout {shape4(dout.shape)} does not match out "
                         f"{shape4(out.shape)}")
    cdef tuple qs = (p.B, p.Hq, p.L, p.E), ks = (p.B, p.Hkv, p.S, p.E)
    cdef tuple vs = (p.B, p.Hkv, p.S, p.Ev)
    if shape4(dq.shape) != qs or shape4(dk.shape) != ks or shape4(dv.shape) != vs:
        raise ValueError(f"attention backward: dq {shape4(dq.shape)}, dk {shape4(dk.shape)}, "
                         f"dv {shape4(dv.shape)} must match q, k, v")
    if p.has_sinks and dsinks.shape[0] != p.Hq:
        raise ValueError(f"attention backward: dsinks ({dsinks.shape[0]},), expected "
                         f"({p.Hq},)")
    if mv_size(dsinks.shape, 1):
        memset(&dsinks[0], 0, mv_size(dsinks.shape, 1) * sizeof(floating))
    if p.B * p.Hq * p.L == 0 or p.S == 0:
        # nothing to attend: zero gradients.  Otherwise the kernels write every element
        # (dq row by row at the end of its block, dk/dv zeroed per item and accumulated), in
        # parallel: zeroing them here first cost a serial pass over 3 arrays (~1.5% of a
        # B1 H16 L=S=2048 backward, page faults included).
        if mv_size(dq.shape, 4):
            memset(&dq[0, 0, 0, 0], 0, mv_size(dq.shape, 4) * sizeof(floating))
        if mv_size(dk.shape, 4):
            memset(&dk[0, 0, 0, 0], 0, mv_size(dk.shape, 4) * sizeof(floating))
        if mv_size(dv.shape, 4):
            memset(&dv[0, 0, 0, 0], 0, mv_size(dv.shape, 4) * sizeof(floating))
        return
    a.dout = <const char *>&dout[0, 0, 0, 0] if mv_size(dout.shape, 4) else NULL
    a.flse = <const char *>&lse[0, 0, 0]
    a.dq = <char *>&dq[0, 0, 0, 0] if mv_size(dq.shape, 4) else NULL
    a.dk = <char *>&dk[0, 0, 0, 0] if mv_size(dk.shape, 4) else NULL
    a.dv = <char *>&dv[0, 0, 0, 0] if mv_size(dv.shape, 4) else NULL
    a.dsinks = <char *>&dsinks[0] if p.has_sinks else NULL
    a.rowsink = NULL
    cdef int rc
    with nogil:
        rc = run_backward(&p, &a, <floating *>NULL)
    if rc != 0:
        raise MemoryError("attention backward: could not allocate scratch")
