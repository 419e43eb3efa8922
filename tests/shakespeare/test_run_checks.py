"""`llmstep train` and `llmstep eval` refuse bad input before they write anything: a fresh run over a checkpoint,
sources that do not fit, a stop or a slice that leaves nothing to do, an empty split, AdamW settings out of bounds, a
shape train cannot make, optimizer moments of the wrong shape. A run's
log is one run's; every seed the command line takes trains (the shipped seeds' batches unchanged); a model card's
note gives its own model's window."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from llmstep.cli import main as llmstep_main
from llmstep.shakespeare import data, evaluate, train
from llmstep.shakespeare.train_state import TrainStateError, load_train_state, save_train_state


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A few kB of each split of the shipped corpus, so a run tokenizes in milliseconds."""
    out = tmp_path_factory.mktemp("corpus")
    for split, n_bytes in [("train", 60_000), ("val", 6_000), ("test", 6_000)]:
        data.write_gzip(out / f"{split}.txt.gz", data.read_split(split)[:n_bytes].encode())
    return out


def run(out: Path, corpus: Path, *extra: str) -> None:
    llmstep_main(["train", "--preset", "tiny", "--steps", "6", "--eval-every", "3", "--save-every", "2",
                  "--eval-tokens", "256", "--corpus", str(corpus), "--out", str(out), "--quiet", *extra])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, small_corpus) -> dict[int, Path]:
    """Two exported tiny models, of contexts 64 (the preset's) and 16: {context: directory}."""
    root = tmp_path_factory.mktemp("models")
    run(root / "run64", small_corpus, "--steps", "2", "--export", str(root / "tiny64"))
    run(root / "run16", small_corpus, "--steps", "2", "--max-seq-len", "16", "--seq-len", "16",
        "--export", str(root / "tiny16"))
    return {64: root / "tiny64", 16: root / "tiny16"}


def step_of(out: Path) -> int:
    from safetensors import safe_open

    with safe_open(out / "ckpt.safetensors", framework="pt") as f:
        return json.loads(f.metadata()["llmstep_train_state"])["state"]["step"]


# --------------------------------------------------------------------------------------------------
# The run folder: one run's checkpoint and log
# --------------------------------------------------------------------------------------------------


def test_a_fresh_run_into_a_folder_with_a_checkpoint_is_refused_before_writing(tmp_path, small_corpus):
    out = tmp_path / "run"
    run(out, small_corpus, "--stop-after", "2")
    ckpt, log = (out / "ckpt.safetensors").read_bytes(), (out / "train.log").read_bytes()
    with pytest.raises(SystemExit, match=r"llmstep train: error: --out .*run already holds a training checkpoint "
                                         r"\(ckpt.safetensors\): give --resume to continue it, or another --out"):
        run(out, small_corpus)
    with pytest.raises(ValueError, match=r"already holds a training checkpoint .*resume"):  # the library's own
        train.train(train.train_config("tiny", corpus=str(small_corpus)), out, {}, quiet=True)
    assert (out / "ckpt.safetensors").read_bytes() == ckpt and (out / "train.log").read_bytes() == log
    run(out, small_corpus, "--resume")  # what the message says to do
    assert step_of(out) == 6


def test_a_fresh_run_starts_its_log_anew(tmp_path, small_corpus):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.log").write_text("2000-01-01 00:00:00 step     9/9 loss 1.0000 (an earlier run)\n")
    run(out, small_corpus, "--steps", "2")
    log = (out / "train.log").read_text()
    assert "an earlier run" not in log and log.count("step     2/2") == 1


def test_a_resumed_run_cuts_its_log_at_the_checkpoint_and_marks_the_resumption(tmp_path, small_corpus):
    out = tmp_path / "run"
    run(out, small_corpus, "--stop-after", "2")
    with open(out / "train.log", "a") as f:  # a run that logged step 3 and died before its next checkpoint
        f.write("2000-01-01 00:00:00 step     3/6 loss 9.9999 val 9.9999 lr 3.00e-03 (lost)\n"
                "2000-01-01 00:00:01 a line after it (lost)\n")
    run(out, small_corpus, "--resume", "--export", str(tmp_path / "model"))
    log = (out / "train.log").read_text()
    assert "(lost)" not in log
    lines = log.splitlines()
    resumed = next(i for i, line in enumerate(lines) if "resumed from" in line)
    assert "at step 2" in lines[resumed]
    steps = [(i, line.split()[3]) for i, line in enumerate(lines) if line.split()[2:3] == ["step"]]
    assert [at for i, at in steps if i < resumed] == ["1/6"]  # the first run's, up to its checkpoint
    assert [at for i, at in steps if i > resumed] == ["3/6", "6/6"]  # step 3 trained again, logged once
    exported = (tmp_path / "model" / "train.log").read_text()  # the run's log up to the export, no lost line
    assert log.startswith(exported) and "6/6" in exported and "(lost)" not in exported


# --------------------------------------------------------------------------------------------------
# Bad input, refused before the run folder is made
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, match", [
    (["--teacher", "{short}"], r"--teacher .*tiny16: its context \(16 tokens\) is shorter than the training windows "
                            r"\(seq_len 32\)"),
    (["--init-from", "{short}"], r"--init-from .*tiny16: its shape differs"),
    (["--teacher", "{missing}"], r"--teacher: no model directory .*missing"),
    (["--init-from", "{missing}"], r"--init-from: no model directory .*missing"),
    (["--resume"], r"--resume: no checkpoint at .*ckpt.safetensors"),
    (["--stop-after", "0"], r"argument --stop-after: must be an integer in 1 \.\."),
    (["--eval-tokens", "1"], r"argument --eval-tokens: must be an integer in 2 \.\."),
    (["--export", "{here}"], r"cannot save into .*: it is the current folder or holds it"),
    (["--lr", "1e39"], r"argument --lr: must be a number in \[0, 10\], got 1e39"),  # past float32: AdamW overflowed
    (["--weight-decay", "1e300"], r"argument --weight-decay: must be a number in \[0, 10\], got 1e300"),
    (["--beta1", "1"], r"argument --beta1: must be a number in \[0, 1\), got 1"),  # torch named no flag
    (["--beta2", "1"], r"argument --beta2: must be a number in \[0, 1\), got 1"),
    (["--dim", "30"], r"dim \(30\) is not divisible by n_heads \(4\): each head is dim / n_heads wide, an even "
                      r"width \(RoPE rotates pairs\); give another --dim or --n-heads$"),  # train takes no --head-dim
    (["--dim", "20"], r"head_dim must be a positive even number .* got 5: each head is dim / n_heads wide"),
], ids=["short-teacher", "init-shape", "missing-teacher", "missing-init", "no-checkpoint", "stop-after-0",
        "eval-tokens-1", "export-here", "lr-past-float32", "weight-decay", "beta1-1", "beta2-1", "dim-30", "dim-20"])
def test_bad_input_is_refused_before_the_run_folder_is_made(tmp_path, small_corpus, tiny_models, extra, match,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)  # --export there would replace the folder the process runs in, after training
    names = {"short": str(tiny_models[16]), "missing": str(tmp_path / "missing"), "here": "."}
    extra = [a.format(**names) if a.startswith("{") else a for a in extra]
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"llmstep train: error: .*" + match):
        run(out, small_corpus, *extra)
    assert not out.exists()


def test_the_library_refuses_a_stop_with_no_checkpoint_and_a_slice_with_no_prediction(tmp_path, small_corpus):
    cfg = train.train_config("tiny", corpus=str(small_corpus))
    with pytest.raises(ValueError, match=r"stop_after must be a positive integer .*got 0"):
        train.train(cfg, tmp_path / "run", {}, stop_after=0, quiet=True)
    with pytest.raises(ValueError, match=r"eval_tokens must be an integer >= 2 .*got 1"):
        train.train_config("tiny", eval_tokens=1)
    with pytest.raises(ValueError, match=r"eval_tokens must be an integer >= 2"):  # a TrainConfig made directly
        train.train(train.TrainConfig(**train.RECIPES["tiny"] | dict(preset="tiny", eval_tokens=1)),
                    tmp_path / "run", {}, quiet=True)
    assert not (tmp_path / "run").exists()


def test_the_library_bounds_adamws_settings_before_the_run(tmp_path, small_corpus):
    for name, value, span in [("lr", 1e39, r"\[0, 10\]"), ("lr", float("nan"), r"\[0, 10\]"),
                              ("lr", -1e-3, r"\[0, 10\]"), ("weight_decay", -0.1, r"\[0, 10\]"),
                              ("beta1", 1.0, r"\[0, 1\)"), ("beta2", 1.5, r"\[0, 1\)")]:
        with pytest.raises(ValueError, match=rf"^{name} must be a number in {span}, got {re.escape(repr(value))}$"):
            train.train_config("tiny", **{name: value})
        made = train.TrainConfig(**train.RECIPES["tiny"] | {"preset": "tiny", "corpus": str(small_corpus), name: value})
        with pytest.raises(ValueError, match=rf"^{name} must be a number"):  # a TrainConfig made directly
            train.train(made, tmp_path / "run", {}, quiet=True)
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_refuses_a_stop_at_or_before_its_checkpoint(tmp_path, small_corpus):
    out = tmp_path / "run"
    run(out, small_corpus, "--stop-after", "4")
    ckpt, log = (out / "ckpt.safetensors").read_bytes(), (out / "train.log").read_bytes()
    for stop in ("2", "4"):  # it would train nothing, and log "stopped after step 4"
        with pytest.raises(SystemExit, match=rf"llmstep train: error: --stop-after {stop} is not past the checkpoint's "
                                             r"step \(4\): give a later step, up to --steps \(6\), or none"):
            run(out, small_corpus, "--resume", "--stop-after", stop)
    assert (out / "ckpt.safetensors").read_bytes() == ckpt and (out / "train.log").read_bytes() == log
    run(out, small_corpus, "--resume", "--stop-after", "5")
    assert step_of(out) == 5


@pytest.fixture
def emptied(tmp_path, small_corpus):
    """A copy of the small corpus with one split emptied: emptied("val") is its folder."""
    def make(split: str) -> Path:
        corpus = shutil.copytree(small_corpus, tmp_path / f"no-{split}")
        data.write_gzip(corpus / f"{split}.txt.gz", b"")
        return corpus

    return make


def test_an_empty_val_split_is_refused_naming_its_file_before_the_run_folder(tmp_path, emptied):
    corpus = emptied("val")
    with pytest.raises(SystemExit, match=r"llmstep train: error: .*no-val/val.txt.gz: the val split holds 0 tokens "
                                         r"\(an empty file\?\), and needs at least 2: a context token and one to "
                                         r"predict$"):
        run(tmp_path / "run", corpus)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("split, flags", [("val", ["--no-baseline"]), ("train", [])])
def test_eval_refuses_an_empty_split_naming_its_file_before_loading_a_model(tiny_models, emptied, monkeypatch, split,
                                                                            flags):
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evaluate, "load_model", loaded)
    corpus = emptied(split)  # the baseline is fitted on the train split
    with pytest.raises(SystemExit, match=rf"llmstep eval: error: .*no-{split}/{split}.txt.gz: the {split} split "
                                         r"holds 0 tokens"):
        llmstep_main(["eval", str(tiny_models[64]), "--split", "val", "--corpus", str(corpus), *flags])


# --------------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------------


def test_every_seed_the_command_line_takes_trains(tmp_path, small_corpus):
    run(tmp_path / "run", small_corpus, "--steps", "1", "--seed", str(2**64 - 1))
    assert step_of(tmp_path / "run") == 1


def test_batches_of_seeds_below_2_44_are_those_the_shipped_models_were_trained_on():
    ids = torch.arange(10_000)
    for seed in (0, 1, 7, 1337, 2**44 - 1):
        cfg = train.TrainConfig(batch_size=4, seq_len=16, seed=seed)
        for step in (0, 1, 899, 10**6):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # the formula the models were made with
            starts = torch.randint(0, len(ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
            x, y = train.get_batch(ids, step, cfg)
            assert torch.equal(x[:, 0], starts) and torch.equal(y[:, -1], starts + cfg.seq_len), (seed, step)
    big = train.TrainConfig(batch_size=4, seq_len=16, seed=2**64 - 1)
    assert torch.equal(train.get_batch(ids, 3, big)[0], train.get_batch(ids, 3, big)[0])


# --------------------------------------------------------------------------------------------------
# Optimizer moments on resume
# --------------------------------------------------------------------------------------------------


def _linear_checkpoint(path: Path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    save_train_state(path, model, optimizer, {"step": 1})
    fresh = torch.nn.Linear(4, 3)
    return fresh, torch.optim.AdamW(fresh.parameters(), foreach=False)


def _edit(path: Path, fn) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    fn(tensors)
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update({"optimizer.0.exp_avg": t["optimizer.0.exp_avg"].flatten()}),
     r"parameter 0's optimizer exp_avg must have the parameter's shape \[3, 4\], got shape \[12\]"),
    (lambda t: t.update({"optimizer.1.exp_avg_sq": torch.zeros(1)}),
     r"parameter 1's optimizer exp_avg_sq must have the parameter's shape \[3\], got shape \[1\]"),
    (lambda t: t.pop("optimizer.1.exp_avg_sq"), r"parameter 1's optimizer exp_avg_sq .* got none"),
    (lambda t: [t.pop(k) for k in list(t) if k.startswith("optimizer.1.")], r"parameter 1's optimizer exp_avg .*none"),
    (lambda t: t.pop("optimizer.0.step"), r"parameter 0's optimizer step must be a number >= 0, got None"),
    (lambda t: t.update({"optimizer.0.step": torch.ones(2)}), r"parameter 0's optimizer step must be a number"),
    (lambda t: t.update({"optimizer.5.exp_avg": torch.zeros(3)}), r"optimizer state for parameter 5, which"),
], ids=["exp-avg-shape", "exp-avg-sq-shape", "no-exp-avg-sq", "no-state", "no-step", "step-shape", "extra-index"])
def test_resume_refuses_optimizer_moments_that_do_not_fit_the_parameters(tmp_path, edit, match):
    path = tmp_path / "ckpt.safetensors"
    model, optimizer = _linear_checkpoint(path)
    load_train_state(path, model, optimizer)  # the file as written loads
    model, optimizer = _linear_checkpoint(path)
    _edit(path, edit)
    with pytest.raises(TrainStateError, match=r"ckpt.safetensors: does not fit .*" + match):
        load_train_state(path, model, optimizer)
    assert optimizer.state_dict()["state"] == {}  # nothing was put into the optimizer


def test_a_resumed_run_refuses_a_moment_of_another_shape_before_writing(tmp_path, small_corpus):
    out = tmp_path / "run"
    run(out, small_corpus, "--stop-after", "2")
    _edit(out / "ckpt.safetensors", lambda t: t.update({"optimizer.3.exp_avg": t["optimizer.3.exp_avg"][:1]}))
    log = (out / "train.log").read_bytes()
    with pytest.raises(SystemExit, match=r"llmstep train: error: --resume: .*parameter 3's optimizer exp_avg must "
                                         r"have the parameter's shape"):
        run(out, small_corpus, "--resume")
    assert (out / "train.log").read_bytes() == log and step_of(out) == 2


# --------------------------------------------------------------------------------------------------
# llmstep eval
# --------------------------------------------------------------------------------------------------


def test_the_gzip_figures_in_evals_help_are_the_manifests():
    manifest = json.loads((data.CORPUS_DIR / "manifest.json").read_text())["splits"]
    doc = " ".join(evaluate.__doc__.split())
    for split, info in manifest.items():
        assert f"{info['gz_bytes'] * 8 / info['bytes']:.2f} " + ("bits per byte on train" if split == "train"
                                                                  else f"on {split}") in doc
    assert "2.5 bits" not in doc


def test_each_card_gives_its_own_models_window(tmp_path, small_corpus, tiny_models):
    a, b = shutil.copytree(tiny_models[64], tmp_path / "tiny64"), shutil.copytree(tiny_models[16], tmp_path / "tiny16")
    llmstep_main(["eval", str(a), str(b), "--split", "val", "--max-tokens", "64", "--corpus", str(small_corpus),
                  "--update-cards"])
    note_a, note_b = ((m / "README.md").read_text().split(evaluate.CARD_START)[1] for m in (a, b))
    assert "windows of 64 tokens (16 for tiny16), first 64 tokens)" in note_a
    assert "windows of 16 tokens (64 for tiny64, 64 for kneser-ney-trigram), first 64 tokens)" in note_b
    same = evaluate.card_note(512, None, {"shakespeare-target": 512, "shakespeare-draft": 512})
    assert same == evaluate.card_note(512)  # one window for every row: the note the shipped cards carry


def test_eval_refuses_a_one_token_slice_before_loading_a_model(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evaluate, "evaluate_model", loaded)
    with pytest.raises(SystemExit, match=r"llmstep eval: error: max_tokens must be at least 2 .*got 1"):
        llmstep_main(["eval", "draft", "--max-tokens", "1", "--no-baseline"])
    with pytest.raises(ValueError, match=r"max_tokens must be at least 2"):
        evaluate.evaluate_models(["draft"], splits=("val",), max_tokens=1, baseline=False)


def test_eval_refuses_a_split_named_twice_before_loading_a_model(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evaluate, "evaluate_model", loaded)
    with pytest.raises(SystemExit, match=r"llmstep eval: error: --split val test val: each split once"):
        llmstep_main(["eval", "draft", "--split", "val", "test", "val", "--no-baseline"])


def test_the_library_refuses_an_export_folder_save_cannot_write_before_the_run(tmp_path, small_corpus):
    cfg = train.train_config("tiny", corpus=str(small_corpus))
    (tmp_path / "a-file").write_text("x")
    for export in (tmp_path / "a-file", tmp_path / "a-file" / "model"):
        with pytest.raises(NotADirectoryError, match="a-file"):
            train.train(cfg, tmp_path / "run", {}, export_dir=export, quiet=True)
        assert not (tmp_path / "run").exists()
