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
  tiles, which are of equal size, over the workers (work stealing balances the uneven rows);
- positions are global: causal (both alignments), windows, ALiBi and the dropout hash use the
  tile's place in the whole problem, so a chunked run equals the single-machine one (dropout
  keeps exactly the same weights);
- attn_mask may be a NumPy or a dask array (broadcastable to (..., Hq, L, S)); it is chunked like
  the tiles and each tile reads only its own block, a graph dependency like q, k and v.

The backward (`scaled_dot_product_attention_backward`) takes the forward's out and lse and has
the same tiles: each (query chunk, key chunk) tile computes its share of the gradients with the
whole problem's lse and D = rowsum(dO * O) (the partial-keys backward: FlashAttention-2's form,
P = exp(s - lse) over the tile's keys), so no task needs all keys of a head. The gradients are
running sums passed from tile to tile: a tile task adds its share to its row's dq and its
column's dk, dv and hands them to the next tile of the row and of the column, so each gradient
block has one partial in memory, in any order the scheduler runs the tasks (trees of adds held
the partials of every tile whose reduction had not run). With one key chunk the tiles hold every
key and compute their own row sums instead (the kernels' usual, more accurate form).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

try:
    import dask
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("fastattn.dask needs dask: pip install 'fastattn[dask]' "
                      "(dask[array] and distributed)") from exc

from . import _backends, _parts
from . import api as _api
from ._inputs import (ALIGNMENTS, check_attn_mask, check_backward_rng, check_dropout,
                      check_window, compute_dtype, dq_from_kernels, dropout_seed, for_kernels,
                      lse_dtype, make_problem)

__all__ = ["scaled_dot_product_attention", "scaled_dot_product_attention_backward"]

MERGE_FAN_IN = 4


# ----------------------------------------------------------------------------------------------
# what one task runs
# ----------------------------------------------------------------------------------------------
def _problem(q, k, v, mask, alibi, opts, tile, fn):
    """The tile's Problem with global positions (band, dropout hash), and the ALiBi shift of
    _parts.place. tile = (global band, first row, first key, dropout origin)."""
    band, r0, c0, origin = tile
    p = make_problem(q, k, v, mask, opts["dropout_p"], False, opts["scale"], opts["enable_gqa"],
                     softcap=opts["softcap"], alibi_slopes=alibi, rng=0, fn=fn)
    p.seed = opts["seed"]                        # the whole problem's, drawn once
    shift = _parts.place(p, band, r0, c0, origin)
    return p, shift


def _backend(p, op, opts):
    be = _backends.resolve(p, op, opts["backend"])
    return _backends.registry["numpy"] if p.is_empty or p.q.shape[3] == 0 else be


def _tile_forward(q, k, v, mask, alibi, opts, tile):
    """(out, lse) of one tile, out in the compute dtype (partials are merged before the cast)."""
    p, shift = _problem(q, k, v, mask, alibi, opts, tile,
                        "fastattn.dask.scaled_dot_product_attention")
    p = for_kernels(p)[0]
    out, lse = _backend(p, "forward", opts).forward(p)
    if shift:
        lse = lse - _parts.alibi_shift(p.alibi, shift, lse.dtype)
    return out.reshape(p.out_shape), lse.reshape(p.lse_shape)


def _empty_part(q_shape, Ev, dtype):
    """The partial of a query block no key reaches: out 0, lse -inf."""
    return (np.zeros(q_shape[:-1] + (Ev,), compute_dtype(dtype)),
            np.full(q_shape[:-1], -np.inf, lse_dtype(compute_dtype(dtype))))


def _merge(*parts):
    if len(parts) == 1:
        return parts[0]
    return _api.merge_attention([o for o, _ in parts], [s for _, s in parts])


def _finish(part, dtype, sinks_slice):
    out, lse = part
    if sinks_slice is not None:
        out, lse = _api.merge_attention([out], [lse], sinks=sinks_slice)
    return out.astype(dtype, copy=False), lse


def _tile_backward(dout, q, k, v, out, lse, mask, alibi, sinks, opts, tile, keys_part,
                   dq_sum=None, dkv_sum=None):
    """One tile's gradients added to the running sums it is given: (dq, (dk, dv)), dq the sum
    over its row's tiles so far (dq_sum: the previous tile's, or None), dk and dv over its
    column's (dkv_sum). keys_part: the tile holds a part of its rows' keys, so it takes the whole
    problem's lse and D = rowsum(dout * out) (Problem.delta); else it holds all of them and the
    kernels form the row sums from its own tiles (sinks then complete them)."""
    fn = "fastattn.dask.scaled_dot_product_attention_backward"
    p, shift = _problem(q, k, v, mask, alibi, opts, tile, fn)
    p, dq_factor = for_kernels(p)
    B, Hq, L, _ = p.q.shape
    Ev = p.v.shape[3]
    g = np.ascontiguousarray(dout, p.dtype).reshape(B, Hq, L, Ev)
    o = np.ascontiguousarray(out, p.dtype).reshape(B, Hq, L, Ev)
    s = np.ascontiguousarray(lse, lse_dtype(p.dtype)).reshape(B, Hq, L)
    if keys_part:
        p.delta = _parts.row_delta(g, o, p.dtype)
    elif sinks is not None:
        p.sinks = np.ascontiguousarray(sinks, p.dtype)
    s = _parts.backward_lse(p, shift, s, fn)
    dq, dk, dv, _ = _backend(p, "backward", opts).backward(p, g, o, s)
    dq = _accumulate(dq_from_kernels(dq, dq_factor).reshape(q.shape), dq_sum)
    dk = _accumulate(dk.reshape(k.shape), None if dkv_sum is None else dkv_sum[0])
    dv = _accumulate(dv.reshape(v.shape), None if dkv_sum is None else dkv_sum[1])
    return dq, (dk, dv)


def _accumulate(part, total):
    """part + total, into part when it is the kernels' own writeable array (no second chunk of
    scratch); the running sum given by the previous task is never written to (dask may still
    hold it, e.g. to rerun this task after a worker is lost)."""
    if total is None:
        return part
    if part.flags.writeable and part.dtype == np.result_type(part, total):
        part += total
        return part
    return part + total


def _row_dsinks(dout, out, lse, sinks):
    """dsinks (Hq,) of one query block: -sum_{b,i} exp(sink - lse) * rowsum(dout * out)."""
    Hq, L = lse.shape[-2:]
    g = np.asarray(dout).reshape(-1, Hq, L, dout.shape[-1])
    o = np.asarray(out).reshape(g.shape)
    return _parts.sink_grad(np.asarray(sinks, np.float64), np.asarray(lse).reshape(-1, Hq, L),
                            _parts.row_delta(g, o, np.float64))


def _zeros(shape, dtype):
    return np.zeros(shape, dtype)


def _pick(t, i):
    return t[i]


def _cast(x, dtype):
    return x.astype(dtype, copy=False)


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
    times the group for the query heads, one chunk along E, v's keys chunked like k's. With
    dropout, the batch dims after the first are one chunk each, so a block's flattened batch
    index is an offset plus the block's own (the dropout hash's batch*head is affine in it)."""

    def __init__(self, query, key, value, enable_gqa, fn, flat_batch=False):
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
        if flat_batch:
            batch = batch[:1] + tuple((n,) for n in q.shape[1:nb])
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

    def origin(self, bidx, hb, r0, c0):
        """The dropout hash's (bh0, bh_stride, row0, col0) of a tile (see the class doc)."""
        q, nb = self.q, self.nb
        Hq = q.shape[-3]
        inner = math.prod(q.shape[1:nb])
        b0 = int(_offsets(q.chunks[0])[bidx[0]]) * inner if nb else 0
        h0 = int(_offsets(q.chunks[nb])[hb])
        return (b0 * Hq + h0, Hq, r0, c0)


def _slices(chunks, idx):
    return tuple(slice(o[i], o[i + 1]) for o, i in zip((_offsets(c) for c in chunks), idx))


class _Mask:
    """attn_mask (NumPy or dask) as a dask array of the full score rank, chunked like the
    tiles: broadcast (size-1) dims stay one chunk, the others follow q's batch and head chunks,
    q's query chunks and k's key chunks. block(...) is a tile's block key (a graph dependency)."""

    def __init__(self, mask, lay, fn):
        q, k = lay.q, lay.k
        full = q.shape[:-1] + (k.shape[-2],)
        if not isinstance(mask, da.Array):
            mask = check_attn_mask(mask, full, fn)          # dtype and shape, before chunking
            if mask.ndim and 0 in mask.strides:
                # a stride-0 (np.broadcast_to) axis holds one value: keep it length 1, or the
                # graph would carry (and pickle) the repeats densely
                mask = mask[tuple(slice(0, 1) if st == 0 else slice(None)
                                  for st in mask.strides)]
        elif mask.ndim > len(full) or any(a not in (1, b) for a, b in
                                          zip(mask.shape[::-1], full[::-1])):
            raise ValueError(f"{fn}: attn_mask of shape {mask.shape} does not broadcast to the "
                             f"score shape {full} (batch..., heads, L, S)")
        m = mask.reshape((1,) * (len(full) - mask.ndim) + mask.shape)
        if m.dtype != np.bool_ and compute_dtype(m.dtype) is None:
            raise TypeError(f"{fn}: attn_mask must be a bool mask (True = take part) or a float "
                            f"mask added to the scores, got dtype {m.dtype}")
        want = q.chunks[:-1] + (k.chunks[-2],)
        chunks = tuple((1,) if n == 1 else c for n, c in zip(m.shape, want))
        if isinstance(m, da.Array):
            self.arr = m.rechunk(chunks)
        else:
            self.arr = da.from_array(m, chunks=chunks, name=False)
        self.broadcast = tuple(n == 1 for n in m.shape)
        self.dtype = m.dtype

    def block(self, bidx, hb, li, si):
        idx = bidx + (hb, li, si)
        return (self.arr.name,) + tuple(0 if b else i for b, i in zip(self.broadcast, idx))

    def stand_in(self):
        """A (1, ..., 1) NumPy mask of the same dtype, for the option checks."""
        return np.zeros((1,) * self.arr.ndim, self.dtype)


def _alibi_piece(alibi, batch_shape, bidx_slices, hs):
    if alibi is None:
        return None
    a = np.asarray(alibi)
    if a.ndim == 1:
        return a[hs]
    a = a.reshape(tuple(batch_shape) + (a.shape[-1],))
    return np.ascontiguousarray(a[bidx_slices + (hs,)])


def _options(fn, dropout_p, is_causal, causal_alignment, window, scale, enable_gqa, softcap,
             backend, rng, backward=False):
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"{fn}: causal_alignment must be 'top_left' or 'bottom_right', got "
                         f"{causal_alignment!r}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: is_causal must be a bool, got {type(is_causal).__name__}")
    p_drop = check_dropout(dropout_p, fn)
    if backward:
        check_backward_rng(p_drop, rng, fn)
    # one seed for the whole problem (a Generator or None draws it here, once)
    seed = dropout_seed(rng, fn) if p_drop > 0 else 0
    opts = dict(scale=scale, enable_gqa=enable_gqa, softcap=softcap, backend=backend,
                dropout_p=p_drop, seed=seed)
    return check_window(window, fn), opts


def _check_options(lay, mask, opts, alibi, sinks, win, is_causal, alignment, fn):
    """Every option checked once, on a one-row stand-in of the whole problem."""
    q, k, v = lay.q, lay.k, lay.v
    stand = [np.zeros(x.shape[:-2] + (1, x.shape[-1]), x.dtype) for x in (q, k, v)]
    m = None if mask is None else mask.stand_in()
    kw = {} if sinks is None else {"sinks": sinks}
    _api.scaled_dot_product_attention(*stand, m, opts["dropout_p"], bool(is_causal),
                                      opts["scale"], opts["enable_gqa"],
                                      causal_alignment=alignment, window=win,
                                      softcap=opts["softcap"], alibi_slopes=alibi, rng=0,
                                      backend=opts["backend"], **kw)


def _check_backend(lay, opts, op, keys_part=False):
    """An explicitly named backend that cannot run the tiles' modes (the dropout hash's
    offsets, the partial-keys backward) raises here, when the graph is built, naming why,
    rather than in every task on the workers."""
    if opts["backend"] is None:
        return
    stand = [np.zeros(x.shape[:-2] + (1, x.shape[-1]), compute_dtype(x.dtype))
             for x in (lay.q, lay.k, lay.v)]
    p = make_problem(*stand, None, opts["dropout_p"], False, None, opts["enable_gqa"], rng=0)
    if opts["dropout_p"] > 0:
        p.dropout_origin = (0, p.q.shape[1], 0, 1)
    if keys_part:
        p.delta = np.zeros(p.q.shape[:3], p.dtype)
    _backends.resolve(p, op, opts["backend"])


def _tiles(lay, band):
    """Every non-empty tile: (bidx, hb, li, si, tile) with tile = (band, r0, c0, origin); the
    tiles the band leaves without a key are not made."""
    q, k, nb = lay.q, lay.k, lay.nb
    lo, so = _offsets(q.chunks[nb + 1]), _offsets(k.chunks[nb + 1])
    for bidx, hb in lay.blocks():
        for li in range(len(lo) - 1):
            for si in range(len(so) - 1):
                r0, c0 = int(lo[li]), int(so[si])
                if _parts.tile_band(band, r0, c0, int(lo[li + 1]) - r0,
                                    int(so[si + 1]) - c0) is not None:
                    yield bidx, hb, li, si, (band, r0, c0, lay.origin(bidx, hb, r0, c0))


def _tree(layer, name, parts, fn, index):
    """A tree of fn(*up to MERGE_FAN_IN parts) over `parts`; returns the root's key."""
    level = 0
    while len(parts) > 1:
        nxt = []
        for i in range(0, len(parts), MERGE_FAN_IN):
            key = (name, level) + index + (i,)
            layer[key] = (fn,) + tuple(parts[i:i + MERGE_FAN_IN])
            nxt.append(key)
        parts, level = nxt, level + 1
    return parts[0]


def _graph_forward(lay, mask, alibi, sinks, opts, band):
    q, k, v = lay.q, lay.k, lay.v
    nb = lay.nb
    name = _namer("fastattn-sdpa", dask.base.tokenize(
        q, k, v, None if mask is None else mask.arr, alibi, sinks, repr(opts), repr(band)))
    layer = {}
    Ev = v.shape[-1]
    batch_shape = q.shape[:nb]
    parts = {}
    for bidx, hb, li, si, tile in _tiles(lay, band):
        bsl = _slices(q.chunks[:nb], bidx)
        hs = _slices((q.chunks[nb],), (hb,))[0]
        key = (name("tile"),) + bidx + (hb, li, si)
        layer[key] = (_tile_forward, (q.name,) + bidx + (hb, li, 0),
                      (k.name,) + bidx + (hb, si, 0), (v.name,) + bidx + (hb, si, 0),
                      None if mask is None else mask.block(bidx, hb, li, si),
                      _alibi_piece(alibi, batch_shape, bsl, hs), opts, tile)
        parts.setdefault((bidx, hb, li), []).append(key)
    for bidx, hb in lay.blocks():
        hs = _slices((q.chunks[nb],), (hb,))[0]
        for li in range(len(q.chunks[nb + 1])):
            index = bidx + (hb, li)
            row = parts.get((bidx, hb, li))
            if not row:
                shape = tuple(c[i] for c, i in zip(q.chunks, index + (0,)))
                row = [(name("empty"),) + index]
                layer[row[0]] = (_empty_part, shape, Ev, lay.dtype)
            root = _tree(layer, name("merge"), row, _merge, index)
            fin = (name("fin"),) + index
            layer[fin] = (_finish, root, lay.dtype, None if sinks is None else np.asarray(sinks)[hs])
            layer[(name("out"),) + index + (0,)] = (_pick, fin, 0)
            layer[(name("lse"),) + index] = (_pick, fin, 1)
    deps = [q, k, v] + ([] if mask is None else [mask.arr])
    out = _array(layer, name("out"), q.chunks[:-1] + ((Ev,),), lay.dtype, deps)
    lse = _array(layer, name("lse"), q.chunks[:-1], lse_dtype(compute_dtype(lay.dtype)), deps)
    return out, lse


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 causal_alignment="top_left", window=None, softcap=None,
                                 alibi_slopes=None, sinks=None, return_lse=False, rng=None,
                                 backend=None):
    """fastattn.scaled_dot_product_attention on dask arrays (same arguments and semantics);
    returns dask arrays: out (..., Hq, L, Ev) chunked like query, and lse with return_lse.

    attn_mask may be a NumPy or a dask array. With dropout, the kept weights are those of the
    single-process call with the same int `rng` (a Generator or None draws one seed, once)."""
    fn = "fastattn.dask.scaled_dot_product_attention"
    win, opts = _options(fn, dropout_p, is_causal, causal_alignment, window, scale, enable_gqa,
                         softcap, backend, rng)
    lay = _Layout(query, key, value, enable_gqa, fn, flat_batch=opts["dropout_p"] > 0)
    mask = None if attn_mask is None else _Mask(attn_mask, lay, fn)
    _check_options(lay, mask, opts, alibi_slopes, sinks, win, is_causal, causal_alignment, fn)
    _check_backend(lay, opts, "forward")
    band = _parts.global_band(lay.q.shape[-2], lay.k.shape[-2], bool(is_causal),
                              causal_alignment, win)
    out, lse = _graph_forward(lay, mask, alibi_slopes, sinks, opts, band)
    qc = lay.in_chunks[0]
    out, lse = out.rechunk(qc[:-1] + out.chunks[-1:]), lse.rechunk(qc[:-1])
    if lay.squeeze:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def scaled_dot_product_attention_backward(grad_out, query, key, value, out, lse, attn_mask=None,
                                          dropout_p=0.0, is_causal=False, scale=None,
                                          enable_gqa=False, *, causal_alignment="top_left",
                                          window=None, softcap=None, alibi_slopes=None,
                                          sinks=None, rng=None, backend=None):
    """Gradients (dq, dk, dv) of the dask forward as dask arrays chunked like query, key, value
    (and dsinks as a one-chunk dask array when sinks are given). Same tiles as the forward;
    each takes the whole problem's lse and D (see the module doc), so no task reads all keys,
    and adds its gradients to running sums it passes on (one partial per gradient block).
    With dropout pass the forward's int `rng`."""
    fn = "fastattn.dask.scaled_dot_product_attention_backward"
    win, opts = _options(fn, dropout_p, is_causal, causal_alignment, window, scale, enable_gqa,
                         softcap, backend, rng, backward=True)
    lay = _Layout(query, key, value, enable_gqa, fn, flat_batch=opts["dropout_p"] > 0)
    mask = None if attn_mask is None else _Mask(attn_mask, lay, fn)
    _check_options(lay, mask, opts, alibi_slopes, sinks, win, is_causal, causal_alignment, fn)
    nb = lay.nb
    q, k, v = lay.q, lay.k, lay.v
    sq = 1 if lay.squeeze else 0
    g, o, s = _as_dask(grad_out, "grad_out"), _as_dask(out, "out"), _as_dask(lse, "lse")
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
    band = _parts.global_band(q.shape[-2], k.shape[-2], bool(is_causal), causal_alignment, win)
    name = _namer("fastattn-sdpa-bwd", dask.base.tokenize(
        g, q, k, v, o, s, None if mask is None else mask.arr, alibi_slopes, sinks, repr(opts),
        band))
    keys_part = len(k.chunks[nb + 1]) > 1
    _check_backend(lay, opts, "backward", keys_part)
    layer = {}
    ds_parts = _graph_backward(layer, name, lay, (g, o, s), mask, alibi_slopes, sinks, opts,
                               band, keys_part)
    deps = [g, q, k, v, o, s] + ([] if mask is None else [mask.arr])
    dq = _array(layer, name("dq"), q.chunks, lay.dtype, deps)
    dk = _array(layer, name("dk"), k.chunks, lay.dtype, deps)
    dv = _array(layer, name("dv"), v.chunks, lay.dtype, deps)
    dq, dk, dv = (x.rechunk(c) for x, c in zip((dq, dk, dv), lay.in_chunks))
    if lay.squeeze:
        dq, dk, dv = dq[0], dk[0], dv[0]
    if sinks is None:
        return dq, dk, dv
    Hq = q.shape[-3]
    sdt = np.asarray(sinks).dtype
    layer[(name("dsinks"), 0)] = (_sum_dsinks, Hq, sdt, [span for span, _ in ds_parts],
                                    [t for _, t in ds_parts])
    dsinks = _array(layer, name("dsinks"), ((Hq,),), sdt, deps)
    return dq, dk, dv, dsinks


def _graph_backward(layer, name, lay, gos, mask, alibi, sinks, opts, band, keys_part):
    """The backward's tasks, into `layer`; returns the dsinks parts [((h0, h1), key)].

    One task per tile, as in the forward, but no partial gradients: a tile task takes the
    running dq of its query chunk (from the previous tile of its row) and the running dk, dv of
    its key chunk (from the previous tile of its column), adds its own share and passes them on.
    So a gradient block has one running sum in memory at any time, whatever order the scheduler
    runs the tasks in: a worker holds its chunks, running sums (together the size of the
    gradients) and one tile's scratch, never the partials of tiles whose reduction has not run
    (trees of adds held those: 1319 MiB per worker against the forward's 510 at 65536 tokens,
    docs/DISTRIBUTED.md). Rows go from the tile nearest the diagonal leftwards (si descending),
    columns from it downwards (li ascending): li - si grows along both chains, so the graph is
    acyclic, and under a causal band every diagonal tile is ready at once and tile (li, si)
    waits for li - si others before it, ring attention's schedule (a full grid of nL x nS
    tiles has nL + nS - 1 steps)."""
    g, o, s = gos
    q, k, v, nb = lay.q, lay.k, lay.v, lay.nb
    batch_shape = q.shape[:nb]
    by_block = {}
    for bidx, hb, li, si, tile in _tiles(lay, band):
        by_block.setdefault((bidx, hb), {})[li, si] = tile
    ds_parts = []
    for bidx, hb in lay.blocks():
        tiles = by_block.get((bidx, hb), {})
        hs = _slices((q.chunks[nb],), (hb,))[0]
        alibi_piece = _alibi_piece(alibi, batch_shape, _slices(q.chunks[:nb], bidx), hs)
        sinks_piece = None if sinks is None else np.asarray(sinks)[hs]
        dq_sum, dkv_sum = {}, {}       # li / si -> the key of the row's / column's running sum
        for li, si in sorted(tiles, key=lambda t: (t[0] - t[1], t[0])):
            row, col, idx = bidx + (hb, li), bidx + (hb, si), bidx + (hb, li, si)
            key = (name("tile"),) + idx
            layer[key] = (_tile_backward, (g.name,) + row + (0,), (q.name,) + row + (0,),
                          (k.name,) + col + (0,), (v.name,) + col + (0,), (o.name,) + row + (0,),
                          (s.name,) + row, None if mask is None else mask.block(bidx, hb, li, si),
                          alibi_piece, sinks_piece, opts, tiles[li, si], keys_part,
                          dq_sum.get(li), dkv_sum.get(si))
            # dq and (dk, dv) each their own key: the next tile of the row pulls only the dq
            # it adds to, the next of the column only the dk, dv
            dq_sum[li], dkv_sum[si] = (name("tdq"),) + idx, (name("tdkv"),) + idx
            layer[dq_sum[li]] = (_pick, key, 0)
            layer[dkv_sum[si]] = (_pick, key, 1)
        for li in range(len(q.chunks[nb + 1])):
            row = bidx + (hb, li)
            shape = tuple(c[i] for c, i in zip(q.chunks, row + (0,)))
            last = dq_sum.get(li)
            layer[(name("dq"),) + row + (0,)] = (
                (_zeros, shape, q.dtype) if last is None else (_cast, last, q.dtype))
            if sinks is not None:
                key = (name("ds"),) + row
                layer[key] = (_row_dsinks, (g.name,) + row + (0,), (o.name,) + row + (0,),
                              (s.name,) + row, sinks_piece)
                ds_parts.append(((hs.start, hs.stop), key))
        for si in range(len(k.chunks[nb + 1])):
            col = bidx + (hb, si)
            last = dkv_sum.get(si)
            for j, (x, nm) in enumerate(((k, "dk"), (v, "dv"))):
                shape = tuple(c[i] for c, i in zip(x.chunks, col + (0,)))
                layer[(name(nm),) + col + (0,)] = (
                    (_zeros, shape, x.dtype) if last is None else (_cast, (_pick, last, j), x.dtype))
    return ds_parts


def _namer(prefix, token):
    """name(kind) = "prefix-kind-token": the kind before the token, so that dask's key_split
    gives each kind of task its own prefix (tiles take seconds, picks microseconds: one shared
    prefix made the scheduler think a pick as slow as a tile, and its work stealing moved picks
    to idle workers, each pulling its tile's three gradients along)."""
    return lambda kind: f"{prefix}-{kind}-{token}"


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
