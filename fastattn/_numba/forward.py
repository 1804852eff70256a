"""FlashAttention-2 forward kernel (Numba).

Work items are flattened (batch*head, query-block) pairs; one prange
iteration per thread claims items from an atomic counter. Per item: pack the
Q block once, then for every key block that intersects the allowed band:
S = Q.K^T, the score pipeline only where a block needs it (partial band,
mixed mask, softcap, ALiBi), lazy online softmax (running max m, sum l; acc
rescaled only when m moves; the scale is applied inside the exp argument,
see _tiles.py), acc += P.V. float32 tiles use the register-
blocked kernel of _gemm.py on a once-per-call panel layout of K; float64
tiles use BLAS through numba_xxgemm (beta=1 accumulation, no temporaries).
"""
import threading
from collections import namedtuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._blas import blas_single_thread, gemm_nn, gemm_nt, numba_threads, prime_blas
from ._hash import dropout_bh, dropout_threshold_nb
from ._intrinsics import (
    FM, atomic_count, atomic_next, atomic_read, counters, fcast, prefetch_l2, spin_pause,
    wide_vectors)
from ._kv import gather_k, gather_v, seq_keys, seq_q_offset
from ._record import numba_args, positive
from ._scores import (
    alibi_slope, band_partial, block_status, mask_base, needs_rows, score_units, sink_logit,
    tile_scores)
from ._tiles import (
    block_all_finite, pv_nonfinite, tile_dropout, tile_finalize, tile_online, zero_past_limit)
from ._gemm import MR, NO_LIMIT, PW, gemm_pv, gemm_qk, pack_k_panel, pack_q_tiles


# ---------------------------------------------------------------------------
# dtype dispatch, resolved at compile time: float32 tiles go through the
# packed register-blocked micro-kernel (_gemm.py), float64 through BLAS.
# ---------------------------------------------------------------------------
def _packed(arr):  # pragma: no cover - typing stubs
    raise NotImplementedError


def _prep_q(qf, qoff, nq, E, Qp, ntiles):  # pragma: no cover
    raise NotImplementedError


def _qk(Sb, Bk, qf, qoff, Qp, E, Eld, nq, ntiles, kf, kbase, j0, n, Kp, kpoff, ab,
        dlim):  # pragma: no cover
    raise NotImplementedError


def _pv(acc, Evld, Pb, Bk, vf, voff, Ev, n, nq, ntiles, ab, dlim):  # pragma: no cover
    raise NotImplementedError


def _pack_k(k, Kp, x):  # pragma: no cover
    raise NotImplementedError


@overload(_packed)
def _packed_ol(arr):
    f32 = arr.dtype == types.float32
    return lambda arr: f32


@overload(_prep_q)
def _prep_q_ol(qf, qoff, nq, E, Qp, ntiles):
    if qf.dtype == types.float32:
        def impl(qf, qoff, nq, E, Qp, ntiles):
            pack_q_tiles(qf, qoff, nq, E, Qp, 0, ntiles)
    else:
        def impl(qf, qoff, nq, E, Qp, ntiles):
            pass      # BLAS reads the Q rows in place
    return impl


@overload(_qk)
def _qk_ol(Sb, Bk, qf, qoff, Qp, E, Eld, nq, ntiles, kf, kbase, j0, n, Kp, kpoff, ab, dlim):
    if Sb.dtype == types.float32:
        def impl(Sb, Bk, qf, qoff, Qp, E, Eld, nq, ntiles, kf, kbase, j0, n, Kp, kpoff, ab, dlim):
            gemm_qk(Sb, Bk, Qp, 0, E, ntiles, Kp, kpoff, j0 // PW, (j0 + n + PW - 1) // PW, dlim)
    else:
        def impl(Sb, Bk, qf, qoff, Qp, E, Eld, nq, ntiles, kf, kbase, j0, n, Kp, kpoff, ab, dlim):
            gemm_nt(nq, n, E, qf, qoff, Eld, kf, kbase + j0 * E, Eld, 1, Sb, 0, Bk, ab)
    return impl


@overload(_pv)
def _pv_ol(acc, Evld, Pb, Bk, vf, voff, Ev, n, nq, ntiles, ab, dlim):
    if acc.dtype == types.float32:
        def impl(acc, Evld, Pb, Bk, vf, voff, Ev, n, nq, ntiles, ab, dlim):
            gemm_pv(acc, Evld, Pb, Bk, 0, vf, voff, Ev, Ev, n, ntiles, dlim)
    else:
        def impl(acc, Evld, Pb, Bk, vf, voff, Ev, n, nq, ntiles, ab, dlim):
            gemm_nn(nq, Ev, n, Pb, 0, Bk, vf, voff, Evld, 0, acc, 0, Evld, ab)
    return impl


def _pack_k_local(kf, koff, S, E, Kl, poff, p):  # pragma: no cover
    raise NotImplementedError


@overload(_pack_k_local)
def _pack_k_local_ol(kf, koff, S, E, Kl, poff, p):
    if kf.dtype == types.float32:
        def impl(kf, koff, S, E, Kl, poff, p):
            pack_k_panel(kf, koff, S, E, Kl, poff, p)
    else:
        def impl(kf, koff, S, E, Kl, poff, p):
            pass
    return impl


@overload(_pack_k)
def _pack_k_ol(k, Kp, x):
    if k.dtype == types.float32:
        def impl(k, Kp, x):
            B, Hkv, S, E = k.shape
            npan = (S + PW - 1) // PW
            bk = x // npan
            pack_k_panel(k.reshape(-1), bk * S * E, S, E, Kp, bk * npan * E * PW, x - bk * npan)
    else:
        def impl(k, Kp, x):
            pass
    return impl


@njit(nogil=True)
def _pack_head(k, Kp, bk, npan, pclaim, pdone):
    """Make sure kv head bk's K panels are in Kp: claim and pack the ones no worker has
    claimed yet, then wait for those another worker is still packing (a few microseconds of
    work each; the wait never depends on a worker that has not started)."""
    while True:
        p = atomic_count(pclaim, bk)
        if p >= npan:
            break
        _pack_k(k, Kp, bk * npan + p)
        atomic_count(pdone, bk)
    while atomic_read(pdone, bk) < npan:
        spin_pause()


@njit
def _prefetch_part(af, off, ln, c, nch, step):
    """Prefetch part c of nch of af[off:off+ln] into L2, one line per step."""
    for x in range(off + ln * c // nch, off + ln * (c + 1) // nch, step):
        prefetch_l2(af, x)


# rows of the softmax pass between two rounds of prefetches (see _forward_item)
PF_ROWS = 8


@njit(cache=True, fastmath=FM, nogil=True)
def _forward_item(it, a, out, lse, plan, Kp, ws, pf_it):
    """One (batch*head, query-block) item of the call `a` (_record.NumbaArgs), blocks as in
    `plan` (FwdPlan), scratch `ws` (the worker's slices of the workspace, see workspace()).
    pf_it: the item this worker runs next (-1: none), whose first Q/K/V rows are prefetched
    during this one. Kept out of the prange body so the parfor passes see a trivial loop
    (compile time) and so this function can carry the 512-bit vector-width hint."""
    wide_vectors()
    q, k, v = a.q, a.k, a.v
    Qx, Sb, Pb, acc, m, lsum, Kl, Kg, Vg = ws
    Bq, Bk, reverse_q, local_pack = plan.Bq, plan.Bk, plan.reverse_q, plan.local_pack
    gather = plan.gather
    B, Hq, L, E = q.shape
    Hkv = a.Hkv
    S = a.S
    Ev = a.Ev
    g = Hq // Hkv
    nqb = (L + Bq - 1) // Bq
    Eld = max(E, 1)
    Evld = max(Ev, 1)

    qf = q.reshape(-1)
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    of = out.reshape(-1)

    # the tile is turned into natural scores only when softcap, ALiBi or a
    # float mask need them; otherwise the scale goes into the exp's FMA
    to_nat, c_exp, kappa = score_units(a)
    do_drop = a.dropout_p > 0.0
    thresh = dropout_threshold_nb(a.dropout_p)
    inv_keep = 1.0 / (1.0 - a.dropout_p)
    ninf = fcast(q, -np.inf)
    one = fcast(q, 1.0)
    zero = fcast(q, 0.0)

    bh = it // nqb
    qb = it - bh * nqb
    if reverse_q:
        # causal: expensive (late) query blocks first, cheap ones fill in
        qb = nqb - 1 - qb
    b = bh // Hq
    h = bh - b * Hq
    hk = h // g
    i0 = qb * Bq
    nq = min(Bq, L - i0)

    # rows padded to whole micro-tiles (float32 kernel); pad rows are never
    # read back. Qp holds the packed Q tiles of the float32 kernel.
    ntiles = (nq + MR - 1) // MR
    # Scratch comes from the caller's per-worker workspace: allocating ~1 MB
    # per item cost ~0.5 ms of page faults (mmap'd by malloc, touched fresh).
    Qp = Qx
    for r in range(nq):
        m[r] = ninf
        lsum[r] = zero
    acc[:, :] = zero
    ab = np.empty(2, q.dtype)   # ab[0] = 1 (alpha, and beta=1), ab[1] = 0
    ab[0] = one
    ab[1] = zero

    qoff = ((b * Hq + h) * L + i0) * E
    _prep_q(qf, qoff, nq, E, Qp, ntiles)

    # a KV cache read in place (_kv.py): sequence b's own keys and query positions
    qo = seq_q_offset(a, b)
    pos_first = i0 + qo
    pos_last = i0 + nq - 1 + qo
    jlo = max(0, pos_first - a.win_left)
    jhi = min(seq_keys(a, b) - 1, pos_last + a.win_right)
    slope = alibi_slope(a, b, h)
    kbase = (b * Hkv + hk) * S * E
    vbase = (b * Hkv + hk) * S * Ev

    # key blocks cover exactly [jlo, jhi]: the first starts at jlo (rounded
    # down to a K-panel boundary for the packed kernel) and the last is cut at
    # jhi, so with causal/window masks no work is spent past the band edge
    # Prefetch of the next item's Q block and first key block of K (when it is
    # packed inside the item) and V, spread over the row chunks of this item's
    # last softmax pass: with a single key block per item (L = S = 256) these
    # first reads from L3/memory (pack Q, pack K, the first P.V pass) were
    # ~20 us of a ~200 us item.
    pf_q = pf_k = pf_v = 0
    pq_off = pk_off = pv_off = 0
    if pf_it >= 0:
        pbh = pf_it // nqb
        pqb = pf_it - pbh * nqb
        if reverse_q:
            pqb = nqb - 1 - pqb
        pb = pbh // Hq
        ph = pbh - pb * Hq
        phk = ph // g
        pq_off = ((pb * Hq + ph) * L + pqb * Bq) * E
        pf_q = min(Bq, L - pqb * Bq) * E
        pk_off = (pb * Hkv + phk) * S * E
        pv_off = (pb * Hkv + phk) * S * Ev
        if local_pack and not gather:
            pf_k = min(S, Bk) * E
        if not gather:
            pf_v = min(S, Bk) * Ev
    pf_step = max(1, 64 // q.itemsize)
    pf_nch = (nq + PF_ROWS - 1) // PF_ROWS

    align = PW if _packed(q) else 1
    j0 = (jlo // align) * align
    while j0 <= jhi:
        n = min(Bk, jhi + 1 - j0)
        # block status: 0 skip, 1 no per-element mask, 2 mixed
        mbase = mask_base(a, b, h, i0, j0)
        mstat = block_status(a, mbase, nq, n)
        if mstat == 0:
            j0 += Bk
            continue
        partial = band_partial(a, j0, n, pos_first, pos_last)
        # the band's right edge cuts the block: row r needs the keys below r + dlim only. The
        # float32 products, the score pipeline and the softmax then skip, per micro-tile, what
        # none of its rows needs (the diagonal block of a causal item: ~12% of L = S = 2048's
        # tiles); the band pass of tile_scores masks the rest of each micro-tile's rows. BLAS
        # (float64) does whole blocks.
        dlim = NO_LIMIT
        if _packed(q) and pos_first + a.win_right - j0 + 1 < n:
            dlim = pos_first + a.win_right - j0 + 1

        if gather:
            # a cache read in place: the block's K and V rows made dense in the worker's
            # scratch (a paged cache's pages, a cache's key stride), K then packed as below
            gather_k(a, b, hk, j0, n, kf, Kg)
            gather_v(a, b, hk, j0, n, vf, Vg)
            p0 = j0 // PW
            p1 = (j0 + n + PW - 1) // PW
            for p in range(p0, p1):
                _pack_k_local(Kg, -j0 * E, j0 + n, E, Kl, -p0 * E * PW, p)
            _qk(Sb, Bk, qf, qoff, Qp, E, Eld, nq, ntiles, Kg, -j0 * E, j0, n, Kl,
                -p0 * E * PW, ab, dlim)
        elif local_pack:
            # K used by this item only: lay out just this block's panels in the
            # worker's buffer (cache-hot for the GEMM, no separate pass/region)
            p0 = j0 // PW
            p1 = (j0 + n + PW - 1) // PW
            for p in range(p0, p1):
                _pack_k_local(kf, kbase, S, E, Kl, -p0 * E * PW, p)
            _qk(Sb, Bk, qf, qoff, Qp, E, Eld, nq, ntiles, kf, kbase, j0, n, Kl,
                -p0 * E * PW, ab, dlim)
        else:
            _qk(Sb, Bk, qf, qoff, Qp, E, Eld, nq, ntiles, kf, kbase, j0, n, Kp,
                (b * Hkv + hk) * ((S + PW - 1) // PW) * E * PW, ab, dlim)

        if needs_rows(a, partial, mstat):
            tile_scores(Sb, 0, nq, n, j0, pos_first, a, slope, mbase, mstat, Sb, False, dlim)
        if j0 + Bk > jhi and pf_it >= 0:
            # last key block: softmax in row chunks, prefetching between them
            for c in range(pf_nch):
                r0 = c * PF_ROWS
                tile_online(Sb, Pb, r0, min(nq, r0 + PF_ROWS), n, m, lsum, acc, Ev, c_exp,
                            dlim)
                _prefetch_part(qf, pq_off, pf_q, c, pf_nch, pf_step)
                _prefetch_part(kf, pk_off, pf_k, c, pf_nch, pf_step)
                _prefetch_part(vf, pv_off, pf_v, c, pf_nch, pf_step)
        else:
            tile_online(Sb, Pb, 0, nq, n, m, lsum, acc, Ev, c_exp, dlim)
        if do_drop:
            # the hash at this tile's place in the whole problem (KernelArgs.dropout_*)
            tile_dropout(Pb, 0, nq, n, a.seed, dropout_bh(a, b, h), a.dropout_row0 + i0,
                         a.dropout_col0 + j0, thresh)

        # The exact path only matters where a weight is exactly 0 because of a
        # mask or dropout. In a block with neither, every weight is nonzero or
        # an underflow that the float64 reference also multiplies with the
        # NaN/Inf, so the check (a first read of V: ~6 us per 256x64 block,
        # ~3% of a B4 H8 L256 item) is skipped; the cython kernel does the same.
        fast = mstat == 1 and not partial and not do_drop
        if gather:
            _pv_checked(acc, Evld, Pb, Bk, Vg, 0, Ev, n, nq, ntiles, ab, dlim, fast)
        else:
            _pv_checked(acc, Evld, Pb, Bk, vf, vbase + j0 * Ev, Ev, n, nq, ntiles, ab, dlim,
                        fast)
        j0 += Bk

    tile_finalize(acc, m, lsum, nq, Ev, of, ((b * Hq + h) * L + i0) * Ev,
                  lse.reshape(-1), (b * Hq + h) * L + i0, inv_keep, kappa, sink_logit(a, h))


@njit(fastmath=FM)
def _pv_checked(acc, Evld, Pb, Bk, vf, voff, Ev, n, nq, ntiles, ab, dlim, fast):
    """acc += P . V for the block's V rows at vf[voff] (Ev apart): the products, or, where V
    holds a NaN/Inf and `fast` does not vouch that no weight is 0, the exact path."""
    if fast or block_all_finite(vf, voff, n * Ev):
        _pv(acc, Evld, Pb, Bk, vf, voff, Ev, n, nq, ntiles, ab, dlim)
    else:
        zero_past_limit(Pb, nq, n, dlim)
        Vs = np.empty((Bk, Evld), acc.dtype)
        pv_nonfinite(Pb, nq, n, vf, voff, Ev, Evld, Vs, acc, ab)


# Blocks of a forward call (chosen in forward() from the shapes and KernelArgs.tuning).
# gather: a KV cache read in place (strided, paged or per-sequence lengths), whose key blocks
# are gathered into the worker's scratch (Kg, Vg) before the products.
FwdPlan = namedtuple("FwdPlan", "Bq Bk reverse_q local_pack gather")


@njit(parallel=True, cache=True, nogil=True)
def _forward_kernel(a, out, lse, plan, Kp, ws):
    """Parallel body of forward(): ws are the stacked per-worker scratch arrays (workspace())."""
    q, k = a.q, a.k
    B, Hq, L, E = q.shape
    Hkv = a.Hkv
    S = a.S
    nqb = (L + plan.Bq - 1) // plan.Bq
    # float32: K re-laid out once per call as PW-key panels for the
    # micro-kernel, into Kp (from the caller's workspace; size of K rounded
    # up to whole panels); float64 gets a dummy and no pass. Each kv head's
    # panels are packed where an item of that head first needs them
    # (_pack_head), not in a parallel loop of their own before the items (a
    # second wake and join of the pool, 30-50 us a call on two threads of
    # this VM), and K is packed when its rows are about to be read anyway.
    npan = (S + PW - 1) // PW
    pack = _packed(q) and not plan.local_pack
    nbk = B * Hkv if pack else 1
    pclaim = counters(nbk)
    pdone = counters(nbk)
    g = Hq // Hkv
    n_items = B * Hq * nqb
    wQ, wS, wP, wA, wM, wL, wK, wKg, wVg = ws
    T = wQ.shape[0]
    # one prange iteration per worker, each with its own scratch slice;
    # workers claim items dynamically from an atomic counter (causal items
    # come most expensive first), so a thread slowed down by imbalance or by
    # another process on the machine does not hold up the call.
    # Away from the end a worker claims its next item before running the
    # current one, so the current one can prefetch the next one's data; near
    # the end it claims after, so no item waits behind a busy worker.
    counter = counters(1)
    for w in prange(T):
        it = atomic_next(counter)
        while it < n_items:
            early = it + 2 * T < n_items
            nxt = n_items
            if early:
                nxt = atomic_next(counter)
            pf = -1
            if nxt < n_items:
                pf = nxt
            if pack:
                bh = it // nqb
                _pack_head(k, Kp, (bh // Hq) * Hkv + (bh % Hq) // g, npan, pclaim, pdone)
            _forward_item(it, a, out, lse, plan, Kp,
                          (wQ[w], wS[w], wP[w], wA[w], wM[w], wL[w], wK[w], wKg[w], wVg[w]),
                          pf)
            if early:
                it = nxt
            else:
                it = atomic_next(counter)


def block_sizes(L, S, E, Ev, itemsize, n_threads, B=1, H=1):
    """Block sizes (Bq, Bk) for this machine class (2 MiB L2 per core).

    Larger Bq re-reads K/V fewer times; Bk=512 amortizes the per-row work of
    a block. Keep enough items for the threads.
    """
    Bk = 512
    Bq = 256
    if L <= 128:
        Bq = max(L, 1)
    # enough parallel items for all threads (2 per thread for balance)
    while Bq > 32 and B * H * ((L + Bq - 1) // Bq) < 2 * n_threads:
        Bq //= 2
    return Bq, Bk


_ws = threading.local()


KP_CACHE_MAX = 64 << 20   # keep the K panel buffer between calls up to 64 MiB


def workspace(dtype, T, Bq, Bk, E, Ev, kp_size, local_pack=False, gather=False):
    """Per-worker scratch and the K panel buffer, cached per Python thread
    (concurrent calls from other threads get their own) and reused across
    calls. Freshly allocated, these pages fault on first touch on every call:
    measured ~1 ms per call for a 2 MB K panel buffer in this VM (B4 H8
    L256 d64, a ~10 ms call). Only the latest shape is kept."""
    Bqp = -(-Bq // MR) * MR
    kp = np.dtype(dtype).itemsize * kp_size
    key = (np.dtype(dtype).str, T, Bqp, Bk, max(E, 1), max(Ev, 1), kp_size, local_pack, gather)
    cached = getattr(_ws, 'arrays', None)
    if cached is not None and cached[0] == key:
        return cached[1]
    arrs = (np.empty((T, Bqp * max(E, 1)), dtype),      # Q block (packed or plain)
            np.empty((T, Bqp, Bk), dtype),              # scores
            np.empty((T, Bqp, Bk), dtype),              # weights
            np.empty((T, Bqp, max(Ev, 1)), dtype),      # accumulator
            np.empty((T, Bqp), dtype),                  # running max
            np.empty((T, Bqp), dtype),                  # running sum
            np.empty((T, Bk * max(E, 1) if local_pack else 1), dtype),  # block K panels
            np.empty((T, Bk * max(E, 1) if gather else 1), dtype),      # gathered K block
            np.empty((T, Bk * max(Ev, 1) if gather else 1), dtype))     # gathered V block
    Kp = np.empty(max(kp_size, 1), dtype)
    if kp <= KP_CACHE_MAX:
        _ws.arrays = (key, (Kp,) + arrs)
    else:
        _ws.arrays = None
    return (Kp,) + arrs


def forward(args, out, lse):
    """docs/KERNELS.md forward of the record `args` (KernelArgs); args.tuning.block_q/block_k
    override the block heuristic (0 = choose)."""
    q, k, v = args.q, args.k, args.v
    B, Hq, L, E = q.shape
    # the keys of a sequence: S, or max_pages * page_size of a paged cache
    S = args.block_table.shape[1] * args.page_size if args.has_block_table else k.shape[2]
    Ev = v.shape[3]
    gather = bool(args.has_seqlens or args.has_block_table
                  or not (k.flags.c_contiguous and v.flags.c_contiguous))
    Bq, Bk = block_sizes(L, S, E, Ev, q.itemsize, args.n_threads, B, Hq)
    Bq = positive("block_q", args.tuning.block_q, Bq)
    Bk = positive("block_k", args.tuning.block_k, Bk)
    if B * Hq * L == 0:
        return
    prime_blas()
    if q.dtype == np.float32:
        # key blocks must start on K-panel boundaries
        Bk = max(PW, -(-Bk // PW) * PW)
    reverse_q = args.win_right < S
    with blas_single_thread, numba_threads(args.n_threads) as T:
        nqb = -(-L // Bq)
        T = max(1, min(T, B * Hq * nqb))
        # K used by one item only (one query block, no GQA sharing): pack its
        # panels inside the item instead of in a separate whole-K pass
        local_pack = bool(gather or (q.dtype == np.float32 and nqb == 1 and k.shape[1] == Hq))
        kp_size = (B * k.shape[1] * (-(-S // PW)) * max(E, 1) * PW
                   if (q.dtype == np.float32 and not local_pack) else 1)
        ws = workspace(q.dtype, T, Bq, Bk, E, Ev, kp_size, local_pack, gather)
        _forward_kernel(numba_args(args), out, lse,
                        FwdPlan(Bq, Bk, reverse_q, local_pack, gather), ws[0], ws[1:])
