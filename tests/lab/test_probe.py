"""The GPU probe's measuring pieces (llmstep.lab.probe), on the CPU: nvidia-smi's line read, overlapping kernels
counted once, a step's share from two runs, a recompile refused inside the timed window, agreement counted per
position, runs timed several times."""

from __future__ import annotations

import pytest
import torch

from llmstep.core.config import LlamaConfig
from llmstep.lab import probe
from llmstep.lab.hardware import random_model


def test_nvidia_smis_line_is_read_with_missing_values_as_none():
    text = "NVIDIA H200, 560.35.03, 1980, 1980, 2619, 41, [N/A]\n"
    got = probe.parse_nvidia_smi(text)
    assert got == {"name": "NVIDIA H200", "driver_version": "560.35.03", "clocks.sm": 1980.0,
                   "clocks.max.sm": 1980.0, "clocks.mem": 2619.0, "temperature.gpu": 41.0, "power.draw": None}
    with pytest.raises(ValueError, match="7 fields"):
        probe.parse_nvidia_smi("NVIDIA H200, 560.35.03")


def test_gpu_state_names_every_version_and_says_why_a_value_is_missing(monkeypatch):
    monkeypatch.setattr(probe.shutil, "which", lambda name: None)
    state = probe.gpu_state()
    assert {"torch", "cuda", "cudnn", "triton", "nvidia_smi"} <= set(state)
    assert state["torch"] == torch.__version__ and state["nvidia_smi"] is None
    assert "not found" in state["nvidia_smi_error"]


def test_kernels_that_overlap_are_busy_once_and_a_step_is_the_difference_of_two_runs():
    short = probe.kernel_summary([(0, 10), (5, 10), (30, 5)], wall_us=100)  # busy 0-15 and 30-35
    assert short == {"kernels": 3, "busy_us": 20.0, "wall_us": 100}
    long = probe.kernel_summary([(0, 10), (5, 10), (30, 5), (100, 40), (150, 40)], wall_us=300)
    step = probe.per_step(short, long, steps=2)
    assert step["kernels_per_step"] == 1 and step["gpu_busy_us_per_step"] == 40 and step["step_wall_us"] == 100
    assert step["idle_share"] == pytest.approx(0.6)


def test_profile_steps_counts_one_steps_operators_on_the_cpu():
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def run(n):
        for _ in range(n):
            torch.mm(a, b)
            torch.add(a, b)

    got = probe.profile_steps(run, "cpu", steps=4)
    assert got["kind"] == "top-level CPU ops" and got["kernels_per_step"] == 2 and got["steps"] == 4


def test_a_recompile_inside_the_timed_window_is_an_error():
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    f(torch.ones(3))
    with probe.no_recompiles(), pytest.raises(Exception, match="(?i)recompil"):
        f(torch.ones(5))
    f(torch.ones(5))  # outside it compiles as usual


def test_time_calls_reports_every_run_its_median_and_spread():
    t = probe.time_calls(lambda: torch.ones(100).sum(), "cpu", calls=10, runs=3)
    assert len(t["all_runs"]) == 3 and t["median"] > 0 and t["spread"] >= 0


@torch.no_grad()
def test_teacher_forced_agreement_counts_each_position_given_the_same_history():
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64)
    model = random_model(cfg, device="cpu", dtype=torch.float32)
    prompt, tokens = [1, 2, 3], []
    for _ in range(6):  # eager greedy, one token at a time
        tokens.append(int(model(torch.tensor([prompt + tokens]))[0, -1].argmax()))
    assert probe.teacher_forced_agreement(model, prompt, tokens) == {"agreement": 1.0, "positions": 6,
                                                                     "first_difference": None}
    changed = tokens[:2] + [(tokens[2] + 1) % 97] + tokens[3:]  # one divergence; the rest still judged on its own
    got = probe.teacher_forced_agreement(model, prompt, changed)
    assert got["first_difference"] == 2 and got["positions"] == 6 and got["agreement"] <= 5 / 6


@torch.no_grad()
def test_agreement_against_float32_tells_rounding_from_a_different_function():
    """The bf16 model against its float32 twin (the same weights widened): eager bf16 picks float32's token at
    most positions; a "compiled" run that is another function (here: tokens picked at random) does not."""
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64)
    model = random_model(cfg, device="cpu", dtype=torch.bfloat16)
    twin = probe.float32_twin(model)
    assert next(twin.parameters()).dtype == torch.float32 and next(model.parameters()).dtype == torch.bfloat16
    for (name, w), (_, w32) in zip(model.state_dict().items(), twin.state_dict().items(), strict=True):
        assert torch.equal(w.float(), w32), name  # widened, not redrawn
    prompt, tokens = [1, 2, 3], []
    for _ in range(24):  # float32 greedy: the "compiled" run that computes the true function
        tokens.append(int(twin(torch.tensor([prompt + tokens]))[0, -1].argmax()))
    got = probe.teacher_forced_agreement(model, prompt, tokens, reference=twin)
    assert got["compiled_vs_float32"] == 1.0 and got["eager_vs_float32"] == got["agreement"] >= 0.75
    wrong = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    bad = probe.teacher_forced_agreement(model, prompt, wrong, reference=twin)
    assert bad["compiled_vs_float32"] < 0.3 and bad["eager_vs_float32"] >= 0.75
    assert "compiled_vs_float32" not in probe.teacher_forced_agreement(model, prompt, tokens)


def test_top_kernels_are_one_steps_time_by_name_the_longest_first():
    short = probe.kernel_totals([("gemv", 10.0), ("norm", 2.0), ("prefill_mm", 50.0)])
    long = probe.kernel_totals([("gemv", 10.0), ("norm", 2.0), ("prefill_mm", 58.0)]
                               + [("gemv", 10.0), ("gemv", 12.0), ("norm", 2.0), ("attn", 5.0)] * 4)
    top = probe.top_kernels(short, long, steps=4)
    # the prefill's kernel ran once in both runs: its 8 us more is noise, not a step's (same calls: left out)
    assert [k["name"] for k in top] == ["gemv", "attn", "norm"]
    assert top[0] == {"name": "gemv", "us_per_step": 22.0, "calls_per_step": 2.0}
    assert probe.top_kernels(short, long, steps=4, n=1) == top[:1]


@torch.no_grad()
@pytest.mark.parametrize("spec", ["int8", "int4", "int4-head"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_quantized_models_float32_twin_is_its_dequantized_function(spec, tied):
    """Each quantized linear's twin is codes x scales in float32, unrounded (not the bf16 the layer dequantizes to);
    the rest widened; a quantized head of a tied model keeps its own weights, the embedding its own."""
    from llmstep.core.quantize import QuantConfig, QuantLinear, quantize

    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64,
                      tie_embeddings=tied)
    qc = QuantConfig(spec.removesuffix("-head"), 32 if spec.startswith("int4") else None, lm_head=spec.endswith("head"))
    model = quantize(random_model(cfg, device="cpu", dtype=torch.bfloat16), qc)
    twin = probe.float32_twin(model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert layers and ("output" in layers) == spec.endswith("head")
    for name, m in layers.items():
        w = twin.get_submodule(name).weight
        assert w.dtype == torch.float32 and torch.equal(w, m.dequantized(torch.float32)), name
        assert torch.allclose(w, m.dequantized().float(), rtol=1e-2, atol=1e-3)  # bf16's rounding of the same
    assert torch.equal(twin.tok_embeddings.weight, model.tok_embeddings.weight.float())
    assert (twin.output.weight is twin.tok_embeddings.weight) == (tied and "output" not in layers)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.allclose(twin(ids), model(ids).float(), atol=0.01)  # the same function, up to bf16's rounding
