"""How a command ends when a run goes wrong: an interrupt keeps what finished (records written as they grow),
Ctrl-C in `generate` is one line and exit 130 with the text's line ended, NaN logits end `generate` with
exit status 2, and `eval draft` finds the shipped draft and its tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from llmstep import cli
from llmstep.core import model as model_module
from llmstep.lab import bench_batching
from llmstep.shakespeare import evaluate


def test_an_interrupted_batch_run_keeps_the_runs_that_finished(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    real = bench_batching.serve_both_ways

    def one_run_then_ctrl_c(*args, **kwargs):
        yield next(iter(real(*args, **kwargs)))
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_batching, "serve_both_ways", one_run_then_ctrl_c)
    out = tmp_path / "batch.json"
    with pytest.raises(SystemExit) as e:
        cli.main(["batch", "--model", str(tiny_checkpoint), "--device", "cpu", "--requests", "3", "--slots", "2",
                  "--prompt-len", "4:6", "--new-tokens", "2:4", "--batch-sizes", "1", "--json", str(out)])
    assert e.value.code == 130 and capsys.readouterr().err == "llmstep batch: interrupted\n"
    record = json.loads(out.read_text())
    assert len(record["runs"]) == 1 and record["finished"] is False and record["runs"][0]["requests"] == 3


def test_speculative_writes_its_report_after_every_repeat(tmp_path, tiny_checkpoint, monkeypatch):
    from llmstep.lab import bench_speculative

    real = bench_speculative.bench

    def interrupted_after_one_repeat(*args, on_repeat=None, **kwargs):
        def then_ctrl_c(partial):
            on_repeat(partial)
            raise KeyboardInterrupt

        return real(*args, on_repeat=then_ctrl_c, **kwargs)

    monkeypatch.setattr(bench_speculative, "bench", interrupted_after_one_repeat)
    out = tmp_path / "spec.json"
    with pytest.raises(SystemExit) as e:
        cli.main(["speculative", "--bench", "--target", str(tiny_checkpoint), "--draft", "self-1", "--ks", "1",
                  "--max-new-tokens", "4", "--repeats", "2", "--out", str(out)])
    assert e.value.code == 130
    report = json.loads(out.read_text())
    assert report["repeats_done"] == 1 and len(report["results"]["k=1"]["all_runs"]) == 1
    assert report["command"].startswith("llmstep speculative --bench")


def test_ctrl_c_while_generate_streams_is_one_line_exit_130_and_the_text_line_is_ended(tiny_checkpoint, monkeypatch,
                                                                                      capsys):
    forward, calls = model_module.Llama.forward, []

    def interrupted_at_the_fourth_forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_module.Llama, "forward", interrupted_at_the_fourth_forward)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", "--max-new-tokens", "20",
                  "--temperature", "0"])
    captured = capsys.readouterr()
    assert e.value.code == 130 and captured.err == "llmstep generate: interrupted\n"
    assert captured.out.startswith("thy") and captured.out.endswith("\n")


def test_generate_with_nan_logits_exits_2_naming_the_step(tiny_checkpoint, monkeypatch, capsys):
    forward = model_module.Llama.forward

    def nan_logits(self, *args, **kwargs):
        return torch.full_like(forward(self, *args, **kwargs), float("nan"))

    monkeypatch.setattr(model_module.Llama, "forward", nan_logits)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", "--max-new-tokens", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("llmstep generate: error: the model produced non-finite logits (NaN or Inf) at step 0")


def test_eval_draft_finds_the_shipped_draft_and_its_tokenizer(monkeypatch, tmp_path):
    from llmstep.core.checkpoint import resolve_model_path

    seen = {}

    def record(models, *args, **kwargs):
        seen["models"] = models
        raise KeyboardInterrupt  # the arguments are all this test needs

    monkeypatch.setattr(evaluate, "evaluate_models", record)
    with pytest.raises(SystemExit):
        cli.main(["eval", "draft", "--json", str(tmp_path / "scores.json")])
    assert seen["models"] == [str(resolve_model_path("draft"))]
    assert (resolve_model_path("draft") / "tokenizer.json").is_file()


def test_a_reader_that_closes_the_pipe_ends_generate_quietly_with_141(tiny_checkpoint):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "llmstep", "generate", "--model", str(tiny_checkpoint), "--prompt",
                             "ab", "--max-new-tokens", "100000", "--temperature", "1", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(1)  # `| head -c 1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Errno" not in err and "Traceback" not in err and "internal error" not in err
