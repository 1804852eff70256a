# FlashAttention-2 forward.
#
# Work item = (batch*head, query block of Bq rows).  One OpenMP loop over the flattened items
# (dynamic schedule: causal items differ in cost); per-thread scratch from fa_scratch.h.
# Per item, for each key block of Bk keys inside the causal/window band:
#     S  = Q_blk · K_blkᵀ        (fa_qk, stored transposed: S[key][query lane])
#     score modifiers            (softcap, ALiBi, float mask, bool mask, window edge)
#     online softmax             (running max m, sum l, rescale factor alpha per query)
#     dropout on P               (spec hash)
#     O  = alpha*O + P · V_blk   (fa_pv; exact zero-skipping variant if V has Inf/NaN)
# then out = O / l, lse = m + log l.  Blocks wholly outside the band are never visited, so
# their K/V are never read.  The same row-block engine (attend_rows) serves decode.pxi.

# Block sizes (defaults of fill_tune, problem.pxi).  Bq multiples of 96 = lcm of the tile
# sizes of every ISA copy (P·V rows: 12 or 6; Qt panels of 32 lanes, which the AVX-512 Q·Kᵀ
# takes in pairs, an odd last panel alone).  Causal/banded problems compute the upper triangle
# of each diagonal block for nothing (a fraction Bq/L of the work), so they default to 96;
# otherwise 192 halves the per-item overheads (Qt packing, lane setup).  Bk = 192 (a multiple
# of 96 too): a block's scores, K and V rows, Qt and O then take ~530 KB at d = 128 against
# ~660 KB at Bk = 256, and on a Zen 4 guest on AVX2 (1 MiB L2 per core; tuning(block_k=...),
# interleaved in one process with an explicit 256 as the control, which read 0.99-1.03) the
# forward took 0.95-0.97x the time of Bk = 256 at d = 128 (L = 512...8192, H = 4 and 8, GQA
# 8/2), 0.95-0.98x at d = 64 L = 256, 1024 and 8192, 0.99x causal; Bk = 128 gained 3-4% at
# d = 128, 384 lost 6% at d = 64.  (On a Sapphire Rapids VM with 2 MiB of L2 the inner loop
# had been flat over Bk 128..512: bench/results/cython_kernels.md.)  Decode's slices
# between prefetches (attend_rows) are multiples of 12 (the key strip of fa_qk) and 32
# (fa_pv's summation chunk).


cdef extern from "fa_kvconv.h" nogil:
    void fa_kv_rows_f32(int kind, const void *base, int64_t off, ptrdiff_t ld, ptrdiff_t n,
                        ptrdiff_t E, const float *scale, ptrdiff_t lds, float *dst,
                        ptrdiff_t ldd)
    int fa_kv_quantize_rows(const float *x, ptrdiff_t n, ptrdiff_t E, int8_t *codes,
                            float *scale)


ctypedef struct Work:                # per-thread scratch, one buffer (fa_scratch.h)
    char *base
    char *Qt                         # packed query block, panels [W/pw][E][pw]
    char *S                          # scores / weights, [round_up(Bk, MR)][lds]
    char *O                          # accumulator, [Wcap][ldo]
    char *m
    char *l
    double *ld                       # the group kernels' running sums (decode.pxi), [Wcap]:
                                     #   alpha and cmax's bytes, which that path leaves alone
    char *alpha
    char *cmax
    char *slope
    char *kpad                       # last partial strip of K rows, [MR][E]
    char *kbuf                       # a block's K rows gathered across pages, [Bk][E] (paged),
                                     #   or converted to float32 (a low-precision cache)
    char *vbuf                       #   and its V rows, [Bk][Ev]
    size_t stride                    # bytes from one Work to the next (work_new_n)
    int64_t *pos                     # query position (i + q_offset) per lane
    int64_t *moff                    # mask offset of row (b, h, i) per lane
    int64_t *orow                    # global query row (b*Hq + h)*L + i per lane
    uint32_t *rk                     # dropout row key per lane
    ptrdiff_t rows, W                # started lanes / lanes rounded up to whole panels
    int pw_nv                        # vectors per Qt panel
    bint dot                         # dot-product scores (fa_qk_dot) instead of panels


cdef inline size_t _al(size_t x) noexcept nogil:
    return (x + 63) & ~(<size_t>63)

cdef Work *work_new(AttnProblem *p, floating *dummy) noexcept nogil:
    return work_new_n(p, dummy, 1)


cdef inline Work *work_at(Work *w, ptrdiff_t i) noexcept nogil:
    """Work i of the n that work_new_n carved from one buffer."""
    return <Work *>(<char *>w + i * w.stride)


cdef Work *work_new_n(AttnProblem *p, floating *dummy, ptrdiff_t n) noexcept nogil:
    """n Works (work_at(w, i)) in the calling thread's one scratch buffer."""
    cdef size_t t = sizeof(floating)
    cdef ptrdiff_t mr = k_mr(dummy)
    cdef size_t sz[16]
    # Qt: panels of Wcap lanes, or 4 rows of stride round_up(E, 16) for fa_qk_dot
    sz[0] = _al(max(p.Wcap * p.E, 4 * round_up(p.E, 16)) * t)
    # S: one strip of mr key rows past the block's, since fa_qk stores whole strips and a
    # band segment (attend_block) starts its strips on a multiple of 32 keys, not of mr
    sz[1] = _al((round_up(p.Bk, mr) + mr) * p.lds * t)
    sz[2] = _al(p.Wcap * p.ldo * t)
    sz[3] = sz[4] = sz[5] = sz[6] = sz[7] = _al(p.Wcap * t)
    sz[8] = _al(mr * p.E * t + t)
    sz[9] = sz[10] = sz[11] = _al(p.Wcap * 8)
    sz[12] = _al(p.Wcap * 4)
    sz[13] = _al(sizeof(Work))
    sz[14] = _al(p.Bk * p.E * t) if p.page_size or p.kv_kind else 0
    sz[15] = _al(p.Bk * p.Ev * t) if p.page_size or p.kv_kind else 0
    cdef size_t total = 0, i
    for i in range(16):
        total += sz[i]
    cdef char *base = <char *>fa_scratch_get(64 + n * total)
    if base == NULL:
        return NULL
    cdef char *c0 = <char *>(((<size_t>base) + 63) & ~(<size_t>63))
    cdef ptrdiff_t iw
    for iw in range(n):
        work_carve(<Work *>(c0 + iw * total), base, sz, total)
    return <Work *>c0


cdef void work_carve(Work *w, char *base, size_t *sz, size_t total) noexcept nogil:
    # Not zeroed as a whole: every buffer is written before it is read (Qt/m/l/O per item,
    # S by fa_qk/fa_qk_dot, alpha by softmax).  Only the small per-lane arrays are cleared.
    cdef char *c = <char *>w + sz[13]
    w.base = base
    w.stride = total
    w.Qt = c; c += sz[0]
    w.S = c; c += sz[1]
    w.O = c; c += sz[2]
    w.m = c; c += sz[3]
    w.l = c; c += sz[4]
    w.alpha = c; c += sz[5]
    # (not a buffer of its own: a Work's size sets where a thread's Works fall on the L1 sets;
    # 256 bytes more made it 11.5 x 4 KiB for GQA 32/8 d128, the eight kv heads' accumulators
    # of a flash-layout decode item on two set positions, and such a decode (B8, 128 keys)
    # looked 7-20% slower in a noisy A/B)
    w.ld = <double *>w.alpha        # sz[5] + sz[6] >= Wcap doubles: t >= 4
    w.cmax = c; c += sz[6]
    w.slope = c; c += sz[7]
    w.kpad = c; c += sz[8]
    w.pos = <int64_t *>c; c += sz[9]
    w.moff = <int64_t *>c; c += sz[10]
    w.orow = <int64_t *>c; c += sz[11]
    w.rk = <uint32_t *>c; c += sz[12]
    w.kbuf = c; c += sz[14]
    w.vbuf = c
    memset(w.slope, 0, sz[7])
    memset(w.pos, 0, sz[9] + sz[10] + sz[11] + sz[12])

cdef inline void work_free(Work *w) noexcept nogil:
    if w != NULL:
        fa_scratch_release(w.base)


cdef inline void set_lane(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t r, ptrdiff_t b,
                          ptrdiff_t h, ptrdiff_t i) noexcept nogil:
    w.pos[r] = i + seq_q_offset(p, b)
    w.moff[r] = b * p.msb + h * p.msh + i * p.msi
    w.orow[r] = (b * p.Hq + h) * p.L + i
    if p.has_alibi:
        (<floating *>w.slope)[r] = (<const floating *>p.alibi)[b * p.alibi_bs + h]
    if p.has_dropout:
        w.rk[r] = drop_row_key(p, b, h, i)


cdef void start_rows(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t rows, ptrdiff_t W,
                     ptrdiff_t pw, bint dot) noexcept nogil:
    """Lanes [0, rows) are set (set_lane).  Copy lane 0 into the padding lanes (so masks and
    positions stay in bounds), pack Qt (panels, or for the dot-product decode kernel plain
    rows of stride round_up(E, 16)), reset m/l/O.  W lanes in panels of pw."""
    cdef ptrdiff_t r, e, E = p.E
    w.rows = rows
    w.W = W
    w.pw_nv = <int>(pw // k_vw(dummy))
    w.dot = dot
    cdef floating *Qt = <floating *>w.Qt
    cdef floating *m = <floating *>w.m
    cdef floating *l = <floating *>w.l
    cdef floating *O = <floating *>w.O
    cdef floating *dst
    cdef const floating *src
    for r in range(rows, p.Wcap):
        w.pos[r] = w.pos[0]
        w.moff[r] = w.moff[0]
        w.orow[r] = w.orow[0]
        (<floating *>w.slope)[r] = (<floating *>w.slope)[0]
        w.rk[r] = w.rk[0]
    cdef ptrdiff_t ldq = round_up(E, 16)
    if dot:
        memset(Qt, 0, 4 * ldq * sizeof(floating))
        # fa_qk_dot writes only the real lanes; keep the padding lanes finite (garbage could
        # be NaN or, worse for speed, denormal -> microcode assists in the softmax)
        memset(w.S, 0, round_up(p.Bk, k_mr(dummy)) * p.lds * sizeof(floating))
        for r in range(rows):
            src = <const floating *>p.q + w.orow[r] * E
            for e in range(E):
                Qt[r * ldq + e] = src[e]
    # Panels by runs of consecutive query rows (a forward item is one run; decode lanes are
    # (head, query) pairs, consecutive within a GQA group): the 4x4-blocked transpose packs
    # ~4x faster than the element loop it replaced (~5% of a B=4 H=8 L=256 forward).
    cdef ptrdiff_t run
    r = 0
    while not dot and r < W:
        dst = Qt + (r // pw) * pw * E + r % pw
        if r < rows:
            run = 1
            while (r + run < rows and (r + run) % pw != 0
                   and w.orow[r + run] == w.orow[r] + run):
                run += 1
            k_transpose(<const floating *>p.q + w.orow[r] * E, E, run, E, dst, pw)
            r += run
        else:
            for e in range(E):
                dst[e * pw] = 0
            r += 1
    for r in range(p.Wcap):
        m[r] = -INFINITY
        l[r] = 0
    memset(O, 0, p.Wcap * p.ldo * sizeof(floating))


cdef inline void prefetch_rows(const floating *X, ptrdiff_t ld, ptrdiff_t rows,
                               ptrdiff_t len, int kind) noexcept nogil:
    """Prefetch rows [0, rows) of X (row length len, stride ld): one run when they touch."""
    cdef ptrdiff_t r
    if ld == len:
        fa_prefetch(X, rows * len * sizeof(floating), kind)
        return
    for r in range(rows):
        fa_prefetch(X + r * ld, len * sizeof(floating), kind)


cdef inline bint rows_allfinite(const floating *X, ptrdiff_t ld, ptrdiff_t rows,
                                ptrdiff_t len) noexcept nogil:
    cdef ptrdiff_t r
    if ld == len:
        return k_allfinite(X, rows * len)
    for r in range(rows):
        if not k_allfinite(X + r * ld, len):
            return False
    return True


cdef void block_kv(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t b, ptrdiff_t hk,
                   int64_t j0, ptrdiff_t n, const floating **K, const floating **V,
                   ptrdiff_t *ldk, ptrdiff_t *ldv) noexcept nogil:
    """Where keys [j0, j0 + n) of kv head (b, hk) are: their rows in place (K, ldk), or, for a
    block that straddles pages of a paged cache, gathered into the thread's scratch, so that
    the blocks, and so the sums and their order, are those of the same cache stored
    contiguously (the same bits wherever the cache lives)."""
    cdef int64_t ko, vo, end = kv_segment(p, b, j0, &ko, &vo), j = j0, cnt, r = 0, i, e
    cdef const floating *src
    cdef floating *dst
    if floating is float:
        if p.kv_kind:
            block_kv_convert(p, w, b, hk, j0, n)
            K[0] = <const floating *>w.kbuf
            V[0] = <const floating *>w.vbuf
            ldk[0] = p.E
            ldv[0] = p.Ev
            return
    if j0 + n <= end:
        K[0] = <const floating *>p.k + ko + hk * p.ksh
        V[0] = <const floating *>p.v + vo + hk * p.vsh
        ldk[0] = p.kss
        ldv[0] = p.vss
        return
    while r < n:
        if j > j0:
            end = kv_segment(p, b, j, &ko, &vo)
        cnt = min(end - j, n - r)
        for i in range(cnt):
            src = <const floating *>p.k + ko + hk * p.ksh + i * p.kss
            dst = <floating *>w.kbuf + (r + i) * p.E
            for e in range(p.E):
                dst[e] = src[e]
            src = <const floating *>p.v + vo + hk * p.vsh + i * p.vss
            dst = <floating *>w.vbuf + (r + i) * p.Ev
            for e in range(p.Ev):
                dst[e] = src[e]
        r += cnt
        j += cnt
    K[0] = <const floating *>w.kbuf
    V[0] = <const floating *>w.vbuf
    ldk[0] = p.E
    ldv[0] = p.Ev


cdef inline void kv_scale_offsets(AttnProblem *p, ptrdiff_t b, int64_t j, int64_t *kc,
                                  int64_t *vc) noexcept nogil:
    """Element offsets in k_scale / v_scale of key j of sequence b (kv head 0): kv_segment's
    place in the scales' strides."""
    cdef int64_t pg, r
    if p.block_table == NULL:
        kc[0] = b * p.kcb + j * p.kcs
        vc[0] = b * p.vcb + j * p.vcs
        return
    r = j % p.page_size
    pg = p.block_table[b * p.bt_ld + j // p.page_size]
    kc[0] = pg * p.kcb + r * p.kcs
    vc[0] = pg * p.vcb + r * p.vcs


cdef void block_kv_convert(AttnProblem *p, Work *w, ptrdiff_t b, ptrdiff_t hk, int64_t j0,
                           ptrdiff_t n) noexcept nogil:
    """Keys [j0, j0 + n) of kv head (b, hk) of a low-precision cache, page by page, as
    float32 rows in the thread's kbuf / vbuf (fa_kvconv.h): a block at a time, so the tile
    code reads them as it reads a float32 cache, and never more than a block is converted."""
    cdef int64_t ko, vo, kc = 0, vc = 0, end, j = j0, cnt, r = 0
    while r < n:
        end = kv_segment(p, b, j, &ko, &vo)
        cnt = min(end - j, n - r)
        if p.ksc != NULL:
            kv_scale_offsets(p, b, j, &kc, &vc)
        fa_kv_rows_f32(p.kv_kind, p.k, ko + hk * p.ksh, p.kss, cnt, p.E,
                       p.ksc + kc + hk * p.kch if p.ksc != NULL else NULL, p.kcs,
                       <float *>w.kbuf + r * p.E, p.E)
        fa_kv_rows_f32(p.kv_kind, p.v, vo + hk * p.vsh, p.vss, cnt, p.Ev,
                       p.vsc + vc + hk * p.vch if p.vsc != NULL else NULL, p.vcs,
                       <float *>w.vbuf + r * p.Ev, p.Ev)
        r += cnt
        j += cnt


cdef void prefetch_keys(AttnProblem *p, floating *dummy, ptrdiff_t b, ptrdiff_t hk, int64_t j,
                        int64_t n, bint values) noexcept nogil:
    """Prefetch the K (values: V) rows of keys [j, j + n) of kv head (b, hk), page by page.
    (Not for a low-precision cache: its rows are converted a block at a time, block_kv.)"""
    cdef int64_t ko, vo, end, cnt
    cdef ptrdiff_t len = p.Ev if values else p.E
    if p.kv_kind:
        return
    while n > 0:
        end = kv_segment(p, b, j, &ko, &vo)
        cnt = min(end - j, n)
        if values:
            prefetch_rows(<const floating *>p.v + vo + hk * p.vsh, p.vss, cnt, len, p.prefetch)
        else:
            prefetch_rows(<const floating *>p.k + ko + hk * p.ksh, p.kss, cnt, len, p.prefetch)
        j += cnt
        n -= cnt


cdef inline ptrdiff_t prefetch_count(AttnProblem *p, int64_t j0, ptrdiff_t n,
                                     int64_t jhi) noexcept nogil:
    """Keys to prefetch during block [j0, j0 + n): those from j0 + pf_ahead on, as many as the
    block has, up to jhi (0 when prefetch is off)."""
    if not p.prefetch:
        return 0
    return max(<int64_t>0, min(<int64_t>n, jhi - j0 - p.pf_ahead))


cdef void attend_rows(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t b, ptrdiff_t hk,
                      int64_t jlo, int64_t jhi, int64_t pmin, int64_t pmax,
                      int uniform) noexcept nogil:
    """Run keys [jlo, jhi) of kv head (b, hk) against the started lanes (start_rows), block
    by block (attend_block).  pmin/pmax: the lanes' smallest and largest query position."""
    cdef int64_t j0 = jlo
    cdef ptrdiff_t n
    while j0 < jhi:
        n = p.Bk if jhi - j0 > p.Bk else jhi - j0
        attend_block(p, w, dummy, b, hk, j0, n, prefetch_count(p, j0, n, jhi), pmin, pmax,
                     uniform)
        j0 += n


cdef inline ptrdiff_t band_segment(AttnProblem *p, int64_t j0, ptrdiff_t n, int64_t pmin,
                                  ptrdiff_t pw, ptrdiff_t c) noexcept nogil:
    """Where key segment c of block [j0, j0 + n) starts (keys from j0; the last segment ends
    at n): the first key no lane of panels 0 .. c-1 needs (lanes at positions pmin, pmin + 1,
    ...), rounded up to a multiple of 32 keys, within [0, n]."""
    cdef int64_t first = pmin + c * pw + p.wr - j0
    if first <= 0:
        return 0
    first = (first + 31) // 32 * 32
    return <ptrdiff_t>first if first < n else n


cdef void attend_block(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t b, ptrdiff_t hk,
                       int64_t j0, ptrdiff_t n, ptrdiff_t n2, int64_t pmin, int64_t pmax,
                       int uniform) noexcept nogil:
    """Keys [j0, j0 + n) of kv head (b, hk) against the started lanes (their K/V rows:
    block_kv); n2: keys of the next block to prefetch meanwhile (0: none)."""
    cdef ptrdiff_t rows = w.rows, W = w.W
    cdef int pw_nv = w.pw_nv
    cdef bint dot = w.dot
    cdef const floating *K
    cdef const floating *V
    cdef ptrdiff_t ldk, ldv
    cdef floating *S = <floating *>w.S
    cdef floating *cmax = <floating *>w.cmax
    cdef ptrdiff_t E = p.E, Ev = p.Ev, lds = p.lds, i
    cdef bint win_partial, masked, clean, exact
    cdef ptrdiff_t s0, ns, s1, lane, pw = w.pw_nv * k_vw(dummy), nseg
    block_kv(p, w, dummy, b, hk, j0, n, &K, &V, &ldk, &ldv)
    # does the window/causal band cut through this block for some lane?
    win_partial = j0 < pmax - p.wl or j0 + n - 1 > pmin + p.wr
    masked = p.mask_kind != 0 or win_partial
    clean = not masked and p.softcap == 0 and not p.has_alibi
    for i in range(W):
        cmax[i] = -INFINITY
    # The band's right edge inside the block (a causal item's diagonal block), lanes at
    # consecutive positions (a forward item): key segment c (band_segment) is needed by the
    # lanes of panels c, c+1, ... only, so its scores and P·V run for those lanes alone instead
    # of a Bq x Bq triangle of masked work per item (the window pass masks the rest, the
    # softmax still exponentiates it). Causal d = 64, L = S = 2048, one thread: 0.545 -> 0.536
    # of the full problem's time (0.5 is the flop ratio); with Bq = 192 0.528 (was 0.556), but
    # Bq = 192 loses 15% at L = 256 on two threads (fewer items), so banded items stay at 96.
    nseg = 0
    if (not dot and n2 == 0 and j0 + n - 1 > pmin + p.wr and rows > pw
            and w.pos[rows - 1] - w.pos[0] == rows - 1
            and band_segment(p, j0, n, pmin, pw, 1) > 0):
        nseg = (rows + pw - 1) // pw
    # The band segments' scores (nseg > 0), each for the lanes of its panels on.
    s0 = 0
    for i in range(nseg):
        s1 = band_segment(p, j0, n, pmin, pw, i + 1)
        if s1 > s0:
            lane = i * pw
            k_qk(K + s0 * ldk, ldk, s1 - s0, E, <const floating *>w.Qt + lane * E, W - lane,
                 pw_nv, S + s0 * lds + lane, lds, NULL, <floating *>w.kpad, p.scale)
            s0 = s1
    # Scores in slices of tune.pf_qk keys, each followed by the prefetch of the same slice of
    # the next block's K (decode only): spread over the compute, the prefetches keep DRAM
    # busy while the core works, where one burst per block stalled the core on full
    # fill buffers and left the memory idle during the compute after it.
    while s0 < n:
        ns = min(p.tune.pf_qk if n2 > 0 else n, n - s0)
        if dot:
            k_qk_dot(K + s0 * ldk, ldk, ns, E, <const floating *>w.Qt, round_up(E, 16),
                     <int>rows, S + s0 * lds, lds, p.scale)
        else:
            k_qk(K + s0 * ldk, ldk, ns, E, <const floating *>w.Qt, W, pw_nv,
                 S + s0 * lds, lds, cmax if clean else NULL, <floating *>w.kpad, p.scale)
        if s0 < n2:
            prefetch_keys(p, dummy, b, hk, j0 + p.pf_ahead + s0, min(ns, n2 - s0), False)
        s0 += ns
    if dot or not clean:
        # spec order: softcap, ALiBi, float mask, bool mask, window (the last three
        # replace by -inf, so NaN scores of masked keys cannot survive)
        if p.softcap > 0:
            k_softcap(S, lds, n, W, p.softcap)
        if p.has_alibi:
            k_alibi(S, lds, n, W, j0, w.pos, <const floating *>w.slope)
        if p.mask_kind == 2:
            k_maskf(S, lds, n, W, j0, <const floating *>p.mask_f, w.moff, p.msj, uniform)
        elif p.mask_kind == 1:
            k_maskb(S, lds, n, W, j0, p.mask_b, w.moff, p.msj, uniform)
        if win_partial:
            k_window(S, lds, n, W, j0, w.pos, p.wl, p.wr)
        k_colmax(S, lds, n, W, cmax)
    k_softmax(S, lds, n, W, cmax, <floating *>w.m, <floating *>w.l, <floating *>w.alpha)
    if p.has_dropout:
        k_dropout(S, lds, n, W, j0 + p.drop_col0, w.rk, p.thresh)
    # 0 * NaN = NaN in the tile product: when some weight may be an exact 0 (masking,
    # dropout) and this V block holds Inf/NaN, take the zero-skipping path.
    exact = (masked or p.has_dropout) and not rows_allfinite(V, ldv, n, Ev)
    # The band segments' P·V (nseg > 0), each over its lanes; the first (every lane) rescales
    # O by alpha. Segments start on multiples of 32 keys (the kernels' summation chunk), so
    # each row's sums and their order are those of one call over the block: the same bits.
    s0 = 0
    for i in range(nseg):
        s1 = band_segment(p, j0, n, pmin, pw, i + 1)
        if s1 > s0:
            lane = i * pw
            k_pv(S + s0 * lds + lane, lds, s1 - s0, V + s0 * ldv, ldv, Ev,
                 <floating *>w.O + lane * p.ldo, p.ldo, <const floating *>w.alpha + lane,
                 rows - lane, exact)
            for lane in range(p.Wcap):
                (<floating *>w.alpha)[lane] = 1
            s0 = s1
    # P·V likewise in slices of tune.pf_pv keys (a multiple of the kernels' 32-key summation
    # chunk, so the sums and their order are those of one call); alpha rescales O once.
    while s0 < n:
        ns = min(p.tune.pf_pv if n2 > 0 else n, n - s0)
        k_pv(S + s0 * lds, lds, ns, V + s0 * ldv, ldv, Ev, <floating *>w.O, p.ldo,
             <const floating *>w.alpha, rows, exact)
        if s0 < n2:
            prefetch_keys(p, dummy, b, hk, j0 + p.pf_ahead + s0, min(ns, n2 - s0), True)
        s0 += ns
        if s0 < n:
            for i in range(p.Wcap):
                (<floating *>w.alpha)[i] = 1


cdef inline double sink_fold(double sink, double *m, double *l) noexcept nogil:
    """Fold a sink logit into a finished row's running max m and sum l (the sink counts in the
    denominator only).  Returns exp(m_old - m_new), the factor for the row's accumulated
    output: 0 when the row attended no key, so such a row gives out 0 and lse = sink."""
    cdef double mt = m[0] if m[0] > sink else sink
    cdef double g
    if mt == -INFINITY:                  # no key and a -inf sink: still the empty row
        return 0
    g = exp(m[0] - mt)
    l[0] = l[0] * g + exp(sink - mt)
    m[0] = mt
    return g


cdef inline double row_sink(AttnProblem *p, floating *dummy, int64_t orow) noexcept nogil:
    """The sink logit of global query row orow = (b * Hq + h) * L + i."""
    return (<const floating *>p.sinks)[(orow // p.L) % p.Hq]


cdef void finish_rows(AttnProblem *p, Work *w, floating *dummy) noexcept nogil:
    """out = O / l (times the dropout rescale), lse = m + log l, the sink folded in first;
    l == 0 -> 0 and -inf; l NaN -> NaN (a NaN or Inf took part in the row's scores: the
    exponentials turned it into NaN, and it must not pass for a row without keys)."""
    cdef ptrdiff_t r, c, Ev = p.Ev, rows = w.rows
    cdef floating *O = <floating *>w.O
    cdef floating *m = <floating *>w.m
    cdef floating *l = <floating *>w.l
    cdef floating *o
    cdef floating *lse = <floating *>p.lse
    cdef double inv, mm, ll, g
    for r in range(rows):
        o = <floating *>p.out + w.orow[r] * Ev
        mm = m[r]
        ll = l[r]
        if p.has_sinks:
            g = sink_fold(row_sink(p, dummy, w.orow[r]), &mm, &ll)
        if ll != ll:                     # also a NaN or +inf sink
            for c in range(Ev):
                o[c] = NAN
            lse[w.orow[r]] = NAN
            continue
        if p.has_sinks:
            if ll > 0:
                k_scale_row(O + r * p.ldo, o, Ev, p.keep_scale * g / ll)
                lse[w.orow[r]] = mm + log(ll)
                continue
        elif l[r] > 0:
            # in double: one rounding per output element (float32: O * (1/l) rounded twice)
            inv = p.keep_scale / l[r]
            k_scale_row(O + r * p.ldo, o, Ev, inv)
            lse[w.orow[r]] = m[r] + log(l[r])
            continue
        for c in range(Ev):
            o[c] = 0
        lse[w.orow[r]] = -INFINITY


cdef void fwd_item(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t it, ptrdiff_t Bq,
                   ptrdiff_t nqb, bint longest_first) noexcept nogil:
    cdef ptrdiff_t bh = it // nqb, qb = it % nqb, r
    if longest_first:
        # causal: later query blocks see more keys; hand them out first (dynamic schedule)
        qb = nqb - 1 - qb
    cdef ptrdiff_t b = bh // p.Hq, h = bh % p.Hq, hk = h // p.G
    cdef ptrdiff_t i0 = qb * Bq
    cdef ptrdiff_t rows = Bq if p.L - i0 > Bq else p.L - i0
    cdef ptrdiff_t pw = k_nr(dummy)
    cdef ptrdiff_t W = round_up(rows, pw)
    for r in range(rows):
        set_lane(p, w, dummy, r, b, h, i0 + r)
    start_rows(p, w, dummy, rows, W, pw, False)
    cdef int64_t qo = seq_q_offset(p, b), nk = seq_keys(p, b)
    cdef int64_t pmin = i0 + qo, pmax = i0 + rows - 1 + qo
    cdef int64_t jlo = pmin - p.wl, jhi = pmax + p.wr + 1
    if jlo < 0:
        jlo = 0
    if jhi > nk:
        jhi = nk
    if jlo < jhi:
        attend_rows(p, w, dummy, b, hk, jlo, jhi, pmin, pmax, p.msi == 0)
    finish_rows(p, w, dummy)


ctypedef struct FwdJob:                  # one forward call as the pool's threads see it
    AttnProblem *p
    ptrdiff_t n_items, Bq, nqb
    bint lf
    int fail
    fa_share share


cdef void fwd_job_body(FwdJob *j, floating *dummy) noexcept nogil:
    """One thread's part: its scratch, then items from the counter until none is left."""
    cdef Work *w = work_new(j.p, dummy)
    cdef ptrdiff_t it
    if w == NULL:
        j.fail = 1
    it = fa_share_next(&j.share)
    while it < j.n_items:
        if w != NULL:
            fwd_item(j.p, w, dummy, it, j.Bq, j.nqb, j.lf)
        it = fa_share_next(&j.share)
    work_free(w)


cdef void fwd_job_f(void *ctx) noexcept nogil:
    fwd_job_body(<FwdJob *>ctx, <float *>NULL)


cdef void fwd_job_d(void *ctx) noexcept nogil:
    fwd_job_body(<FwdJob *>ctx, <double *>NULL)


cdef int run_forward(AttnProblem *p, floating *dummy) noexcept nogil:
    # causal / sliding window: some rows see fewer keys than others, so items differ in cost
    # (longest first) and smaller query blocks skip more of the masked triangle.  Causal has
    # an unbounded left side, so a band narrower than S alone missed it: it ran with 192-row
    # blocks in item order (fwd d=64 causal L=256, 4 heads: 0.61-0.63x torch's time with
    # 96-row blocks against 0.84-0.85x, same bits)
    cdef bint banded = (p.wl + p.wr + 1 < p.S
                        or (p.L > 1 and min(p.wl, p.wr) < p.S - 1))
    cdef ptrdiff_t Bq = p.tune.fwd_bq_banded if banded else p.tune.fwd_bq
    cdef ptrdiff_t nqb = (p.L + Bq - 1) // Bq
    cdef ptrdiff_t n_items = p.B * p.Hq * nqb, it
    cdef int fail = 0
    cdef Work *w = NULL
    cdef bint lf = banded
    p.Bk = p.tune.fwd_bk
    p.prefetch = 0
    p.pf_ahead = 0
    p.Wcap = round_up(Bq if Bq < p.L else p.L, k_nr(dummy)) + 16
    p.lds = p.Wcap
    p.ldo = round_up(p.Ev, k_vw(dummy)) if p.Ev > 0 else 1
    if n_items == 0:
        return 0
    cdef int nt = resolve_threads(p.n_threads, n_items)
    # below ~8 MFLOP waking a second thread costs more than it saves
    cdef double band = <double>min(p.S, p.wl + p.wr + 1)
    if <double>p.B * p.Hq * p.L * band * (p.E + p.Ev) * 2 < 8e6:
        nt = 1
    if nt == 1:
        w = work_new(p, dummy)
        if w == NULL:
            return -1
        for it in range(n_items):
            fwd_item(p, w, dummy, it, Bq, nqb, lf)
        work_free(w)
        return 0
    # items from a shared counter, run by the caller and whichever pool helpers are free
    # (csrc/fa_pool.h): nobody waits for a thread that has not started
    cdef FwdJob job
    job.p = p
    job.n_items = n_items
    job.Bq = Bq
    job.nqb = nqb
    job.lf = lf
    job.fail = 0
    fa_share_init(&job.share)
    if floating is double:
        fa_pool_run(nt, fwd_job_d, &job, 1)
    else:
        fa_pool_run(nt, fwd_job_f, &job, 1)
    fail = job.fail
    return -fail


# ---- Python entry ---------------------------------------------------------------------------

def forward(args, out, lse):
    """FlashAttention-2 forward of the record `args` (KernelArgs, docs/KERNELS.md); fills out
    and lse.  The dtype of out decides the specialization (see decode)."""
    cdef ArrView o, l
    if view_outputs(out, lse, &o, &l):
        forward_call(args, &o, &l, <double *>NULL)
    else:
        forward_call(args, &o, &l, <float *>NULL)


cdef int forward_call(object args, ArrView *o, ArrView *l, floating *dummy) except -1:
    cdef AttnProblem p
    fill_problem(&p, args, dummy, o.shape, l.shape)
    if p.B * p.Hq * p.L == 0:
        return 0
    p.out = o.data
    p.lse = l.data
    cdef int rc
    with nogil:
        rc = run_forward(&p, dummy)
    if rc != 0:
        raise MemoryError("attention kernel: could not allocate per-thread scratch")
    return 0
