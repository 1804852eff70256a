"""Layers around the attention functions: a KV cache that owns its arrays and lengths.

    cache = fa.KVCache(batch=1, max_len=2048, kv_heads=8, head_dim=64)
    for token in ...:                                      # one line per layer in the loop
        out = cache.attend(q, k_new, v_new, rotary_cos=cos, rotary_sin=sin)

The arrays have flash-attn's layout ((batch, max_len, kv_heads, head_dim), or pages of
(page_size, kv_heads, head_dim) with a block table); `attend` writes the new tokens in place
(O(kv_heads * head_dim) per token, no copy of the cache) and advances the lengths only when the
call succeeded.
"""
from __future__ import annotations

import numbers

import numpy as np

from . import _kvplan
from ._inputs import describe
from ._kvdtypes import kind_of
from .inference import attention_with_kvcache

__all__ = ["KVCache"]


def _size(x, name: str, positive: bool = True) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise TypeError(f"KVCache: {name} must be an int, got {describe(x)}")
    if x < (1 if positive else 0):
        raise ValueError(f"KVCache: {name} must be {'>= 1' if positive else '>= 0'}, got {int(x)}")
    return int(x)


# Linux backs large NumPy arrays with 2 MiB pages (NumPy asks for them), and two arrays of one
# size allocated one after the other start at nearly the same offset within their pages (4 KiB
# apart): key j and value j then share most of their low 21 address bits, physical ones
# included, and a decode streaming both at once ran slower (bank or cache-set conflicts, we
# guess; not pinned down).  Measured on a Zen 4 guest: B = 8 caches of 16384 x 8 heads x 128
# (512 MB each), lengths 512..16384, 32/8 heads, two threads, against two np.zeros arrays (V
# 4 KiB below K modulo 2 MiB): V 0 or 4 KiB above K 1.05-1.09x the time; 64 KiB 0.96x; 516,
# 1028 and 1536 KiB 0.91-0.92x.  (The bench's shuffled paged pool, whose K and V pages are
# also 4 KiB apart modulo 2 MiB, read at the faster rate: the rule is empirical.)
_HUGE_PAGE = 2 << 20
# Both arrays start on a cache line.  A large np.zeros array starts 16 bytes into its page
# (malloc's header in front of an mmap), so every head row of a (.., heads, 128) float32 cache
# straddles one more cache line than it needs and half the kernels' 32-byte loads are split
# across two lines.  The inference preset's ragged decode (B = 8, 32/8 heads, d = 128, two
# threads, the same buffers shifted to a 64-byte boundary, interleaved in one process, Zen 4
# guest on AVX2) read 6-9% faster from an aligned pair of np.zeros arrays (five runs of 12-40
# rounds each) and 1-5% faster from this class's buffer in four of those runs (1% slower in
# the fifth).  The split loads are not the cost: loading every row as whole aligned vectors
# (no split) was no faster (bench/results/cython_kernels.md), and in a C harness an offset of
# 32 bytes, which splits nothing, cost as much as 16; what costs is a row starting mid-line.
_ALIGN = 64


def _zeros_aligned(count, dtype):
    """`count` zeros of `dtype` from a 64-byte boundary: a view of a slightly longer array
    (NumPy's allocations are 16-byte aligned, so the offset is whole items)."""
    buf = np.zeros(count + _ALIGN // dtype.itemsize, dtype)
    start = (-buf.ctypes.data % _ALIGN) // dtype.itemsize
    return buf[start:start + count]


def _key_value_arrays(kshape, vshape, dtype):
    """Zeroed K and V arrays, each starting on a cache line; above a huge page, views of one
    buffer in which V starts half a huge page (1 MiB) away from K's offset within a page."""
    kcount, vcount = int(np.prod(kshape)), int(np.prod(vshape))
    kn = kcount * dtype.itemsize
    if kn < _HUGE_PAGE:
        return (_zeros_aligned(kcount, dtype).reshape(kshape),
                _zeros_aligned(vcount, dtype).reshape(vshape))
    gap = (-kn) % _HUGE_PAGE + _HUGE_PAGE // 2          # kn + gap: a multiple of 1 MiB
    start = (kn + gap) // dtype.itemsize
    buf = _zeros_aligned(start + vcount, dtype)
    return buf[:kcount].reshape(kshape), buf[start:].reshape(vshape)


class KVCache:
    """Keys and values of `batch` sequences of up to `max_len` tokens, for one attention layer.

    page_size=None: contiguous arrays (batch, max_len, kv_heads, head_dim). With a page size, a
    paged cache (batch * pages_per_seq, page_size, kv_heads, head_dim) and its int32
    block_table (batch, pages_per_seq) (sequence b owns pages b * pages_per_seq ...).
    k and v start on 64-byte boundaries; above 2 MiB they are views of one buffer
    (_key_value_arrays).
    value_dim defaults to head_dim. `seqlens` (int32, (batch,)) counts the tokens held.
    dtype: float32 or float64, or a low-precision cache read in place (float16, bfloat16 from
    ml_dtypes, int8: fastattn/_kvdtypes.py); an int8 cache also owns `k_scale` and `v_scale`,
    float32 (batch, max_len, kv_heads) (paged: (pages, page_size, kv_heads)), None otherwise.
    """

    def __init__(self, batch, max_len, kv_heads, head_dim, dtype=np.float32, page_size=None, *,
                 value_dim=None):
        self.batch = _size(batch, "batch")
        self.max_len = _size(max_len, "max_len", positive=False)
        kv_heads = _size(kv_heads, "kv_heads")
        head_dim = _size(head_dim, "head_dim")
        value_dim = head_dim if value_dim is None else _size(value_dim, "value_dim")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"KVCache: dtype must be a dtype, got {describe(dtype)}") from None
        if not self.dtype.isnative or kind_of(self.dtype) is None:
            raise TypeError(f"KVCache: dtype must be float32, float64, float16, bfloat16 "
                            f"(ml_dtypes) or int8, got {self.dtype}")
        self.page_size = None if page_size is None else _size(page_size, "page_size")
        if self.page_size is None:
            shape = (self.batch, self.max_len)
            self.block_table = None
        else:
            per_seq = -(-self.max_len // self.page_size)
            shape = (self.batch * per_seq, self.page_size)
            self.block_table = np.arange(self.batch * per_seq, dtype=np.int32).reshape(
                self.batch, per_seq)
        self.k, self.v = _key_value_arrays(shape + (kv_heads, head_dim),
                                           shape + (kv_heads, value_dim), self.dtype)
        # int8: the per-token, per-kv-head scales of the codes (fastattn/_kvdtypes.py)
        self.k_scale = self.v_scale = None
        if self.dtype == np.int8:
            self.k_scale = np.zeros(shape + (kv_heads,), np.float32)
            self.v_scale = np.zeros(shape + (kv_heads,), np.float32)
        self.seqlens = np.zeros(self.batch, np.int32)
        self._plan = None             # the per-token path's plan (fastattn/_kvplan.py)

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold (max_len rounded up to whole pages)."""
        if self.block_table is None:
            return self.max_len
        return self.block_table.shape[1] * self.page_size

    def attend(self, q, k=None, v=None, **options):
        """Append k, v (batch, Lnew, kv_heads, dim) at each sequence's end, then attend q
        (batch, Lq, Hq, head_dim) to everything held; options as attention_with_kvcache
        (is_causal=True by default, rotary, window, softcap, ...). Returns what it returns."""
        result = _kvplan.attend(self, q, k, v, options)     # a decode step: fastattn/_kvplan.py
        if result is not _kvplan.MISS:
            return result
        scales = {} if self.k_scale is None else dict(k_scale=self.k_scale,
                                                       v_scale=self.v_scale)
        result = attention_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=self.seqlens,
                                        block_table=self.block_table, **options, **scales)
        if k is not None:
            self.seqlens += np.int32(np.shape(k)[1])
        _kvplan.remember(self, q, k, v, options)
        return result

    def reset(self) -> None:
        """Forget every sequence's tokens (the arrays are kept for reuse)."""
        self.seqlens[:] = 0

    def trim(self, length) -> None:
        """Keep at most `length` tokens per sequence (an int, or one per sequence)."""
        n = np.asarray(length)
        if not np.issubdtype(n.dtype, np.integer) or n.shape not in ((), (self.batch,)):
            raise TypeError(f"KVCache.trim: length must be an int or {self.batch} ints, got "
                            f"{describe(length)}")
        if np.any(n < 0):
            raise ValueError(f"KVCache.trim: length must be >= 0, got {n.tolist()}")
        self.seqlens[:] = np.minimum(self.seqlens, n).astype(np.int32)

    def reorder(self, batch_idx) -> None:
        """Sequence b becomes a copy of sequence batch_idx[b] (beam search keeps its best
        beams); indices may repeat. Copies the held tokens only."""
        idx = np.asarray(batch_idx)
        if not np.issubdtype(idx.dtype, np.integer) or idx.shape != (self.batch,):
            raise TypeError(f"KVCache.reorder: batch_idx must be {self.batch} ints, got "
                            f"{describe(batch_idx)}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.batch):
            raise ValueError(f"KVCache.reorder: batch_idx entries must be in [0, {self.batch}), "
                             f"got {idx.tolist()}")
        n = int(self.seqlens[idx].max(initial=0))
        # the pages of sequence b are b * per_seq ... in order, so both layouts are one
        # (batch, capacity, heads, dim) array underneath
        arrays = (self.k, self.v) if self.k_scale is None else (
            self.k, self.v, self.k_scale, self.v_scale)
        for arr in arrays:
            seqs = arr.reshape((self.batch, self.capacity) + arr.shape[2:])
            seqs[:, :n] = seqs[idx, :n]
        self.seqlens[:] = self.seqlens[idx]
