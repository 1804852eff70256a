"""The per-token path of KVCache.attend: append and attend without re-deciding what cannot change.

A model's decode loop calls `cache.attend(q, k, v, rotary_cos=..., rotary_sin=...)` once per
layer per token with the same shapes. attention_with_kvcache checks the cache's layout, dtypes,
lengths, page table and every option, builds a Problem and chooses a backend on every call;
for a small model (glassllm: 4 query heads of 32 dims) that Python costs many times the kernel.
A KVCache owns its arrays, so most of it is a fact of the cache, decided once.

After a call of KVCache.attend went the full way (attention_with_kvcache), `remember` leaves a
plan for its key: the shapes and dtypes of q, k, v and the rotary tables, rotary_interleaved, and
the cache's arrays (by identity; the page table by value). A plan is made only for calls whose
options are rotary or none (causal bottom-right, default scale, no lse) on a backend that reads
the cache in place, so everything the full path checked is a function of the key except what
`attend` checks on every call: the cache's arrays and their writeability, the page table, the
lengths (room for the new tokens; rotary positions), and the backend choice's state (as
fastattn._fastpath does). Anything else -- another option, a length over capacity, a changed
page table -- goes the full way, so every error still comes from there with its message, before
anything is written.
"""
from __future__ import annotations

import numpy as np

from . import _backends, _config, _fastpath, _kvdtypes, _process, _tuning
from ._inputs import for_kernels, lse_dtype, make_cache_problem
from .inference import _in_place_backend, _min_max, _rotate, _write_new

_ndarray = np.ndarray
_ALLOWED = {"rotary_cos", "rotary_sin", "rotary_interleaved"}
MISS = object()                       # attend's answer when the call must go the full way


def _key(cache, q, k, v, options):
    """The plan key of a call, or None when the call is not of the planned kind."""
    if (k is None or type(q) is not _ndarray or type(k) is not _ndarray
            or type(v) is not _ndarray or not options.keys() <= _ALLOWED):
        return None
    cos, sin = options.get("rotary_cos"), options.get("rotary_sin")
    rot = None
    if cos is not None or sin is not None:
        if type(cos) is not _ndarray or type(sin) is not _ndarray:
            return None
        rot = (cos.shape, cos.dtype, sin.shape, sin.dtype)
    inter = options.get("rotary_interleaved", False)
    if not (inter is False or inter is True):
        return None
    # q, k, v in the cache's dtype; for a float16/bfloat16/int8 cache (computed in float32)
    # all float32 or all float64
    dt = cache.dtype
    if dt not in _FULL:
        dt = q.dtype
        if dt not in _FULL:
            return None
    if q.dtype != dt or k.dtype != dt or v.dtype != dt:
        return None
    return (q.shape, q.dtype, k.shape, v.shape, rot, inter)


_FULL = (np.dtype(np.float32), np.dtype(np.float64))
_F32 = np.dtype(np.float32)


class _Plan:
    __slots__ = ("key", "k_cache", "v_cache", "table", "table_bytes", "be", "kernel", "record",
                 "state", "decode", "threads", "row_bytes", "steps", "rows", "out_shape",
                 "lse_dtype", "kind", "k_scale", "v_scale")


def remember(cache, q, k, v, options) -> None:
    """After a successful full call of cache.attend(q, k, v, **options): plan its key."""
    cache._plan = None
    key = _key(cache, q, k, v, options)
    kind = _kvdtypes.kind_of(cache.dtype)
    if key is None or kind is None or not cache.dtype.isnative:
        return
    B, n, Hq, E = q.shape
    if n != k.shape[1] or n == 0 or q.size == 0 or v.shape[3] == 0:
        return
    table = cache.block_table
    if table is not None and table.size and (
            table.min() < 0 or table.max() >= cache.k.shape[0]
            or np.unique(table).size != table.size):
        # the full path checked only the pages in use so far; attend() writes into later
        # columns unchecked, so a plan needs every entry to be a page of its own
        return
    tr = (0, 2, 1, 3)
    ks, vs = cache.k_scale, cache.v_scale
    compute = _F32 if kind.low else q.dtype
    problem = make_cache_problem(
        np.ascontiguousarray(q.transpose(tr), dtype=compute), cache.k.transpose(tr), cache.v.transpose(tr),
        seqlens=cache.seqlens, block_table=cache.block_table, is_causal=True,
        kv_kind=kind.code, k_scale=None if ks is None else ks.transpose(0, 2, 1),
        v_scale=None if vs is None else vs.transpose(0, 2, 1), fn="attention_with_kvcache")
    try:
        be = _in_place_backend(problem, None)
    except _backends.BackendUnavailableError:
        return
    if not hasattr(be, "forward_plan"):
        return
    problem, factor = for_kernels(problem)
    if factor is not None:
        return
    kernel, record = be.forward_plan(problem)
    plan = _Plan()
    plan.key = key
    plan.k_cache, plan.v_cache = cache.k, cache.v
    plan.kind, plan.k_scale, plan.v_scale = kind, ks, vs
    plan.table = None if cache.block_table is None else cache.block_table.copy()
    # a small table is compared by its bytes (~0.5 us; np.array_equal took ~5)
    plan.table_bytes = (plan.table.tobytes() if plan.table is not None
                        and plan.table.size <= 4096 else None)
    plan.be, plan.kernel, plan.record = be, kernel, record
    plan.state = _fastpath._state(be)
    plan.decode = kernel is be._decode_kernel
    plan.threads = _config.num_threads() if plan.decode else record.n_threads
    Hkv = cache.k.shape[2]
    plan.row_bytes = Hkv * ((cache.k.shape[3] + cache.v.shape[3]) * cache.k.itemsize
                            + (8 if ks is not None else 0))
    plan.steps = np.arange(n)
    plan.rows = np.arange(B)
    plan.out_shape = (B, Hq, n, cache.v.shape[3])
    plan.lse_dtype = lse_dtype(problem.dtype)
    cache._plan = plan


def attend(cache, q, k, v, options):
    """cache.attend through its plan: the result, or MISS (nothing written) when the call has
    no valid plan."""
    plan = cache._plan
    if plan is None or _key(cache, q, k, v, options) != plan.key:
        return MISS
    be = plan.be
    ctx, proc, settings, tune, reg = plan.state
    if not (_backends._context_choice.get() is ctx and _backends._process_choice is proc
            and _config._settings is settings and _tuning._current.get() is tune
            and _backends.registry.get(be.name) is be):
        return MISS
    kc, vc, table = cache.k, cache.v, cache.block_table
    if kc is not plan.k_cache or vc is not plan.v_cache or not (
            kc.flags.writeable and vc.flags.writeable):
        return MISS
    kind = plan.kind
    if kind.scaled and (cache.k_scale is not plan.k_scale or cache.v_scale is not plan.v_scale
                        or not (plan.k_scale.flags.writeable and plan.v_scale.flags.writeable)):
        return MISS
    if table is not None and not (
            table.dtype == np.int32 and table.shape == plan.table.shape
            and (table.tobytes() == plan.table_bytes if plan.table_bytes is not None
                 else np.array_equal(table, plan.table))):
        return MISS
    lens = cache.seqlens
    n = q.shape[1]
    if type(lens) is not _ndarray or lens.dtype != np.int32 or lens.shape != (q.shape[0],):
        return MISS                   # replaced by the user: the full path checks it
    lo, hi = _min_max(lens)          # (Python ints: NumPy's reductions cost ~3 us each here)
    if not (lo >= 0 and hi + n <= cache.capacity):
        return MISS
    cos = options.get("rotary_cos")
    if cos is not None and hi + n > cos.shape[0]:
        return MISS                   # the rotary tables lack positions: the full path says so
    total = lens + np.int32(n)
    # ---- write the new tokens (every check is done) ----
    B, _, Hq, E = q.shape
    if cos is not None:
        flat = (lens[:, None] + plan.steps).reshape(-1)      # absolute positions
        sin, inter = options["rotary_sin"], options.get("rotary_interleaved", False)
        k = _rotate(k.reshape(B * n, k.shape[2], E), flat, cos, sin, inter).reshape(k.shape)
        q = _rotate(q.reshape(B * n, Hq, E), flat, cos, sin, inter).reshape(q.shape)
    if kind.low:
        # cast, or quantize (int8: a NaN or Inf token goes the full way, which refuses it
        # before anything is written)
        if kind.scaled and not (np.isfinite(k).all() and np.isfinite(v).all()):
            return MISS
        k, ks = _kvdtypes.encode(kind, k, kc.dtype, "k", "attention_with_kvcache")
        v, vs = _kvdtypes.encode(kind, v, vc.dtype, "v", "attention_with_kvcache")
        if ks is not None:
            _write_new(((plan.k_scale, ks), (plan.v_scale, vs)), lens, table, plan.rows)
    _write_new(((kc, k), (vc, v)), lens, table, plan.rows)
    # ---- attend: the planned kernel with this call's q and lengths ----
    threads = plan.threads
    if plan.decode and threads > 1:   # the rule of CompiledBackend.decode_threads
        keys = sum(total.tolist()) if B <= 64 else int(total.sum())
        threads = be.threads_for_decode_bytes(keys * plan.row_bytes, threads)
    compute = plan.lse_dtype          # (float32 or float64: the compute dtype)
    record = plan.record._replace(q=np.ascontiguousarray(q.transpose(0, 2, 1, 3),
                                                         dtype=compute),
                                  seqlens=total, n_threads=threads)
    out = np.empty(plan.out_shape, compute)
    lse = np.empty(plan.out_shape[:3], plan.lse_dtype)
    _process.note_pool_used()
    plan.kernel(record, out, lse)
    lens[:] = total
    out = out.transpose(0, 2, 1, 3)
    return out if out.dtype == q.dtype else out.astype(q.dtype)   # float64 q, low cache
