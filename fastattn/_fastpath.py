"""Call plans: the per-token path of scaled_dot_product_attention.

A decode loop calls attention thousands of times with the same few shapes and options, and its
kernel takes ~1 us; the full path (make_problem's checks, the Problem, resolve, the kernel
record) costs several times that in Python. So a call that went the full way with options that
need no per-call array of their own (no mask, softcap, ALiBi, sinks or dropout) leaves a plan:
the backend, its kernel, and the kernel record without q/k/v. A later call with the same key --
the shapes except the key count S, dtype, scale, is_causal, enable_gqa, causal_alignment, window
and backend= argument -- reuses it; a call with another S (a decode loop's growing cache) gets
the band, K/V strides and decode threads make_problem and the backend would give it.

Correctness rests on two things:
- A plan is made only after the full path accepted the same key, and everything make_problem
  checks is a function of the key (the shapes, dtype and scalars; of S only that K and V agree
  on it and that it is not 0, which run() checks), except the array types and
  layout, which are checked here on every call (exact ndarrays of one native float32/float64
  dtype; other layouts are made contiguous as make_problem does, except K/V views -- a cache's
  prefix cache[:, :, :t+1], every other head, (B, S, H, E) storage transposed -- which a
  backend that reads K/V through the record's strides gets as they are, with the bits of
  contiguous copies). Every error therefore still comes from the
  full path, with its message.
- The backend choice is a function of state outside the call (use_backend, set_backend, the
  environment's reading, the registry, the tuning block), so a plan remembers the state it was
  made under and is used only while that state is the same object for object. A fork() child
  starts with no plans (numba's availability changes there).
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from . import _backends, _config, _process
from ._backends._compiled import CompiledBackend, band_keys
from ._backends._kernel_args import KernelArgs, forward_outputs
from ._inputs import Problem, check_window, lse_dtype, make_band
from . import _tuning
from ._tuning import current_tuning

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_ndarray = np.ndarray
_ascontiguous = np.ascontiguousarray
_new_record = tuple.__new__
_context_choice = _backends._context_choice
_registry = _backends.registry
_empty = np.empty
_pool_state = _process._state
_tuning_var = _tuning._current            # current_tuning() is _tuning_var.get()

# Problem fields a plan's key determines, or that are the per-call arrays; every other field
# must have its default for a call to be planned.
_KEYED = {"q", "k", "v", "scale", "band", "in_dtype", "out_shape", "lse_shape"}
_OPTION_FIELDS = tuple(f for f in dataclasses.fields(Problem) if f.name not in _KEYED)
assert all(f.default is not dataclasses.MISSING for f in _OPTION_FIELDS)

# key -> (backend, kernel, record tail, state, out shape, lse shape, lse dtype, reads K/V views,
#         the S of the tail, S -> (band, threads))
_plans: dict = {}
# A program with many shapes (batch sizes, prompt lengths) makes many plans; the dict is emptied
# when it gets this big (a plan is rebuilt by one full call).
MAX_PLANS = 512


def plan_key(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
             window, backend):
    """The plan key of a call, or None when the call is not of the planned kind.

    Only exact types make a key: `True == 1` and `1 == 1.0` hash alike, so a bool where a
    number is expected (or a number where a bool is) must not find the plan of a valid call."""
    if type(query) is not _ndarray or type(key) is not _ndarray or type(value) is not _ndarray:
        return None
    dt = query.dtype
    if not ((dt is _F32 or dt is _F64) and key.dtype is dt and value.dtype is dt
            and query.ndim == 4):     # (B, H, N, D): the kernels' layout, results as they are
        return None
    tp = type(dropout_p)
    if not ((tp is float or tp is int) and dropout_p == 0):
        return None
    if not ((is_causal is False or is_causal is True)
            and (enable_gqa is False or enable_gqa is True)
            and type(causal_alignment) is str
            and (backend is None or type(backend) is str)):
        return None
    if scale is not None:
        tp = type(scale)
        if not (tp is float or tp is int):
            return None
    if window is not None:            # a (left, right) tuple of ints or None (a decode loop
        if type(window) is not tuple or len(window) != 2:       # over a preallocated cache
            return None                                         # passes window=(0, t))
        left, right = window
        if not ((left is None or type(left) is int) and (right is None or type(right) is int)):
            return None
    # S is not in the key: a decode loop over a growing cache reuses one plan (run() gives the
    # record the band, strides and threads of each call's S)
    ks, vs = key.shape, value.shape
    return (query.shape, (ks[0], ks[1], ks[3]), (vs[0], vs[1], vs[3]), dt is _F64, scale,
            is_causal, enable_gqa, causal_alignment, window, backend)


def _state(backend_obj):
    return (_context_choice.get(), _backends._process_choice, _config._settings,
            current_tuning(), _registry.get(backend_obj.name))


def run(pkey, query, key, value):
    """(out, lse) of the call through its plan, or None when there is no valid plan."""
    plan = _plans.get(pkey)
    if plan is None:
        return None
    be, kernel, tail, state, out_shape, lse_shape, lse_dt, reads_views, S0, per_S = plan
    ctx, proc, settings, tune, reg = state
    if not (_context_choice.get() is ctx and _backends._process_choice is proc
            and _config._settings is settings and _tuning_var.get() is tune
            and _registry.get(be.name) is be):
        return None
    S = key.shape[2]
    if value.shape[2] != S or not S:
        return None                            # the full path's error, or its empty result
    dt = query.dtype
    out = _empty(out_shape, dt)
    lse = _empty(lse_shape, lse_dt)
    strides = None
    if reads_views and not (key.flags.c_contiguous and value.flags.c_contiguous):
        ks, vs = _view_strides(key), _view_strides(value)
        if ks is not None and vs is not None:
            strides = (ks, vs)
    if strides is None:                        # copied, as make_problem does
        key, value = _ascontiguous(key), _ascontiguous(value)
        if S != S0:
            strides = (_c_strides(key.shape), _c_strides(value.shape))
    if strides is not None or S != S0:
        tail = _retail(tail, strides, per_S(S) if S != S0 else None)
    _pool_state["pool_used"] = True           # _process.note_pool_used(), inline
    kernel(_new_record(KernelArgs, (_ascontiguous(query), key, value) + tail), out, lse)
    return out, lse


# positions of fields in a plan's record tail (the record without q, k, v)
_TAIL = {name: KernelArgs._fields.index(name) - 3
         for name in ("k_strides", "v_strides", "q_offset", "win_left", "win_right", "n_threads")}


def _c_strides(shape):
    """Element strides (b, h, s) of a C-contiguous (B, H, S, E) array."""
    _, H, S, E = shape
    return (H * S * E, S * E, E)


def _view_strides(x):
    """Element strides (b, h, s) of a K or V view the kernels can read in place, else None.

    In place: aligned, the head_dim axis contiguous, no negative stride. Heads side by side
    ((B, S, H, E) storage transposed, as split_heads gives, or a head broadcast) are read in
    place too: the kernels walk such K/V head by head, as a contiguous array (a walk over all
    heads of a key block at once is for KV cache calls only, csrc/decode.pxi
    dec_heads_together), so a planned call gives the bits of the first call of its key, which
    make_problem served from a contiguous copy. (The copy cost more than the call: an MHA
    decode of 12 heads x 1024 keys, d = 64, from (1, S, 12, 64) views took ~5 ms, ~70x the
    kernel.)"""
    st = x.strides
    item = x.itemsize
    if not x.flags.aligned or (x.shape[3] > 1 and st[3] != item):
        return None
    sb, sh, ss = st[0], st[1], st[2]
    if sb < 0 or sh < 0 or ss < 0 or sb % item or sh % item or ss % item:
        return None
    return (sb // item, sh // item, ss // item)


def _retail(tail, strides, band_threads):
    """The plan's record tail with this call's K/V strides and, for another key count than the
    plan's, its band and threads."""
    tail = list(tail)
    if strides is not None:
        tail[_TAIL["k_strides"]], tail[_TAIL["v_strides"]] = strides
    if band_threads is not None:
        band, threads = band_threads
        tail[_TAIL["q_offset"]] = band.q_offset
        tail[_TAIL["win_left"]] = band.left
        tail[_TAIL["win_right"]] = band.right
        tail[_TAIL["n_threads"]] = threads
    return tuple(tail)


def _per_key_count(pkey, p, be, kernel, record):
    """S -> (band, threads) of a call of this plan's key with S keys: what make_problem and the
    backend's forward_plan give it (the band from the same cached make_band; decode threads
    from the keys the band reads, as CompiledBackend.decode_threads counts them)."""
    B, Hkv, _, E = p.k.shape
    L = p.q.shape[2]
    row_bytes = B * Hkv * (E + p.v.shape[3]) * p.k.itemsize
    is_causal, alignment = bool(pkey[5]), pkey[7]
    win = check_window(pkey[8], "scaled_dot_product_attention")
    decode = kernel is be._decode_kernel
    threads = _config.num_threads()
    fixed = record.n_threads

    def per_S(S):
        band = make_band(L, S, is_causal, alignment, win)
        if not decode:
            return band, fixed
        return band, be.threads_for_decode_bytes(band_keys(L, S, band) * row_bytes, threads)
    return per_S


def forward_and_plan(pkey, p, be):
    """be.forward(p) for a call that went the full way, leaving the plan of its key when the
    call can have one: Problem `p` (as the kernels take it, unrewritten) served by a compiled
    backend. The kernel and record it runs are the plan's, built once."""
    if not _plannable(pkey, p, be):
        return be.forward(p)
    state = _state(be)
    kernel, record = be.forward_plan(p)
    out, lse = forward_outputs(p)
    _process.note_pool_used()
    kernel(record, out, lse)
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[pkey] = (be, kernel, tuple(record[3:]), state, tuple(p.out_shape),
                    tuple(p.lse_shape), lse_dtype(p.dtype), _reads_views(be), p.k.shape[2],
                    _per_key_count(pkey, p, be, kernel, record))
    return out, lse


def _reads_views(be) -> bool:
    """Whether the backend's forward and decode kernels read K/V through the record's strides
    (a KV cache in place), so a planned call passes a view such as cache[:, :, :t+1] as it is
    instead of copying it (the copy was most of a small decode step's time)."""
    return "kv_strides" not in be.unsupported_options


def _plannable(pkey, p, be) -> bool:
    if not isinstance(be, CompiledBackend) or type(be).forward is not CompiledBackend.forward:
        return False                  # the numpy backend, or a backend with its own forward
    if "forward" in vars(be):
        return False                  # an instance whose forward was replaced
    if p.is_empty or p.q.shape[3] == 0:
        return False                  # served by the numpy backend
    if pkey[0] != p.q.shape or p.out_shape != p.q.shape[:3] + p.v.shape[3:]:
        return False                  # not the kernels' layout (plan_key asks for 4-D arrays)
    for f in _OPTION_FIELDS:          # every option at its default (also fields added later)
        value = getattr(p, f.name)
        if value is not f.default and (f.default is None or value != f.default):
            return False
    return True


def clear() -> None:
    _plans.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=clear)
