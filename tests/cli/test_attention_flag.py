"""--attention on the commands that run the model: the kernel reaches the run, its records say which was asked,
and a kernel the device lacks ends the command with one line naming the flag (bad input, exit 2)."""

from __future__ import annotations

import pytest

from llmstep import cli
from llmstep.core import attention_backend

TINY_BENCH = ["bench", "--preset", "llama-3.2-1b", "--set", "n_layers=2", "dim=64", "n_heads=4", "n_kv_heads=2",
              "hidden_dim=128", "vocab_size=512", "max_seq_len=64", "--dtype", "float32", "--device", "cpu",
              "--threads", "1", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1", "--no-hf",
              "--no-bandwidth"]


def test_bench_records_the_backend_asked_for_and_runs_under_it(monkeypatch):
    monkeypatch.setattr(attention_backend, "_cpu_step", None)  # no CPU kernel registered by an earlier test
    seen = []
    real = attention_backend.kernels
    monkeypatch.setattr(attention_backend, "kernels", lambda: seen.append(attention_backend.current()) or real())
    record = cli.main([*TINY_BENCH, "--attention", "math"])
    assert record["attention"] == {"asked": "math", "decode_step": "sdpa"}
    assert seen and set(seen) == {"math"}  # every attention call of the run
    assert cli.main(TINY_BENCH)["attention"] == {"asked": "auto", "decode_step": "sdpa"}
    assert attention_backend.current() == "auto"


def test_a_kernel_the_cpu_lacks_is_bad_input_named_by_its_flag(capsys):
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(["generate", "--prompt", "ROMEO:", "--device", "cpu", "--max-new-tokens", "2", "--temperature", "0",
                  "--attention", "efficient"])
    assert failed.value.code == 2
    assert str(failed.value).startswith("llmstep generate: error: --attention efficient: PyTorch has no efficient")
    assert "ROMEO:" not in capsys.readouterr().out  # refused before the prompt is echoed
    with pytest.raises(cli.CommandFailed, match="invalid choice: 'fast'"):
        cli.main(["batch", "--attention", "fast"])


@pytest.mark.parametrize("command", ["generate", "trace", "bench", "batch", "speculative", "serve"])
def test_every_command_that_runs_the_model_takes_the_flag(command):
    prompt = ["--prompt", "x"] if command == "generate" else []
    args = cli.build_parser().parse_args([command, "--attention", "cudnn", *prompt])
    assert args.attention == "cudnn"


def test_serve_refuses_a_kernel_the_cpu_lacks_before_it_is_ready(monkeypatch):
    """As generate does: a probe forward after the weights load, not a 500 at the first request (the server gone)."""
    from llmstep.serve import app

    bound = []
    bind = app.bind
    monkeypatch.setattr(app, "bind", lambda *a, **k: bound.append(bind(*a, **k)) or bound[-1])
    monkeypatch.setattr(app, "serve", lambda *a, **k: pytest.fail("the server started"))
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(["serve", "--port", "0", "--device", "cpu", "--attention", "efficient"])
    assert failed.value.code == 2
    assert str(failed.value).startswith("llmstep serve: error: --attention efficient: PyTorch has no efficient")
    assert len(bound) == 1 and bound[0].fileno() == -1  # its port let go



def test_the_probe_tries_the_kernel_with_and_without_a_mask_tensor(monkeypatch):
    """A paged cache's step hands SDPA a mask tensor, a plain prompt is_causal: CUDA's flash kernel takes the one and
    refuses the other, so the probe runs both before anything is served."""
    import torch

    from llmstep.cli.args import probe_attention
    from llmstep.core import attention
    from llmstep.core.config import LlamaConfig
    from llmstep.lab.hardware import random_model

    model = random_model(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                     max_seq_len=16), "cpu", torch.float32)
    sdpa, tensors = attention.sdpa, []

    def spy(q, k, v, mask, *args, **kwargs):
        tensors.append(mask.visible is not None)
        return sdpa(q, k, v, mask, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa", spy)
    probe_attention(model, "math")
    assert tensors == [False, True]
