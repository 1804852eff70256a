"""The examples run and show what they claim (they are the teaching code)."""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    path = EXAMPLES / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{path} not found (tests run without the examples directory)")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_induction_heads_seed_values(capsys):
    mod = load("induction_heads")
    w = mod.second_cat_weights()
    # head 1: 0.47 on the two "cat" positions 1 and 8; head 2: 0.88 on position 7
    np.testing.assert_allclose(w[0, [1, 8]], 0.47, atol=0.005)
    assert np.argsort(w[0])[-2:].tolist() in ([1, 8], [8, 1])
    np.testing.assert_allclose(w[1, 7], 0.88, atol=0.005)
    assert np.argmax(w[1]) == 7
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-12)
    mod.main()
    assert '"cat"' in capsys.readouterr().out


def test_scaling_keeps_entropy_unscaled_collapses():
    mod = load("scaling_entropy")
    rows = mod.table()
    raw = [r[1] for r in rows]
    scaled = [r[2] for r in rows]
    assert all(a > b for a, b in zip(raw, raw[1:]))           # collapses as d_k grows
    assert max(scaled) - min(scaled) < 0.1                    # stays put with 1/sqrt(d_k)
    assert all(s < np.log(16) for s in scaled) and raw[-1] < 0.5


def test_training_with_fastattn_backward_lowers_the_loss():
    mod = load("train_copy")
    hist = mod.train(steps=120, verbose=False)
    assert abs(hist[0] - np.log(mod.VOCAB)) < 0.3            # starts at chance
    assert np.mean(hist[-10:]) < 0.2 * hist[0]               # and learns the copy


@pytest.mark.parametrize("lang", ["pt", "en"])
def test_glassllm_generates_the_same_tokens_through_fastattn(lang):
    pytest.importorskip("glassllm", reason="glassllm (the test extra) is not installed")
    mod = load("glassllm_generate")
    r = mod.compare(lang, n_new=16)
    assert r["n_new"] == 16
    assert r["same_tokens"], r["text"]
    assert r["err_fastattn"] <= r["bound"], r


def test_transformers_cpu_generates_eagers_tokens_with_each_implementation(capsys):
    pytest.importorskip("torch", reason="torch is not installed")
    pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    mod = load("transformers_cpu")
    models = mod.build_models(layers=2, hidden=64, heads=4, kv_heads=2, vocab=96)
    assert models["fastattn"].config._attn_implementation == "fastattn"
    ids, mask = mod.prompts(2, 24, 96)
    assert mask[1, :7].sum() == 0 and mask[0].all()          # the second prompt is left-padded
    results = mod.generate_all(models, ids, mask, 6)
    eager = results["eager"][0]
    assert eager.shape == (2, 24 + 6)
    for impl in ("fastattn", "sdpa"):
        assert torch_equal(results[impl][0], eager), impl
    assert mod.main(["--prompt", "16", "--new", "3", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("same tokens as eager: True") == 3 and "tokens/s" in out


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)
