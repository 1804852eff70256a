# FlashAttention-2 backward (docs/KERNELS.md, last section).
#
# Work item = (batch, kv head, chunk of query blocks).  An item owns the dk/dv rows of its kv
# head (or, when there are too few kv heads to keep the threads busy, a private partial copy
# summed afterwards in a fixed order), and every query block belongs to exactly one item, so
# nothing is shared between threads: no atomics, and the same bits on every run whatever the
# schedule.  Per query block (W rows of one query head, packed once like the forward's Q):
#     D = rowsum(dO * O), lse (+inf for rows with no key), per-lane positions/mask offsets
#     for each key sub-block [ja, jb) of the band (the lanes it touches: [lo, hi)):
#         S  = K·Qᵀ, dPᵀ = V·dOᵀ          (fa_qk, tiles T[key][lane] as in the forward)
#         softcap (+ its derivative), ALiBi, masks, window edge: the forward's score pipeline
#         P = exp(S - lse); dP *= keep/(1-p); dS = P (dP - D) [* softcap']   (fa_bwd_ds)
#         dV[ja:jb] += Pdᵀ·dO,  dK[ja:jb] += dSᵀ·Q                          (fa_ptq)
#         dQ_blk    += dS·K                                                 (fa_pv)
#     dq rows = scale * dQ_blk
# then dk *= scale, dv *= 1/(1-p).  Sub-blocks are Bk keys where the band covers every lane of
# the block and DB keys where its edge cuts through, so a causal diagonal costs little more
# than its triangle.  Keys outside the band are never read.

from libc.string cimport memcpy

cdef ptrdiff_t BWD_W = 128          # query rows per block (multiple of 32, <= FA_BWD_MAXW)
cdef ptrdiff_t BWD_BK = 128         # keys per sub-block inside the band
cdef ptrdiff_t BWD_DB = 32          # keys per sub-block where the band edge cuts the block
cdef ptrdiff_t BWD_ITEMS_PER_THREAD = 4   # fewer (batch, kv head) items: split into chunks


def set_bwd_blocks(ptrdiff_t w=128, ptrdiff_t bk=128, ptrdiff_t db=32,
                   ptrdiff_t items_per_thread=4):
    """Experimentation hook: query rows per block (multiple of 32, <= 192), keys per interior
    sub-block, keys per band-edge sub-block, and the (batch, kv head) items per thread below
    which query blocks are split into chunks."""
    global BWD_W, BWD_BK, BWD_DB, BWD_ITEMS_PER_THREAD
    if w <= 0 or w % 32 or w > FA_BWD_MAXW or bk <= 0 or db <= 0 or items_per_thread <= 0:
        raise ValueError("bad backward block sizes")
    BWD_W, BWD_BK, BWD_DB, BWD_ITEMS_PER_THREAD = w, bk, db, items_per_thread


ctypedef struct BwdArgs:
    const char *dout
    const char *fout                 # the forward's output
    const char *flse                 # the forward's lse
    char *dq
    char *dk
    char *dv
    char *kpart                      # C > 1: [C][B*Hkv][S][E] partial dk (NULL when C == 1)
    char *vpart                      #        [C][B*Hkv][S][Ev] partial dv
    ptrdiff_t W, Bk, DB              # block sizes
    ptrdiff_t nqb                    # query blocks per head
    ptrdiff_t U                      # units = (query head of the group, query block) per kv head
    ptrdiff_t C                      # chunks of units per kv head
    ptrdiff_t *ubound                # [C + 1] unit boundaries of the chunks (cost-balanced)
    ptrdiff_t ldq                    # row stride of the dQ block accumulator
    ptrdiff_t mrows                  # rows of the S/dP tiles (max sub-block, rounded to MR)


ctypedef struct BwdWork:             # per-thread scratch, one buffer (fa_scratch.h)
    char *base
    char *Qt                         # packed query block, panels [W/pw][E][pw]
    char *dOt                        # packed dO block, panels [W/pw][Ev][pw]
    char *S                          # S, then P (dropout applied): [mrows][FA_BWD_LDS]
    char *dP                         # dP, then dS
    char *G                          # softcap derivative
    char *dQ                         # dQ of the block, [W + 16][ldq]
    char *kpad                       # partial K/V strip for fa_qk, [MR][max(E, Ev)]
    char *lse                        # per lane: lse (+inf for rows without keys)
    char *D                          #           rowsum(dO * O)
    char *slope                      #           ALiBi slope
    char *ones                       #           1 (fa_pv's rescale factor)
    int64_t *pos                     #           query position i + q_offset
    int64_t *moff                    #           mask offset of row (b, h, i)
    uint32_t *rk                     #           dropout row key


cdef BwdWork *bwd_work_new(AttnProblem *p, BwdArgs *a, floating *dummy) noexcept nogil:
    cdef size_t t = sizeof(floating)
    cdef ptrdiff_t mr = k_mr(dummy)
    cdef ptrdiff_t wcap = a.W + 16
    cdef size_t sz[15]
    sz[0] = _al(a.W * p.E * t + t)
    sz[1] = _al(a.W * p.Ev * t + t)
    sz[2] = sz[3] = sz[4] = _al(a.mrows * FA_BWD_LDS * t)
    sz[5] = _al(wcap * a.ldq * t)
    sz[6] = _al(mr * max(p.E, p.Ev) * t + t)
    sz[7] = sz[8] = sz[9] = sz[10] = _al(wcap * t)
    sz[11] = sz[12] = _al(wcap * 8)
    sz[13] = _al(wcap * 4)
    sz[14] = _al(sizeof(BwdWork))
    cdef size_t total = 64, i
    for i in range(15):
        total += sz[i]
    cdef char *base = <char *>fa_scratch_get(total)
    if base == NULL:
        return NULL
    cdef char *c = <char *>(((<size_t>base) + 63) & ~(<size_t>63))
    cdef BwdWork *w = <BwdWork *>c
    c += sz[14]
    w.base = base
    w.Qt = c; c += sz[0]
    w.dOt = c; c += sz[1]
    w.S = c; c += sz[2]
    w.dP = c; c += sz[3]
    w.G = c; c += sz[4]
    w.dQ = c; c += sz[5]
    w.kpad = c; c += sz[6]
    w.lse = c; c += sz[7]
    w.D = c; c += sz[8]
    w.slope = c; c += sz[9]
    w.ones = c; c += sz[10]
    w.pos = <int64_t *>c; c += sz[11]
    w.moff = <int64_t *>c; c += sz[12]
    w.rk = <uint32_t *>c
    # Lanes past the block's rows are read by the tile kernels (whole panels): keep every
    # per-lane array finite and defined.  The tiles themselves are written before being read
    # (S/dP by fa_qk, G by fa_softcap_grad), except rows of S/dP past a sub-block's end that
    # fa_qk fills with zeros.
    memset(w.S, 0, sz[2] + sz[3] + sz[4])
    memset(w.lse, 0, sz[7] + sz[8] + sz[9] + sz[10] + sz[11] + sz[12] + sz[13])
    for i in range(<size_t>wcap):
        (<floating *>w.ones)[i] = 1
    return w


cdef void bwd_tile(AttnProblem *p, BwdArgs *a, BwdWork *w, floating *dummy, ptrdiff_t b,
                   ptrdiff_t hk, ptrdiff_t row0, ptrdiff_t rows, int64_t ja, int64_t jb,
                   ptrdiff_t lo, ptrdiff_t hi, ptrdiff_t Wt, floating *dk_t,
                   floating *dv_t) noexcept nogil:
    """Keys [ja, jb) against lanes [lo, lo + Wt) of the started block; lanes [lo, hi) are
    the real rows that may attend some of these keys (the others are masked or padding)."""
    cdef ptrdiff_t E = p.E, Ev = p.Ev, m = jb - ja, ldt = FA_BWD_LDS
    cdef const floating *K = <const floating *>p.k + ((b * p.Hkv + hk) * p.S + ja) * E
    cdef const floating *V = <const floating *>p.v + ((b * p.Hkv + hk) * p.S + ja) * Ev
    cdef floating *S = <floating *>w.S
    cdef floating *dP = <floating *>w.dP
    cdef floating *G = <floating *>w.G
    cdef ptrdiff_t last = (lo + Wt if lo + Wt < rows else rows) - 1
    cdef bint win_partial = ja < w.pos[last] - p.wl or jb - 1 > w.pos[lo] + p.wr
    cdef bint masked = p.mask_kind != 0 or win_partial
    cdef bint exact
    cdef int nv = k_nv(dummy)
    k_qk(K, E, m, E, <const floating *>w.Qt + lo * E, Wt, nv, S, ldt, NULL,
         <floating *>w.kpad, p.scale)
    k_qk(V, Ev, m, Ev, <const floating *>w.dOt + lo * Ev, Wt, nv, dP, ldt, NULL,
         <floating *>w.kpad, 1.0)
    # the forward's score pipeline, in its order (softcap, ALiBi, float mask, bool mask, band)
    if p.softcap > 0:
        k_softcap_grad(S, G, ldt, m, Wt, p.softcap)
    if p.has_alibi:
        k_alibi(S, ldt, m, Wt, ja, w.pos + lo, <const floating *>w.slope + lo)
    if p.mask_kind == 2:
        k_maskf(S, ldt, m, Wt, ja, <const floating *>p.mask_f, w.moff + lo, p.msj, p.msi == 0)
    elif p.mask_kind == 1:
        k_maskb(S, ldt, m, Wt, ja, p.mask_b, w.moff + lo, p.msj, p.msi == 0)
    if win_partial:
        k_window(S, ldt, m, Wt, ja, w.pos + lo, p.wl, p.wr)
    if p.has_dropout:
        k_dropout_scale(dP, ldt, m, Wt, ja, w.rk + lo, p.thresh, p.keep_scale)
    k_bwd_ds(S, dP, G if p.softcap > 0 else NULL, m, Wt, <const floating *>w.lse + lo,
             <const floating *>w.D + lo)
    if p.has_dropout:
        k_dropout(S, ldt, m, Wt, ja, w.rk + lo, p.thresh)
    k_ptq(S, m, hi - lo, <const floating *>a.dout + (row0 + lo) * Ev, Ev, Ev, dv_t + ja * Ev, Ev)
    k_ptq(dP, m, hi - lo, <const floating *>p.q + (row0 + lo) * E, E, E, dk_t + ja * E, E)
    # dS is 0 on masked keys, but 0 * NaN = NaN: a K block with Inf/NaN takes the exact path
    exact = masked and not k_allfinite(K, m * E)
    k_pv(dP, ldt, m, K, E, E, <floating *>w.dQ + lo * a.ldq, a.ldq,
         <const floating *>w.ones, Wt, exact)


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
    cdef floating *D = <floating *>w.D
    cdef floating *slope = <floating *>w.slope
    cdef floating *dQ = <floating *>w.dQ
    cdef floating *Qt = <floating *>w.Qt
    cdef floating *dOt = <floating *>w.dOt
    cdef floating *dst
    cdef const floating *src
    cdef const floating *flse = <const floating *>a.flse
    cdef floating lv
    for r in range(rows):
        w.pos[r] = i0 + r + p.q_offset
        w.moff[r] = b * p.msb + h * p.msh + (i0 + r) * p.msi
        if p.has_alibi:
            slope[r] = (<const floating *>p.alibi)[b * p.alibi_bs + h]
        if p.has_dropout:
            w.rk[r] = fa_row_key(p.seed, <uint32_t>bh, <uint32_t>(i0 + r))
        lv = flse[row0 + r]
        lse[r] = INFINITY if lv == -INFINITY else lv
        D[r] = <floating>k_rowdot(<const floating *>a.dout + (row0 + r) * Ev,
                                  <const floating *>a.fout + (row0 + r) * Ev, Ev)
    for r in range(rows, a.W + 16):
        w.pos[r] = w.pos[0]
        w.moff[r] = w.moff[0]
        slope[r] = slope[0]
        w.rk[r] = w.rk[0]
        lse[r] = INFINITY
        D[r] = 0
    # pack Q and dO as the forward packs Q: panels [W/pw][E][pw], zero lanes past the rows
    for r in range(W):
        dst = Qt + (r // pw) * pw * E + r % pw
        if r < rows:
            src = <const floating *>p.q + (row0 + r) * E
            for e in range(E):
                dst[e * pw] = src[e]
        else:
            for e in range(E):
                dst[e * pw] = 0
        dst = dOt + (r // pw) * pw * Ev + r % pw
        if r < rows:
            src = <const floating *>a.dout + (row0 + r) * Ev
            for e in range(Ev):
                dst[e * pw] = src[e]
        else:
            for e in range(Ev):
                dst[e * pw] = 0
    memset(dQ, 0, W * a.ldq * sizeof(floating))

    cdef int64_t pmin = i0 + p.q_offset, pmax = i0 + rows - 1 + p.q_offset
    cdef int64_t jlo = pmin - p.wl, jhi = pmax + p.wr + 1
    if jlo < 0:
        jlo = 0
    if jhi > p.S:
        jhi = p.S
    # keys in [full_lo, full_hi] are inside the band for every row of the block
    cdef int64_t full_lo = pmax - p.wl, full_hi = pmin + p.wr
    cdef int64_t ja = jlo, jb
    cdef ptrdiff_t lo, hi
    while ja < jhi:
        if full_lo <= ja <= full_hi:
            jb = min(ja + a.Bk, full_hi + 1, jhi)
        else:
            jb = min(ja + a.DB, jhi)
            if ja < full_lo < jb:
                jb = full_lo
        # the rows that may attend some key of [ja, jb): pos - wl <= jb - 1, pos + wr >= ja
        lo = <ptrdiff_t>max(<int64_t>0, ja - p.wr - p.q_offset - i0)
        hi = <ptrdiff_t>min(<int64_t>rows, jb - 1 + p.wl - p.q_offset - i0 + 1)
        if lo < hi:
            lo = lo // pw * pw
            bwd_tile(p, a, w, dummy, b, hk, row0, rows, ja, jb, lo, hi,
                     round_up(hi, pw) - lo, dk_t, dv_t)
        ja = jb

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
    if a.C == 1:
        dk_t = <floating *>a.dk + bhk * nk
        dv_t = <floating *>a.dv + bhk * nv
    else:
        dk_t = <floating *>a.kpart + (c * nbh + bhk) * nk
        dv_t = <floating *>a.vpart + (c * nbh + bhk) * nv
    memset(dk_t, 0, nk * sizeof(floating))
    memset(dv_t, 0, nv * sizeof(floating))
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
    """C > 1: dk/dv rows of one (b, kv head, row range) = the chunks' partials summed in
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
    memcpy(dst, <floating *>a.kpart + off, n * sizeof(floating))
    for c in range(1, a.C):
        src = <const floating *>a.kpart + c * nbh * p.S * p.E + off
        for x in range(n):
            dst[x] = dst[x] + src[x]
    for x in range(n):
        dst[x] = dst[x] * sc
    n = (j1 - j0) * p.Ev
    off = bhk * p.S * p.Ev + j0 * p.Ev
    dst = <floating *>a.dv + off
    memcpy(dst, <floating *>a.vpart + off, n * sizeof(floating))
    for c in range(1, a.C):
        src = <const floating *>a.vpart + c * nbh * p.S * p.Ev + off
        for x in range(n):
            dst[x] = dst[x] + src[x]
    if p.has_dropout:
        for x in range(n):
            dst[x] = dst[x] * ks


cdef int run_backward(AttnProblem *p, BwdArgs *a, floating *dummy,
                      int n_threads) noexcept nogil:
    cdef ptrdiff_t nbh = p.B * p.Hkv, i, u, c, it, n_items
    cdef int fail = 0
    cdef int *pfail = &fail
    cdef BwdWork *w = NULL
    cdef ptrdiff_t mr = k_mr(dummy)
    a.W = BWD_W
    a.Bk = BWD_BK
    a.DB = BWD_DB
    a.mrows = round_up(max(a.Bk, a.DB), mr)
    a.ldq = round_up(p.E, k_vw(dummy)) if p.E > 0 else 1
    a.nqb = (p.L + a.W - 1) // a.W
    a.U = p.G * a.nqb
    a.kpart = a.vpart = NULL
    a.ubound = NULL
    if nbh == 0:
        return 0
    cdef int nt = resolve_threads(n_threads, nbh * a.U)
    cdef double band = <double>min(p.S, p.wl + p.wr + 1)
    if <double>p.B * p.Hq * p.L * band * (3 * p.E + 2 * p.Ev) * 2 < 8e6:
        nt = 1
    # chunks: enough items for a dynamic schedule to balance (each chunk needs its own dk/dv)
    a.C = 1
    if nt > 1 and nbh < BWD_ITEMS_PER_THREAD * nt:
        a.C = min(a.U, (BWD_ITEMS_PER_THREAD * nt + nbh - 1) // nbh)
    a.ubound = <ptrdiff_t *>malloc((a.C + 1) * sizeof(ptrdiff_t))
    if a.ubound == NULL:
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
        a.kpart = <char *>malloc(max(<size_t>1, <size_t>(a.C * nbh * p.S * p.E * sizeof(floating))))
        a.vpart = <char *>malloc(max(<size_t>1, <size_t>(a.C * nbh * p.S * p.Ev * sizeof(floating))))
        if a.kpart == NULL or a.vpart == NULL:
            free(a.kpart)
            free(a.vpart)
            free(a.ubound)
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
            fa_scratch_release(w.base)
    else:
        with parallel(num_threads=nt):
            w = bwd_work_new(p, a, dummy)
            if w == NULL:
                pfail[0] = 1
            for it in prange(n_items, schedule='dynamic'):
                if w != NULL:
                    bwd_item(p, a, w, dummy, it)
            if w != NULL:
                fa_scratch_release(w.base)
    if a.C > 1 and not fail:
        if nt == 1:
            for it in range(n_red):
                bwd_reduce(p, a, dummy, it, rows_per)
        else:
            with parallel(num_threads=nt):
                for it in prange(n_red, schedule='static'):
                    bwd_reduce(p, a, dummy, it, rows_per)
    free(a.kpart)
    free(a.vpart)
    free(a.ubound)
    return -fail


# ---- Python entry ---------------------------------------------------------------------------

def backward(const floating[:, :, :, ::1] q, const floating[:, :, :, ::1] k,
             const floating[:, :, :, ::1] v, int mask_kind,
             const uint8_t[:, :, :, ::1] mask_bool, const floating[:, :, :, ::1] mask_float,
             bint has_alibi, const floating[:, ::1] alibi, double scale, double softcap,
             int64_t q_offset, int64_t win_left, int64_t win_right, double dropout_p, seed,
             const floating[:, :, :, ::1] dout, const floating[:, :, :, ::1] out,
             const floating[:, :, ::1] lse, floating[:, :, :, ::1] dq,
             floating[:, :, :, ::1] dk, floating[:, :, :, ::1] dv, int n_threads=1):
    """FlashAttention-2 backward per docs/KERNELS.md; fills dq, dk, dv (every element)."""
    cdef AttnProblem p
    cdef BwdArgs a
    fill_problem(&p, shape4(q.shape), shape4(k.shape), shape4(v.shape), mask_kind,
                 shape4(mask_bool.shape), shape4(mask_float.shape), has_alibi,
                 (alibi.shape[0], alibi.shape[1]), softcap, q_offset, win_left, win_right,
                 dropout_p, seed, shape4(out.shape), (lse.shape[0], lse.shape[1], lse.shape[2]))
    if shape4(dout.shape) != shape4(out.shape):
        raise ValueError(f"attention backward: dout {shape4(dout.shape)} does not match out "
                         f"{shape4(out.shape)}")
    if (shape4(dq.shape) != shape4(q.shape) or shape4(dk.shape) != shape4(k.shape)
            or shape4(dv.shape) != shape4(v.shape)):
        raise ValueError(f"attention backward: dq {shape4(dq.shape)}, dk {shape4(dk.shape)}, "
                         f"dv {shape4(dv.shape)} must match q, k, v")
    if dq.size:
        memset(&dq[0, 0, 0, 0], 0, dq.size * sizeof(floating))
    if dk.size:
        memset(&dk[0, 0, 0, 0], 0, dk.size * sizeof(floating))
    if dv.size:
        memset(&dv[0, 0, 0, 0], 0, dv.size * sizeof(floating))
    if p.B * p.Hq * p.L == 0 or p.S == 0:
        return
    p.scale = scale
    p.q = <const char *>&q[0, 0, 0, 0] if q.size else NULL
    p.k = <const char *>&k[0, 0, 0, 0] if k.size else NULL
    p.v = <const char *>&v[0, 0, 0, 0] if v.size else NULL
    p.out = NULL
    p.lse = NULL
    p.mask_b = &mask_bool[0, 0, 0, 0] if mask_bool.size else NULL
    p.mask_f = <const char *>&mask_float[0, 0, 0, 0] if mask_float.size else NULL
    p.alibi = <const char *>&alibi[0, 0] if alibi.size else NULL
    a.dout = <const char *>&dout[0, 0, 0, 0] if dout.size else NULL
    a.fout = <const char *>&out[0, 0, 0, 0] if out.size else NULL
    a.flse = <const char *>&lse[0, 0, 0]
    a.dq = <char *>&dq[0, 0, 0, 0] if dq.size else NULL
    a.dk = <char *>&dk[0, 0, 0, 0] if dk.size else NULL
    a.dv = <char *>&dv[0, 0, 0, 0] if dv.size else NULL
    cdef int rc
    with nogil:
        rc = run_backward(&p, &a, <floating *>NULL, n_threads)
    if rc != 0:
        raise MemoryError("attention backward: could not allocate scratch")
