"""Train a tiny attention model with plain NumPy and fastattn's forward/backward.

Task: at every position, output the token that came one step earlier (a "previous-token" copy,
the first half of an induction head). The model is one causal multi-head attention layer over
token + position embeddings, then a linear readout; every gradient is computed by hand except
attention's, which is fa.scaled_dot_product_attention_backward. Adam updates the weights.

The loss starts near ln(vocab) (guessing) and falls close to 0 once a head learns to attend
to the previous position.

Run:  python examples/train_copy.py [--steps 300]
"""
from __future__ import annotations

import argparse

import numpy as np

import fastattn as fa

VOCAB, SEQ, D_MODEL, HEADS, BATCH = 16, 24, 32, 2, 32


def init(rng):
    s = 0.5 / np.sqrt(D_MODEL)
    return {"tok": rng.standard_normal((VOCAB, D_MODEL)) * 0.5,
            "pos": rng.standard_normal((SEQ, D_MODEL)) * 0.5,
            "Wq": rng.standard_normal((D_MODEL, D_MODEL)) * s,
            "Wk": rng.standard_normal((D_MODEL, D_MODEL)) * s,
            "Wv": rng.standard_normal((D_MODEL, D_MODEL)) * s,
            "Wout": rng.standard_normal((D_MODEL, VOCAB)) * s}


def loss_and_grads(params, tokens, seed):
    """Cross-entropy of predicting tokens[:, i-1] at position i >= 1, and its gradients."""
    P = {k: v.astype(np.float32) for k, v in params.items()}
    X = P["tok"][tokens] + P["pos"][None]                                  # (B, L, D)
    Q, K, V = (fa.split_heads(X @ P[w], HEADS) for w in ("Wq", "Wk", "Wv"))
    opts = dict(is_causal=True, dropout_p=0.1, rng=seed)
    O, lse = fa.scaled_dot_product_attention(Q, K, V, return_lse=True, **opts)
    Om = fa.merge_heads(O)                                                 # (B, L, D)
    logits = Om @ P["Wout"]
    logits = logits - logits.max(-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(-1, keepdims=True)
    target = tokens[:, :-1]
    picked = np.take_along_axis(probs[:, 1:], target[..., None], -1)[..., 0]
    loss = float(-np.log(picked + 1e-12).mean())
    # backward, by hand down to attention
    dlogits = probs.copy()
    dlogits[:, 0] = 0                                                      # position 0 has no target
    np.put_along_axis(dlogits[:, 1:], target[..., None], np.take_along_axis(
        dlogits[:, 1:], target[..., None], -1) - 1, -1)
    dlogits /= target.size
    grads = {"Wout": np.einsum("bld,blv->dv", Om, dlogits)}
    dO = fa.split_heads(dlogits @ P["Wout"].T, HEADS)
    dQ, dK, dV = fa.scaled_dot_product_attention_backward(dO, Q, K, V, O, lse, **opts)
    dX = np.zeros_like(X)
    for w, dH in (("Wq", dQ), ("Wk", dK), ("Wv", dV)):
        dproj = fa.merge_heads(dH)
        grads[w] = np.einsum("bld,ble->de", X, dproj)
        dX += dproj @ P[w].T
    grads["pos"] = dX.sum(0)
    grads["tok"] = np.zeros_like(P["tok"])
    np.add.at(grads["tok"], tokens, dX)
    return loss, grads


def train(steps=300, lr=3e-2, seed=0, log_every=50, verbose=True):
    rng = np.random.default_rng(seed)
    params = init(rng)
    m = {k: np.zeros_like(v) for k, v in params.items()}
    s = {k: np.zeros_like(v) for k, v in params.items()}
    history = []
    for step in range(1, steps + 1):
        tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ))
        loss, grads = loss_and_grads(params, tokens, seed=step)
        history.append(loss)
        for k in params:                                                   # Adam
            m[k] = 0.9 * m[k] + 0.1 * grads[k]
            s[k] = 0.999 * s[k] + 0.001 * grads[k] ** 2
            params[k] -= lr * (m[k] / (1 - 0.9 ** step)) / (np.sqrt(s[k] / (1 - 0.999 ** step)) + 1e-8)
        if verbose and (step == 1 or step % log_every == 0):
            print(f"step {step:4d}  loss {np.mean(history[-log_every:]):.3f}")
    return history


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(f"copy-previous-token task, vocab {VOCAB}: chance loss ln {VOCAB} = {np.log(VOCAB):.3f}")
    hist = train(args.steps)
    print(f"final loss {np.mean(hist[-20:]):.3f} (started at {hist[0]:.3f})")


if __name__ == "__main__":
    main()
