"""The oracle itself: checked against the seed values, the classic formulas and torch."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import torch_or_skip
from helpers import randn

import fastattn as fa
from fastattn import reference


def test_seed_induction_heads_with_reference_attention():
    """The toy of examples/induction_heads.py, recomputed head by head with reference.attention."""
    tokens = "the cat sat on the mat . the cat".split()
    L = len(tokens)
    vocab = sorted(set(tokens), key=tokens.index)
    # head 1: same-token score 4 -> e^4 / (2 e^4 + 7) = 0.47 on both cats
    tok = np.array([[1.0 if t == u else 0.0 for u in vocab] for t in tokens]) * 2.0
    _, w1 = reference.attention(tok, tok, np.eye(L), fa.causal_mask(L), scale=1.0)
    # head 2: previous-token score ln(0.88*8/0.12) -> 0.88 on position 7
    b = np.log(0.88 * 8 / 0.12)
    q2 = np.eye(L, k=-1) * np.sqrt(b)                       # row p is e_{p-1}
    k2 = np.eye(L) * np.sqrt(b)
    _, w2 = reference.attention(q2, k2, np.eye(L), fa.causal_mask(L), scale=1.0)
    assert round(w1[8, 1], 2) == 0.47 and round(w1[8, 8], 2) == 0.47
    assert round(w2[8, 7], 2) == 0.88
    np.testing.assert_allclose(w1[8, 1], np.exp(4) / (2 * np.exp(4) + 7), rtol=1e-14)


def test_softmax_is_the_classic_formula_where_that_is_defined(rng):
    x = rng.standard_normal((5, 7)) * 10
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(reference.softmax(x), e / e.sum(-1, keepdims=True), rtol=1e-15)


def test_fully_masked_row_is_zero_not_uniform():
    out, w = reference.attention(np.ones((2, 4)), np.ones((3, 4)), np.arange(6.0).reshape(3, 2),
                                 np.array([[1, 1, 0], [0, 0, 0]]))
    np.testing.assert_allclose(w[0], [0.5, 0.5, 0])
    assert np.all(w[1] == 0) and np.all(out[1] == 0)


def _torch_sdpa_manual(torch, q, k, v, scale, mask_add=None, softcap=None, keep=None):
    """softmax(scores) @ v computed with torch ops, for the options torch's SDPA lacks."""
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask_add is not None:
        s = s + mask_add
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float", "gqa", "scale", "L_ne_S", "L_gt_S"])
def test_reference_equals_torch_sdpa(rng, case):
    torch = torch_or_skip()
    F = torch.nn.functional.scaled_dot_product_attention
    T = torch.from_numpy
    Hkv = 2 if case == "gqa" else 4
    L, S = {"L_ne_S": (9, 23), "L_gt_S": (23, 9)}.get(case, (17, 17))
    q, k, v = randn(rng, (2, 4, L, 8), np.float64), randn(rng, (2, Hkv, S, 8), np.float64), randn(rng, (2, Hkv, S, 6), np.float64)
    kw, tkw = {}, {}
    if case == "causal" or case.startswith("L_"):
        kw["is_causal"] = tkw["is_causal"] = True
    if case == "bool":
        m = rng.random((2, 1, L, S)) > 0.3
        kw["attn_mask"], tkw["attn_mask"] = m, T(m)
    if case == "float":
        m = rng.standard_normal((4, L, S))
        kw["attn_mask"], tkw["attn_mask"] = m, T(m)
    if case == "scale":
        kw["scale"] = tkw["scale"] = 0.7
    if case == "gqa":
        kw["enable_gqa"] = tkw["enable_gqa"] = True
    ours = reference.scaled_dot_product_attention(q, k, v, **kw)
    theirs = F(T(q), T(k), T(v), **tkw).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-13)


def test_reference_equals_torch_for_softcap_alibi_window_bottom_right(rng):
    torch = torch_or_skip()
    T = torch.from_numpy
    L, S = 11, 19
    q, k, v = randn(rng, (1, 3, L, 8), np.float64), randn(rng, (1, 3, S, 8), np.float64), randn(rng, (1, 3, S, 8), np.float64)
    slopes = np.array([0.5, 0.25, 0.125])
    pos = np.arange(L)[:, None] + (S - L)
    alibi = -slopes[:, None, None] * np.abs(pos - np.arange(S)[None, :])
    keep = (np.arange(S)[None, :] <= pos) & (np.arange(S)[None, :] >= pos - 4)
    ours = reference.scaled_dot_product_attention(
        q * 4, k * 4, v, is_causal=True, causal_alignment="bottom_right", window=(4, None), softcap=3.0,
        alibi_slopes=slopes)
    theirs = _torch_sdpa_manual(torch, T(q * 4), T(k * 4), T(v), 1 / np.sqrt(8), T(alibi), 3.0, T(keep)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-13)


def test_fully_masked_rows_match_torch_safe_softmax(rng):
    torch = torch_or_skip()
    q, k, v = randn(rng, (1, 1, 4, 8), np.float64), randn(rng, (1, 1, 5, 8), np.float64), randn(rng, (1, 1, 5, 8), np.float64)
    mask = np.ones((4, 5), bool)
    mask[2] = False
    ours = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *map(torch.from_numpy, (q, k, v)), attn_mask=torch.from_numpy(mask)).numpy()
    assert np.all(ours[0, 0, 2] == 0)
    np.testing.assert_allclose(ours, theirs, atol=1e-13)
