"""fastattn: exact scaled-dot-product attention for NumPy arrays on the CPU, fast.

    import fastattn as fa
    out = fa.scaled_dot_product_attention(q, k, v, is_causal=True)

See README.md for the semantics; `python -m fastattn info` shows which backends are available.
"""
from . import _process  # noqa: F401  (registers the fork hook before any backend loads)
from .api import (attention, merge_attention, merge_heads, multihead, scaled_dot_product_attention,
                  scaled_dot_product_attention_backward, softmax, split_heads)
from ._backends import (BackendInfo, BackendUnavailableError, backends, get_backend,
                        reload_environment, set_backend, use_backend)
from .inference import attention_with_kvcache, varlen_attention, varlen_attention_backward
from ._kvdtypes import dequantize_kv, quantize_kv
from .masks import causal_mask, padding_mask, sliding_window_mask
from .nn import KVCache
from ._blas_pools import blas_threads_shared, share_blas_threads, share_from_environment

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention", "scaled_dot_product_attention_backward", "merge_attention", "softmax", "attention", "multihead",
    "split_heads", "merge_heads", "attention_with_kvcache", "varlen_attention",
    "varlen_attention_backward", "KVCache", "quantize_kv", "dequantize_kv", "causal_mask", "padding_mask", "sliding_window_mask",
    "backends", "get_backend", "set_backend", "use_backend", "reload_environment", "BackendInfo",
    "BackendUnavailableError", "share_blas_threads", "blas_threads_shared", "__version__",
]

share_from_environment()            # FASTATTN_SHARE_BLAS_THREADS=1: the user's choice
del share_from_environment
