"""A real model generating text through fastattn: glassllm's attention replaced by a KV cache.

glassllm (on PyPI) is a small pretrained Llama-style decoder written in NumPy (RMSNorm, RoPE,
grouped-query attention 4/2, head dim 32), with its weights in the wheel. Its own attention
concatenates the new keys onto the cache at every step and builds the full score matrix. Here,
while decoding with a cache, each layer's attention is `fa.KVCache.attend` instead: the new keys
and values are written in place, RoPE is applied by fastattn at the absolute positions (glassllm
rotates interleaved pairs, GPT-J style), causal bottom-right. Nothing of glassllm is copied: its
`Attention.__call__` is wrapped while the `fastattn_attention()` context is active.

    python examples/glassllm_generate.py            # both shipped models, greedy, 48 tokens

prints the text, whether the greedy tokens are the same, the logits' error against a float64
run of glassllm's own code (next to the error of glassllm's own float32 run), and tokens/s;
then the same decode with an int8 KV cache (per-token scales, fastattn.quantize_kv): its
tokens/s and how many of its greedy tokens match those of a cache in the model's dtype.
"""
from __future__ import annotations

import contextlib
import sys
import time

import numpy as np

import fastattn as fa

try:
    import glassllm
    from glassllm import Tensor, no_grad
    from glassllm.nn import Attention
except ImportError:  # pragma: no cover - the example says what it needs
    glassllm = None


def _fastattn_call(self, x, layer, trace=None, cache=None, start=0, cache_dtype=None):
    """glassllm Attention.__call__ with the cached path through fastattn (see the module doc);
    the KV cache in cache_dtype (default: the model's)."""
    b, n, _ = x.shape
    fc = getattr(cache, "fastattn", None)
    if fc is None or fc.batch != b:
        fc = cache.fastattn = fa.KVCache(b, len(self.cos), self.n_kv_heads, self.d_k,
                                         cache_dtype or x.data.dtype)
    if int(fc.seqlens[0]) != start:
        fc.trim(start)                      # glassllm restarted its window at `start`
    q = (x @ self.W_Q).data.reshape(b, n, self.n_heads, self.d_k)
    k = (x @ self.W_K).data.reshape(b, n, self.n_kv_heads, self.d_k)
    v = (x @ self.W_V).data.reshape(b, n, self.n_kv_heads, self.d_k)
    mixed = fc.attend(q, k, v, rotary_cos=self.cos, rotary_sin=self.sin, rotary_interleaved=True)
    return Tensor(mixed.reshape(b, n, self.n_heads * self.d_k)) @ self.W_O


@contextlib.contextmanager
def fastattn_attention(cache_dtype=None):
    """Inside the block, glassllm's cached (inference) attention runs through fastattn, with
    KV caches of cache_dtype (default: the model's dtype; np.float16, ml_dtypes.bfloat16,
    np.int8 read in place); calls without a cache (training, traced steps) keep glassllm's own
    code."""
    original = Attention.__call__

    def call(self, x, layer, trace=None, cache=None, start=0):
        if cache is None or trace is not None:
            return original(self, x, layer, trace, cache, start)
        return _fastattn_call(self, x, layer, trace, cache, start, cache_dtype)

    Attention.__call__ = call
    try:
        yield
    finally:
        Attention.__call__ = original


def cached_logits(model, prompt, n_new, forced=None):
    """Greedy decoding with a KV cache; the logits of every step (n_new, vocab) and the tokens.
    With `forced`, those tokens are fed instead of the argmax (to compare runs on one path)."""
    cache, logits, tokens = model.new_cache(), [], []
    pending, start = list(prompt), 0
    with no_grad():
        for step in range(n_new):
            out = model.forward(pending, cache=cache, start=start).data[0, -1]
            start += len(pending)
            logits.append(out.astype(np.float64))
            tok = int(np.argmax(out)) if forced is None else int(forced[step])
            tokens.append(int(np.argmax(out)))
            pending = [tok]
    return np.array(logits), tokens


def compare(lang, prompt_text="the", n_new=48):
    """Run glassllm's own attention (float32 and float64) and fastattn's (float32) on one prompt."""
    model32, tok = glassllm.load_pretrained(lang)
    model64 = glassllm.GlassLM.load(
        glassllm.__path__[0] + f"/weights/{lang}.npz", dtype=np.float64)
    prompt = tok.encode(prompt_text)
    n_new = min(n_new, model32.cfg.max_len - len(prompt))
    t0 = time.perf_counter()
    own32, own_tokens = cached_logits(model32, prompt, n_new)
    t_own = time.perf_counter() - t0
    ref64, _ = cached_logits(model64, prompt, n_new, forced=own_tokens)
    with fastattn_attention():
        cached_logits(model32, prompt, 2)                        # warm-up (numba compile)
        t0 = time.perf_counter()
        fa32, fa_tokens = cached_logits(model32, prompt, n_new)
        t_fa = time.perf_counter() - t0
        fa32_forced, _ = cached_logits(model32, prompt, n_new, forced=own_tokens)
    err_fa = float(np.max(np.abs(fa32_forced - ref64)))
    err_own = float(np.max(np.abs(own32 - ref64)))
    return dict(lang=lang, text=tok.decode(prompt + fa_tokens), same_tokens=fa_tokens == own_tokens,
                err_fastattn=err_fa, err_own=err_own, bound=2 * err_own + 1e-6,
                tokens_per_s_own=n_new / t_own, tokens_per_s_fastattn=n_new / t_fa, n_new=n_new)


def compare_cache_dtype(lang, cache_dtype=np.int8, prompt_text="the", n_new=48):
    """Greedy decode through fastattn with a cache of the model's dtype and with one of
    cache_dtype: the second's tokens/s, and how many of its greedy tokens equal the first's
    (in all, and before the first that differs)."""
    model, tok = glassllm.load_pretrained(lang)
    prompt = tok.encode(prompt_text)
    n_new = min(n_new, model.cfg.max_len - len(prompt))
    runs = {}
    for name, dt in (("model", None), ("low", cache_dtype)):
        with fastattn_attention(dt):
            cached_logits(model, prompt, 2)                      # warm-up
            t0 = time.perf_counter()
            _, tokens = cached_logits(model, prompt, n_new)
            runs[name] = (tokens, n_new / (time.perf_counter() - t0))
    ref, low = runs["model"][0], runs["low"][0]
    same = [a == b for a, b in zip(ref, low)]
    prefix = same.index(False) if False in same else len(same)
    return dict(lang=lang, cache_dtype=np.dtype(cache_dtype).name, n_new=n_new,
                matching=sum(same), matching_prefix=prefix,
                tokens_per_s_model_dtype=runs["model"][1], tokens_per_s=runs["low"][1],
                text=tok.decode(prompt + low))


def main(argv=None) -> int:
    if glassllm is None:
        print("this example needs glassllm: pip install glassllm")
        return 1
    ok = True
    for lang in glassllm.LANGUAGES:
        r = compare(lang)
        ok &= r["same_tokens"] and r["err_fastattn"] <= r["bound"]
        print(f"[{lang}] {r['text']!r}")
        print(f"    greedy tokens identical to glassllm's own attention: {r['same_tokens']}")
        print(f"    logits max error vs float64: fastattn {r['err_fastattn']:.2e}, glassllm's own "
              f"float32 {r['err_own']:.2e} (bound {r['bound']:.2e})")
        print(f"    {r['n_new']} tokens: {r['tokens_per_s_own']:.0f} tokens/s with its own attention,"
              f" {r['tokens_per_s_fastattn']:.0f} with fastattn")
        q8 = compare_cache_dtype(lang)
        print(f"    int8 KV cache: {q8['matching']} of {q8['n_new']} greedy tokens equal to those "
              f"of a cache in the model's dtype (the first {q8['matching_prefix']} in a row); "
              f"{q8['tokens_per_s']:.0f} tokens/s ({q8['tokens_per_s_model_dtype']:.0f} with the "
              f"model's dtype)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
