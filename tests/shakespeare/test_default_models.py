"""The two shipped models in data/models/: architecture, checksums, tokenizer, held-out perplexity, golden text."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from llmstep.shakespeare import data
from llmstep.shakespeare import evaluate as evaluation

MODELS = data.DATA_DIR / "models"
TARGET, DRAFT = MODELS / "shakespeare-target", MODELS / "shakespeare-draft"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md",
         "train.log", "eval.json", "golden.json")


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def models():
    from llmstep.core.checkpoint import load

    return {"target": load(TARGET, device="cpu", dtype=torch.float32),
            "draft": load(DRAFT, device="cpu", dtype=torch.float32)}


@pytest.mark.parametrize("model_dir", [TARGET, DRAFT], ids=["target", "draft"])
def test_shipped_model_has_every_file(model_dir):
    for name in FILES:
        assert (model_dir / name).is_file(), name
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_shipped_files_match_the_recorded_checksums():
    lines = (MODELS / "checksums.txt").read_text().splitlines()
    recorded = dict(reversed(line.split("  ", 1)) for line in lines)
    for model_dir in (TARGET, DRAFT):
        for name in FILES:
            rel = f"{model_dir.name}/{name}"
            assert recorded[rel] == sha256(model_dir / name), rel


def test_both_models_share_the_corpus_tokenizer():
    assert sha256(TARGET / "tokenizer.json") == sha256(DRAFT / "tokenizer.json") == sha256(data.TOKENIZER_PATH)


def test_models_have_the_documented_llama3_architecture(models):
    target, draft = models["target"][0].config, models["draft"][0].config
    for c in (target, draft):
        assert c.n_kv_heads < c.n_heads  # grouped-query attention
        assert c.rope_theta == 500000.0 and c.rope_scaling is None
        assert c.vocab_size == 8192 and c.tie_embeddings and c.max_seq_len == 512
        assert (c.bos_token_id, c.eos_token_id) == (7936, [7937])
    assert (target.dim, target.n_layers, target.n_heads, target.n_kv_heads, target.hidden_dim) == (384, 6, 6, 2, 1024)
    assert (draft.dim, draft.n_layers, draft.n_heads, draft.n_kv_heads, draft.hidden_dim) == (128, 2, 4, 1, 384)
    n = {k: sum(p.numel() for p in m.parameters()) for k, (m, _) in models.items()}
    assert 8e6 <= n["target"] <= 15e6 and n["draft"] <= n["target"] / 5
    for k, model_dir in {"target": TARGET, "draft": DRAFT}.items():
        assert f"{n[k]:,}" in (model_dir / "README.md").read_text(), k


@pytest.mark.parametrize("name", ["target", "draft"])
def test_perplexity_on_a_held_out_slice_matches_the_recorded_value(models, name):
    model_dir = TARGET if name == "target" else DRAFT
    recorded = json.loads((model_dir / "eval.json").read_text())
    settings, score = recorded["settings"], recorded["scores"][0]
    assert settings["max_tokens"] is not None and settings["max_tokens"] <= 4096  # a quick slice
    model, _ = models[name]
    ids = evaluation.split_ids(evaluation.load_tokenizer(model_dir), score["split"], max_tokens=settings["max_tokens"])
    nll, n = evaluation.model_nll(model, ids, settings["seq_len"])
    assert n == score["tokens"]
    assert math.exp(nll / n) == pytest.approx(score["perplexity"], rel=1e-4)


@pytest.mark.parametrize("name", ["target", "draft"])
def test_greedy_continuation_equals_the_recorded_golden_output(models, name):
    from llmstep.engines.generate import generate

    model_dir = TARGET if name == "target" else DRAFT
    golden = json.loads((model_dir / "golden.json").read_text())
    model, tokenizer = models[name]
    out = generate(model, tokenizer, golden["prompt"], max_new_tokens=golden["max_new_tokens"], temperature=0.0)
    assert out.tokens == golden["tokens"]
    assert out.text == golden["text"]


def test_target_beats_draft_and_the_ngram_baseline_on_held_out_plays():
    scores = json.loads((MODELS / "eval.json").read_text())["scores"]
    for split in ("val", "test"):
        by_name = {s["name"]: s for s in scores if s["split"] == split}
        target, draft = by_name["shakespeare-target"], by_name["shakespeare-draft"]
        baseline = by_name["kneser-ney-trigram"]
        assert target["tokens"] == draft["tokens"] == baseline["tokens"]  # the same predictions are scored
        assert target["perplexity"] < 0.85 * draft["perplexity"]
        assert target["perplexity"] < 0.85 * baseline["perplexity"]
        for name in ("shakespeare-target", "shakespeare-draft"):  # the cards carry the same table
            card = (MODELS / name / "README.md").read_text()
            assert f"{target['perplexity']:.2f}" in card and f"{baseline['perplexity']:.2f}" in card


# ---- the measuring stick itself (llmstep eval) ---------------------------------------------------


def test_windows_predict_every_token_exactly_once():
    ids = list(range(23))
    wins = evaluation.windows(ids, seq_len=5)
    predicted = [t for w in wins for t in w[1:]]
    assert predicted == ids[1:]
    assert all(len(w) <= 6 for w in wins)


def test_bytes_counted_are_the_utf8_bytes_of_the_text():
    tok = evaluation.load_tokenizer(data.TOKENIZER_PATH)
    text = "Fair is foul, and foul is fair:\nHover through the fog and filthy air. Naïve 🙂\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert evaluation.count_bytes(tok, [7936, *ids, 7937]) == len(text.encode("utf-8"))


def test_kneser_ney_trigram_is_a_probability_distribution():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (3000,), generator=g).tolist() + [1, 2, 3] * 50
    kn = evaluation.KneserNeyTrigram(vocab_size=25).fit(ids)
    for u, v in [(1, 2), (3, 1), (24, 24), (0, 7)]:  # seen, seen, unseen, random contexts
        assert sum(kn.p3(u, v, w) for w in range(25)) == pytest.approx(1.0)
    assert kn.p3(1, 2, 3) > 0.5  # a pattern repeated 50 times is learned
    nll, n = kn.nll(ids[:100], seq_len=10)
    assert n == 99 and nll > 0
