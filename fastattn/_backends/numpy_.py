"""The pure-NumPy backend: always available, tiled so memory stays O(block * S).

FlashAttention-2's forward written with NumPy's BLAS matmuls on blocks: for each query block
(all heads of a batch element at once, to keep Python overhead low) walk the key blocks the
causal/window band allows, keep a running row max m, row sum l and an unnormalized accumulator,
and rescale them when the max grows. Masks are sliced per tile, never expanded to (B, H, L, S).
"""
from __future__ import annotations

import numpy as np

from .. import _dropout
from .._inputs import MASK_BOOL, MASK_FLOAT, lse_dtype
from ._base import Backend

# A score tile holds about this many elements (all query heads x query block x key block):
# large enough that NumPy's per-call overhead is amortized, small enough to stay cache-friendly
# and to bound memory (2**20 float32 = 4 MiB).
TILE_ELEMENTS = 1 << 20
KEY_BLOCK = 1024


def _blocks(p):
    Hq, L = p.q.shape[1], p.q.shape[2]
    S = p.k.shape[2]
    bk = max(1, min(S, KEY_BLOCK))
    bq = max(16, TILE_ELEMENTS // max(1, Hq * bk))
    return min(bq, max(L, 1)), bk


def safe_matmul(w: np.ndarray, v: np.ndarray) -> np.ndarray:
    """w @ v for (..., M, N) @ (..., N, D) where a zero weight never lets a NaN/Inf of v through.

    BLAS computes 0 * NaN = NaN, so a NaN in a masked key (padding, an unused KV-cache tail)
    would leak. Only when v has non-finite values (checked in O(N*D), cheap next to the matmul)
    do we zero them for the matmul and add back the terms whose weight is non-zero.
    """
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


def _apply_scores_pipeline(p, s, b, i0, i1, j0, j1):
    """Scale, softcap, ALiBi, masks and band on a score tile s of shape (Hq, nq, nk), in place.

    Returns 1 - tanh^2 of the softcap (its derivative, for the backward) or None without softcap.
    """
    band = p.band
    s *= p.dtype.type(p.scale)
    softcap_grad = None
    if p.softcap:
        cap = p.dtype.type(p.softcap)
        np.divide(s, cap, out=s)
        np.tanh(s, out=s)
        softcap_grad = 1 - s * s
        s *= cap
    pos = np.arange(i0, i1)[:, None] + band.q_offset      # query positions (nq, 1)
    keys = np.arange(j0, j1)[None, :]                      # (1, nk)
    if p.alibi is not None:
        slopes = p.alibi[b if p.alibi.shape[0] > 1 else 0]
        dist = np.abs(pos - keys).astype(p.dtype)
        s -= slopes[:, None, None] * dist
    if p.mask_kind != 0:
        m = p.mask
        tile = m[b if m.shape[0] > 1 else 0, :,
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


def _dropout_scale(p, b, Hq, i0, i1, j0, j1):
    """keep / (1 - p) for a tile (Hq, nq, nk): the hash regenerates the forward's kept set."""
    bh = (b * Hq + np.arange(Hq))[:, None, None]
    keep = _dropout.keep_mask(p.seed, p.dropout_p, bh, np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :])
    return keep * p.dtype.type(1.0 / (1.0 - p.dropout_p))


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
        if B * Hq * L and p.k.shape[2]:
            with np.errstate(invalid="ignore"):  # inf * 0 from masked keys; masked out per tile
                self._forward_tiles(p, out, lse)
        return out, lse

    def _forward_tiles(self, p, out, lse):
        B, Hq, L, E = p.q.shape
        Hkv, S, Ev = p.k.shape[1], p.k.shape[2], p.v.shape[3]
        G = p.group
        dt = p.dtype
        bq, bk = _blocks(p)
        for b in range(B):
            qb = p.q[b].reshape(Hkv, G, L, E)
            kb, vb = p.k[b], p.v[b]
            for i0 in range(0, L, bq):
                i1 = min(L, i0 + bq)
                nq = i1 - i0
                j_lo, j_hi = p.band.key_range(i0, i1, S)
                if j_lo >= j_hi:
                    continue                           # every key outside the band: zeros, -inf
                # (Hkv, G*nq, E): the G query heads sharing a KV head are one matmul operand.
                qt = np.ascontiguousarray(qb[:, :, i0:i1]).reshape(Hkv, G * nq, E)
                m = np.full((Hq, nq), -np.inf, dt)
                l = np.zeros((Hq, nq), dt)
                acc = np.zeros((Hkv, G * nq, Ev), dt)
                for j0 in range(j_lo, j_hi, bk):
                    j1 = min(j_hi, j0 + bk)
                    s = np.matmul(qt, kb[:, j0:j1].transpose(0, 2, 1))     # (Hkv, G*nq, nk)
                    s3 = s.reshape(Hq, nq, j1 - j0)
                    _apply_scores_pipeline(p, s3, b, i0, i1, j0, j1)
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
                    acc += safe_matmul(s, vb[:, j0:j1])
                    m = m_new
                l4 = l.reshape(Hq, nq, 1)
                res = acc.reshape(Hq, nq, Ev)
                np.divide(res, l4, out=out[b, :, i0:i1], where=l4 != 0)
                with np.errstate(divide="ignore"):
                    lse[b, :, i0:i1] = np.where(l != 0, m + np.log(l), -np.inf)

    # ------------------------------------------------------------------------------------------
    def backward(self, p, dout, out, lse):
        """FlashAttention-2's backward on NumPy tiles: P is recomputed from the saved lse.

        D = rowsum(dO * O); per tile: P = exp(s - lse), dV += Pd^T dO, dP = dO V^T (dropout
        applied), dS = P (dP - D) (times softcap's derivative), dQ += scale dS K,
        dK += scale dS^T Q. Accumulators are in the compute dtype (float32 or float64).
        """
        dq = np.zeros_like(p.q)
        dk = np.zeros_like(p.k)
        dv = np.zeros_like(p.v)
        B, Hq, L, _ = p.q.shape
        if B * Hq * L and p.k.shape[2]:
            with np.errstate(invalid="ignore"):   # inf * 0 from masked keys; zeroed per tile
                self._backward_tiles(p, dout, out, lse, dq, dk, dv)
        return dq, dk, dv

    def _backward_tiles(self, p, dout, out, lse, dq, dk, dv):
        B, Hq, L, E = p.q.shape
        Hkv, S, Ev = p.k.shape[1], p.k.shape[2], p.v.shape[3]
        G = p.group
        dt = p.dtype
        bq, bk = _blocks(p)
        delta = np.einsum("bhld,bhld->bhl", dout, out)                    # D = rowsum(dO * O)
        # rows with no key have lse = -inf: use +inf so exp(s - lse) = 0 there, not NaN
        lse_safe = np.where(np.isneginf(lse), np.inf, lse).astype(dt)
        scale = dt.type(p.scale)
        for b in range(B):
            qb = p.q[b].reshape(Hkv, G, L, E)
            dob = dout[b].reshape(Hkv, G, L, Ev)
            kb, vb = p.k[b], p.v[b]
            for i0 in range(0, L, bq):
                i1 = min(L, i0 + bq)
                nq = i1 - i0
                j_lo, j_hi = p.band.key_range(i0, i1, S)
                if j_lo >= j_hi:
                    continue
                qt = np.ascontiguousarray(qb[:, :, i0:i1]).reshape(Hkv, G * nq, E)
                dot = np.ascontiguousarray(dob[:, :, i0:i1]).reshape(Hkv, G * nq, Ev)
                lse_t = lse_safe[b, :, i0:i1, None]                         # (Hq, nq, 1)
                delta_t = delta[b, :, i0:i1, None]
                dq_acc = np.zeros((Hkv, G * nq, E), dt)
                for j0 in range(j_lo, j_hi, bk):
                    j1 = min(j_hi, j0 + bk)
                    nk = j1 - j0
                    s = np.matmul(qt, kb[:, j0:j1].transpose(0, 2, 1))
                    s3 = s.reshape(Hq, nq, nk)
                    softcap_grad = _apply_scores_pipeline(p, s3, b, i0, i1, j0, j1)
                    s3 -= lse_t
                    P = np.exp(s3, out=s3)                                  # (Hq, nq, nk)
                    drop = _dropout_scale(p, b, Hq, i0, i1, j0, j1) if p.dropout_p > 0 else None
                    Pd = P * drop if drop is not None else P
                    dv[b, :, j0:j1] += np.matmul(Pd.reshape(Hkv, G * nq, nk).transpose(0, 2, 1), dot)
                    dP = np.matmul(dot, vb[:, j0:j1].transpose(0, 2, 1)).reshape(Hq, nq, nk)
                    if drop is not None:
                        dP *= drop
                    dP -= delta_t
                    dS = np.multiply(P, dP, out=dP)
                    if softcap_grad is not None:
                        dS *= softcap_grad
                    if not (np.isfinite(kb[:, j0:j1]).all() and np.isfinite(vb[:, j0:j1]).all()):
                        np.copyto(dS, 0, where=(P == 0))                   # masked keys: no NaN
                    dS *= scale
                    dS3 = dS.reshape(Hkv, G * nq, nk)
                    dq_acc += safe_matmul(dS3, kb[:, j0:j1])
                    dk[b, :, j0:j1] += np.matmul(dS3.transpose(0, 2, 1), qt)
                dq[b, :, i0:i1] = dq_acc.reshape(Hq, nq, E)
