"""Mask builders and their agreement with the kernels' band rule."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn as fa


def test_causal_top_left_is_tril():
    np.testing.assert_array_equal(fa.causal_mask(4), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(fa.causal_mask(3, 5), np.tril(np.ones((3, 5), bool)))


def test_causal_bottom_right_is_shifted_tril():
    for L, S in [(3, 5), (5, 3), (4, 4), (1, 6)]:
        np.testing.assert_array_equal(fa.causal_mask(L, S, alignment="bottom_right"),
                                      np.tril(np.ones((L, S), bool), k=S - L))


def test_sliding_window():
    m = fa.sliding_window_mask(6, 6, (2, 0))
    want = np.array([[abs(i - j) <= 2 and j <= i for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(m, want)
    m = fa.sliding_window_mask(3, 7, (1, 1), alignment="bottom_right")
    want = np.array([[abs(i + 4 - j) <= 1 for j in range(7)] for i in range(3)])
    np.testing.assert_array_equal(m, want)
    np.testing.assert_array_equal(fa.sliding_window_mask(4, 4, (None, -1)), np.ones((4, 4), bool))


def test_padding_mask():
    m = fa.padding_mask(np.array([2, 0, 4]), 4)
    assert m.shape == (3, 1, 1, 4)
    np.testing.assert_array_equal(m[:, 0, 0], [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="lengths must be in"):
        fa.padding_mask(np.array([5]), 4)
    with pytest.raises(TypeError, match="lengths must be a 1-D array of ints"):
        fa.padding_mask(np.array([1.5]), 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="alignment"):
        fa.causal_mask(3, alignment="bottom")
    with pytest.raises(ValueError, match="L must be a non-negative int"):
        fa.causal_mask(-1)
    with pytest.raises(TypeError, match="S must be a non-negative int"):
        fa.causal_mask(3, 2.5)
