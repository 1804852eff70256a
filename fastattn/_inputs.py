"""Checking user input and building the canonical problem the backends compute.

Everything that is Python-level (dtype rules, broadcasting, defaults, strides) happens here once,
so a backend only ever sees C-contiguous float32/float64 arrays and plain scalars.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
ALIGNMENTS = ("top_left", "bottom_right")


# ----------------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------------
def compute_dtype(dtype: np.dtype) -> np.dtype | None:
    """The dtype kernels compute in for an input dtype, or None when the dtype is unsupported.

    float16 and bfloat16 compute in float32 (their own range overflows in Q.K^T) and the result is
    cast back; float32 and float64 compute in their own precision.
    """
    known = _COMPUTE_DTYPE.get(dtype)       # every call checks q, k and v: skip np.dtype()
    if known is not None:
        return known
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return np.dtype(np.float64)
    if dtype in (np.float32, np.float16) or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return None


_COMPUTE_DTYPE = {np.dtype(np.float32): np.dtype(np.float32),
                  np.dtype(np.float64): np.dtype(np.float64),
                  np.dtype(np.float16): np.dtype(np.float32)}


def describe(x) -> str:
    """A short description of an argument for error messages."""
    if isinstance(x, np.ndarray):
        return f"array of shape {x.shape} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:120]


def native_byte_order(arr: np.ndarray) -> np.ndarray:
    """arr in the machine's byte order (a converted copy only for a non-native one).

    A big-endian file read with np.load gives '>f4' arrays: the same numbers, which the kernels
    (and the dtype rules) only know in native order.
    """
    if arr.dtype.isnative:
        return arr
    return arr.astype(arr.dtype.newbyteorder("="))


def as_float_array(x, name: str, fn: str) -> np.ndarray:
    """x as an ndarray of a supported float dtype, or TypeError naming the argument."""
    if isinstance(x, np.ndarray):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"{fn}: {name} must be an array of floats, got {describe(x)} ({exc})") from None
    if not arr.dtype.isnative:
        arr = native_byte_order(arr)
    if compute_dtype(arr.dtype) is None:
        raise TypeError(
            f"{fn}: {name} must have a float dtype (float16, bfloat16, float32 or float64), "
            f"got {arr.dtype} (shape {arr.shape})")
    return arr


def check_same_dtype(fn: str, **arrays: np.ndarray) -> np.dtype:
    first = None
    for a in arrays.values():            # the usual call: one dtype object for all of them
        if first is None:
            first = a.dtype
        elif a.dtype is not first:
            break
    else:
        if first is not None:
            return first
    dtypes = {name: a.dtype for name, a in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name} {dt}" for name, dt in dtypes.items())
        raise TypeError(f"{fn}: {', '.join(dtypes)} must have the same dtype, got {listed}")
    return next(iter(dtypes.values()))


def lse_dtype(compute: np.dtype) -> np.dtype:
    return np.dtype(np.float64 if compute == np.float64 else np.float32)


# ----------------------------------------------------------------------------------------------
# scalar options
# ----------------------------------------------------------------------------------------------
def _real(x, name: str, fn: str) -> float:
    if type(x) is float or type(x) is int:      # the usual case, without the ABC check
        return float(x)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{fn}: {name} must be a real number, got {describe(x)}")
    return float(x)


def check_scale(scale, head_dim: int, fn: str, dtype=None) -> float:
    """The score scale: any finite number (torch's rule: negative and zero scales are allowed).

    With `dtype` (the compute dtype), a scale beyond its range is rejected: it would be inf in the
    kernels, and inf * 0 = NaN, inf * x = +-inf, not the answer the math gives.
    """
    if scale is None:
        # 1/sqrt(E) as in torch; E == 0 has no meaningful default, every score is 0 anyway.
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    value = _real(scale, "scale", fn)
    if not math.isfinite(value):
        raise ValueError(f"{fn}: scale must be a finite number, got {scale!r}")
    if dtype is not None:
        top = float(np.finfo(dtype).max)
        if abs(value) > top:
            raise ValueError(
                f"{fn}: scale={scale!r} is beyond the range of the compute dtype "
                f"{np.dtype(dtype).name} (max {top:.6g})")
    return value


def check_softcap(softcap, fn: str, dtype=None) -> float:
    """The softcap (0.0 = off), any finite number > 0 the compute dtype `dtype` can hold.

    s / softcap must stay finite-divisible: a softcap below the dtype's smallest normal number
    rounds to 0 or a subnormal in the kernels (division by zero, or 1/softcap = inf), and one
    above its max is inf (inf * tanh(s / inf) = NaN). Both are rejected, naming the range.
    """
    if softcap is None:
        return 0.0
    value = _real(softcap, "softcap", fn)
    if value == 0.0:
        return 0.0
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{fn}: softcap must be None, 0 or a finite number > 0, got {softcap!r}")
    if dtype is not None:
        info = np.finfo(dtype)
        if not float(info.tiny) <= value <= float(info.max):
            raise ValueError(
                f"{fn}: softcap={softcap!r} is outside the range of the compute dtype "
                f"{np.dtype(dtype).name}: it must be in [{float(info.tiny):.6g}, "
                f"{float(info.max):.6g}] (or None/0 for no softcap)")
    return value


def check_dropout(dropout_p, fn: str) -> float:
    value = _real(dropout_p, "dropout_p", fn)
    if not (0.0 <= value < 1.0):
        raise ValueError(f"{fn}: dropout_p must be in [0, 1), got {dropout_p!r}")
    return value


def dropout_seed(rng, fn: str) -> int:
    """A uint32 seed for the dropout hash from an int seed, a Generator, or fresh entropy (None)."""
    if rng is None:
        return int(np.random.default_rng().integers(0, 2**32, dtype=np.uint64))
    if isinstance(rng, np.random.Generator):
        return int(rng.integers(0, 2**32, dtype=np.uint64))
    if isinstance(rng, (numbers.Integral, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        if rng < 0:
            raise ValueError(f"{fn}: rng must be a non-negative int seed or a numpy Generator, got {rng!r}")
        # SeedSequence spreads any int (also > 2**32) over the 32 bits the hash uses.
        return int(np.random.SeedSequence(int(rng)).generate_state(1, np.uint32)[0])
    raise TypeError(f"{fn}: rng must be None, an int seed or a numpy.random.Generator, got {describe(rng)}")


def check_backward_rng(dropout_p, rng, fn: str) -> None:
    """The backward regenerates the forward's dropout mask from its seed: it needs that seed.

    rng=None would draw a fresh seed (the gradients of another mask, silently), and a Generator
    would draw a seed from its current state, which is the forward's only if the caller rewound
    it exactly; both are refused, asking for the int seed the forward was given.
    """
    if check_dropout(dropout_p, fn) == 0.0:
        return
    if isinstance(rng, (numbers.Integral, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        return
    got = "None" if rng is None else describe(rng)
    raise ValueError(
        f"{fn}: with dropout_p > 0 the backward needs rng = the int seed the forward was called "
        f"with (the kept weights are regenerated from it), got rng={got}; call the forward with "
        f"an int seed, e.g. rng=1234, and pass the same int here")


def check_alignment(alignment, name: str, fn: str) -> str:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"{fn}: {name} must be 'top_left' or 'bottom_right', got {alignment!r}")
    return alignment


def _window_side(x, fn: str) -> int | None:
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise TypeError(f"{fn}: window sides must be ints (or None/-1 for unbounded), got {describe(x)}")
    if x == -1:
        return None
    if x < 0:
        raise ValueError(f"{fn}: window sides must be >= 0, or None/-1 for unbounded, got {int(x)}")
    return int(x)


def check_window(window, fn: str) -> tuple[int | None, int | None]:
    """(left, right) with None meaning unbounded."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"{fn}: window must be None or a (left, right) pair, got {describe(window)}")
    return _window_side(window[0], fn), _window_side(window[1], fn)


# ----------------------------------------------------------------------------------------------
# band: causal + sliding window folded into one rule
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Band:
    """Key j may be attended by query i iff  pos_i - left <= j <= pos_i + right,  pos_i = i + q_offset.

    An unbounded side is stored as L + S + 1 so kernels can use plain int arithmetic.
    """

    q_offset: int
    left: int
    right: int
    unbounded: int

    @property
    def active(self) -> bool:
        return self.left < self.unbounded or self.right < self.unbounded

    def key_range(self, i0: int, i1: int, S: int) -> tuple[int, int]:
        """Keys [j0, j1) that rows i0..i1-1 may touch at all (the rest of the row is skipped)."""
        j0 = max(0, i0 + self.q_offset - self.left)
        j1 = min(S, i1 - 1 + self.q_offset + self.right + 1)
        return j0, max(j0, j1)


@functools.lru_cache(maxsize=256)
def make_band(L: int, S: int, is_causal: bool, alignment: str, window) -> Band:
    """The Band of a call (cached: a decode loop asks for the same few; a Band is immutable)."""
    q_offset = 0 if alignment == "top_left" else S - L
    unbounded = L + S + 1
    left, right = window
    left = unbounded if left is None else min(left, unbounded)
    right = unbounded if right is None else min(right, unbounded)
    if is_causal:
        right = min(right, 0)
    return Band(q_offset, left, right, unbounded)


# ----------------------------------------------------------------------------------------------
# the canonical problem
# ----------------------------------------------------------------------------------------------
@dataclass
class Problem:
    """One attention call, normalized. Arrays are C-contiguous in the compute dtype.

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev). The mask is 4-D (Bm, Hm, Lm, Sm), each
    dim 1 (broadcast) or full, never expanded. alibi is (Ba, Hq) with Ba in {1, B}.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    mask_kind: int = MASK_NONE
    mask: np.ndarray | None = None
    band: Band = None
    softcap: float = 0.0
    alibi: np.ndarray | None = None
    dropout_p: float = 0.0
    seed: int = 0
    sinks: np.ndarray | None = None      # (Hq,) compute dtype: softmax-denominator logits
    # Where this problem sits in a larger one, for the dropout hash: (bh0, bh_stride, row0,
    # col0) gives hash coordinates (bh0 + b * bh_stride + h, row0 + i, col0 + j); None is the
    # whole problem, (0, Hq, 0, 0). Set by callers that compute a piece (fastattn.dask).
    dropout_origin: tuple | None = None
    # Backward only. None: the kernels recompute each row's Z = sum P and D = sum P dP from
    # their own tiles (exact when k/v hold every key of the row). An array (B, Hq, L) in the
    # compute dtype: k/v are a part of the keys, lse and this D = rowsum(dout * out) belong to
    # the whole problem, and the kernels use P = exp(s - lse) and D as given (FlashAttention-2's
    # form), so the gradients are this part's share (dq summed over the parts is the whole dq).
    delta: np.ndarray | None = None
    # A KV cache read in place (fastattn.attention_with_kvcache builds these; None = off, the
    # usual dense problem). Backends that do not read one list it in unsupported_options.
    # kv_strides: ((b, h, s) of k, (b, h, s) of v), element strides of k and v, which are then
    #   strided views (last axis contiguous) instead of C-contiguous arrays: a cache stored
    #   (B, S_max, Hkv, E) is k = cache.transpose(0, 2, 1, 3), read without a copy.
    kv_strides: tuple | None = None
    # seqlens: (B,) int32. Sequence b attends only its first seqlens[b] keys, and its query
    #   row i sits at key position i + band.q_offset + seqlens[b] - S (the band of a sequence of
    #   S keys moved to end where sequence b ends: bottom-right causal per sequence).
    seqlens: np.ndarray | None = None
    # block_table: (B, max_pages) int32, a paged cache. k/v are then the pages viewed as
    #   (num_pages, Hkv, page_size, E): key j of sequence b is row j % page_size of page
    #   block_table[b, j // page_size], and S = max_pages * page_size.
    block_table: np.ndarray | None = None
    # kv_kind: the cache's storage (fastattn/_kvdtypes.py): 0 = k/v in the compute dtype;
    #   1 float16, 2 bfloat16, 3 int8 codes, read as float32 (the compute dtype is float32).
    # k_scale, v_scale: int8 only, float32 (Bk, Hkv, Sk) views (strided, like k and v): key j
    #   of k[b, h] reads float32(code) * k_scale[b, h, j]. None otherwise.
    kv_kind: int = 0
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None
    # how to give results back
    in_dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))
    out_shape: tuple = ()
    lse_shape: tuple = ()

    @property
    def dtype(self) -> np.dtype:
        return self.q.dtype

    @property
    def n_keys(self) -> int:
        """S: the keys of a sequence (max_pages * page_size for a paged cache)."""
        bt = self.block_table
        return self.k.shape[2] if bt is None else bt.shape[1] * self.k.shape[2]

    @property
    def shape(self) -> dict:
        B, Hq, L, E = self.q.shape
        return dict(B=B, Hq=Hq, Hkv=self.k.shape[1], L=L, S=self.n_keys, E=E, Ev=self.v.shape[3])

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1] if self.k.shape[1] else 1

    @property
    def is_empty(self) -> bool:
        return self.q.size == 0 or self.v.shape[3] == 0 or self.n_keys == 0


def _canonical(x: np.ndarray, batch: int, dtype: np.dtype) -> np.ndarray:
    """(..., H, N, D) -> C-contiguous (batch, H, N, D) in dtype; copies only when it must."""
    if x.ndim == 4 and x.dtype == dtype and x.flags.c_contiguous:
        return x                                 # already canonical (the usual 4-D call)
    return np.ascontiguousarray(x, dtype=dtype).reshape((batch,) + x.shape[-3:])


_FAST_DTYPES = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


def check_qkv(query, key, value, enable_gqa: bool, fn: str):
    """Validate q/k/v; returns the arrays, batch shape, heads and sizes."""
    # The usual call first: three 4-D float32/float64 ndarrays that agree. Anything else (and
    # every error message) goes through the checks below, in their order.
    if type(query) is np.ndarray and type(key) is np.ndarray and type(value) is np.ndarray:
        qs, ks, vs = query.shape, key.shape, value.shape
        dt = query.dtype
        if (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and dt in _FAST_DTYPES
                and key.dtype == dt and value.dtype == dt and qs[0] == ks[0] == vs[0]
                and qs[3] == ks[3] and ks[1] == vs[1] and ks[2] == vs[2]):
            Hq, Hkv = qs[1], ks[1]
            if Hq == Hkv or (enable_gqa and Hkv and Hq % Hkv == 0):
                return query, key, value, dt, qs[:1], Hq, Hkv
    q = as_float_array(query, "query", fn)
    k = as_float_array(key, "key", fn)
    v = as_float_array(value, "value", fn)
    dtype = q.dtype
    if not (dtype == k.dtype and dtype == v.dtype):
        dtype = check_same_dtype(fn, query=q, key=k, value=v)
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(
            f"{fn}: query, key and value must be at least 2-D (..., L, E), got shapes "
            f"{q.shape}, {k.shape}, {v.shape}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"{fn}: query, key and value must have the same number of dims, got query {q.shape}, "
            f"key {k.shape}, value {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{fn}: query and key must have the same head dim (last axis), got query {q.shape} "
            f"and key {k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{fn}: key and value must have the same sequence length (axis -2), got key {k.shape} "
            f"and value {v.shape}")
    if q.ndim >= 3:
        if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
            raise ValueError(
                f"{fn}: query, key and value must have the same batch dims, got query {q.shape}, "
                f"key {k.shape}, value {v.shape}")
        if k.shape[-3] != v.shape[-3]:
            raise ValueError(
                f"{fn}: key and value must have the same number of heads (axis -3), got key "
                f"{k.shape} and value {v.shape}")
        Hq, Hkv = q.shape[-3], k.shape[-3]
        if Hq != Hkv:
            if not enable_gqa:
                raise ValueError(
                    f"{fn}: query has {Hq} heads but key/value have {Hkv} (axis -3); pass "
                    f"enable_gqa=True for grouped-query attention (query {q.shape}, key {k.shape})")
            if Hkv == 0 or Hq % Hkv != 0:
                raise ValueError(
                    f"{fn}: with enable_gqa the number of query heads must be a multiple of the "
                    f"key/value heads, got {Hq} query heads and {Hkv} key/value heads")
        batch_shape = q.shape[:-3]
    else:
        Hq = Hkv = 1
        batch_shape = ()
    return q, k, v, dtype, batch_shape, Hq, Hkv


def check_attn_mask(attn_mask, score_shape: tuple, fn: str, name: str = "attn_mask"):
    """An ndarray for attn_mask (bool or float) that broadcasts to score_shape."""
    if isinstance(attn_mask, np.ndarray):
        m = attn_mask
    else:
        try:
            m = np.asarray(attn_mask)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"{fn}: {name} must be an array (bool or float), got "
                            f"{describe(attn_mask)} ({exc})") from None
    if not m.dtype.isnative:
        m = native_byte_order(m)
    if m.dtype == np.bool_:
        pass
    elif compute_dtype(m.dtype) is None:
        raise TypeError(
            f"{fn}: {name} must be a bool mask (True = take part) or a float mask added to the "
            f"scores, got dtype {m.dtype} (shape {m.shape}); convert integer masks with "
            f"mask.astype(bool)")
    if m.ndim > len(score_shape):
        raise ValueError(
            f"{fn}: {name} of shape {m.shape} does not broadcast to the score shape {score_shape} "
            f"(batch..., heads, L, S)")
    for ms, ss in zip(m.shape[::-1], score_shape[::-1]):
        if ms not in (1, ss):
            raise ValueError(
                f"{fn}: {name} of shape {m.shape} does not broadcast to the score shape "
                f"{score_shape} (batch..., heads, L, S)")
    return m


def mask_to_4d(m: np.ndarray, batch_shape: tuple, head_axis: bool, B: int, dtype) -> np.ndarray:
    """A broadcastable mask as a contiguous (Bm, Hm, Lm, Sm) array, each dim 1 or full.

    Only the batch dims can force a copy (when some but not all of them are broadcast); the
    (L, S) part is never expanded.
    """
    nb = len(batch_shape)
    full_nd = nb + (1 if head_axis else 0) + 2
    # A stride-0 axis (np.broadcast_to, or a broadcast view) holds one value along it: keep
    # length 1 there, which the kernels broadcast, instead of copying the repeats out densely
    # (np.broadcast_to(row, (1, 1, L, L)) was L x L in memory).
    if m.ndim and 0 in m.strides:
        m = m[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                    for st, n in zip(m.strides, m.shape))]
    m = m.reshape((1,) * (full_nd - m.ndim) + m.shape)
    if not head_axis:
        m = m.reshape(m.shape[:nb] + (1,) + m.shape[nb:])
    mb = m.shape[:nb]
    if all(d == 1 for d in mb):
        Bm = 1
    else:
        if mb != tuple(batch_shape):
            m = np.broadcast_to(m, tuple(batch_shape) + m.shape[nb:])
        Bm = B
    m = np.ascontiguousarray(m, dtype=dtype)
    return m.reshape((Bm,) + m.shape[nb:])


def check_alibi(alibi_slopes, batch_shape: tuple, Hq: int, B: int, dtype, fn: str) -> np.ndarray:
    a = as_float_array(alibi_slopes, "alibi_slopes", fn)
    if a.shape == (Hq,):
        a2 = a.reshape(1, Hq)
    elif a.shape == tuple(batch_shape) + (Hq,) or (a.ndim == 2 and a.shape == (B, Hq)):
        a2 = a.reshape(B, Hq)
    else:
        raise ValueError(
            f"{fn}: alibi_slopes must have shape (H,) = ({Hq},) or (batch, H) = "
            f"{tuple(batch_shape) + (Hq,)}, got {a.shape}")
    if not np.all(np.isfinite(a2)):
        raise ValueError(f"{fn}: alibi_slopes must be finite")
    return np.ascontiguousarray(a2, dtype=dtype)


def check_sinks(sinks, Hq: int, dtype, fn: str) -> np.ndarray:
    """The sink logits as a contiguous (Hq,) array in the compute dtype.

    One logit per query head, as gpt-oss and StreamingLLM learn them; any float dtype (like
    alibi_slopes and float masks). -inf means "no sink" for that head. NaN and +inf are kept, not
    rejected: they take part in every row of their head, so by the NaN rule those rows come out
    NaN (torch's softmax over the scores with the sink appended does the same).
    """
    s = as_float_array(sinks, "sinks", fn)
    if s.shape != (Hq,):
        raise ValueError(f"{fn}: sinks must have shape (Hq,) = ({Hq},), one logit per query "
                         f"head, got shape {s.shape}")
    return np.ascontiguousarray(s, dtype=dtype)


def for_kernels(p: Problem) -> tuple[Problem, float | None]:
    """The problem as the kernels take it: scale > 0 (they fold it into the softmax's max).

    Any finite scale is allowed (torch's rule); the others are rewritten without changing a
    score bit: for scale < 0, (-q) and |scale| (negation is exact, so every score is the same
    float as scale * q.k); for a scale that is 0 in the compute dtype, q * 0.0 and scale 1 (every
    score 0, and NaN/Inf in q still make NaN, as 0 * inf does). Returns (problem, dq_factor):
    the backward's dq w.r.t. the rewritten q times dq_factor is the gradient w.r.t. q (None:
    the problem is unchanged, the usual case).
    """
    s = p.dtype.type(p.scale)
    if s > 0:
        return p, None
    if s < 0:
        return dataclasses.replace(p, q=np.negative(p.q), scale=-p.scale), -1.0
    with np.errstate(invalid="ignore"):          # inf * 0 = NaN is the point here
        q0 = p.q * p.dtype.type(0.0)
    return dataclasses.replace(p, q=q0, scale=1.0), 0.0


def dq_from_kernels(dq: np.ndarray, dq_factor: float | None) -> np.ndarray:
    """The gradient w.r.t. the caller's q from the kernels' dq w.r.t. for_kernels' q.

    For scale = 0 the true dq is 0 * (a sum of finite terms), i.e. 0, wherever no NaN/Inf took
    part (then the kernels' dq is already NaN, and stays NaN). The kernels sum at scale 1, which
    can overflow to inf for large finite k and v (float32 v ~ 1e30, k ~ 1e10: dq ~ 1e41), and
    inf * 0 would be NaN: an inf there is an overflow, not an Inf input, so it gives 0."""
    if dq_factor is None:
        return dq
    if dq_factor == 0:
        return np.where(np.isinf(dq), dq.dtype.type(0), dq) * dq.dtype.type(0)
    return dq * dq.dtype.type(dq_factor)


def make_problem(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, *, causal_alignment="top_left", window=None, softcap=None,
                 alibi_slopes=None, sinks=None, rng=None,
                 fn="scaled_dot_product_attention") -> Problem:
    """Validate the arguments of scaled_dot_product_attention and build the canonical Problem."""
    q, k, v, in_dtype, batch_shape, Hq, Hkv = check_qkv(query, key, value, enable_gqa, fn)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: is_causal must be a bool, got {describe(is_causal)}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"{fn}: enable_gqa must be a bool, got {describe(enable_gqa)}")
    check_alignment(causal_alignment, "causal_alignment", fn)
    win = check_window(window, fn)
    cdt = compute_dtype(in_dtype)
    qs = q.shape
    L, E = qs[-2], qs[-1]
    S, Ev = k.shape[-2], v.shape[-1]
    B = math.prod(batch_shape) if batch_shape else 1
    head_axis = len(qs) >= 3
    p_drop = check_dropout(dropout_p, fn)

    problem = Problem(
        q=_canonical(q if head_axis else q[None], B, cdt),
        k=_canonical(k if head_axis else k[None], B, cdt),
        v=_canonical(v if head_axis else v[None], B, cdt),
        scale=check_scale(scale, E, fn, cdt),
        band=make_band(L, S, bool(is_causal), causal_alignment, win),
        softcap=check_softcap(softcap, fn, cdt),
        dropout_p=p_drop,
        seed=dropout_seed(rng, fn) if p_drop > 0.0 else 0,
        in_dtype=in_dtype,
        out_shape=qs[:-1] + (Ev,),
        lse_shape=qs[:-1],
    )
    if attn_mask is not None:
        score_shape = qs[:-1] + (S,)
        m = check_attn_mask(attn_mask, score_shape, fn)
        if m.dtype == np.bool_:
            problem.mask_kind = MASK_BOOL
            problem.mask = mask_to_4d(m, batch_shape, head_axis, B, np.bool_)
        else:
            problem.mask_kind = MASK_FLOAT
            problem.mask = mask_to_4d(m, batch_shape, head_axis, B, cdt)
    if alibi_slopes is not None:
        problem.alibi = check_alibi(alibi_slopes, batch_shape, Hq, B, cdt, fn)
    if sinks is not None:
        problem.sinks = check_sinks(sinks, Hq, cdt, fn)
    return problem


def _element_strides(x: np.ndarray, name: str, fn: str) -> tuple:
    """Element strides of the first three axes of a 4-D view whose last axis is contiguous."""
    item = x.itemsize
    s0, s1, s2, s3 = x.strides
    if x.size == 0:                      # nothing is read (NumPy may give such a view any strides)
        return (s0 // item, s1 // item, s2 // item)
    if x.shape[3] > 1 and s3 != item:
        raise ValueError(f"{fn}: {name}'s last axis (head_dim) must be contiguous, got byte "
                         f"strides {x.strides}")
    if s0 % item or s1 % item or s2 % item:
        raise ValueError(f"{fn}: {name}'s byte strides {x.strides} are not whole elements")
    return (s0 // item, s1 // item, s2 // item)


def make_cache_problem(q, k, v, *, seqlens, block_table=None, is_causal=True, window=None,
                       softcap=None, alibi_slopes=None, sinks=None, scale=None, kv_kind=0,
                       k_scale=None, v_scale=None, fn="attention_with_kvcache") -> Problem:
    """The Problem of a ragged batch attending a KV cache read in place.

    q (B, Hq, L, E) in the compute dtype (float32/float64, any strides: it is small and
    copied); k, v (Bk, Hkv, Sk, E / Ev) views of the cache with the head_dim axis contiguous,
    in the compute dtype (kv_kind 0) or stored as kv_kind says (k_scale, v_scale: the int8
    scales as (Bk, Hkv, Sk) views)
    (Bk = B rows, or the pages of a paged cache with Sk = page_size); seqlens (B,) int32 with
    0 <= seqlens[b] <= S; block_table (B, max_pages) int32 or None. The caller (inference.py)
    has checked the cache's shapes, lengths and pages; this checks the score options as
    make_problem does and builds the band bottom-right (per sequence through seqlens).
    """
    dtype = q.dtype
    B, Hq, L, E = q.shape
    S = k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]
    kv_strides = (_element_strides(k, "k_cache", fn), _element_strides(v, "v_cache", fn))
    problem = Problem(
        q=np.ascontiguousarray(q), k=k, v=v,
        scale=check_scale(scale, E, fn, dtype),
        band=make_band(L, S, bool(is_causal), "bottom_right", check_window(window, fn)),
        softcap=check_softcap(softcap, fn, dtype),
        in_dtype=dtype, out_shape=(B, Hq, L, v.shape[3]), lse_shape=(B, Hq, L),
        kv_strides=kv_strides, seqlens=np.ascontiguousarray(seqlens, np.int32),
        block_table=None if block_table is None else np.ascontiguousarray(block_table, np.int32),
        kv_kind=int(kv_kind), k_scale=k_scale, v_scale=v_scale)
    if alibi_slopes is not None:
        problem.alibi = check_alibi(alibi_slopes, (B,), Hq, B, dtype, fn)
    if sinks is not None:
        problem.sinks = check_sinks(sinks, Hq, dtype, fn)
    return problem
