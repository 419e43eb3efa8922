"""`llmstep generate --quantize`: the loaded float weights quantized before generating (the same text as
`quantize` then `llmstep.generate`, the mode named in the summary line), and every combination it cannot serve
refused with one line before any weight is read."""

from __future__ import annotations

import re

import pytest
import torch

import llmstep
from llmstep import cli
from llmstep.core import checkpoint, parallel
from llmstep.core.quantize import quantize


@pytest.mark.parametrize("mode", ["int8", "int4-g16+lm_head-int8"])
def test_the_text_is_the_quantized_models_and_the_summary_names_it(tiny_checkpoint, capsys, mode):
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", "--max-new-tokens", "12",
            "--temperature", "0", "--device", "cpu", "--dtype", "float32"]
    cli.main(argv + ["--quantize", mode])
    out = capsys.readouterr()
    model, tokenizer = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    float_text = llmstep.generate(model, tokenizer, "thy", max_new_tokens=12, temperature=0).text
    want = llmstep.generate(quantize(model, mode), tokenizer, "thy", max_new_tokens=12, temperature=0).text
    assert out.out == "thy" + want + "\n"
    assert f"[cpu float32 {mode}]" in out.err
    cli.main(argv)
    plain = capsys.readouterr()
    assert plain.out == "thy" + float_text + "\n" and "[cpu float32]" in plain.err
    read = [float(e.split(" MB read per token")[0].rsplit("| ", 1)[1]) for e in (out.err, plain.err)]
    assert read[0] < read[1]  # fewer weight bytes a step than the float model's


@pytest.fixture
def no_loading(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(checkpoint, "load", load)


@pytest.mark.parametrize("extra, says", [
    (["--quantize", "int4-g48"], "group_size 48 does not divide"),
    (["--quantize", "int4-g32+lm_head-int8", "--keep-quantized"], "is a checkpoint directory"),
    (["--quantize", "int8", "--draft", "self-int4"], "--draft self-int4 quantizes the float target"),
    (["--keep-quantized", "--draft", "self-int8"], "--draft self-int8 quantizes a float copy of the target; "
                                                   "--keep-quantized keeps"),
])
def test_what_it_cannot_serve_is_refused_before_loading(tiny_checkpoint, no_loading, extra, says):
    with pytest.raises(SystemExit, match=f"llmstep generate: error: .*{says}"):
        cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", *extra])


def test_a_quantized_checkpoint_is_refused_by_its_path(tmp_path, tiny_checkpoint, no_loading):
    model, tokenizer = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    path = checkpoint.save(quantize(model, "int8"), tmp_path / "int8", tokenizer)
    with pytest.raises(SystemExit, match=re.escape(f"{path} is quantized already (int8)")):
        cli.main(["generate", "--model", str(path), "--prompt", "thy", "--quantize", "int4"])


def test_under_torchrun_it_is_refused(tiny_checkpoint, no_loading, monkeypatch):
    monkeypatch.setattr(parallel, "launched_by_torchrun", lambda: True)
    with pytest.raises(SystemExit, match="--quantize does not run tensor-parallel"):
        cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", "--quantize", "int8"])
    monkeypatch.setattr(parallel, "init_from_environment", lambda *a: pytest.fail("the process group was joined"))
    with pytest.raises(SystemExit, match="--keep-quantized does not run tensor-parallel"):  # it would dequantize
        cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", "--keep-quantized"])


@pytest.mark.parametrize("draft", ["self-1", "checkpoint"])
def test_a_draft_keeps_the_quantized_targets_greedy_text(tiny_checkpoint, capsys, draft):
    """A self-N draft shares the target's first layers, quantized in place before it is made; a checkpoint draft is
    its own float model. Either way greedy speculative decoding gives the quantized target's own text."""
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", "--max-new-tokens", "16", "--temperature",
            "0", "--device", "cpu", "--dtype", "float32", "--quantize", "int8"]
    cli.main(argv)
    alone = capsys.readouterr().out
    cli.main(argv + ["--draft", draft if draft != "checkpoint" else str(tiny_checkpoint)])  # itself, unquantized
    assert capsys.readouterr().out == alone


def test_greedy_says_the_draws_settings_change_nothing(tiny_checkpoint, capsys):
    """--temperature 0 takes the likeliest token: --top-k / --top-p / --seed given with it are named as doing
    nothing (the text is the greedy one), and no note where none is given."""
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "thy", "--max-new-tokens", "6",
            "--temperature", "0", "--device", "cpu", "--dtype", "float32"]
    cli.main(argv)
    plain = capsys.readouterr()
    assert "note: greedy" not in plain.err
    cli.main(argv + ["--top-k", "3", "--seed", "7"])
    noted = capsys.readouterr()
    assert noted.out == plain.out
    assert "by --temperature 0" in noted.err and "--top-k, --seed change nothing" in noted.err
    assert "--top-p" not in noted.err
    cli.main(argv + ["--top-p", "0.5"])
    assert "; --top-p changes nothing" in capsys.readouterr().err


def test_info_reports_a_quantized_checkpoints_own_bytes(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """`llmstep info` on a quantized checkpoint: its mode, its bytes in memory and a step's weight bytes as stored
    (core.cost's one rule), not the float model's."""
    from llmstep.core.cost import checkpoint_bytes, decode_step_cost, weight_bytes

    model, tokenizer = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.bfloat16)
    float_step = decode_step_cost(model.config, dtype=torch.bfloat16).weight_bytes
    quantized = quantize(model, "int4-g16+lm_head-int8")
    path = checkpoint.save(quantized, tmp_path / "int4", tokenizer)
    import llmstep.cli.model as command

    asked = []  # the tiny model's GB round to 0.000 either way: the qc handed to the one rule is what is checked
    monkeypatch.setattr(command, "decode_step_cost", lambda *a, **k: asked.append(k.get("qc")) or
                        decode_step_cost(*a, **k))
    cli.main(["info", "--model", str(path), "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    qc = quantized.quantization
    assert f"stored quantized ({qc}): {checkpoint_bytes(model.config, torch.bfloat16, qc) / 1e9:.3f} GB" in out
    step = f"at bfloat16 {qc}, 0 tokens of context: {weight_bytes(quantized) / 1e9:.3f} GB of weights"
    assert step in out and weight_bytes(quantized) < float_step and asked == [qc]
    cli.main(["info", "--model", str(tiny_checkpoint), "--dtype", "bfloat16"])
    plain = capsys.readouterr().out
    assert asked == [qc, None]
    assert "stored quantized" not in plain and f"at bfloat16, 0 tokens of context: {float_step / 1e9:.3f} GB" in plain
