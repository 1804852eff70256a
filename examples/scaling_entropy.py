"""Why attention divides by sqrt(d_k): without it, softmax saturates as d_k grows.

For random unit-variance queries and keys, q.k has variance d_k. Unscaled, the scores spread
wider with d_k and the softmax over 16 keys collapses onto one key (entropy -> 0). Divided by
sqrt(d_k) they keep unit variance and the entropy stays near its value at any d_k, below the
maximum ln 16 = 2.77 nats of a uniform distribution.

Run:  python examples/scaling_entropy.py
"""
from __future__ import annotations

import numpy as np

import fastattn as fa

N_KEYS = 16
TRIALS = 2000


def mean_entropy(d_k: int, scaled: bool, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((TRIALS, 1, d_k))
    k = rng.standard_normal((TRIALS, N_KEYS, d_k))
    scores = (q @ k.swapaxes(-1, -2))[:, 0]
    if scaled:
        scores = scores / np.sqrt(d_k)
    w = fa.softmax(scores, axis=-1)
    ent = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0), axis=-1)
    return float(ent.mean())


def table():
    return [(d, mean_entropy(d, False), mean_entropy(d, True)) for d in (16, 64, 256, 1024)]


def main():
    print(f"mean attention entropy over {N_KEYS} random keys (nats); maximum ln {N_KEYS} = "
          f"{np.log(N_KEYS):.2f}")
    print(f"{'d_k':>6}  {'unscaled':>9}  {'scaled 1/sqrt(d_k)':>19}")
    for d, raw, scaled in table():
        print(f"{d:>6}  {raw:>9.2f}  {scaled:>19.2f}")


if __name__ == "__main__":
    main()
