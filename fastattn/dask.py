"""Exact attention on dask arrays: tiles computed on any dask scheduler, merged by log-sum-exp.

    import dask.array as da
    from distributed import Client
    import fastattn.dask as fad

    client = Client()                                    # or Client("tcp://scheduler:8786")
    q = da.from_array(q_np, chunks=(1, 8, 8192, 64))     # (..., H, L, E), torch's layout
    out = fad.scaled_dot_product_attention(q, k, v, is_causal=True)    # a dask array
    out.compute()

How the work is cut (`pip install 'fastattn[dask]'`; `import fastattn` never imports dask):

- batch and head chunks are independent: each output block needs only its own q, k, v blocks
  (under GQA, a chunk of kv heads and the query heads of those groups go together);
- along the key sequence, each (query chunk, key chunk) tile gives a partial (out, lse) over its
  keys, and a tree of `merge_attention` calls combines them exactly (the sum over key chunks of
  exp(lse_part - lse) * out_part);
- along the query sequence with causal masking or a window, tiles the band leaves empty are not
  created at all, so the graph holds only the causal half; the scheduler spreads the remaining
  tiles, which are of equal size, over the workers (work stealing balances the uneven rows).
- positions are global: causal (both alignments), windows and ALiBi use the tile's place in the
  whole problem, so a chunked run equals the single-machine one.

The backward (`scaled_dot_product_attention_backward`) takes the forward's out and lse. Each
query chunk's task needs all keys of its heads at once (key chunks are merged into one there),
so its gradients are exact with the kernels as they are; dk and dv are summed over the query
chunks by a tree. Splitting the backward's keys across workers needs a kernel mode that takes
the global D = rowsum(dO * O) instead of recomputing it from the tile: not built yet.

Not supported yet: dropout (the kernels do not take the hash's position offsets yet) and
attn_mask as a dask array (a NumPy mask is sliced per tile when the graph is built).
"""
from __future__ import annotations

import itertools

import numpy as np

try:
    import dask
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("fastattn.dask needs dask: pip install 'fastattn[dask]' "
                      "(dask[array] and distributed)") from exc

from . import _backends
from . import api as _api
from ._inputs import (ALIGNMENTS, Band, check_window, compute_dtype, lse_dtype, make_problem)

__all__ = ["scaled_dot_product_attention", "scaled_dot_product_attention_backward"]

MERGE_FAN_IN = 4


# ----------------------------------------------------------------------------------------------
# the band of one tile, in the tile's own coordinates
# ----------------------------------------------------------------------------------------------
def _global_band(L: int, S: int, is_causal: bool, alignment: str, window):
    """(q_offset, left, right) of the whole problem; None = unbounded side."""
    left, right = window
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return (0 if alignment == "top_left" else S - L), left, right


def _tile_band(band, r0: int, c0: int, L: int, S: int):
    """(Band, shift) for rows r0.. and keys c0.. of the whole problem's band, in the tile's
    coordinates, or None when the band leaves the tile no key at all.

    The kernels take a band as j in [i + q_offset - left, i + q_offset + right] with an
    unbounded side stored as L + S + 1, which is unbounded only for q_offset within
    [-(L-1), S-1]. A tile far from the diagonal has q_offset outside that range, so it is moved
    to the nearest end (`shift` = the tile's true q_offset minus the one given) and the bounded
    sides are moved with it: the same constraints. ALiBi reads q_offset too; see _tile_forward.
    """
    q_off_g, left, right = band
    q_off = q_off_g + r0 - c0                      # key position of the tile's query row 0
    unb = L + S + 1
    lo = None if left is None else q_off - left    # row i's keys: [i + lo, i + hi]
    hi = None if right is None else q_off + right
    if L == 0 or S == 0 or (lo is not None and lo > S - 1) or (hi is not None and hi < -(L - 1)):
        return None
    if lo is not None and lo <= -(L - 1):
        lo = None                                  # no key of the tile is cut on the left
    if hi is not None and hi >= S - 1:
        hi = None
    q_new = min(max(q_off, -(L - 1)), S - 1)
    return (Band(q_new, unb if lo is None else q_new - lo, unb if hi is None else hi - q_new, unb),
            q_off - q_new)


# ----------------------------------------------------------------------------------------------
# what one task runs
# ----------------------------------------------------------------------------------------------
def _problem(q, k, v, mask, alibi, opts, tile, fn):
    """The tile's Problem: the user's options, with the band in the tile's coordinates; and the
    q_offset shift of _tile_band."""
    band, r0, c0 = tile
    tb, shift = _tile_band(band, r0, c0, q.shape[-2], k.shape[-2])
    p = make_problem(q, k, v, mask, 0.0, False, opts["scale"], opts["enable_gqa"],
                     softcap=opts["softcap"], alibi_slopes=alibi, fn=fn)
    p.band = tb
    return p, shift


def _tile_forward(q, k, v, mask, alibi, opts, tile):
    """(out, lse) of one tile, out in the compute dtype (partials are merged before the cast)."""
    p, shift = _problem(q, k, v, mask, alibi, opts, tile,
                        "fastattn.dask.scaled_dot_product_attention")
    be = _backends.resolve(p, "forward", opts["backend"])
    if p.is_empty or p.q.shape[3] == 0:
        be = _backends.registry["numpy"]
    out, lse = be.forward(p)
    out, lse = out.reshape(p.out_shape), lse.reshape(p.lse_shape)
    if shift and alibi is not None:
        # The tile sits wholly on one side of the diagonal, so |pos_i - j| = |i + q_new - j| +
        # |shift| for every (i, j): the true bias is the computed one minus slope * |shift|, a
        # constant per row, which leaves the weights (and out) as they are and lowers the lse.
        slopes = np.asarray(alibi, lse.dtype)
        lse = lse - slopes[..., None] * abs(shift)
    return out, lse


def _empty_part(q_shape, Ev, dtype):
    """The partial of a query block no key reaches: out 0, lse -inf."""
    return (np.zeros(q_shape[:-1] + (Ev,), compute_dtype(dtype)),
            np.full(q_shape[:-1], -np.inf, lse_dtype(compute_dtype(dtype))))


def _merge(*parts):
    outs = [o for o, _ in parts]
    lses = [s for _, s in parts]
    if len(parts) == 1:
        return parts[0]
    return _api.merge_attention(outs, lses)


def _finish(part, dtype, sinks_slice):
    out, lse = part
    if sinks_slice is not None:
        out, lse = _api.merge_attention([out], [lse], sinks=sinks_slice)
    return out.astype(dtype, copy=False), lse


def _tile_backward(dout, q, k, v, out, lse, mask, alibi, sinks, opts, tile):
    p, shift = _problem(q, k, v, mask, alibi, opts, tile,
                        "fastattn.dask.scaled_dot_product_attention_backward")
    if shift and alibi is not None:
        # the shifted tile's scores are the true ones plus slope * |shift| (see _tile_forward):
        # so is its lse, and so must its sinks be
        c = np.asarray(alibi, np.float64) * abs(shift)
        lse = lse + c[..., None].astype(lse.dtype)
        if sinks is not None:
            if c.ndim > 1:
                raise ValueError("fastattn.dask.scaled_dot_product_attention_backward: sinks with "
                                 "per-batch alibi_slopes and query rows past the last key "
                                 "(L > S) are not supported yet")
            sinks = sinks + c.astype(np.asarray(sinks).dtype)
    p.sinks = None if sinks is None else np.ascontiguousarray(sinks, p.dtype)
    be = _backends.resolve(p, "backward", opts["backend"])
    if p.is_empty:
        be = _backends.registry["numpy"]
    B, Hq, L, _ = p.q.shape
    Ev = p.v.shape[3]
    g = np.ascontiguousarray(dout, p.dtype).reshape(B, Hq, L, Ev)
    o = np.ascontiguousarray(out, p.dtype).reshape(B, Hq, L, Ev)
    s = np.ascontiguousarray(lse, lse_dtype(p.dtype)).reshape(B, Hq, L)
    grads = be.backward(p, g, o, s)
    dq, dk, dv = (x.reshape(shape) for x, shape in zip(grads[:3], (q.shape, k.shape, v.shape)))
    ds = grads[3] if len(grads) > 3 else None
    return dq, dk, dv, ds


def _add(*xs):
    total = xs[0].copy()
    for x in xs[1:]:
        total += x
    return total


def _pick(t, i):
    return t[i]


# ----------------------------------------------------------------------------------------------
# graph building
# ----------------------------------------------------------------------------------------------
def _as_dask(x, name):
    if isinstance(x, da.Array):
        return x
    if isinstance(x, np.ndarray):
        return da.from_array(x, chunks=x.shape or (), name=False)
    raise TypeError(f"fastattn.dask: {name} must be a dask or NumPy array, got {type(x).__name__}")


def _offsets(chunks):
    return np.concatenate([[0], np.cumsum(chunks)]).astype(int)


class _Layout:
    """q, k, v rechunked so that their blocks line up: the same batch chunks, kv-head chunks
    times the group for the query heads, one chunk along E, v's keys chunked like k's."""

    def __init__(self, query, key, value, enable_gqa, fn):
        q, k, v = (_as_dask(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
        self.squeeze = q.ndim == 2
        if self.squeeze:
            q, k, v = q[None], k[None], v[None]
        # the shape checks of the single-machine function, on empty stand-ins
        make_problem(*(np.empty(x.shape[:-2] + (0, x.shape[-1]), x.dtype) for x in (q, k, v)),
                     enable_gqa=enable_gqa, fn=fn)
        self.in_chunks = (q.chunks, k.chunks, v.chunks)   # results are given back like these
        nb = q.ndim - 3
        Hq, Hkv = q.shape[-3], k.shape[-3]
        g = Hq // Hkv
        batch = tuple(q.chunks[:nb])
        kv_heads = k.chunks[nb]
        q_heads = tuple(c * g for c in kv_heads)
        self.q = q.rechunk(batch + (q_heads, q.chunks[nb + 1], (q.shape[-1],)))
        self.k = k.rechunk(batch + (kv_heads, k.chunks[nb + 1], (k.shape[-1],)))
        self.v = v.rechunk(batch + (kv_heads, self.k.chunks[nb + 1], (v.shape[-1],)))
        self.nb, self.g = nb, g
        self.dtype = q.dtype

    def blocks(self):
        """(batch block index, head block index) pairs."""
        nb = self.nb
        return itertools.product(itertools.product(*(range(len(c)) for c in self.q.chunks[:nb])),
                                 range(len(self.k.chunks[nb])))


def _slices(chunks, idx):
    return tuple(slice(o[i], o[i + 1]) for o, i in zip((_offsets(c) for c in chunks), idx))


def _mask_piece(mask, full_shape, bidx_slices, hs, ls, ss):
    """The NumPy mask's piece for one tile (broadcast dims stay size 1)."""
    if mask is None:
        return None
    m = mask.reshape((1,) * (len(full_shape) - mask.ndim) + mask.shape)
    sl = []
    for ax, s in enumerate(bidx_slices + (hs, ls, ss)):
        sl.append(slice(None) if m.shape[ax] == 1 else s)
    return np.ascontiguousarray(m[tuple(sl)])


def _alibi_piece(alibi, batch_shape, bidx_slices, hs):
    if alibi is None:
        return None
    a = np.asarray(alibi)
    if a.ndim == 1:
        return a[hs]
    a = a.reshape(tuple(batch_shape) + (a.shape[-1],))
    return np.ascontiguousarray(a[bidx_slices + (hs,)])


def _options(fn, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, window,
             softcap, alibi_slopes, sinks, rng, backend):
    if dropout_p:
        raise ValueError(f"{fn}: dropout_p > 0 is not supported on dask arrays yet (the kernels "
                         f"do not take the dropout hash's position offsets yet), got {dropout_p!r}")
    if attn_mask is not None and not isinstance(attn_mask, np.ndarray):
        if isinstance(attn_mask, da.Array):
            raise TypeError(f"{fn}: attn_mask as a dask array is not supported yet; pass a NumPy "
                            f"mask (it is sliced per tile)")
        attn_mask = np.asarray(attn_mask)
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"{fn}: causal_alignment must be 'top_left' or 'bottom_right', got "
                         f"{causal_alignment!r}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: is_causal must be a bool, got {type(is_causal).__name__}")
    opts = dict(scale=scale, enable_gqa=enable_gqa, softcap=softcap, backend=backend)
    return attn_mask, check_window(window, fn), opts


def _graph_forward(lay, mask, alibi, sinks, opts, band_of, fn):
    q, k, v = lay.q, lay.k, lay.v
    nb = lay.nb
    name = "fastattn-sdpa-" + dask.base.tokenize(q, k, v, mask, alibi, sinks, repr(opts),
                                                 repr(band_of))
    layer = {}
    Ev = v.shape[-1]
    L, S = q.shape[-2], k.shape[-2]
    band = band_of(L, S)
    lo, so = _offsets(q.chunks[nb + 1]), _offsets(k.chunks[nb + 1])
    batch_shape = q.shape[:nb]
    full_shape = q.shape[:-1] + (S,)
    for bidx, hb in lay.blocks():
        bsl = _slices(q.chunks[:nb], bidx)
        hs = _slices((q.chunks[nb],), (hb,))[0]
        a = _alibi_piece(alibi, batch_shape, bsl, hs)
        for li in range(len(lo) - 1):
            parts = []
            for si in range(len(so) - 1):
                tile = (band, int(lo[li]), int(so[si]))
                Lc, Sc = int(lo[li + 1] - lo[li]), int(so[si + 1] - so[si])
                if _tile_band(band, tile[1], tile[2], Lc, Sc) is None:
                    continue                                     # the band leaves it empty
                m = _mask_piece(mask, full_shape, bsl, hs, slice(lo[li], lo[li + 1]),
                                slice(so[si], so[si + 1]))
                key = (name + "-tile",) + bidx + (hb, li, si)
                layer[key] = (_tile_forward, (q.name,) + bidx + (hb, li, 0),
                              (k.name,) + bidx + (hb, si, 0), (v.name,) + bidx + (hb, si, 0),
                              m, a, opts, tile)
                parts.append(key)
            if not parts:
                shape = tuple(c[i] for c, i in zip(q.chunks, bidx + (hb, li, 0)))
                key = (name + "-empty",) + bidx + (hb, li)
                layer[key] = (_empty_part, shape, Ev, lay.dtype)
                parts = [key]
            level = 0
            while len(parts) > 1:                                # tree of merges
                nxt = []
                for i in range(0, len(parts), MERGE_FAN_IN):
                    key = (name + f"-merge{level}",) + bidx + (hb, li, i)
                    layer[key] = (_merge,) + tuple(parts[i:i + MERGE_FAN_IN])
                    nxt.append(key)
                parts, level = nxt, level + 1
            s_sl = None if sinks is None else np.asarray(sinks)[hs]
            fin = (name + "-fin",) + bidx + (hb, li)
            layer[fin] = (_finish, parts[0], lay.dtype, s_sl)
            layer[(name + "-out",) + bidx + (hb, li, 0)] = (_pick, fin, 0)
            layer[(name + "-lse",) + bidx + (hb, li)] = (_pick, fin, 1)
    out = _array(layer, name + "-out", q.chunks[:-1] + ((Ev,),), lay.dtype, [q, k, v])
    lse = _array(layer, name + "-lse", q.chunks[:-1], lse_dtype(compute_dtype(lay.dtype)),
                 [q, k, v])
    return out, lse


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 causal_alignment="top_left", window=None, softcap=None,
                                 alibi_slopes=None, sinks=None, return_lse=False, rng=None,
                                 backend=None):
    """fastattn.scaled_dot_product_attention on dask arrays (same arguments and semantics);
    returns dask arrays: out (..., Hq, L, Ev) chunked like query, and lse with return_lse."""
    fn = "fastattn.dask.scaled_dot_product_attention"
    lay = _Layout(query, key, value, enable_gqa, fn)
    mask, win, opts = _options(fn, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                               causal_alignment, window, softcap, alibi_slopes, sinks, rng, backend)
    # every option checked once, here, on a one-row stand-in of the whole problem
    _check_options(lay, mask, opts, alibi_slopes, sinks, win, is_causal, causal_alignment, fn)
    out, lse = _graph_forward(lay, mask, alibi_slopes, sinks, opts,
                              lambda L, S: _global_band(L, S, bool(is_causal), causal_alignment,
                                                        win), fn)
    qc = lay.in_chunks[0]
    out, lse = out.rechunk(qc[:-1] + out.chunks[-1:]), lse.rechunk(qc[:-1])
    if lay.squeeze:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _check_options(lay, mask, opts, alibi, sinks, win, is_causal, alignment, fn):
    q, k, v = lay.q, lay.k, lay.v
    stand = [np.zeros(x.shape[:-2] + (1, x.shape[-1]), x.dtype) for x in (q, k, v)]
    m = None
    if mask is not None:
        m = mask.reshape((1,) * (q.ndim - mask.ndim) + mask.shape)
        full = q.shape[:-1] + (k.shape[-2],)
        if m.ndim > q.ndim or any(a not in (1, b) for a, b in zip(m.shape, full)):
            raise ValueError(f"{fn}: attn_mask of shape {mask.shape} does not broadcast to the "
                             f"score shape {full} (batch..., heads, L, S)")
        m = m[..., :1, :1]
    kw = {} if sinks is None else {"sinks": sinks}
    _api.scaled_dot_product_attention(*stand, m, 0.0, bool(is_causal), opts["scale"],
                                      opts["enable_gqa"], causal_alignment=alignment,
                                      window=win, softcap=opts["softcap"], alibi_slopes=alibi,
                                      backend=opts["backend"], **kw)


def scaled_dot_product_attention_backward(grad_out, query, key, value, out, lse, attn_mask=None,
                                          dropout_p=0.0, is_causal=False, scale=None,
                                          enable_gqa=False, *, causal_alignment="top_left",
                                          window=None, softcap=None, alibi_slopes=None,
                                          sinks=None, rng=None, backend=None):
    """Gradients (dq, dk, dv) of the dask forward as dask arrays chunked like query, key, value
    (and dsinks as a NumPy-backed dask array when sinks are given). See the module doc: each
    query chunk's task reads all keys of its heads."""
    fn = "fastattn.dask.scaled_dot_product_attention_backward"
    lay = _Layout(query, key, value, enable_gqa, fn)
    mask, win, opts = _options(fn, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                               causal_alignment, window, softcap, alibi_slopes, sinks, rng, backend)
    _check_options(lay, mask, opts, alibi_slopes, sinks, win, is_causal, causal_alignment, fn)
    nb = lay.nb
    q = lay.q
    k = lay.k.rechunk(lay.k.chunks[:nb + 1] + ((lay.k.shape[-2],), lay.k.chunks[-1]))
    v = lay.v.rechunk(lay.v.chunks[:nb + 1] + ((lay.v.shape[-2],), lay.v.chunks[-1]))
    sq = 1 if lay.squeeze else 0
    g = _as_dask(grad_out, "grad_out")
    o = _as_dask(out, "out")
    s = _as_dask(lse, "lse")
    if lay.squeeze:
        g, o, s = g[None], o[None], s[None]
    Ev = v.shape[-1]
    want = q.shape[:-1] + (Ev,)
    for nm, arr, shape in (("grad_out", g, want), ("out", o, want), ("lse", s, q.shape[:-1])):
        if arr.shape != shape:
            raise ValueError(f"{fn}: {nm} must have shape {shape[sq:]}, got {arr.shape[sq:]}")
    g = g.rechunk(q.chunks[:-1] + ((Ev,),))
    o = o.rechunk(q.chunks[:-1] + ((Ev,),))
    s = s.rechunk(q.chunks[:-1])
    L, S = q.shape[-2], k.shape[-2]
    band = _global_band(L, S, bool(is_causal), causal_alignment, win)
    name = "fastattn-sdpa-bwd-" + dask.base.tokenize(g, q, k, v, o, s, mask, alibi_slopes, sinks,
                                                     repr(opts), band)
    layer = {}
    lo = _offsets(q.chunks[nb + 1])
    batch_shape = q.shape[:nb]
    full_shape = q.shape[:-1] + (S,)
    ds_keys = []
    for bidx, hb in lay.blocks():
        bsl = _slices(q.chunks[:nb], bidx)
        hs = _slices((q.chunks[nb],), (hb,))[0]
        a = _alibi_piece(alibi_slopes, batch_shape, bsl, hs)
        sk = None if sinks is None else np.asarray(sinks)[hs]
        dk_parts, dv_parts = [], []
        for li in range(len(lo) - 1):
            tile = (band, int(lo[li]), 0)
            m = _mask_piece(mask, full_shape, bsl, hs, slice(lo[li], lo[li + 1]), slice(0, S))
            key = (name + "-tile",) + bidx + (hb, li)
            layer[key] = (_tile_backward, (g.name,) + bidx + (hb, li, 0),
                          (q.name,) + bidx + (hb, li, 0), (k.name,) + bidx + (hb, 0, 0),
                          (v.name,) + bidx + (hb, 0, 0), (o.name,) + bidx + (hb, li, 0),
                          (s.name,) + bidx + (hb, li), m, a, sk, opts, tile)
            layer[(name + "-dq",) + bidx + (hb, li, 0)] = (_pick, key, 0)
            dk_parts.append((_pick, key, 1))
            dv_parts.append((_pick, key, 2))
            if sinks is not None:
                ds_keys.append(((hs.start, hs.stop), (_pick, key, 3)))
        layer[(name + "-dk",) + bidx + (hb, 0, 0)] = (_add,) + tuple(dk_parts)
        layer[(name + "-dv",) + bidx + (hb, 0, 0)] = (_add,) + tuple(dv_parts)
    deps = [g, q, k, v, o, s]
    dq = _array(layer, name + "-dq", q.chunks, lay.dtype, deps)
    dk = _array(layer, name + "-dk", k.chunks, lay.dtype, deps)
    dv = _array(layer, name + "-dv", v.chunks, lay.dtype, deps)
    dq, dk, dv = (x.rechunk(c) for x, c in zip((dq, dk, dv), lay.in_chunks))
    if lay.squeeze:
        dq, dk, dv = dq[0], dk[0], dv[0]
    if sinks is None:
        return dq, dk, dv
    Hq = q.shape[-3]
    layer[(name + "-dsinks", 0)] = (_sum_dsinks, Hq, np.asarray(sinks).dtype,
                                    [span for span, _ in ds_keys], [t for _, t in ds_keys])
    dsinks = _array(layer, name + "-dsinks", ((Hq,),), np.asarray(sinks).dtype, deps)
    return dq, dk, dv, dsinks


def _array(layer, name, chunks, dtype, deps):
    """A dask array whose blocks are the keys (name, ...) of `layer` (a layer shared by several
    outputs is given to each; computed together, the same keys run once)."""
    graph = HighLevelGraph.from_collections(name, layer, dependencies=deps)
    return da.Array(graph, name, chunks, dtype=dtype)


def _sum_dsinks(Hq, dtype, spans, parts):
    total = np.zeros(Hq, np.float64)
    for (h0, h1), part in zip(spans, parts):
        total[h0:h1] += part
    return total.astype(dtype)
