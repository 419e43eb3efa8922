"""Flags the model's context cannot hold, and text that is not UTF-8, are refused from the config alone: no weight
is read or built (a Llama 3.1 8B preset's random model would take tens of GB before a one-line refusal)."""

from __future__ import annotations

import pytest

from llmstep import cli
from llmstep.core import checkpoint
from llmstep.lab import bench as decode_bench
from llmstep.lab import hardware


@pytest.fixture
def nothing_loads(monkeypatch):
    for owner, name in ((checkpoint, "load_model"), (checkpoint, "load"), (hardware, "random_model"),
                        (decode_bench, "bench_model")):
        monkeypatch.setattr(owner, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))


@pytest.mark.parametrize("argv, words", [
    (["trace", "--preset", "llama-3.1-8b", "--context", "200000"],
     "--context 200000 and the step's token need 200001 positions; the model's context holds 131072"),
    (["trace", "--context", "512"], "need 513 positions; the model's context holds 512"),
    (["profile", "--prompt-len", "500", "--new-tokens", "100"],
     "--prompt-len 500 and --new-tokens 100 need 600 positions; the model's context holds 512"),
    (["bench", "--prompt-len", "500", "--new-tokens", "100", "--no-hf"], "need 600 positions"),
    (["bench", "--peers", "llama.cpp", "--prompt-len", "500", "--new-tokens", "100"], "need 600 positions"),
    (["bench", "--peers", "llama.cpp", "--dtype", "float16"], "--peers compares float32 or bfloat16 weights"),
    (["bench", "--preset", "llama-3.2-1b", "--set", "max_seq_len=64", "--prompt-len", "60", "--new-tokens", "8"],
     "need 68 positions; the model's context holds 64"),
    (["batch", "--prompt-len", "600:600"], "prompts of --prompt-len 600 need 600 positions"),
    (["batch", "--context", "512"], "need 513 positions"),
    (["generate", "--prompt", "ab\udcffcd"], "--prompt is not UTF-8 text: the byte at character 2"),
    (["generate", "--prompt", "x", "--chat", "--system", "\udcc3"], "--system is not UTF-8 text"),
    *((cmd, "argument --temperature: must be at most 3.403e+38 (float32's largest), got 1e+39")  # sampling's rule
      for cmd in (["generate", "--prompt", "x", "--temperature", "1e39"], ["batch", "--temperature", "1e39"],
                  ["speculative", "--temperature", "1e39"])),
])
def test_refused_by_its_flags_before_any_weight(nothing_loads, argv, words):
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(argv)
    assert failed.value.code == 2 and words in str(failed.value), str(failed.value)


def test_info_refuses_its_context_before_printing_anything(capsys):
    with pytest.raises(cli.CommandFailed, match="--context 200000 and the step's token need 200001 positions"):
        cli.main(["info", "--preset", "llama-3.2-1b", "--context", "200000"])
    assert capsys.readouterr().out == ""  # no table above the error


def test_a_prompt_that_fills_the_context_is_taken_by_batch(nothing_loads):
    """A batch prompt may fill the context (its one new token ends it): not refused on its length."""
    with pytest.raises(pytest.fail.Exception, match="load_model ran"):
        cli.main(["batch", "--prompt-len", "500:512", "--new-tokens", "8:8"])


@pytest.fixture
def card_less_draft(tmp_path):
    import shutil

    from llmstep.core.registry import resolve_model_path

    folder = tmp_path / "draft"
    shutil.copytree(resolve_model_path("draft"), folder)
    (folder / "README.md").unlink()
    return folder


@pytest.mark.parametrize("flags, words", [
    (["--update-cards"], "README.md: no model card to update"),
    (["--golden-prompt", ""], "the golden prompt is empty"),
    (["--seq-len", "600"], "seq_len 600 is longer than"),
])
def test_eval_refuses_before_scoring_or_writing(card_less_draft, monkeypatch, flags, words):
    from llmstep.shakespeare import evaluate

    monkeypatch.setattr(evaluate, "evaluate_model", lambda *a, **k: pytest.fail("a model was scored"))
    before = sorted((p.name, p.read_bytes()) for p in card_less_draft.iterdir())
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(["eval", str(card_less_draft), "--no-baseline", "--write-eval-json", *flags])
    assert words in str(failed.value)
    assert sorted((p.name, p.read_bytes()) for p in card_less_draft.iterdir()) == before  # eval.json as it was


@pytest.mark.parametrize("flags, written", [(["--write-eval-json"], "eval.json"),
                                            (["--golden-prompt", "ROMEO:"], "golden.json")])
def test_eval_refuses_a_file_it_cannot_write_in_any_model_before_scoring_the_first(tmp_path, monkeypatch, flags,
                                                                                 written):
    """The second model's eval.json (golden.json) cannot be written (here a folder is in its place; a read-only
    model folder alike): refused before the first model is scored or its own file written."""
    import shutil

    from llmstep.core.registry import resolve_model_path
    from llmstep.shakespeare import evaluate

    monkeypatch.setattr(evaluate, "evaluate_model", lambda *a, **k: pytest.fail("a model was scored"))
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        shutil.copytree(resolve_model_path("draft"), folder)
    (second / written).unlink(missing_ok=True)
    (second / written).mkdir()
    before = sorted((p.name, p.read_bytes()) for p in first.iterdir())
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(["eval", str(first), str(second), "--no-baseline", *flags])
    assert f"{second / written} is a directory" in str(failed.value), str(failed.value)
    assert sorted((p.name, p.read_bytes()) for p in first.iterdir()) == before  # its own file as it was


def test_eval_names_a_file_that_is_not_a_checkpoint_directory(tmp_path):
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(cli.CommandFailed, match="scores a checkpoint directory"):
        cli.main(["eval", str(gguf), "--no-baseline"])


@pytest.mark.parametrize("flags, words", [(["--export", "/proc/llmstep-export"], "--export path"),
                                          (["--n-heads", "5"], ""),
                                          (["--stop-after", "3"], "--stop-after 3 is past the run's last step (2,")])
def test_train_refuses_before_training_and_leaves_no_run_folder(tmp_path, monkeypatch, flags, words):
    from llmstep.shakespeare import train

    monkeypatch.setattr(train, "init_weights", lambda *a, **k: pytest.fail("the model was built"))
    out = tmp_path / "run"
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(["train", "--preset", "tiny", "--steps", "2", "--out", str(out), "--quiet", *flags])
    assert words in str(failed.value) and not out.exists(), str(failed.value)


@pytest.mark.parametrize("argv, words", [
    (["bench", "--quantize", "none", "none"], "each mode once"),
    (["bench", "--group-size", "32"], "--group-size sets int4's groups"),
    (["bench", "--quantize", "none", "int8", "--group-size", "32"], "--group-size sets int4's groups"),
    (["bench", "--quantize-lm-head"], "--quantize-lm-head quantises the head of the quantised rows"),
    (["bench", "--no-compile", "--compile-mode", "max-autotune"], "cannot go with --no-compile"),
    (["profile", "--no-compile", "--compile-mode", "max-autotune"], "cannot go with --no-compile"),
    (["speculative", "--bench", "--compile-mode", "max-autotune"], "add --compile"),
    (["bench", "--device", "cpu", "--compile-mode", "max-autotune"], "not compile on cpu by default: add --compile"),
    (["bench", "--device", "cpu", "--no-eager"], "--no-eager drops the eager rows"),
    (["bench", "--llama-cpp-extra-bufts", "off"], "add --peers llama.cpp"),
    (["bench", "--peers", "llama.cpp", "--no-hf"], "--no-hf sets a row of the bench without --peers"),
    (["bench", "--peers", "llama.cpp", "--hf-dtype", "float32"], "--hf-dtype sets a row of the bench without"),
    (["bench", "--json", ""], "--json"),
    (["profile", "--rate-only", "--steps", "5"], "--steps sets the profile, which --rate-only skips"),
    (["profile", "--rate-only", "--kernel-profile"], "--kernel-profile sets the profile, which --rate-only skips"),
    (["info", "--model", "target", "--context", "512"], "--context 512 and the step's token need 513 positions"),
    (["serve", "--block-size", "100000000"], "--block-size 100000000 is longer than the model's context (512"),
    (["bench", "--preset", "llama-3.2-1b", "--set", "dim=64", "dim=128"],
     "--set dim is given twice (dim=64 and dim=128): give each field once"),
    (["bench", "--preset", "llama-3.2-1b", "--random-weights"], "has random weights already: drop --random-weights"),
])
def test_a_flag_that_would_do_nothing_is_refused(nothing_loads, argv, words):
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(argv)
    assert failed.value.code == 2 and words in str(failed.value), str(failed.value)


def test_the_speculative_bench_refuses_fewer_than_3_new_tokens_by_its_flag(nothing_loads, capsys):
    """With 2, no round has room to propose a token: nothing to measure."""
    with pytest.raises(SystemExit) as e:
        cli.main(["speculative", "--bench", "--max-new-tokens", "2"])
    assert e.value.code == 2 and "--max-new-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("flags, flag", [(["--out", ""], "--out"), (["--out", "run", "--export", ""], "--export")])
def test_train_refuses_an_empty_folder_rather_than_using_the_current_one_or_skipping(tmp_path, monkeypatch, flags,
                                                                                     flag):
    from llmstep.shakespeare import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("the run started"))
    with pytest.raises(cli.CommandFailed, match=f"llmstep train: error: {flag} is empty: give a directory"):
        cli.main(["train", "--preset", "tiny", "--steps", "1", "--quiet", *flags])
    assert list(tmp_path.iterdir()) == []


def test_checksums_refuses_an_empty_out_rather_than_writing_the_default(tmp_path):
    (tmp_path / "a").write_text("a\n")
    with pytest.raises(cli.CommandFailed, match=r"--out path \. is a directory"):  # as every other output flag
        cli.main(["data", "checksums", str(tmp_path), "--out", ""])
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
