"""A Hugging Face causal LM on the CPU with attn_implementation="fastattn", "sdpa" and "eager".

    python examples/transformers_cpu.py [--prompt 512] [--new 32] [--batch 2] [--layers 4]

`fastattn.torch.register_transformers()` adds "fastattn" to transformers' attention (and mask)
interfaces; from then on any model takes it like "sdpa":

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fastattn")

Here the model is built from a small Llama config (grouped-query attention 8/2, head dim 32,
random weights with a fixed seed: nothing to download), the same weights under each
implementation. It generates greedily from a left-padded batch of prompts, and the example
prints whether the tokens are the same as eager's and the tokens/s of each implementation.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import fastattn.torch as fat

IMPLEMENTATIONS = ("fastattn", "sdpa", "eager")


def build_models(layers=4, hidden=256, heads=8, kv_heads=2, vocab=1024, max_positions=4096,
                 seed=0) -> dict:
    """{implementation: the same small Llama, in eval mode}."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    fat.register_transformers()
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    models = {}
    for impl in IMPLEMENTATIONS:
        torch.manual_seed(seed)
        models[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                        attn_implementation=impl).eval()
    return models


def prompts(batch: int, length: int, vocab: int, seed: int = 1):
    """Left-padded random prompts: row b has length - 7*b real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        mask[b, :min(7 * b, length - 1)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate_all(models: dict, ids, mask, new_tokens: int) -> dict:
    """{implementation: (tokens, seconds)} of greedy generation."""
    out = {}
    for impl, model in models.items():
        with torch.no_grad():
            t = time.perf_counter()
            tokens = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    pad_token_id=0)
            out[impl] = (tokens, time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=512, help="prompt length (tokens)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)

    models = build_models(layers=args.layers)
    vocab = models["eager"].config.vocab_size
    ids, mask = prompts(args.batch, args.prompt, vocab)
    generate_all(models, ids[:, :8], mask[:, :8], 2)          # warm-up (first calls, caches)
    results = generate_all(models, ids, mask, args.new)
    reference = results["eager"][0]
    print(f"Llama, {args.layers} layers, GQA 8/2, head dim 32; batch {args.batch}, prompts of "
          f"{args.prompt} tokens (left-padded), {args.new} new tokens, greedy, "
          f"{torch.get_num_threads()} threads")
    for impl, (tokens, seconds) in results.items():
        same = torch.equal(tokens, reference)
        rate = args.batch * args.new / seconds
        print(f"  {impl:9s} {rate:8.1f} tokens/s   same tokens as eager: {same}")
    print("  first sequence's new tokens:", results["fastattn"][0][0, -args.new:].tolist())
    return 0 if all(torch.equal(t, reference) for t, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
