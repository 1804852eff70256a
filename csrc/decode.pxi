# Decode: a few query rows (L <= ~16) against a long key sequence -- memory-bound, so the
# goal is to read K and V exactly once at full bandwidth.
#
# Item = (batch, kv head, row group, key chunk).  The lanes of an item are ALL query rows of
# the KV group (G query heads x L rows), so every K/V block is streamed once for the whole
# group instead of G times.  Lanes are packed into Qt panels one vector wide when they fit
# (MHA decode has 1 lane; a 2-vector panel would double the padding work).
# When B*Hkv*row_groups < threads, the keys are split into chunks (flash-decoding); each chunk
# leaves an unnormalised partial (O, m, l) and dec_merge combines them by log-sum-exp:
#     M = max_c m_c,  l = sum_c e^(m_c - M) l_c,  out = sum_c e^(m_c - M) O_c / l,  lse = M + log l

cdef extern from "fa_decode1.h" nogil:
    int FA_D1_BK
    int fa_decode1_available()
    void fa_decode1_f_avx512(const float *q, const float *K, ptrdiff_t ldk, const float *V,
                             ptrdiff_t ldv, ptrdiff_t n, ptrdiff_t E, ptrdiff_t Ev, float scale,
                             float *m, double *l, float *O, int pf_kind, const float *Kpf,
                             const float *Vpf, ptrdiff_t npf)

cdef extern from "fa_decodeg.h" nogil:
    int FA_DG_MAXR
    void fa_decodeg_f_avx512(int R, const float *q, ptrdiff_t ldq, const float *K, ptrdiff_t ldk,
                             const float *V, ptrdiff_t ldv, ptrdiff_t n, ptrdiff_t E,
                             ptrdiff_t Ev, float scale, float *m, double *l, float *O,
                             ptrdiff_t ldo, int pf_kind, const float *Kpf, const float *Vpf,
                             ptrdiff_t npf)

cdef extern from "fa_decode_avx2.h" nogil:
    int fa_decode_avx2_available(ptrdiff_t E, ptrdiff_t Ev)
    void fa_decodeg_f_avx2(int R, const float *q, ptrdiff_t ldq, const float *K, ptrdiff_t ldk,
                           const float *V, ptrdiff_t ldv, ptrdiff_t n, ptrdiff_t E, ptrdiff_t Ev,
                           float scale, float *m, double *l, float *O, ptrdiff_t ldo, int pf_kind,
                           const float *Kpf, const float *Vpf, ptrdiff_t npf)

cdef extern from "fa_decode_lowp512.h" nogil:
    int fa_decode_lowp_copy(ptrdiff_t E, ptrdiff_t Ev)
    # the AVX-512 copy (fa_decode_lowp512.h) where fa_decode_lowp_copy says 2, else AVX2's
    void fa_decode_lowp(int kv_kind, int R, const float *q, ptrdiff_t ldq, const void *K,
                        ptrdiff_t ldk, const void *V, ptrdiff_t ldv, const float *ks,
                        ptrdiff_t ldks, const float *vs, ptrdiff_t ldvs, ptrdiff_t n,
                        ptrdiff_t E, ptrdiff_t Ev, float scale, float *m, float *l, float *O,
                        ptrdiff_t ldo, int pf_kind, const void *Kpf, const void *Vpf,
                        ptrdiff_t npf)

# Keys per block (tune.dec_bk, default 48): small enough that a block's V (Bk x Ev floats)
# stays in L1 across the P·V column panels, a multiple of the 12-row key strip so fa_qk never
# copies a tail strip; the next block's prefetch is spread over the compute (attend_rows'
# slices).
cdef enum:
    DEC_RCAP = 192                   # lanes per item (query rows of one KV group)
    DEC_MIN_CHUNK = 1024             # do not split keys finer than this
    # A call reading less K/V than this does not wake sleeping pool helpers: one arrives
    # ~25-50 us after the wake on a VM, when the caller is nearly done (cython_.py's
    # serial_decode_bytes, bench/results/pool_spin.md).  Helpers that are awake, spinning
    # between the jobs of a tight loop (csrc/fa_pool.h), join any call.
    DEC_WAKE_BYTES = 4 << 20
    DEC_VIEWS_ITEMS = 2              # items per thread at least, walking side-by-side heads
    DEC_HG_BK = 32                   # keys per block of dec_heads_group (AVX-512 kernels)
    # ... with the AVX2 kernel (fa_decode_avx2.h): on a Zen 3 guest (512 KiB L2, 32 KiB 8-way
    # L1) a kv head's rows of a flash-layout cache lie Hkv * d * 4 bytes apart (4 KiB at
    # 8 x 128: one L1 set), and the inference preset's ragged GQA decode (8 x 128, B = 8) read
    # 4.9 GB/s at 32 keys with prefetch, 9.1-9.4 at 8 keys without (4: 7.2-8.5, 16: 6.0).
    # That run had it off at 8 keys too (5.5-5.8 with it); see dec1_prefetch for why it is on.
    DEC_HG_BK_AVX2 = 8
    # ... and fa_decode_lowp.h's (a low-precision cache: its rows are 2-4x shorter)
    DEC_HG_BK_LOWP = 8
    # ... and fa_decode_lowp512.h's: a call costs ~80 ns besides its keys (a C harness over
    # the kernel, GQA 4 rows x d = 128, int8, a flash-layout cache in L2, this Xeon): 34 ns a
    # key at 8 keys a call, 28 at 16, 23 at 32 and 64 (float16 alike); from DRAM 44 -> 40.
    DEC_HG_BK_LOWP512 = 32
    DEC_L1_WAYS = 12                 # L1d associativity dec_lowp512_keys assumes (SPR/GNR)


cdef inline ptrdiff_t dec_lowp512_keys(AttnProblem *p) noexcept nogil:
    """Keys per block of the AVX-512 low-precision decode: DEC_HG_BK_LOWP512, or fewer (not
    below 16) where a block's V rows would crowd L1 sets.  P·V reads a block's V rows once
    per column panel (two at d = 128 for groups of 3-6 rows), and rows `stride` bytes apart
    fall into 4096 / gcd(stride, 4096) set positions: 32 float16 rows 2 KiB apart (8 kv
    heads x d = 128, flash layout) put 16 lines into each of their sets, past L1's 12 ways,
    and the second panel read them from L2.  cache_dtypes_decode's shape (GQA 32/8, d = 128,
    16384 keys, 15 rounds with the read probe): float16 0.667 -> 0.717 of the probe at 24
    keys (0.720 at 16), bfloat16 0.658 -> 0.675, int8 0.51 both (1 KiB rows).  Where rows
    are 1 KiB apart (d = 64, or 4 kv heads) 24 keys read 1-7.5% slower: those keep 32."""
    cdef int64_t stride = p.vss * (1 if p.kv_kind == 3 else 2), g = 4096, t
    while stride > 0:                # g = gcd(4096, stride)
        t = g % stride
        g = stride
        stride = t
    return max(<ptrdiff_t>16, min(<ptrdiff_t>DEC_HG_BK_LOWP512,
                                  <ptrdiff_t>(DEC_L1_WAYS * (4096 // g))))


cdef void dec_rows(AttnProblem *p, ptrdiff_t g, ptrdiff_t nrg, ptrdiff_t Rcap, ptrdiff_t *b,
                   ptrdiff_t *hk, ptrdiff_t *r0, ptrdiff_t *rows) noexcept nogil:
    cdef ptrdiff_t rg = g % nrg
    b[0] = (g // nrg) // p.Hkv
    hk[0] = (g // nrg) % p.Hkv
    r0[0] = rg * Rcap
    rows[0] = min(Rcap, p.G * p.L - r0[0])


cdef void dec_item(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t it, ptrdiff_t nrg,
                   ptrdiff_t Rcap, ptrdiff_t nsplit, ptrdiff_t chunk, floating *part_O,
                   floating *part_ml) noexcept nogil:
    cdef ptrdiff_t c = it % nsplit, g = it // nsplit
    cdef ptrdiff_t b, hk, r0, rows, r, rr, h, i
    dec_rows(p, g, nrg, Rcap, &b, &hk, &r0, &rows)
    cdef int64_t qo = seq_q_offset(p, b), nk = seq_keys(p, b)
    cdef int64_t pmin = qo + p.L, pmax = qo - 1
    cdef int64_t jlo, jhi, end, ko, vo, n, ahead, kc = 0, vc = 0
    if floating is float:
        if dec_group_ok(p, rows):
            # one query position for the rows of the group (MHA: one row, fa_decode1.h; GQA:
            # its G rows, fa_decodeg.h).  The band of one position is the key range
            # [jlo, jhi), read run by run of keys stored at one stride (kv_segment: the range,
            # or each page).
            dec_group_start(p, w, dummy, b, hk, rows)
            jlo = max(c * chunk, max(<int64_t>0, qo - p.wl))
            jhi = min(min((c + 1) * chunk, nk), qo + p.wr + 1)
            while jlo < jhi:
                end = min(kv_segment(p, b, jlo, &ko, &vo), jhi)
                if p.ksc != NULL:
                    kv_scale_offsets(p, b, jlo, &kc, &vc)
                n = end - jlo
                ahead = dec1_ahead(p)
                dec_group_run(p, w, hk, ko, vo, n, ko + ahead * p.kss, vo + ahead * p.vss,
                              n - ahead, kc, vc)
                jlo = end
            dec_group_end(p, w)
            dec_item_done(p, w, dummy, it, rows, nsplit, Rcap, part_O, part_ml)
            return
    dec_lanes(p, w, dummy, b, hk, r0, rows, &pmin, &pmax)
    jlo = max(c * chunk, max(<int64_t>0, pmin - p.wl))
    jhi = min(min((c + 1) * chunk, nk), pmax + p.wr + 1)
    if jlo < jhi:
        attend_rows(p, w, dummy, b, hk, jlo, jhi, pmin, pmax, p.msh == 0 and p.msi == 0)
    dec_item_done(p, w, dummy, it, rows, nsplit, Rcap, part_O, part_ml)


cdef void dec_lanes(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t b, ptrdiff_t hk,
                    ptrdiff_t r0, ptrdiff_t rows, int64_t *pmin, int64_t *pmax) noexcept nogil:
    """Start lanes [0, rows) of w: query rows r0 ... of kv head (b, hk)'s group; widens
    [pmin, pmax] to their positions."""
    cdef ptrdiff_t r, rr, h, i
    for r in range(rows):
        rr = r0 + r
        h = hk * p.G + rr // p.L
        i = rr % p.L
        set_lane(p, w, dummy, r, b, h, i)
        pmin[0] = min(pmin[0], w.pos[r])
        pmax[0] = max(pmax[0], w.pos[r])
    cdef ptrdiff_t vw = k_vw(dummy)
    cdef int pw_nv = 1 if rows <= vw else k_nv(dummy)
    cdef ptrdiff_t W = round_up(rows, pw_nv * vw)
    # <= 4 query rows: dot-product scores when the ISA has them (fa_decode_avx512.h)
    cdef bint dot = rows <= 4 and k_has_dot(dummy) and p.tune.dec_use_dot
    start_rows(p, w, dummy, rows, W, pw_nv * vw, dot)


cdef bint dec_heads_together(AttnProblem *p, floating *dummy, ptrdiff_t R) noexcept nogil:
    """The kv heads' key rows lie side by side (a flash-layout cache (B, S, Hkv, E) read in
    place: head stride < key stride).  Then an item takes every kv head of its sequence and
    walks the keys once for all of them, block by block (dec_heads_item), so memory is read in
    order; item by kv head, each head's rows are Hkv*E floats apart, and the same DRAM pages
    were opened once per head (60 vs 36 ms of CPU time for the bench's decode).
    fa_decode1.h / fa_decodeg.h take the same walk (dec_heads_group).
    Only for a KV cache's call (seqlens given: attention_with_kvcache, KVCache): its blocks
    differ from the head-by-head walk's, and so do the sums' roundings.  A
    scaled_dot_product_attention call on (B, S, H, E) views (split_heads, a flash-layout
    cache transposed; fastattn/_fastpath.py reads them in place) takes dec_views_walk: the
    head-by-head walk's chunks and kernel blocks, heads together, the bits of the same call
    on contiguous copies."""
    return kv_heads_interleaved(p) and p.seqlens != NULL


cdef inline bint kv_heads_interleaved(AttnProblem *p) noexcept nogil:
    return p.Hkv >= 2 and p.ksh < p.kss and p.vsh < p.vss


cdef inline bint dec_views_walk(AttnProblem *p) noexcept nogil:
    """A call on (B, S, H, E) views (no KV cache: dec_heads_together declined) whose group
    kernels walk the kv heads' rows together (dec_heads_group) with the bits of the
    head-by-head walk: float32 rows in place, not paged."""
    return kv_heads_interleaved(p) and p.kv_kind == 0 and p.page_size == 0 and p.seqlens == NULL


cdef inline ptrdiff_t dec_views_heads(AttnProblem *p, ptrdiff_t nsplit, int nt) noexcept nogil:
    """kv heads per item of the views walk: all of them, or as few groups as give each thread
    DEC_VIEWS_ITEMS items (a thread that starts late or is descheduled leaves little behind).
    More heads an item read more of each key row in order, which pays from DRAM; from L3 it
    hardly matters.  split_heads views, kv heads an item swept, 12 x d = 64 (MHA) and 8 x
    d = 128 (GQA 32/8), 2 threads, medians of 7 interleaved rounds in one process, ms
    (/work/scratch/s22/hpgpf.py; contiguous copies last):
        MHA  4096 keys  1: 1.75  2: 0.79  3: 0.55  6: 0.58  12: 0.58  contiguous 0.44
        MHA 16384 keys  1: 8.93  2: 4.43  3: 4.59  6: 3.94  12: 4.03  contiguous 3.56
        GQA  4096 keys  1: 2.37  2: 1.96  4: 1.63  8: 2.16            contiguous 1.40
        GQA 16384 keys  1: 10.6  2: 9.10  4: 8.64  8: 7.70            contiguous 6.44
    (1 head an item is the head-by-head walk; 12 at 1024 keys, one item, ran on one thread.)"""
    if nt == 1:
        return p.Hkv
    cdef ptrdiff_t units = p.B * nsplit
    cdef ptrdiff_t groups = min(<ptrdiff_t>p.Hkv,
                                (DEC_VIEWS_ITEMS * nt + units - 1) // units)
    return (p.Hkv + groups - 1) // groups


cdef void dec_heads_group(AttnProblem *p, Work *w0, floating *dummy, ptrdiff_t su,
                          ptrdiff_t nsplit, ptrdiff_t chunk, ptrdiff_t hpg, floating *part_O,
                          floating *part_ml) noexcept nogil:
    """dec_heads_item for the group kernels (dec_group_ok: L = 1, one row group per kv head):
    item su = (batch, group of hpg kv heads, key chunk), kv head hk's group rows in
    work_at(w0, hk - the group's first); blocks of p.Bk keys, for the group's kv heads in
    turn, so the rows of a block are read in memory order."""
    cdef ptrdiff_t c = su % nsplit, nhg = (p.Hkv + hpg - 1) // hpg, hk, n
    cdef ptrdiff_t b = (su // nsplit) // nhg, h0 = ((su // nsplit) % nhg) * hpg
    cdef ptrdiff_t h1 = min(p.Hkv, h0 + hpg)
    cdef int64_t qo = seq_q_offset(p, b), nk = seq_keys(p, b), jlo, jhi, end, ko, vo
    cdef int64_t jp, pko = 0, pvo = 0, npf, kc = 0, vc = 0
    for hk in range(h0, h1):
        dec_group_start(p, work_at(w0, hk - h0), dummy, b, hk, p.G)
    jlo = max(c * chunk, max(<int64_t>0, qo - p.wl))
    jhi = min(min((c + 1) * chunk, nk), qo + p.wr + 1)
    while jlo < jhi:
        end = min(kv_segment(p, b, jlo, &ko, &vo), jhi)
        n = min(<int64_t>p.Bk, end - jlo)
        # the keys pf_ahead on, also on the next page (the hardware prefetchers stop at
        # a page, and the next one is elsewhere)
        jp = jlo + p.pf_ahead
        npf = 0
        if jp < jhi:
            npf = min(min(<int64_t>n, kv_segment(p, b, jp, &pko, &pvo) - jp), jhi - jp)
        if p.ksc != NULL:
            kv_scale_offsets(p, b, jlo, &kc, &vc)
        for hk in range(h0, h1):
            dec_group_run(p, work_at(w0, hk - h0), hk, ko, vo, n, pko, pvo, npf, kc, vc)
        jlo += n
    for hk in range(h0, h1):
        dec_group_end(p, work_at(w0, hk - h0))
        dec_item_done(p, work_at(w0, hk - h0), dummy, (b * p.Hkv + hk) * nsplit + c, p.G,
                      nsplit, p.G, part_O, part_ml)


cdef void dec_heads_item(AttnProblem *p, Work *w0, floating *dummy, ptrdiff_t su,
                         ptrdiff_t nrg, ptrdiff_t Rcap, ptrdiff_t nsplit, ptrdiff_t chunk,
                         floating *part_O, floating *part_ml) noexcept nogil:
    """Item su = (batch, row group, key chunk) for every kv head at once (dec_heads_together):
    kv head hk's lanes in work_at(w0, hk) and its results where dec_item would leave them
    (item ((b * Hkv + hk) * nrg + rg) * nsplit + c), the same blocks in the same order per
    head, so the same bits as item by head."""
    cdef ptrdiff_t c = su % nsplit, gr = su // nsplit
    cdef ptrdiff_t b = gr // nrg, rg = gr % nrg, hk, bb, hh, r0, rows = 0
    cdef int64_t qo = seq_q_offset(p, b), nk = seq_keys(p, b)
    cdef int64_t pmin = qo + p.L, pmax = qo - 1, jlo, jhi, j0
    cdef ptrdiff_t n
    cdef int uniform = p.msh == 0 and p.msi == 0
    for hk in range(p.Hkv):
        dec_rows(p, (b * p.Hkv + hk) * nrg + rg, nrg, Rcap, &bb, &hh, &r0, &rows)
        dec_lanes(p, work_at(w0, hk), dummy, b, hk, r0, rows, &pmin, &pmax)
    jlo = max(c * chunk, max(<int64_t>0, pmin - p.wl))
    jhi = min(min((c + 1) * chunk, nk), pmax + p.wr + 1)
    j0 = jlo
    while j0 < jhi:
        n = p.Bk if jhi - j0 > p.Bk else jhi - j0
        for hk in range(p.Hkv):
            attend_block(p, work_at(w0, hk), dummy, b, hk, j0, n,
                         prefetch_count(p, j0, n, jhi), pmin, pmax, uniform)
        j0 += n
    for hk in range(p.Hkv):
        dec_item_done(p, work_at(w0, hk), dummy, ((b * p.Hkv + hk) * nrg + rg) * nsplit + c,
                      rows, nsplit, Rcap, part_O, part_ml)


# The software prefetch of fa_decode1.h / fa_decodeg.h (prefetcht1, the next block): on by
# default once the call's K/V exceed 8 MiB.  An earlier rule (from a Xeon) turned it on only
# above the last-level cache, 32 MiB: on this Zen 4 guest the L3 we get holds 8-16 MiB at
# most (a plain one-thread read loop: 100 GB/s at 4-8 MiB, 59 at 16, 25 at 24 = DRAM), and
# the MHA decode of the latency preset (12 heads, d = 64, S = 4096: 25 MB) took 0.39-0.55x
# the time with the prefetch (bench/ab_trees.py); at S = 2048 (13 MB) 0.54x; at S = 1024
# (6 MB, in L3) the prefetch cost 6-11%.
# prefetcht0 and prefetchnta were 1.7-1.8x slower than prefetcht1 on the DRAM rows, none 1.4-2x;
# two blocks ahead was 1.05-1.1x slower than one.
cdef enum:
    DEC1_PREFETCH_BYTES = 8 << 20


# The AVX2 kernel's heads-group walk (DEC_HG_BK_AVX2) takes the same rule.  It had the
# prefetch off, from a Zen 3 measurement (above DEC_HG_BK_AVX2) of an older kernel that
# prefetched the next block's V rows in one burst in its first P·V panel and timed one call
# per round next to OpenBLAS's spinning probe.  With V prefetched along with K through the
# scores (fa_decode_avx2.h), on a Zen 4 guest without AVX-512 (1 MiB L2) the inference
# preset's ragged decode took 0.76x the time with it on 2 threads (57% -> 75% of the gemv
# probe interleaved, batches of 4 calls) and 0.81x on one; a block further ahead (16, 32
# keys) was no better.  Not remeasured on a Zen 3.
cdef inline int dec1_prefetch(AttnProblem *p) noexcept nogil:
    if p.tune.dec_pf_kind >= 0:
        return p.tune.dec_pf_kind
    return 2 if (<int64_t>p.B * p.Hkv * p.S * (p.E + p.Ev) * <int64_t>sizeof(float)
                 > DEC1_PREFETCH_BYTES) else 0


cdef inline ptrdiff_t dec1_ahead(AttnProblem *p) noexcept nogil:
    return p.tune.dec_pf_ahead if p.tune.dec_pf_ahead else 64     # FA_D1_BK: the next block


cdef inline bint dec_group_ok(AttnProblem *p, ptrdiff_t rows) noexcept nogil:
    """fa_decode1.h / fa_decodeg.h (or on AVX2 fa_decode_avx2.h) serve an item of `rows` rows:
    float32, scores with no modifier, one query position (L = 1), at most FA_DG_MAXR rows."""
    return p.L == 1 and rows <= FA_DG_MAXR and dec_one_row_ok(p)


cdef void dec_group_start(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t b, ptrdiff_t hk,
                          ptrdiff_t rows) noexcept nogil:
    """Lanes [0, rows) of w: the query heads of kv head (b, hk)'s group (L = 1), with empty
    running state."""
    cdef ptrdiff_t r
    for r in range(rows):
        set_lane(p, w, dummy, r, b, hk * p.G + r, 0)
        (<float *>w.m)[r] = -INFINITY
        (<float *>w.l)[r] = 0
        w.ld[r] = 0
    w.rows = rows
    memset(w.O, 0, rows * p.ldo * sizeof(float))


cdef inline void dec_group_end(AttnProblem *p, Work *w) noexcept nogil:
    """The group's running sums as the finish and merge code reads them: float32, rounded once
    after the item's last kernel call (the float32 kernels carry them in double across calls;
    fa_decode_lowp's are float32 already)."""
    cdef ptrdiff_t r
    if p.kv_kind == 0:
        for r in range(w.rows):
            (<float *>w.l)[r] = <float>w.ld[r]


cdef inline void dec_group_run(AttnProblem *p, Work *w, ptrdiff_t hk, int64_t ko, int64_t vo,
                               ptrdiff_t n, int64_t pko, int64_t pvo, int64_t npf, int64_t kc,
                               int64_t vc) noexcept nogil:
    """n keys stored from element offsets ko / vo (kv_segment, kv head 0) against w's group
    rows, prefetching meanwhile up to npf key rows stored from pko / pvo (same strides).  A
    low-precision cache: its own kernel (fa_decode_lowp.h), the int8 scales of the first key
    at element offsets kc / vc (kv_scale_offsets, kv head 0)."""
    cdef const float *q = <const float *>p.q + w.orow[0] * p.E
    cdef ptrdiff_t item
    if p.kv_kind:
        item = 1 if p.kv_kind == 3 else 2
        fa_decode_lowp(p.kv_kind, <int>w.rows, q, p.E,
                       p.k + (ko + hk * p.ksh) * item, p.kss,
                       p.v + (vo + hk * p.vsh) * item, p.vss,
                       p.ksc + kc + hk * p.kch if p.ksc != NULL else NULL, p.kcs,
                       p.vsc + vc + hk * p.vch if p.vsc != NULL else NULL, p.vcs,
                       n, p.E, p.Ev, <float>p.scale, <float *>w.m, <float *>w.l,
                       <float *>w.O, p.ldo, dec1_prefetch(p),
                       p.k + (pko + hk * p.ksh) * item, p.v + (pvo + hk * p.vsh) * item, npf)
        return
    cdef const float *K = <const float *>p.k + ko + hk * p.ksh
    cdef const float *V = <const float *>p.v + vo + hk * p.vsh
    if not fa_decode1_available():          # the AVX2 copy (dec_one_row_ok)
        fa_decodeg_f_avx2(<int>w.rows, q, p.E, K, p.kss, V, p.vss, n, p.E, p.Ev,
                          <float>p.scale, <float *>w.m, w.ld, <float *>w.O, p.ldo,
                          dec1_prefetch(p), <const float *>p.k + pko + hk * p.ksh,
                          <const float *>p.v + pvo + hk * p.vsh, npf)
    elif w.rows == 1:
        fa_decode1_f_avx512(q, K, p.kss, V, p.vss, n, p.E, p.Ev, <float>p.scale,
                            <float *>w.m, w.ld, <float *>w.O, dec1_prefetch(p),
                            <const float *>p.k + pko + hk * p.ksh,
                            <const float *>p.v + pvo + hk * p.vsh, npf)
    else:
        fa_decodeg_f_avx512(<int>w.rows, q, p.E, K, p.kss, V, p.vss, n, p.E, p.Ev,
                            <float>p.scale, <float *>w.m, w.ld, <float *>w.O, p.ldo,
                            dec1_prefetch(p), <const float *>p.k + pko + hk * p.ksh,
                            <const float *>p.v + pvo + hk * p.vsh, npf)


cdef inline bint dec_one_row_ok(AttnProblem *p) noexcept nogil:
    """fa_decode1.h / fa_decodeg.h serve this call (float32 on AVX-512), or
    fa_decode_avx2.h (float32 on AVX2, head dims multiples of 8); scores with no modifier."""
    if p.kv_kind:
        # a low-precision cache: fa_decode_lowp512.h / fa_decode_lowp.h, the same conditions
        return (fa_decode_lowp_copy(p.E, p.Ev) != 0 and p.tune.dec_use_dot
                and p.mask_kind == 0 and p.softcap == 0 and not p.has_alibi
                and not p.has_dropout)
    return ((fa_decode1_available() or fa_decode_avx2_available(p.E, p.Ev))
            and p.tune.dec_use_dot and p.mask_kind == 0
            and p.softcap == 0 and not p.has_alibi and not p.has_dropout)


cdef void dec_item_done(AttnProblem *p, Work *w, floating *dummy, ptrdiff_t it, ptrdiff_t rows,
                        ptrdiff_t nsplit, ptrdiff_t Rcap, floating *part_O,
                        floating *part_ml) noexcept nogil:
    """The item's rows are attended: finish them, or park the partials for dec_merge."""
    if nsplit == 1:
        finish_rows(p, w, dummy)
        return
    cdef ptrdiff_t r, cc
    cdef floating *O = <floating *>w.O
    cdef floating *dst
    for r in range(rows):
        dst = part_O + (it * Rcap + r) * p.Ev
        for cc in range(p.Ev):
            dst[cc] = O[r * p.ldo + cc]
        part_ml[(it * Rcap + r) * 2] = (<floating *>w.m)[r]
        part_ml[(it * Rcap + r) * 2 + 1] = (<floating *>w.l)[r]


cdef void dec_merge(AttnProblem *p, floating *dummy, ptrdiff_t g, ptrdiff_t nrg,
                    ptrdiff_t Rcap, ptrdiff_t nsplit, const floating *part_O,
                    const floating *part_ml) noexcept nogil:
    cdef ptrdiff_t b, hk, r0, rows, r, rr, h, i, c, cc, it, Ev = p.Ev
    cdef int64_t orow
    cdef double M, lsum, f, mc, lc
    cdef bint bad
    cdef floating *o
    cdef const floating *src
    cdef floating *lse = <floating *>p.lse
    dec_rows(p, g, nrg, Rcap, &b, &hk, &r0, &rows)
    for r in range(rows):
        rr = r0 + r
        h = hk * p.G + rr // p.L
        i = rr % p.L
        orow = (b * p.Hq + h) * p.L + i
        o = <floating *>p.out + orow * Ev
        M = -INFINITY
        bad = False
        for c in range(nsplit):
            mc = part_ml[((g * nsplit + c) * Rcap + r) * 2]
            lc = part_ml[((g * nsplit + c) * Rcap + r) * 2 + 1]
            bad = bad or lc != lc                # NaN/Inf in the scores: see finish_rows
            if mc > M:
                M = mc
        if bad:
            for cc in range(Ev):
                o[cc] = NAN
            lse[orow] = NAN
            continue
        for cc in range(Ev):
            o[cc] = 0
        lsum = 0
        if M != -INFINITY:
            for c in range(nsplit):
                it = g * nsplit + c
                mc = part_ml[(it * Rcap + r) * 2]
                if mc == -INFINITY:          # chunk saw no allowed key: contributes nothing
                    continue
                f = exp(mc - M)
                lsum += f * part_ml[(it * Rcap + r) * 2 + 1]
                src = part_O + (it * Rcap + r) * Ev
                for cc in range(Ev):
                    o[cc] += <floating>(f * src[cc])
        if p.has_sinks:
            f = sink_fold(row_sink(p, dummy, orow), &M, &lsum)
            if lsum != lsum:             # a NaN or +inf sink
                for cc in range(Ev):
                    o[cc] = NAN
                lse[orow] = NAN
                continue
            if lsum > 0:
                f = p.keep_scale * f / lsum
                for cc in range(Ev):
                    o[cc] = <floating>(o[cc] * f)
                lse[orow] = <floating>(M + log(lsum))
                continue
        elif lsum > 0:
            f = p.keep_scale / lsum
            for cc in range(Ev):
                o[cc] = <floating>(o[cc] * f)
            lse[orow] = <floating>(M + log(lsum))
            continue
        for cc in range(Ev):
            o[cc] = 0
        lse[orow] = -INFINITY


cdef inline void dec_any(AttnProblem *p, Work *w, floating *dummy, bint heads, bint group,
                         ptrdiff_t it, ptrdiff_t nrg, ptrdiff_t Rcap, ptrdiff_t nsplit,
                         ptrdiff_t chunk, ptrdiff_t hpg, floating *part_O,
                         floating *part_ml) noexcept nogil:
    if heads and group:
        dec_heads_group(p, w, dummy, it, nsplit, chunk, hpg, part_O, part_ml)
    elif heads:
        dec_heads_item(p, w, dummy, it, nrg, Rcap, nsplit, chunk, part_O, part_ml)
    else:
        dec_item(p, w, dummy, it, nrg, Rcap, nsplit, chunk, part_O, part_ml)


cdef inline int64_t dec_longest_keys(AttnProblem *p) noexcept nogil:
    """The most keys any sequence reads: S, or the longest of seqlens (chunks past it would
    hold no key)."""
    cdef int64_t n = 0, b
    if p.seqlens == NULL:
        return p.S
    for b in range(p.B):
        n = max(n, <int64_t>seq_keys(p, b))
    return n


ctypedef struct DecJob:                  # one decode call as the pool's threads see it
    AttnProblem *p
    bint heads, group
    ptrdiff_t n_loop, nrg, Rcap, nsplit, chunk, hpg, n_works
    void *part_O                        # floating *: partial results of split key ranges
    void *part_ml
    int fail
    fa_share share


cdef void dec_job_body(DecJob *j, floating *dummy) noexcept nogil:
    """One thread's part: its scratch, then items from the counter until none is left."""
    cdef Work *w = work_new_n(j.p, dummy, j.n_works)
    cdef ptrdiff_t it
    if w == NULL:
        j.fail = 1
    it = fa_share_next(&j.share)
    while it < j.n_loop:
        if w != NULL:
            dec_any(j.p, w, dummy, j.heads, j.group, it, j.nrg, j.Rcap, j.nsplit, j.chunk,
                    j.hpg, <floating *>j.part_O, <floating *>j.part_ml)
        it = fa_share_next(&j.share)
    work_free(w)


cdef void dec_job_f(void *ctx) noexcept nogil:
    dec_job_body(<DecJob *>ctx, <float *>NULL)


cdef void dec_job_d(void *ctx) noexcept nogil:
    dec_job_body(<DecJob *>ctx, <double *>NULL)


cdef int run_decode(AttnProblem *p, floating *dummy) noexcept nogil:
    cdef ptrdiff_t R = p.G * p.L
    cdef ptrdiff_t Rcap = min(R, DEC_RCAP)
    cdef ptrdiff_t nrg = (R + Rcap - 1) // Rcap if R else 0
    cdef ptrdiff_t n_groups = p.B * p.Hkv * nrg, it, g
    if n_groups == 0:
        return 0
    # The caller chooses the threads by the bytes the call reads (fastattn/_backends/
    # _compiled.py, decode_threads): a small call arrives with n_threads = 1, a call below
    # DEC_WAKE_BYTES takes only helpers that are awake.
    cdef int nt = resolve_threads(p.n_threads, 1 << 30)
    # Enough items for the dynamic schedule to even out (the machines are shared: a thread
    # that gets descheduled should leave little behind), but chunks of >= DEC_MIN_CHUNK keys.
    # Items of all kv heads at once (dec_heads_together) are Hkv times larger and a ragged
    # batch's differ by its lengths: split them finer.
    cdef bint heads = dec_heads_together(p, dummy, R)
    cdef bint group = False, views = False
    if floating is float:
        group = dec_group_ok(p, R)
        views = group and not heads and dec_views_walk(p)
    cdef ptrdiff_t units = n_groups // p.Hkv if heads else n_groups
    cdef ptrdiff_t want = (32 if heads else 8) * nt
    cdef ptrdiff_t nsplit = 1
    # Split by the keys a sequence can read (a KV cache's lengths, not its capacity), and only
    # for more than one thread: a split costs its partial results and a merge, and at one thread
    # there is no schedule to even out.  (A decode step of 8 sequences of 17 keys in caches of
    # 2048 was split 4 ways, 3 of them empty: 171 us at one thread, most of it the merge and
    # the page faults of its fresh 0.5 MB of partials.)
    cdef int64_t keys = dec_longest_keys(p)
    if units < want and nt > 1:
        nsplit = min((want + units - 1) // units, max(<ptrdiff_t>1, keys // DEC_MIN_CHUNK))
    cdef ptrdiff_t n_items = n_groups * nsplit
    cdef ptrdiff_t n_loop = units * nsplit      # loop iterations: items, or items of all heads
    cdef ptrdiff_t hpg = p.Hkv, n_works = p.Hkv if heads else 1
    p.Bk = p.tune.dec_bk
    # the chunks of the head-by-head walk (whole p.Bk blocks from 0)
    cdef ptrdiff_t chunk = round_up((keys + nsplit - 1) // nsplit, p.Bk) if keys else 1
    if views:
        # side-by-side heads of a scaled_dot_product_attention call: the head-by-head walk's
        # chunks, walked in the kernels' own blocks from each chunk's start for groups of hpg
        # kv heads in turn (dec_heads_group), so every head gets the kernel's blocks of one
        # call over its chunk: the same bits, the rows read in memory order
        hpg = dec_views_heads(p, nsplit, nt)
        heads = True
        n_works = hpg
        n_loop = p.B * ((p.Hkv + hpg - 1) // hpg) * nsplit
        p.Bk = FA_D1_BK
    nt = resolve_threads(nt, n_loop)
    if heads and group and not views:
        # dec_heads_group's blocks: all kv heads' rows of DEC_HG_BK keys (Hkv x 32 KB at d =
        # 128), then the next; a block ahead is prefetched (dec1_prefetch).  The AVX2 kernel:
        # DEC_HG_BK_AVX2 keys
        if p.tune.dec_bk_set:
            p.Bk = p.tune.dec_bk
        else:
            if p.kv_kind:
                p.Bk = (dec_lowp512_keys(p) if fa_decode_lowp_copy(p.E, p.Ev) == 2
                        else DEC_HG_BK_LOWP)
            else:
                p.Bk = DEC_HG_BK if fa_decode1_available() else DEC_HG_BK_AVX2
    p.prefetch = 2 if p.tune.dec_pf_kind < 0 else p.tune.dec_pf_kind
    p.pf_ahead = p.tune.dec_pf_ahead if p.tune.dec_pf_ahead else p.Bk
    if heads and not views:
        chunk = round_up((keys + nsplit - 1) // nsplit, p.Bk) if keys else 1
    p.Wcap = round_up(Rcap, k_nr(dummy)) + 16
    p.lds = p.Wcap
    p.ldo = round_up(p.Ev, k_vw(dummy)) if p.Ev > 0 else 1
    cdef floating *part_O = NULL
    cdef floating *part_ml = NULL
    if nsplit > 1:
        part_O = <floating *>malloc(n_items * Rcap * max(p.Ev, 1) * sizeof(floating))
        part_ml = <floating *>malloc(n_items * Rcap * 2 * sizeof(floating))
        if part_O == NULL or part_ml == NULL:
            free(part_O)
            free(part_ml)
            return -1
    cdef int fail = 0
    cdef DecJob job
    cdef Work *w = NULL
    cdef int64_t item
    cdef bint wake
    if nt == 1:
        w = work_new_n(p, dummy, n_works)
        if w == NULL:
            fail = 1
        else:
            for it in range(n_loop):
                dec_any(p, w, dummy, heads, group, it, nrg, Rcap, nsplit, chunk, hpg, part_O,
                        part_ml)
            work_free(w)
    else:
        # items from a shared counter, run by the caller and whichever pool helpers are free
        # (csrc/fa_pool.h): nobody waits for a thread that has not started
        job.p = p
        job.heads = heads
        job.group = group
        job.n_loop = n_loop
        job.nrg = nrg
        job.Rcap = Rcap
        job.nsplit = nsplit
        job.chunk = chunk
        job.hpg = hpg
        job.n_works = n_works
        job.part_O = part_O
        job.part_ml = part_ml
        job.fail = 0
        fa_share_init(&job.share)
        item = sizeof(floating) if p.kv_kind == 0 else 1 if p.kv_kind == 3 else 2
        wake = p.B * p.Hkv * keys * (p.E + p.Ev) * item >= DEC_WAKE_BYTES
        if floating is double:
            fa_pool_run(nt, dec_job_d, &job, wake)
        else:
            fa_pool_run(nt, dec_job_f, &job, wake)
        fail = job.fail
    if nsplit > 1 and not fail:
        for g in range(n_groups):
            dec_merge(p, dummy, g, nrg, Rcap, nsplit, part_O, part_ml)
    free(part_O)
    free(part_ml)
    return -fail


def decode(args, out, lse):
    """Decode-shaped attention of the record `args` (same arguments and results as
    forward).  Not a fused-type def: Cython's dispatch on the argument types cost ~0.5 us of a
    ~5 us call; the dtype of out decides the specialization, fill_problem checks the rest."""
    cdef ArrView o, l
    if view_outputs(out, lse, &o, &l):
        decode_call(args, &o, &l, <double *>NULL)
    else:
        decode_call(args, &o, &l, <float *>NULL)


cdef int decode_call(object args, ArrView *o, ArrView *l, floating *dummy) except -1:
    cdef AttnProblem p
    fill_problem(&p, args, dummy, o.shape, l.shape)
    if p.B * p.Hq * p.L == 0:
        return 0
    p.out = o.data
    p.lse = l.data
    cdef int rc
    with nogil:
        rc = run_decode(&p, dummy)
    if rc != 0:
        raise MemoryError("attention kernel: could not allocate decode scratch")
    return 0
