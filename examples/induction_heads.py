"""Toy induction heads with fa.multihead: the second "cat" looks back at the first.

Sequence: "the cat sat on the mat . the cat" (positions 0..8). Embeddings are one-hot token
identity (6 dims) followed by one-hot position (9 dims). Two heads, causal mask:

  head 1 (same-token head): query and key both read the token identity, so the second "cat"
         (position 8) matches positions 1 and 8 with score a = 4.0 and everything else with 0:
         weight e^4 / (2 e^4 + 7) = 0.47 on each "cat".
  head 2 (previous-token head): the query reads its own position p as "p - 1", the key reads
         its position, so position 8 matches position 7 with score b and the other 8 visible
         positions with 0; b = ln(0.88 * 8 / 0.12) puts 0.88 on position 7.

Run:  python examples/induction_heads.py
"""
from __future__ import annotations

import numpy as np

import fastattn as fa

TOKENS = "the cat sat on the mat . the cat".split()
VOCAB = sorted(set(TOKENS), key=TOKENS.index)          # the, cat, sat, on, mat, .
SAME_TOKEN_SCORE = 4.0
PREV_TOKEN_SCORE = float(np.log(0.88 * 8 / 0.12))
HEAD_DIM = 9


def build():
    """(X, Wq, Wk, Wv, Wo) for the toy: X is (L, D) with D = |vocab| + L."""
    L, V = len(TOKENS), len(VOCAB)
    D = V + L
    X = np.zeros((L, D))
    for pos, tok in enumerate(TOKENS):
        X[pos, VOCAB.index(tok)] = 1.0
        X[pos, V + pos] = 1.0
    Wq = np.zeros((D, 2 * HEAD_DIM))
    Wk = np.zeros((D, 2 * HEAD_DIM))
    # scores are divided by sqrt(HEAD_DIM); q.k = g^2 on a match, so g^2 = score * sqrt(HEAD_DIM)
    g1 = np.sqrt(SAME_TOKEN_SCORE * np.sqrt(HEAD_DIM))
    g2 = np.sqrt(PREV_TOKEN_SCORE * np.sqrt(HEAD_DIM))
    for t in range(V):                                   # head 1: token identity
        Wq[t, t] = g1
        Wk[t, t] = g1
    for pos in range(L):                                 # head 2: position p asks for p - 1
        if pos >= 1:
            Wq[V + pos, HEAD_DIM + pos - 1] = g2
        Wk[V + pos, HEAD_DIM + pos] = g2
    Wv = np.eye(D, 2 * HEAD_DIM)
    Wo = np.eye(2 * HEAD_DIM, D)
    return X, Wq, Wk, Wv, Wo


def second_cat_weights():
    """The attention weights (2 heads, L keys) of the second "cat" (the last position)."""
    X, Wq, Wk, Wv, Wo = build()
    L = len(TOKENS)
    _, A = fa.multihead(X, Wq, Wk, Wv, Wo, num_heads=2, mask=fa.causal_mask(L))
    return A[:, L - 1]


def main():
    w = second_cat_weights()
    print("sequence:", " ".join(f"{i}:{t}" for i, t in enumerate(TOKENS)))
    for h, name in enumerate(["head 1 (same token)", "head 2 (previous token)"]):
        row = "  ".join(f"{x:.2f}" for x in w[h])
        top = np.argsort(w[h])[::-1][:2]
        print(f'{name}: second "cat" -> [{row}]  top positions {top[0]} ({w[h][top[0]]:.2f}), '
              f"{top[1]} ({w[h][top[1]]:.2f})")


if __name__ == "__main__":
    main()
