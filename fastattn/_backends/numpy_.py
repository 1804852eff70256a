"""The pure-NumPy backend: always available, tiled so memory stays O(block * S).

FlashAttention-2's forward written with NumPy's BLAS matmuls on blocks: for each query block
(all heads of a batch element at once, to keep Python overhead low) walk the key blocks the
causal/window band allows, keep a running row max m, row sum l and an unnormalized accumulator,
and rescale them when the max grows. Masks are sliced per tile, never expanded to (B, H, L, S).
"""
from __future__ import annotations

import numpy as np

from .. import _config, _dropout
from .._inputs import MASK_BOOL, MASK_FLOAT, Band, lse_dtype
from .._kvdtypes import as_compute, kind_by_code
from ._base import Backend
from ._threads import check_cancelled, parallel_map

# A score tile holds about this many elements (all query heads x query block x key block):
# large enough that NumPy's per-call overhead is amortized, small enough to stay cache-friendly
# and to bound memory (2**20 float32 = 4 MiB).
TILE_ELEMENTS = 1 << 20
KEY_BLOCK = 1024
# The backward keeps a query block's tiles between its two sweeps up to this many key blocks
# (P and dP: 2 x 4 MiB each in float32), and recomputes them beyond.
_BWD_KEPT_KEY_BLOCKS = 4
_BWD_MAX_ROWS = 256


def _blocks(p):
    Hq, L = p.q.shape[1], p.q.shape[2]
    S = p.n_keys
    bk = max(1, min(S, KEY_BLOCK))
    bq = max(16, TILE_ELEMENTS // max(1, Hq * bk))
    return min(bq, max(L, 1)), bk


def safe_matmul(w: np.ndarray, v: np.ndarray, v_finite: bool | None = None) -> np.ndarray:
    """w @ v for (..., M, N) @ (..., N, D) where a zero weight never lets a NaN/Inf of v through.

    BLAS computes 0 * NaN = NaN, so a NaN in a masked key (padding, an unused KV-cache tail)
    would leak. Only when v has non-finite values (checked in O(N*D), cheap next to the matmul;
    callers that know v is all finite pass v_finite=True) do we zero them for the matmul and
    add back the terms whose weight is non-zero.
    """
    if v_finite:
        return np.matmul(w, v)
    finite = np.isfinite(v)
    if finite.all():
        return np.matmul(w, v)
    res = np.matmul(w, np.where(finite, v, 0))
    bad_key = ~finite.all(axis=-1)                                   # (..., N)
    bad_keys = np.nonzero(bad_key.reshape(-1, bad_key.shape[-1]).any(axis=0))[0]
    used = (w[..., bad_keys] != 0).reshape(-1, len(bad_keys)).any(axis=0)
    with np.errstate(invalid="ignore"):
        for j in bad_keys[used]:
            wj = w[..., :, j:j + 1]                                  # (..., M, 1)
            vj = v[..., j:j + 1, :]                                  # (..., 1, D)
            res += np.where((wj != 0) & ~finite[..., j:j + 1, :], wj * vj, 0)
    return res


def _sequence(p, b):
    """Keys of sequence b as (Hkv, n, E) / (Hkv, n, Ev) arrays, their int8 scales (Hkv, n) (or
    None), n, and the band of its rows.

    The dense problem: p.k[b], p.v[b], S, p.band. A KV cache read in place (Problem.seqlens,
    block_table, kv_strides): the first seqlens[b] keys (its pages gathered: this backend is
    the reference for correctness, the compiled ones read the pages where they are), and the
    band moved to end where the sequence ends. The keys stay as the cache stores them
    (float16, bfloat16, int8 codes: Problem.kv_kind); _forward_block converts them a key
    block at a time, never the whole cache.
    """
    S = p.n_keys
    if p.seqlens is None and p.block_table is None:
        return p.k[b], p.v[b], None, None, S, p.band
    n = S if p.seqlens is None else int(p.seqlens[b])
    scales = (p.k_scale, p.v_scale) if p.k_scale is not None else ()
    if p.block_table is None:
        kb, vb = p.k[b, :, :n], p.v[b, :, :n]
        ks, vs = (s[b, :, :n] for s in scales) if scales else (None, None)
    else:
        page = p.k.shape[2]
        pages = p.block_table[b, :-(-n // page)]
        kb = p.k[pages].transpose(1, 0, 2, 3).reshape(p.k.shape[1], -1, p.k.shape[3])[:, :n]
        vb = p.v[pages].transpose(1, 0, 2, 3).reshape(p.v.shape[1], -1, p.v.shape[3])[:, :n]
        ks, vs = ((s[pages].transpose(1, 0, 2).reshape(s.shape[1], -1)[:, :n] for s in scales)
                  if scales else (None, None))
    band = p.band
    return kb, vb, ks, vs, n, Band(band.q_offset + n - S, band.left, band.right, band.unbounded)


def _key_block(p, x, scales, j0, j1):
    """Keys/values j0..j1-1 of a sequence's (H, n, D) array in the compute dtype: a float16,
    bfloat16 or int8 cache's block converted here (fastattn/_kvdtypes.py: float32(code) *
    scale for int8), a float32/float64 one as it is."""
    if not p.kv_kind:
        return x[:, j0:j1]
    return as_compute(kind_by_code(p.kv_kind), x[:, j0:j1],
                      None if scales is None else scales[:, j0:j1])


def _apply_scores_pipeline(p, s, b, i0, i1, j0, j1, heads=slice(None), band=None):
    """Scale, softcap, ALiBi, masks and band on a score tile s of shape (nh, nq, nk), in place.

    The tile holds the query heads `heads` (a slice of range(Hq)) of batch element b; `band`:
    that sequence's (default p.band).

    Returns 1 - tanh^2 of the softcap (its derivative, for the backward) or None without softcap.
    """
    band = p.band if band is None else band
    s *= p.dtype.type(p.scale)
    softcap_grad = None
    if p.softcap:
        cap = p.dtype.type(p.softcap)
        with np.errstate(over="ignore"):     # s / cap -> +-inf for a small cap: tanh gives +-1
            np.divide(s, cap, out=s)
        np.tanh(s, out=s)
        softcap_grad = 1 - s * s
        s *= cap
    pos = np.arange(i0, i1)[:, None] + band.q_offset      # query positions (nq, 1)
    keys = np.arange(j0, j1)[None, :]                      # (1, nk)
    if p.alibi is not None:
        slopes = p.alibi[b if p.alibi.shape[0] > 1 else 0, heads]
        dist = np.abs(pos - keys).astype(p.dtype)
        s -= slopes[:, None, None] * dist
    if p.mask_kind != 0:
        m = p.mask
        tile = m[b if m.shape[0] > 1 else 0, heads if m.shape[1] > 1 else slice(None),
                 slice(i0, i1) if m.shape[2] > 1 else slice(None),
                 slice(j0, j1) if m.shape[3] > 1 else slice(None)]
        if p.mask_kind == MASK_BOOL:
            np.copyto(s, -np.inf, where=~tile)
        else:
            s += tile
            np.copyto(s, -np.inf, where=np.isneginf(tile))   # replacement: NaN + -inf stays masked
    # Band edges cut through this tile only near the diagonal; elsewhere skip the comparison.
    inside = (i1 - 1 + band.q_offset - band.left <= j0) and (j1 - 1 <= i0 + band.q_offset + band.right)
    if not inside:
        allowed = (keys >= pos - band.left) & (keys <= pos + band.right)
        np.copyto(s, -np.inf, where=~allowed)
    return softcap_grad


def _dropout_scale(p, b, Hq, i0, i1, j0, j1, heads=slice(None)):
    """keep / (1 - p) for a tile (nh, nq, nk): the hash regenerates the forward's kept set, at
    the hash coordinates of the problem's dropout origin (a piece of a larger problem: fastattn.dask)."""
    keep = _dropout.piece_keep(p.seed, p.dropout_p, _dropout.origin(p), b,
                               np.arange(Hq)[heads][:, None, None], np.arange(i0, i1)[:, None],
                               np.arange(j0, j1)[None, :])
    return keep * p.dtype.type(1.0 / (1.0 - p.dropout_p))


def _sink_grad(p, dout, out, lse):
    """dsinks_h = -sum_{b,i} exp(sink_h - lse_bhi) * D_bhi with D = rowsum(dO * O).

    The sink's weight in a row is exp(sink - lse) (lse includes the sink); its value is 0 and
    so is its upstream gradient, which leaves -P_sink * D of the softmax Jacobian.
    """
    sink = p.sinks[None, :, None]
    with np.errstate(invalid="ignore", over="ignore"):
        # a row with lse = -inf had no key and a -inf sink: no sink weight (0, not NaN)
        p_sink = np.where(np.isneginf(lse), 0, np.exp(sink - lse.astype(p.dtype)))
        delta = np.einsum("bhld,bhld->bhl", dout, out) if p.delta is None else p.delta
        return -np.einsum("bhl,bhl->h", p_sink, delta)


class NumpyBackend(Backend):
    """Always available; the tiled algorithms in NumPy (BLAS matmuls on blocks)."""

    name = "numpy"
    ops = ("forward", "backward", "softmax")

    def details(self) -> dict:
        return {"numpy": np.__version__}

    # ------------------------------------------------------------------------------------------
    def softmax_rows(self, x: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
        if keep is not None:
            x = np.where(keep, x, -np.inf)
        if x.shape[-1] == 0:
            return np.zeros_like(x)
        m = x.max(axis=-1, keepdims=True)
        m[np.isneginf(m)] = 0                          # all-masked row: exp(-inf) = 0, not NaN
        e = np.exp(x - m)
        total = e.sum(axis=-1, keepdims=True)
        return np.divide(e, total, out=np.zeros_like(e), where=total != 0)

    # ------------------------------------------------------------------------------------------
    def forward(self, p):
        B, Hq, L, _ = p.q.shape
        out = np.zeros((B, Hq, L, p.v.shape[3]), p.dtype)
        lse = np.full((B, Hq, L), -np.inf, lse_dtype(p.dtype))
        # with no key at all a row still has its sink (out 0, lse = sink): run the tiles
        if B * Hq * L and (p.n_keys or p.sinks is not None):
            with np.errstate(invalid="ignore"):  # inf * 0 from masked keys; masked out per tile
                self._forward_tiles(p, out, lse)
        return out, lse

    def _forward_tiles(self, p, out, lse):
        B, L = p.q.shape[0], p.q.shape[2]
        bq, bk = _blocks(p)
        # the usual case: no per-tile checks (a low-precision cache is checked per block,
        # not converted whole)
        v_finite = None if p.kv_kind else bool(np.isfinite(p.v).all())

        def block(item):
            b, i0 = item
            with np.errstate(invalid="ignore"):        # errstate is per thread
                self._forward_block(p, out, lse, b, i0, min(L, i0 + bq), bk, v_finite)

        # query blocks are independent (disjoint rows of out and lse): one thread each
        parallel_map(block, [(b, i0) for b in range(B) for i0 in range(0, L, bq)],
                     _config.num_threads())

    def _forward_block(self, p, out, lse, b, i0, i1, bk, v_finite):
        """Rows i0..i1-1 of batch b, all heads: online softmax over the band's key blocks."""
        Hq, L, E = p.q.shape[1:]
        Hkv, Ev = p.k.shape[1], p.v.shape[3]
        G = p.group
        dt = p.dtype
        nq = i1 - i0
        kb, vb, ks, vs, S, band = _sequence(p, b)
        j_lo, j_hi = band.key_range(i0, i1, S)
        if j_lo >= j_hi and p.sinks is None:
            return                                     # every key outside the band: zeros, -inf
        # (Hkv, G*nq, E): the G query heads sharing a KV head are one matmul operand.
        qt = np.ascontiguousarray(p.q[b].reshape(Hkv, G, L, E)[:, :, i0:i1]).reshape(Hkv, G * nq, E)
        m = np.full((Hq, nq), -np.inf, dt)
        l = np.zeros((Hq, nq), dt)
        if p.sinks is not None:
            # the sink is the first "key" of every row: running max = sink, running sum
            # exp(sink - sink) = 1 (0 for a -inf sink; NaN for a NaN or +inf one, which then
            # spreads to the whole row, as the NaN rule asks). It has no value: acc stays 0.
            m[:] = p.sinks[:, None]
            l[:] = np.exp(m - np.where(np.isneginf(m), 0, m))
        acc = np.zeros((Hkv, G * nq, Ev), dt)
        for j0 in range(j_lo, j_hi, bk):
            check_cancelled()                          # the caller was interrupted: stop here
            j1 = min(j_hi, j0 + bk)
            s = np.matmul(qt, _key_block(p, kb, ks, j0, j1).transpose(0, 2, 1))  # (Hkv, G*nq, nk)
            s3 = s.reshape(Hq, nq, j1 - j0)
            _apply_scores_pipeline(p, s3, b, i0, i1, j0, j1, band=band)
            m_new = np.maximum(m, s3.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), 0, m_new).astype(dt)
            s3 -= m_safe[:, :, None]
            np.exp(s3, out=s3)
            alpha = np.exp(m - m_safe)                 # 0 while the row had no key yet
            l *= alpha
            l += s3.sum(axis=-1)
            if p.dropout_p > 0:
                s3 *= _dropout_scale(p, b, Hq, i0, i1, j0, j1)
            acc *= alpha.reshape(Hkv, G * nq, 1)
            acc += safe_matmul(s, _key_block(p, vb, vs, j0, j1), v_finite)
            m = m_new
        l4 = l.reshape(Hq, nq, 1)
        np.divide(acc.reshape(Hq, nq, Ev), l4, out=out[b, :, i0:i1], where=l4 != 0)
        with np.errstate(divide="ignore"):
            lse[b, :, i0:i1] = np.where(l != 0, m + np.log(l), -np.inf)

    # ------------------------------------------------------------------------------------------
    def backward(self, p, dout, out, lse):
        """FlashAttention-2's backward on NumPy tiles: P is recomputed from the saved lse.

        Per tile: P = exp(s - lse), dP = dO V^T (dropout applied); per row Z = sum P and
        D = sum P dP over the row's tiles; then P /= Z, dV += Pd^T dO, dS = P (dP - D / Z)
        (times softcap's derivative), dQ += scale dS K, dK += scale dS^T Q (see
        _backward_heads). Accumulators are in the compute dtype (float32 or float64), Z and D
        in float64.

        With p.delta (the partial-keys form: k/v are a part of the keys, lse and D belong to the
        whole problem) there is no first sweep: P = exp(s - lse) unnormalized, D = p.delta.

        Returns (dq, dk, dv, dsinks): dsinks (Hq,) is None without sinks. The tiles need no
        change for sinks (lse includes the sink, so P does); dsinks is one reduction over rows.
        """
        if p.seqlens is not None or p.block_table is not None or p.kv_strides is not None:
            raise ValueError("the numpy backward takes dense k/v, not a KV cache read in place "
                             "(seqlens, block_table, kv_strides)")
        dq = np.zeros_like(p.q)
        dk = np.zeros_like(p.k)
        dv = np.zeros_like(p.v)
        B, Hq, L, _ = p.q.shape
        if B * Hq * L and p.k.shape[2]:
            with np.errstate(invalid="ignore"):   # inf * 0 from masked keys; zeroed per tile
                self._backward_tiles(p, dout, out, lse, dq, dk, dv)
        return dq, dk, dv, (None if p.sinks is None else _sink_grad(p, dout, out, lse))

    def _backward_tiles(self, p, dout, out, lse, dq, dk, dv):
        B, Hkv = p.q.shape[0], p.k.shape[1]
        bq, bk = _blocks(p)
        # dV and dK sum over query rows inside each block's matmul, in the compute dtype: past a
        # few hundred rows the float32 sum's rounding dominates the error (S=4, L=2048: 9e-5 in
        # dv against torch's 2e-5, 2.4e-5 with 256-row blocks), so blocks stay at most
        # _BWD_MAX_ROWS rows (what key blocks of 1024 give anyway from Hq = 4 up).
        bq = min(bq, _BWD_MAX_ROWS)
        ctx = dict(
            # rows with no key have lse = -inf: use +inf so exp(s - lse) = 0 there, not NaN
            lse_safe=np.where(np.isneginf(lse), np.inf, lse).astype(p.dtype),
            kv_finite=bool(np.isfinite(p.k).all() and np.isfinite(p.v).all()),
            bq=bq, bk=bk)
        threads = _config.num_threads()
        # dk/dv of a KV head collect every query block of its group: an item owns whole KV heads
        # (and so its query heads' dq rows), so no two threads write the same gradient rows
        n_split = min(Hkv, max(1, -(-2 * threads // B)))
        bounds = np.linspace(0, Hkv, n_split + 1).astype(int)
        items = [(b, h0, h1) for b in range(B) for h0, h1 in zip(bounds[:-1], bounds[1:]) if h1 > h0]

        def group(item):
            # errstate is per thread; gradients beyond the dtype's range are its inf, not an error
            with np.errstate(invalid="ignore", over="ignore"):
                self._backward_heads(p, dout, dq, dk, dv, ctx, *item)

        parallel_map(group, items, threads)

    def _backward_heads(self, p, dout, dq, dk, dv, ctx, b, h0, h1):
        """Gradients of KV heads h0..h1-1 of batch b and of the query heads reading them.

        Two sweeps per query block, as the compiled backends do (csrc/backward.pxi): the first
        forms P = exp(s - lse) and dP and sums Z = sum_j P and D = sum_j P dP (in float64);
        the second uses P / Z and D / Z. In exact arithmetic Z = 1 and D / Z = rowsum(dO * O),
        but taking both from the same tiles as dS makes dS exactly 0 where a row's weight sits
        on one key (dP - D/Z = dP - dP), where rowsum(dO * O) cancels to a rounding error that
        the large dP then amplifies into dq/dk; and P / Z removes the rounding of the saved lse
        from dV. Tiles are kept between the sweeps when they are few, else recomputed (the same
        code, so the same values).
        """
        L, E = p.q.shape[2], p.q.shape[3]
        S, Ev = p.k.shape[2], p.v.shape[3]
        G = p.group
        dt = p.dtype
        nkv = h1 - h0
        heads = slice(h0 * G, h1 * G)                                       # their query heads
        qb = p.q[b, heads].reshape(nkv, G, L, E)
        dob = dout[b, heads].reshape(nkv, G, L, Ev)
        kb, vb = p.k[b, h0:h1], p.v[b, h0:h1]
        scale = dt.type(p.scale)
        bq, bk, kv_finite = ctx["bq"], ctx["bk"], ctx["kv_finite"]
        for i0 in range(0, L, bq):
            i1 = min(L, i0 + bq)
            nq = i1 - i0
            j_lo, j_hi = p.band.key_range(i0, i1, S)
            if j_lo >= j_hi:
                continue
            qt = np.ascontiguousarray(qb[:, :, i0:i1]).reshape(nkv, G * nq, E)
            dot = np.ascontiguousarray(dob[:, :, i0:i1]).reshape(nkv, G * nq, Ev)
            lse_t = ctx["lse_safe"][b, heads, i0:i1, None]                  # (nh, nq, 1)
            starts = list(range(j_lo, j_hi, bk))
            keep_tiles = len(starts) <= _BWD_KEPT_KEY_BLOCKS

            def tile(j0):
                return self._backward_tile(p, qt, dot, kb, vb, lse_t, b, i0, i1, j0,
                                           min(j_hi, j0 + bk), heads, kv_finite)

            if p.delta is not None:
                # The partial-keys form: k/v are a part of the row's keys, so neither Z nor D of
                # these tiles is the row's. P = exp(s - lse) with the whole problem's lse, as
                # recomputed, and D as given: no first sweep.
                inv_z, keep_tiles = None, False
                d_z = p.delta[b, heads, i0:i1, None].astype(dt, copy=False)
            else:
                inv_z, d_z, kept = self._row_sums(p, tile, starts, keep_tiles, lse_t, heads, nq)
            # sweep 2: dS = (P / Z)(dP - D / Z), and the matmuls
            dq_acc = np.zeros((nkv, G * nq, E), dt)
            for n, j0 in enumerate(starts):
                check_cancelled()
                j1 = min(j_hi, j0 + bk)
                nk = j1 - j0
                P, dP, softcap_grad, drop, finite = kept[n] if keep_tiles else tile(j0)
                if inv_z is not None:
                    P *= inv_z
                Pd = P * drop if drop is not None else P
                dv[b, h0:h1, j0:j1] += np.matmul(Pd.reshape(nkv, G * nq, nk).transpose(0, 2, 1), dot)
                dP -= d_z
                dS = np.multiply(P, dP, out=dP)
                if softcap_grad is not None:
                    dS *= softcap_grad
                if not finite:
                    np.copyto(dS, 0, where=(P == 0))                       # masked keys: no NaN
                dS *= scale
                dS3 = dS.reshape(nkv, G * nq, nk)
                dq_acc += safe_matmul(dS3, kb[:, j0:j1], kv_finite)
                dk[b, h0:h1, j0:j1] += np.matmul(dS3.transpose(0, 2, 1), qt)
            dq[b, heads, i0:i1] = dq_acc.reshape(nkv * G, nq, E)

    @staticmethod
    def _row_sums(p, tile, starts, keep_tiles, lse_t, heads, nq):
        """Sweep 1 of a query block: (1 / Z, D / Z, the tiles when kept) of its rows, with
        Z = sum_j P and D = sum_j P dP over the block's key tiles (float64 sums)."""
        dt = p.dtype
        nh = lse_t.shape[0]
        Z = np.zeros((nh, nq), np.float64)
        D = np.zeros((nh, nq), np.float64)
        kept = []
        for j0 in starts:
            check_cancelled()                      # the caller was interrupted: stop here
            t = tile(j0)
            P, dP = t[0], t[1]
            Z += P.sum(axis=-1, dtype=np.float64)
            PdP = P.astype(np.float64) * dP
            if not t[4]:
                np.copyto(PdP, 0, where=(P == 0))                       # masked keys: no NaN
            D += PdP.sum(axis=-1)
            if keep_tiles:
                kept.append(t)
        if p.sinks is not None:
            # lse includes the sink: its weight exp(sink - lse) completes Z (its dP is 0)
            sink = p.sinks[heads].astype(np.float64)[:, None]
            with np.errstate(over="ignore"):
                Z += np.exp(sink - lse_t[..., 0].astype(np.float64))
        ok = Z > 0
        inv_z = np.divide(1.0, Z, out=np.zeros_like(Z), where=ok)
        d_z = (D * inv_z).astype(dt)[:, :, None]                       # D / Z, (nh, nq, 1)
        inv_z = inv_z.astype(dt)[:, :, None]
        return inv_z, d_z, kept

    @staticmethod
    def _backward_tile(p, qt, dot, kb, vb, lse_t, b, i0, i1, j0, j1, heads, kv_finite):
        """(P, dP, softcap', dropout scale or None, finite) of one tile, (nh, nq, nk) each."""
        nkv, nq, nk = kb.shape[0], i1 - i0, j1 - j0
        s = np.matmul(qt, kb[:, j0:j1].transpose(0, 2, 1))
        s3 = s.reshape(-1, nq, nk)
        softcap_grad = _apply_scores_pipeline(p, s3, b, i0, i1, j0, j1, heads)
        s3 -= lse_t
        P = np.exp(s3, out=s3)
        drop = (_dropout_scale(p, b, p.q.shape[1], i0, i1, j0, j1, heads)
                if p.dropout_p > 0 else None)
        dP = np.matmul(dot, vb[:, j0:j1].transpose(0, 2, 1)).reshape(-1, nq, nk)
        if drop is not None:
            dP *= drop
        finite = kv_finite or bool(np.isfinite(kb[:, j0:j1]).all() and np.isfinite(vb[:, j0:j1]).all())
        return P, dP, softcap_grad, drop, finite
