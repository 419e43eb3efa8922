"""The training command (`llmstep train`): a tiny model for a few steps on the CPU, checkpoints and resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmstep.cli import main as llmstep_main
from llmstep.shakespeare import data, train


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A few kB of each split of the shipped corpus, so a run tokenizes in milliseconds."""
    out = tmp_path_factory.mktemp("corpus")
    for split, n_bytes in [("train", 60_000), ("val", 6_000), ("test", 6_000)]:
        text = data.read_split(split)[:n_bytes]
        data.write_gzip(out / f"{split}.txt.gz", text.encode())
    return out


def run(out: Path, corpus: Path, *extra: str) -> None:
    llmstep_main(["train", "--preset", "tiny", "--steps", "6", "--eval-every", "3", "--save-every", "2",
                  "--eval-tokens", "256", "--corpus", str(corpus), "--out", str(out), "--quiet", *extra])


def checkpoint(out: Path) -> dict:
    """The run's checkpoint as {"model": state dict, **its JSON state} (read as data: safetensors, no pickle)."""
    from safetensors import safe_open

    with safe_open(out / "ckpt.safetensors", framework="pt") as f:
        header = json.loads(f.metadata()["llmstep_train_state"])
        model = {k.removeprefix("model."): f.get_tensor(k) for k in f.keys() if k.startswith("model.")}
    return header["state"] | {"model": model | {a: model[s] for a, s in header["aliases"].items()}}


def weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint(out)["model"]


def test_tiny_run_writes_a_loadable_hugging_face_checkpoint(tmp_path, small_corpus):
    from llmstep.core.checkpoint import load

    run(tmp_path / "run", small_corpus, "--export", str(tmp_path / "model"))
    model_dir = tmp_path / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                 "README.md", "train.log"):
        assert (model_dir / name).is_file(), name
    model, tokenizer = load(model_dir, device="cpu")
    c = model.config
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads) == (32, 2, 4, 2)
    assert c.rope_theta == 500000.0 and c.tie_embeddings and c.vocab_size == 8192
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert tokenizer.bos_id == 7936 and tokenizer.eos_ids == [7937]
    # the exported bf16 weights are the trained ones, rounded
    trained = weights(tmp_path / "run")["layers.0.attention.wq.weight"]
    assert torch.equal(model.layers[0].attention.wq.weight, trained.to(torch.bfloat16).float())
    card = (model_dir / "README.md").read_text()
    assert "llmstep train --preset tiny --steps 6" in card and "Steps: 6 of 4 x 32 tokens" in card
    log = (model_dir / "train.log").read_text()
    assert "step     6/6" in log and "val" in log


def test_resume_continues_from_the_saved_step_with_identical_results(tmp_path, small_corpus):
    run(tmp_path / "whole", small_corpus)
    run(tmp_path / "split", small_corpus, "--stop-after", "3")
    assert checkpoint(tmp_path / "split")["step"] == 3
    run(tmp_path / "split", small_corpus, "--resume")

    whole = checkpoint(tmp_path / "whole")
    split = checkpoint(tmp_path / "split")
    assert whole["step"] == split["step"] == 6
    for name, w in whole["model"].items():
        assert torch.equal(w, split["model"][name]), name
    assert [r["loss"] for r in whole["history"]] == [r["loss"] for r in split["history"]]
    assert "resumed from" in (tmp_path / "split" / "train.log").read_text()


class RunsCode:
    """A pickle that would touch a file when unpickled: what a crafted ckpt.pt does to torch.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name", ["ckpt.pt", "ckpt.safetensors"])
def test_resume_refuses_a_pickle_without_running_it(tmp_path, small_corpus, name):
    marker = tmp_path / "code-ran"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save({"model": RunsCode(marker), "step": 3}, run_dir / name)  # the format torch.load reads
    with pytest.raises(SystemExit, match=r"llmstep train: error: --resume: .*ckpt\.(pt is a pickle|safetensors is not "
                                         r"a training checkpoint)"):
        run(run_dir, small_corpus, "--resume")
    assert not marker.exists()  # the pickle was never unpickled


def test_resume_refuses_different_settings(tmp_path, small_corpus):
    run(tmp_path / "run", small_corpus, "--stop-after", "2")
    with pytest.raises(SystemExit, match=r"llmstep train: error: --resume: .* different settings \(lr: 0.003 -> 0.5\)"):
        run(tmp_path / "run", small_corpus, "--resume", "--lr", "0.5")
    with pytest.raises(SystemExit, match="llmstep train: error: --resume: no checkpoint"):
        run(tmp_path / "fresh", small_corpus, "--resume")


def test_same_seed_same_model_different_seed_different_model(tmp_path, small_corpus):
    run(tmp_path / "a", small_corpus, "--steps", "2")
    run(tmp_path / "b", small_corpus, "--steps", "2")
    run(tmp_path / "c", small_corpus, "--steps", "2", "--seed", "7")
    a, b, c = weights(tmp_path / "a"), weights(tmp_path / "b"), weights(tmp_path / "c")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])


def test_learning_rate_warms_up_linearly_then_follows_a_cosine():
    cfg = train.TrainConfig(steps=110, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert train.lr_at(0, cfg) == pytest.approx(1e-4)
    assert train.lr_at(9, cfg) == pytest.approx(1e-3)
    assert train.lr_at(60, cfg) == pytest.approx(0.55e-3)  # half way down the cosine
    assert train.lr_at(110, cfg) == pytest.approx(1e-4)
    lrs = [train.lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_batches_depend_only_on_seed_and_step():
    ids = torch.arange(1000)
    cfg = train.TrainConfig(batch_size=3, seq_len=8, seed=1)
    x, y = train.get_batch(ids, 5, cfg)
    assert x.shape == y.shape == (3, 8) and torch.equal(y, x + 1)  # targets are the next tokens
    assert torch.equal(x, train.get_batch(ids, 5, cfg)[0])
    assert not torch.equal(x, train.get_batch(ids, 6, cfg)[0])


def test_presets_have_llama3_shapes_with_gqa():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data.TOKENIZER_PATH))
    for preset in ("target", "draft"):
        c = train.model_config(preset, tok)
        assert c.n_kv_heads < c.n_heads and c.rope_theta == 500000.0 and c.vocab_size == 8192
    n = {p: sum(math.prod(s) for _, s in _shapes(train.model_config(p, tok))) for p in ("target", "draft")}
    assert 8e6 <= n["target"] <= 15e6 and n["draft"] < n["target"] / 5


def _shapes(config):
    from llmstep.core.checkpoint import hf_names

    return hf_names(config).values()


def _kl_to(teacher, student, ids: torch.Tensor) -> float:
    """Mean KL(teacher || student) of the next-token distributions over ids [B, T]."""
    with torch.no_grad():
        p, log_q = torch.softmax(teacher(ids).float(), -1), torch.log_softmax(student(ids).float(), -1)
        return float((p * (p.clamp_min(1e-30).log() - log_q)).sum(-1).mean())


def test_distillation_starts_from_the_given_weights_and_moves_towards_the_teacher(tmp_path, small_corpus):
    from llmstep.core.checkpoint import load_model

    run(tmp_path / "teacher-run", small_corpus, "--seed", "1", "--export", str(tmp_path / "teacher"))
    run(tmp_path / "start-run", small_corpus, "--seed", "2", "--export", str(tmp_path / "start"))
    start = load_model(tmp_path / "start", device="cpu", dtype=torch.float32)
    teacher = load_model(tmp_path / "teacher", device="cpu", dtype=torch.float32)
    # --init-from: before any step the student is the starting checkpoint, not a fresh init (one step at lr 0,
    # weight decay included, moves no weight: stop_after is at least 1, the step whose checkpoint is written)
    cfg = train.TrainConfig(**train.RECIPES["tiny"] | dict(preset="tiny", corpus=str(small_corpus), lr=0.0,
                                                           init_from=str(tmp_path / "start")))
    untrained = train.train(cfg, tmp_path / "zero", {}, stop_after=1, quiet=True)
    assert all(torch.equal(w, start.state_dict()[k]) for k, w in untrained.state_dict().items())
    # 30 steps against the teacher's distribution bring the student closer to it
    llmstep_main(["train", "--preset", "tiny", "--steps", "30", "--eval-every", "30", "--eval-tokens", "256",
                  "--corpus", str(small_corpus), "--out", str(tmp_path / "distil"), "--quiet", "--init-from",
                  str(tmp_path / "start"), "--teacher", str(tmp_path / "teacher"), "--export",
                  str(tmp_path / "student")])
    student = load_model(tmp_path / "student", device="cpu", dtype=torch.float32)
    from tokenizers import Tokenizer

    text = data.read_split("val", small_corpus)
    ids = torch.tensor(data.encode_split(Tokenizer.from_file(str(data.TOKENIZER_PATH)), text)[:256]).view(4, 64)
    before, after = _kl_to(teacher, start, ids), _kl_to(teacher, student, ids)
    assert after < 0.8 * before, (before, after)
    assert "--teacher" in (tmp_path / "student" / "README.md").read_text()


def test_distillation_refuses_a_mismatched_start_or_teacher(tmp_path, small_corpus):
    run(tmp_path / "tiny-run", small_corpus, "--export", str(tmp_path / "tiny"))
    with pytest.raises(SystemExit, match="llmstep train: error: --init-from .*shape differs"):
        llmstep_main(["train", "--preset", "tiny", "--dim", "64", "--steps", "2", "--corpus", str(small_corpus),
                      "--out", str(tmp_path / "a"), "--quiet", "--init-from", str(tmp_path / "tiny")])
    with pytest.raises(SystemExit, match="llmstep train: error: .*missing"):
        llmstep_main(["train", "--preset", "tiny", "--steps", "2", "--corpus", str(small_corpus),
                      "--out", str(tmp_path / "b"), "--quiet", "--teacher", str(tmp_path / "missing")])


def test_train_config_is_the_recipe_with_overrides():
    cfg = train.train_config("tiny", steps=3, lr=None)
    assert cfg.preset == "tiny" and cfg.steps == 3 and cfg.lr == train.RECIPES["tiny"]["lr"]
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        train.train_config("huge")
    with pytest.raises(ValueError, match=r"not TrainConfig fields: \['dim'\]"):
        train.train_config("tiny", dim=64)


def test_a_batch_that_cannot_fit_is_refused_with_its_estimate_before_training(tmp_path):
    with pytest.raises(SystemExit, match=r"llmstep train: error: training tiny with batches of 100000000 x .* needs "
                                         r"about [\d,.]+ GB, but cpu has"):
        llmstep_main(["train", "--preset", "tiny", "--steps", "2", "--quiet", "--out", str(tmp_path / "run"),
                      "--batch-size", "100000000", "--device", "cpu"])
    assert not (tmp_path / "run" / "ckpt.safetensors").exists()


def test_a_tokenizer_file_that_is_not_json_is_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("not json")
    with pytest.raises(SystemExit, match=rf"llmstep train: error: {bad} is not a valid tokenizer.json"):
        llmstep_main(["train", "--preset", "tiny", "--steps", "2", "--quiet", "--out", str(tmp_path / "run"),
                      "--tokenizer", str(bad), "--device", "cpu"])


def test_a_checkpoint_that_cannot_be_written_is_an_os_error_naming_it(tmp_path):
    import resource

    from llmstep.shakespeare.train_state import save_train_state

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / "ckpt.safetensors"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))  # a file-size limit (Python ignores SIGXFSZ): EFBIG
    try:
        with pytest.raises(OSError, match=r"ckpt.safetensors: the training checkpoint could not be written"):
            save_train_state(path, model, optimizer, {"step": 1})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def rewrite_checkpoint(out: Path, tensors=None, header=None) -> None:
    """Change a run's checkpoint as a damaged disk or a hostile file would: tensors[name] = fn(tensor), or
    header = fn(header) on its JSON header."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = out / "ckpt.safetensors"
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["llmstep_train_state"])
        stored = {k: f.get_tensor(k) for k in f.keys()}
    for name, fn in (tensors or {}).items():
        stored[name] = fn(stored[name])
    meta = header(meta) if header else meta
    save_file(stored, path, metadata={"llmstep_train_state": json.dumps(meta)})


def _set(*keys, value):
    def change(h):
        d = h
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
        return h
    return change


def test_resume_refuses_non_finite_weights_and_moments(tmp_path, small_corpus):
    run(tmp_path / "run", small_corpus, "--stop-after", "2")
    good = (tmp_path / "run" / "ckpt.safetensors").read_bytes()
    for name in ("model.layers.0.attention.wq.weight", "optimizer.3.exp_avg_sq"):
        (tmp_path / "run" / "ckpt.safetensors").write_bytes(good)
        rewrite_checkpoint(tmp_path / "run", tensors={name: lambda t: t.index_fill(0, torch.tensor([0]), math.nan)})
        with pytest.raises(SystemExit, match=f"--resume: .*ckpt.safetensors: tensor {name} holds NaN"):
            run(tmp_path / "run", small_corpus, "--resume")
    assert checkpoint(tmp_path / "run")["step"] == 2  # nothing trained, nothing written


@pytest.mark.parametrize("change, match", [
    (_set("state", "step", value=-5), "step must be an integer >= 0, got -5"),
    (_set("state", "step", value="3"), "step must be an integer >= 0, got '3'"),
    (_set("state", "history", value=7), "history must be a list of records"),
    (_set("state", "elapsed_seconds", value=math.inf), "elapsed_seconds must be a finite number"),
    (_set("optimizer", "param_groups", 0, "maximize", value=True), "group 0 has maximize True, but this run's"),
    (_set("optimizer", "param_groups", 0, "weight_decay", value=1e30), "group 0 has weight_decay 1e\\+30"),
    (_set("optimizer", "param_groups", 1, "eps", value=math.nan), "group 1 has eps nan"),
    (_set("optimizer", "param_groups", value={"a": 1}), "parameter groups"),
    (_set("optimizer", "scalars", value=[1]), "optimizer scalars must be finite numbers"),
], ids=["negative-step", "string-step", "history-type", "inf-elapsed", "maximize", "weight-decay", "nan-eps",
        "groups-type", "scalars-type"])
def test_resume_validates_the_training_state_header(tmp_path, small_corpus, change, match):
    run(tmp_path / "run", small_corpus, "--stop-after", "2")
    rewrite_checkpoint(tmp_path / "run", header=change)
    with pytest.raises(SystemExit, match=r"llmstep train: error: --resume: .*ckpt.safetensors: .*" + match):
        run(tmp_path / "run", small_corpus, "--resume")


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path, small_corpus, monkeypatch):
    real = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda step, cfg: real(step, cfg) if step < 2 else 1e30)  # blows up at 3
    with pytest.raises(SystemExit, match=r"llmstep train: error: training diverged at step [34]: .*stopped without "
                                         r"saving \(.*ckpt.safetensors keeps step 2\)"):
        run(tmp_path / "run", small_corpus)
    saved = checkpoint(tmp_path / "run")
    assert saved["step"] == 2 and all(bool(torch.isfinite(w).all()) for w in saved["model"].values())
