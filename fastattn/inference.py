"""Inference functions with flash-attn's layout: a KV cache appended in place, packed ragged batches.

`attention_with_kvcache` and `varlen_attention` take flash-attn's layouts, because that is the
code users port: tokens before heads, `q (B, Lq, Hq, E)`, caches `(B_cache, S_max, Hkv, E)` or
paged `(num_pages, page_size, Hkv, E)` with a `block_table`, packed `(total, H, E)` arrays with
`cu_seqlens`. (`scaled_dot_product_attention` keeps torch's heads-before-sequence layout.)

Every argument is checked before anything is written, so a rejected call leaves the cache
byte-for-byte as it was. Each sequence attends its own keys only (causal bottom-right, as
flash-attn does for these functions): a ragged batch costs the sum of its sequences, not
batch x longest.

`attention_with_kvcache` is check -> write the new tokens -> one kernel call for the whole
batch, which reads the cache where it is (the kernel record's k/v strides, per-sequence key
counts and page table: docs/KERNELS.md), in every cache dtype (float32/float64, and float16,
bfloat16, int8 with scales: the table in fastattn/_kvdtypes.py). A backend that does not read
a problem says why (not_supported_reasons): auto takes the next, a backend named raises. Only
a cache the kernels cannot address (head_dim not contiguous) is read from a contiguous copy.
`varlen_attention` runs sequence by sequence.
"""
from __future__ import annotations

import numbers

import numpy as np

from . import _backends, _kvdtypes
from ._inputs import (as_float_array, check_same_dtype, check_window, describe, for_kernels,
                      make_cache_problem)
from .api import scaled_dot_product_attention, scaled_dot_product_attention_backward

__all__ = ["attention_with_kvcache", "varlen_attention", "varlen_attention_backward"]


# ----------------------------------------------------------------------------------------------
# checks (all of them run before the cache is touched)
# ----------------------------------------------------------------------------------------------
def _int_vector(x, name: str, n: int | None, fn: str, *, allow_scalar: bool = False) -> np.ndarray:
    """An int32 vector (flash-attn's index dtype) of length n, non-negative, as int64 for the
    index arithmetic here."""
    if allow_scalar and type(x) is not np.ndarray and isinstance(
            x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_)):
        if x < 0:
            raise ValueError(f"{fn}: {name} must be >= 0, got {int(x)}")
        return np.full(n, int(x), np.int64)
    arr = x if isinstance(x, np.ndarray) else None
    if arr is None or arr.dtype != np.int32:
        raise TypeError(f"{fn}: {name} must be an int32 array"
                        + (" (or a Python int)" if allow_scalar else "") + f", got {describe(x)}")
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        want = f"({n},)" if n is not None else "1-D"
        raise ValueError(f"{fn}: {name} must have shape {want}, got {arr.shape}")
    if arr.size and _min_max(arr)[0] < 0:
        raise ValueError(f"{fn}: {name} must be non-negative, got {arr.tolist()[:16]}")
    return arr.astype(np.int64)


def _min_max(arr: np.ndarray) -> tuple:
    """(min, max) of a non-empty integer array as Python ints.  A decode step's arrays hold a
    few entries, where a NumPy reduction costs ~3 us each and the list's builtins a tenth."""
    if arr.size <= 256:
        values = arr.ravel().tolist()
        return min(values), max(values)
    return int(arr.min()), int(arr.max())


def _heads_layout(x, name: str, fn: str, ndim: int = 4) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype in _NATIVE_FLOATS and x.ndim == ndim:
        return x                         # the usual call: as_float_array would return it as is
    arr = as_float_array(x, name, fn)
    if arr.ndim != ndim:
        layout = "(batch, seqlen, heads, head_dim)" if ndim == 4 else "(total, heads, head_dim)"
        raise ValueError(f"{fn}: {name} must be {ndim}-D {layout}, got shape {arr.shape}")
    return arr


def _rotary_tables(rotary_cos, rotary_sin, E: int, fn: str):
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError(f"{fn}: rotary_cos and rotary_sin go together, got only "
                         f"{'rotary_cos' if rotary_sin is None else 'rotary_sin'}")
    cos = as_float_array(rotary_cos, "rotary_cos", fn)
    sin = as_float_array(rotary_sin, "rotary_sin", fn)
    if cos.ndim != 2 or cos.shape != sin.shape:
        raise ValueError(f"{fn}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2),"
                         f" got {cos.shape} and {sin.shape}")
    if 2 * cos.shape[1] > E or cos.shape[1] == 0:
        raise ValueError(f"{fn}: rotary_dim = 2 * rotary_cos.shape[1] = {2 * cos.shape[1]} must be "
                         f"in [2, head_dim = {E}]")
    return cos, sin


def _rotate(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray,
            interleaved: bool) -> np.ndarray:
    """x (n, H, E) rotated at positions pos (n,): GPT-J pairs (0,1),(2,3)... when interleaved,
    GPT-NeoX halves [0, r/2) with [r/2, r) otherwise; dims past rotary_dim r are kept."""
    half = cos.shape[1]
    c = cos[pos][:, None, :].astype(x.dtype)          # (n, 1, r/2)
    s = sin[pos][:, None, :].astype(x.dtype)
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = a * s + b * c
    return out


def _sequence_options(is_causal, window, softcap, sinks, scale, gqa, backend) -> dict:
    """scaled_dot_product_attention's keywords for one sequence: causal is bottom-right (the
    last query on the last key), as flash-attn has it for these functions."""
    return dict(is_causal=bool(is_causal), causal_alignment="bottom_right", window=window,
                softcap=softcap, sinks=sinks, scale=scale, enable_gqa=gqa, backend=backend)


def _alibi_row(alibi_slopes, b: int, B: int, Hq: int, fn: str):
    if alibi_slopes is None:
        return None
    a = as_float_array(alibi_slopes, "alibi_slopes", fn)
    if a.shape == (Hq,):
        return a
    if a.shape == (B, Hq):
        return a[b]
    raise ValueError(f"{fn}: alibi_slopes must have shape (Hq,) = ({Hq},) or (batch, Hq) = "
                     f"({B}, {Hq}), got {a.shape}")


_NATIVE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))     # in the machine's byte order


def _kernel_layout(cache: np.ndarray) -> bool:
    """The kernels can read this cache where it is: head_dim contiguous, whole-element
    strides (the dtype is a cache dtype in the machine's byte order: _cache_layout)."""
    item = cache.itemsize
    s0, s1, s2, s3 = cache.strides
    return ((cache.shape[3] <= 1 or s3 == item)
            and not (s0 % item or s1 % item or s2 % item or s3 % item))


_NATIVE_CACHE = _NATIVE_FLOATS + (np.dtype(np.float16), np.dtype(np.int8))


def _cache_layout(x, name: str, fn: str) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype in _NATIVE_CACHE and x.ndim == 4:
        return x                         # the usual call (bfloat16 goes the checked way)
    arr = _kvdtypes.cache_array(x, name, fn)
    if arr.ndim != 4:
        raise ValueError(f"{fn}: {name} must be 4-D (batch, seqlen, heads, head_dim), got shape "
                         f"{arr.shape}")
    return arr


def _wide(x: np.ndarray) -> np.ndarray:
    """x to rotate: float16/bfloat16 in float32 (rounded once, when stored or computed with),
    float32/float64 as they are."""
    return x if x.dtype in _NATIVE_FLOATS else x.astype(np.float32)


def _in_place_backend(problem, backend):
    """The backend that runs `problem` (a cache read in place): the one named, or auto's
    first that reads it (numpy reads every cache). BackendUnavailableError when the one
    named cannot, with its reasons."""
    return _backends.resolve(problem, "forward", backend)


def _write_new(pairs, lens, block_table, rows) -> None:
    """For each (target, values) of pairs, values[b] (Lnew, ...) into positions lens[b] ... of
    sequence b: cache row rows[b], or through block_table (targets: k/v caches, and an int8
    cache's scales, whose first two axes are the caches').  The targets are distinct (checked by
    the caller), so the order of the writes does not matter.  Up to 4 sequences whose new
    tokens stay in one page are written through slices (~1 us each); otherwise one indexed
    assignment per target for the batch (about 5 us each whatever the batch; row by row with
    index arrays, 8 sequences cost ~80 us)."""
    first, values = pairs[0]
    B, Lnew = values.shape[:2]
    starts = lens.tolist()
    if B <= 4:
        spans = []
        for b, start in enumerate(starts):
            if block_table is None:
                spans.append((int(rows[b]), start))
                continue
            page, slot = divmod(start, first.shape[1])
            if slot + Lnew > first.shape[1]:
                break                                   # crosses a page: the indexed way
            spans.append((int(block_table[b, page]), slot))
        else:
            for b, (row, at) in enumerate(spans):
                for target, new in pairs:
                    target[row, at:at + Lnew] = new[b]
            return
    pos = lens[:, None] + np.arange(Lnew)                 # (B, Lnew) absolute positions
    if block_table is None:
        where = (rows[:, None], pos)
    else:
        page_size = first.shape[1]
        where = (block_table[np.arange(B)[:, None], pos // page_size], pos % page_size)
    for target, new in pairs:
        target[where] = new


# ----------------------------------------------------------------------------------------------
# attention against a KV cache
# ----------------------------------------------------------------------------------------------
def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                           cache_batch_idx=None, block_table=None, k_scale=None, v_scale=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                           is_causal=True, window=None, softcap=None, alibi_slopes=None,
                           sinks=None, scale=None, return_lse=False, backend=None):
    """Append new keys/values to a KV cache in place, then attend to the cache (flash-attn layout).

    q : (B, Lq, Hq, E).
    k_cache, v_cache : (B_cache, S_max, Hkv, E / Ev), or with `block_table` a paged cache
        (num_pages, page_size, Hkv, E / Ev). Written in place (must be writeable). float32 or
        float64 (q, k, v of the same dtype), or a low-precision cache read in place: float16,
        bfloat16 (ml_dtypes) or int8 with k_scale/v_scale; then q, k, v are any one float
        dtype, the attention is computed in float32 over the cache's values, out has q's
        dtype and lse is float32 (fastattn/_kvdtypes.py).
    k_scale, v_scale : int8 caches only: float32 (B_cache, S_max, Hkv) (paged: (num_pages,
        page_size, Hkv)); cached element [b, s, h, e] is float32(code) * scale[b, s, h]. New
        tokens are quantized per token and kv head (fastattn.quantize_kv) and their scales
        written here, at the positions their codes take.
    k, v : optional new tokens (B, Lnew, Hkv, E / Ev), written at positions
        cache_seqlens[b] ... + Lnew - 1 of sequence b (after rotary, when given), cast to the
        cache's dtype (or quantized).
    cache_seqlens : int32 (B,) (or an int): tokens already in each sequence's cache. Not updated
        here (see fastattn.KVCache, which keeps the lengths).
    cache_batch_idx : int32 (B,): which cache row serves batch element b (contiguous cache only;
        distinct when k/v are given). Default: row b.
    block_table : int32 (B, max_pages): the pages of sequence b in order; page p holds its
        positions p*page_size ... (p+1)*page_size - 1. Pages used by live sequences must be
        distinct.
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2): rotary embedding applied to q and the
        new k at their absolute positions (GPT-J pairs when rotary_interleaved, GPT-NeoX halves
        otherwise). As in flash-attn, q rows sit at cache_seqlens[b] + i when is_causal or a
        window side is below the cache's capacity per sequence, and all at cache_seqlens[b]
        otherwise. As in flash-attn, they
        need k and v (of length 0 to add no token).
    Then q of sequence b attends to its first cache_seqlens[b] + Lnew keys, causal bottom-right
    when is_causal (the last query sits on the last key). window, softcap, alibi_slopes ((Hq,)
    or (B, Hq)), sinks, scale: as in scaled_dot_product_attention, except that a window side
    at least the cache's capacity per sequence is no side (flash-attn's rule).

    Returns out (B, Lq, Hq, Ev), and lse (B, Hq, Lq) when return_lse.
    """
    fn = "attention_with_kvcache"
    given = {"k_cache": k_cache, "v_cache": v_cache}     # the arrays new tokens are written to
    q = _heads_layout(q, "q", fn)
    k_cache = _cache_layout(k_cache, "k_cache", fn)
    v_cache = _cache_layout(v_cache, "v_cache", fn)
    kind = _kvdtypes.kind_of(k_cache.dtype)
    B, Lq, Hq, E = q.shape
    paged = block_table is not None
    n_slots, slot_len, Hkv, Ek = k_cache.shape
    Ev = v_cache.shape[3]
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{fn}: k_cache and v_cache must agree on all but the last axis, got "
                         f"{k_cache.shape} and {v_cache.shape}")
    if Ek != E:
        raise ValueError(f"{fn}: q and k_cache must have the same head dim, got q {q.shape} and "
                         f"k_cache {k_cache.shape}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{fn}: the query heads ({Hq}) must be a multiple of the cache's kv heads "
                         f"({Hkv})")
    # float32/float64 caches: q, k, v and the caches of one dtype; a low-precision cache: q, k,
    # v of one float dtype (the cache's is its own)
    named = {"q": q} if kind.low else {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v go together, got only {'k' if v is None else 'v'}")
    if k is not None:
        k = _heads_layout(k, "k", fn)
        v = _heads_layout(v, "v", fn)
        named.update(k=k, v=v)
        if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[2] != Hkv:
            raise ValueError(f"{fn}: k and v must be (B={B}, Lnew, Hkv={Hkv}, head_dim), got "
                             f"k {k.shape} and v {v.shape}")
        if k.shape[3] != E or v.shape[3] != Ev:
            raise ValueError(f"{fn}: k and v must have the cache's head dims ({E}, {Ev}), got "
                             f"k {k.shape} and v {v.shape}")
        for name in ("k_cache", "v_cache"):
            if not k.shape[1]:                                       # length 0 writes nothing
                continue
            # the caller's own array takes the writes: a list would be read through a fresh
            # array and an array of the other byte order through a converted copy, and writes
            # into those are lost (the next step would not see this one's tokens)
            if not isinstance(given[name], np.ndarray):
                raise TypeError(f"{fn}: {name} must be a NumPy array when k and v are given (the "
                                f"new keys/values are written into it in place), got "
                                f"{describe(given[name])}")
            if not given[name].flags.writeable:
                raise ValueError(f"{fn}: {name} is read-only; the new keys/values are written "
                                 f"into it in place")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{fn}: k_cache and v_cache must have the same dtype, got k_cache "
                        f"{k_cache.dtype} and v_cache {v_cache.dtype}")
    check_same_dtype(fn, **named)
    Lnew = 0 if k is None else k.shape[1]
    k_scale, v_scale = _kvdtypes.check_scales(kind, k_scale, v_scale, k_cache.shape[:3],
                                              Lnew > 0, fn)
    lens = _int_vector(cache_seqlens, "cache_seqlens", B, fn, allow_scalar=True)
    total = lens + Lnew                                   # keys each sequence attends
    if paged:
        if cache_batch_idx is not None:
            raise ValueError(f"{fn}: cache_batch_idx applies to a contiguous cache, not with "
                             f"block_table")
        bt = block_table if isinstance(block_table, np.ndarray) else None
        if bt is None or bt.dtype != np.int32 or bt.ndim != 2 or bt.shape[0] != B:
            raise TypeError(f"{fn}: block_table must be an int32 array (B={B}, max_pages), got "
                            f"{describe(block_table)}")
        page_size = slot_len
        capacity = bt.shape[1] * page_size
        if page_size == 0 and total.max(initial=0) > 0:
            raise ValueError(f"{fn}: the paged cache has page_size 0")
        # the pages the live positions use: sequence b's first ceil(total[b] / page_size)
        # (as many as its row has; a longer sequence is refused below), in row order
        n_used = -(-total // page_size) if page_size else np.zeros(B, np.int64)
        used = bt[np.arange(bt.shape[1]) < n_used[:, None]]
        if used.size:
            lo, hi = _min_max(used)
            if lo < 0 or hi >= n_slots:
                bad = used[(used < 0) | (used >= n_slots)][:8].tolist()
                raise ValueError(f"{fn}: block_table entries must be pages in [0, {n_slots}), "
                                 f"got {bad} among the pages in use")
            distinct = (len(set(used.tolist())) if used.size <= 4096
                        else np.unique(used).size)
            if distinct != used.size:
                raise ValueError(f"{fn}: block_table gives the same page to more than one "
                                 f"position of the live sequences (pages in use: "
                                 f"{used.tolist()[:32]})")
    else:
        capacity = slot_len
        if cache_batch_idx is None:
            rows = np.arange(B)
            if B > n_slots:
                raise ValueError(f"{fn}: q has batch {B} but the cache only {n_slots} rows; pass "
                                 f"cache_batch_idx")
        else:
            rows = _int_vector(cache_batch_idx, "cache_batch_idx", B, fn)
            if rows.size and _min_max(rows)[1] >= n_slots:
                raise ValueError(f"{fn}: cache_batch_idx entries must be < B_cache = {n_slots}, "
                                 f"got {rows.tolist()[:16]}")
            if Lnew and len(set(rows.tolist())) != rows.size:
                raise ValueError(f"{fn}: cache_batch_idx must be distinct when k/v are written, "
                                 f"got {rows.tolist()[:16]}")
    if total.size and _min_max(total)[1] > capacity:
        b = int(np.argmax(total))
        raise ValueError(f"{fn}: cache_seqlens[{b}] + Lnew = {int(lens[b])} + {Lnew} exceeds the "
                         f"cache's capacity of {capacity} tokens per sequence")
    rot = _rotary_tables(rotary_cos, rotary_sin, E, fn)
    # A window side at least the cache's capacity per sequence is no side, as flash_api.cpp
    # has it (it sets a side >= seqlen_k to -1): for the mask, and for q's rotary positions,
    # which are cache_seqlens + i when causal or local (a side left), else all cache_seqlens.
    window = tuple(None if w is None or w >= capacity else w for w in check_window(window, fn))
    banded = bool(is_causal) or window != (None, None)
    if rot is not None and k is None:
        # flash-attn refuses this too: with no new token, q's position is ambiguous (at
        # cache_seqlens it would sit one past the last key, where causal puts the last query)
        raise ValueError(f"{fn}: rotary_cos/rotary_sin rotate the new keys and q at their "
                         f"positions and need k and v (of length 0 for none), got k=None")
    if rot is not None:
        need = int((lens + max(Lnew, Lq if banded else min(Lq, 1))).max(initial=0))
        if need > rot[0].shape[0]:
            raise ValueError(f"{fn}: rotary_cos/rotary_sin have {rot[0].shape[0]} positions, the "
                             f"call needs {need}")

    # ---- the problem that reads the cache where it is: the whole batch in one kernel call.
    # Its construction checks every option of the attention itself, and choosing its backend
    # checks that the backend reads it, before anything is written. A cache the kernels cannot
    # address (head_dim not contiguous, strides not whole elements) is read from a contiguous
    # copy, which takes the new tokens too.
    if paged:
        kv_rows, table = slice(None), block_table
    elif cache_batch_idx is not None:
        # cache row rows[b] serves sequence b: a paged cache of one page per sequence
        kv_rows, table = slice(None), rows.astype(np.int32).reshape(B, 1)
    else:
        kv_rows, table = slice(0, B), None
    k_read = k_cache if _kernel_layout(k_cache) else np.ascontiguousarray(k_cache)
    v_read = v_cache if _kernel_layout(v_cache) else np.ascontiguousarray(v_cache)
    compute = np.dtype(np.float32) if kind.low else q.dtype
    tr = (0, 2, 1, 3)
    problem = make_cache_problem(
        q.astype(compute, copy=False).transpose(tr), k_read[kv_rows].transpose(tr),
        v_read[kv_rows].transpose(tr), seqlens=total, block_table=table, is_causal=is_causal,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, scale=scale,
        kv_kind=kind.code,
        k_scale=None if k_scale is None else k_scale[kv_rows].transpose(0, 2, 1),
        v_scale=None if v_scale is None else v_scale[kv_rows].transpose(0, 2, 1), fn=fn)
    be = _in_place_backend(problem, backend)
    if not B * Lq * Hq * E * Ev or not capacity:
        # degenerate sizes, or a cache of no slots (every sequence then attends no key; with
        # cache_batch_idx it is a paged cache of page_size 0, which the kernels refuse): the
        # NumPy code handles each edge
        be = _backends.registry["numpy"]

    # ---- write the new tokens (every check is done; int8 codes are made before any write,
    # so a non-finite token is refused with nothing written) ----
    if k is not None and Lnew:
        kn = k
        if rot is not None:
            pos = lens[:, None] + np.arange(Lnew)         # (B, Lnew) absolute positions
            kn = _rotate(_wide(k).reshape(B * Lnew, Hkv, E), pos.reshape(-1), *rot,
                         rotary_interleaved).reshape(k.shape)
        kc, ks = _kvdtypes.encode(kind, kn, k_cache.dtype, "k", fn)
        vc, vs = _kvdtypes.encode(kind, v, v_cache.dtype, "v", fn)
        where = (block_table, None) if paged else (None, rows)
        targets = {id(given["k_cache"]): (given["k_cache"], given["v_cache"])}
        # the arrays read (a converted copy of a cache in the other byte order, a contiguous
        # copy of one the kernels cannot address) take the tokens too
        targets.setdefault(id(k_read), (k_read, v_read))
        for kt, vt in targets.values():
            _write_new(((kt, kc), (vt, vc)), lens, *where)
        if ks is not None:
            _write_new(((k_scale, ks), (v_scale, vs)), lens, *where)

    # ---- attend: one kernel call ----
    if rot is not None:
        qpos = lens[:, None] + (np.arange(Lq)[None, :] if banded else 0)
        qpos = np.broadcast_to(qpos, (B, Lq))
        qr = _rotate(_wide(q).reshape(B * Lq, Hq, E), qpos.reshape(-1), *rot,
                     rotary_interleaved)
        problem.q = np.ascontiguousarray(
            qr.reshape(B, Lq, Hq, E).astype(compute, copy=False).transpose(tr))
    problem = for_kernels(problem)[0]        # scale <= 0 rewritten, same scores
    out, lse = be.forward(problem)
    out = out.transpose(tr)
    if out.dtype != q.dtype:                  # a low-precision cache: out in q's dtype
        with np.errstate(over="ignore"):     # float16 beyond 65504 is inf, its own answer
            out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# packed ragged batches
# ----------------------------------------------------------------------------------------------
def _cu_seqlens(cu, name: str, total: int, fn: str) -> np.ndarray:
    arr = cu if isinstance(cu, np.ndarray) else None
    if arr is None or arr.dtype != np.int32 or arr.ndim != 1 or arr.size < 1:
        raise TypeError(f"{fn}: {name} must be a 1-D int32 array (batch + 1,), got {describe(cu)}")
    c = arr.astype(np.int64)
    if c[0] != 0 or np.any(np.diff(c) < 0):
        raise ValueError(f"{fn}: {name} must start at 0 and be non-decreasing, got "
                         f"{arr.tolist()[:16]}")
    if c[-1] != total:
        raise ValueError(f"{fn}: {name}[-1] = {int(c[-1])} must equal the packed length {total}")
    return c


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, fn):
    q = _heads_layout(q, "q", fn, 3)
    k = _heads_layout(k, "k", fn, 3)
    v = _heads_layout(v, "v", fn, 3)
    check_same_dtype(fn, q=q, k=k, v=v)
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: q (total_q, Hq, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev) "
                         f"do not fit together: {q.shape}, {k.shape}, {v.shape}")
    cq = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], fn)
    ck = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], fn)
    if cq.size != ck.size:
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {cq.size - 1} and {ck.size - 1}")
    for name, cu, mx in (("max_seqlen_q", cq, max_seqlen_q), ("max_seqlen_k", ck, max_seqlen_k)):
        if mx is not None and cu.size > 1 and np.diff(cu).max() > mx:
            raise ValueError(f"{fn}: a sequence is longer than {name} = {mx} "
                             f"(longest: {int(np.diff(cu).max())})")
    return q, k, v, cq, ck


def _varlen_window(window, ck: np.ndarray, max_seqlen_k, fn: str):
    """flash-attn's rule (mha_varlen_fwd/bwd): a window side >= max_seqlen_k (the longest key
    sequence when not given) is no side."""
    cap = max_seqlen_k if max_seqlen_k is not None else int(np.diff(ck).max(initial=0))
    return tuple(None if w is None or w >= cap else w for w in check_window(window, fn))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, is_causal=False, window=None, softcap=None,
                     alibi_slopes=None, sinks=None, scale=None, return_lse=False, backend=None):
    """Attention over a packed ragged batch (flash-attn's varlen layout).

    q (total_q, Hq, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev): the sequences one after the
    other; sequence i is q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] against
    k[cu_seqlens_k[i]:cu_seqlens_k[i+1]] (int32 arrays of batch + 1 offsets). Each sequence
    attends only within itself; is_causal is bottom-right per sequence (flash-attn). GQA when
    Hq != Hkv. window, softcap, alibi_slopes ((Hq,) or (batch, Hq)), sinks, scale as in
    scaled_dot_product_attention, except that a window side >= max_seqlen_k (the longest key
    sequence when not given) is no side, as in flash-attn. max_seqlen_q/k are optional checks
    (flash-attn needs them to size its grid). Returns out (total_q, Hq, Ev), and lse (Hq, total_q) when return_lse.
    """
    fn = "varlen_attention"
    q, k, v, cq, ck = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, fn)
    window = _varlen_window(window, ck, max_seqlen_k, fn)
    n_seq, Hq, Hkv = cq.size - 1, q.shape[1], k.shape[1]
    opts = _sequence_options(is_causal, window, softcap, sinks, scale, Hq != Hkv, backend)
    alibis = [_alibi_row(alibi_slopes, i, n_seq, Hq, fn) for i in range(n_seq)]
    out = np.empty(q.shape[:2] + (v.shape[2],), q.dtype)
    lse = np.empty((Hq, q.shape[0]), np.float64 if q.dtype == np.float64 else np.float32)
    for i in range(n_seq):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        o, s = scaled_dot_product_attention(
            q[qs].transpose(1, 0, 2), k[ks].transpose(1, 0, 2), v[ks].transpose(1, 0, 2),
            alibi_slopes=alibis[i], return_lse=True, **opts)
        out[qs] = o.transpose(1, 0, 2)
        lse[:, qs] = s
    return (out, lse) if return_lse else out


def varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, is_causal=False, window=None,
                              softcap=None, alibi_slopes=None, sinks=None, scale=None,
                              backend=None):
    """Gradients (dq, dk, dv) of varlen_attention, packed like q, k, v (and dsinks, summed over
    the sequences, as a fourth value when sinks are given). out and lse are the forward's
    (return_lse=True); every other argument must be what the forward was called with."""
    fn = "varlen_attention_backward"
    q, k, v, cq, ck = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, fn)
    window = _varlen_window(window, ck, max_seqlen_k, fn)
    n_seq, Hq, Hkv = cq.size - 1, q.shape[1], k.shape[1]
    g = as_float_array(grad_out, "grad_out", fn)
    o = as_float_array(out, "out", fn)
    want = q.shape[:2] + (v.shape[2],)
    for name, arr in (("grad_out", g), ("out", o)):
        if arr.shape != want:
            raise ValueError(f"{fn}: {name} must have shape {want}, got {arr.shape}")
    s = as_float_array(lse, "lse", fn)
    if s.shape != (Hq, q.shape[0]):
        raise ValueError(f"{fn}: lse must have shape (Hq, total_q) = {(Hq, q.shape[0])}, got "
                         f"{s.shape}")
    opts = _sequence_options(is_causal, window, softcap, sinks, scale, Hq != Hkv, backend)
    alibis = [_alibi_row(alibi_slopes, i, n_seq, Hq, fn) for i in range(n_seq)]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = None
    for i in range(n_seq):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        t = lambda x: x.transpose(1, 0, 2)                        # noqa: E731
        grads = scaled_dot_product_attention_backward(
            t(g[qs]), t(q[qs]), t(k[ks]), t(v[ks]), t(o[qs]), s[:, qs],
            alibi_slopes=alibis[i], **opts)
        dq[qs], dk[ks], dv[ks] = t(grads[0]), t(grads[1]), t(grads[2])
        if len(grads) > 3:
            dsinks = grads[3] if dsinks is None else dsinks + grads[3]
    if sinks is not None:
        if dsinks is None:
            dsinks = np.zeros(np.shape(sinks), np.asarray(sinks).dtype)
        return dq, dk, dv, dsinks
    return dq, dk, dv
