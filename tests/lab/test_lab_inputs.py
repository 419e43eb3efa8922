"""The lab's functions and widgets refuse what they cannot honour, by name, before any work: a context past the
model's window, an empty or non-finite matrix, a control value off its range; and the benchmark names what it
compares tokens with and which buffer it measured."""

from __future__ import annotations

import matplotlib
import pytest
import torch

matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402

from llmstep import cli  # noqa: E402
from llmstep.core.config import LlamaConfig  # noqa: E402
from llmstep.lab import bench as decode_bench  # noqa: E402
from llmstep.lab import explore, explorers, pictures  # noqa: E402
from llmstep.lab.hardware import decode_ceiling, random_model  # noqa: E402

SMALL = LlamaConfig.preset("llama-3.2-1b", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, hidden_dim=64,
                           vocab_size=128, max_seq_len=32, bos_token_id=None, eos_token_id=[])
WINDOW = SMALL.max_seq_len  # 32 positions


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def small():
    return random_model(SMALL, "cpu", torch.float32, 0)


def bench(model, variants, **kw):
    return decode_bench.run_bench(model, variants, prompt_len=4, new_tokens=4, compile=False, repeats=1, hf=False,
                                  log=lambda _: None, **({"bandwidth": False} | kw))


# ---- the benchmark's record ---------------------------------------------------------------------------

def test_without_an_eager_float_row_the_bench_names_its_reference_and_claims_no_float_one(small):
    record = bench(small, ["int8", "int4"], group_size=16)
    assert record["token_reference"] == "llmstep eager int8"
    for row in record["rows"]:
        assert row["same_tokens_as_eager_float"] is None and row["matching_prefix_with_eager_float"] is None
    assert record["rows"][0]["same_tokens_as_reference"] and record["rows"][0]["matching_prefix_with_reference"] == 4
    table = decode_bench.format_table(record)
    assert "= eager float" not in table and "= reference" in table
    assert "tokens in common with llmstep eager int8's (no eager float row ran)" in table


def test_with_an_eager_float_row_the_bench_compares_every_row_with_it(small):
    record = bench(small, ["int8", "none"])
    assert record["token_reference"] == "llmstep eager float"
    int8_row, float_row = record["rows"]
    assert float_row["same_tokens_as_eager_float"] and float_row["matching_prefix_with_eager_float"] == 4
    assert int8_row["same_tokens_as_eager_float"] == int8_row["same_tokens_as_reference"]
    assert "= eager float" in decode_bench.format_table(record)


def test_the_table_names_the_bandwidth_buffer_the_run_measured(small, monkeypatch):
    monkeypatch.setattr(decode_bench, "measure_bandwidth", lambda *a, **k: 10.0)  # its size is what is checked
    record = bench(small, ["none"], bandwidth=True, bandwidth_bytes=2**20)
    assert record["bandwidth_buffer_bytes"] == 2**20
    table = decode_bench.format_table(record)
    assert "copy 10.0 GB/s (1,048,576-byte buffer)" in table and "DRAM-sized" not in table
    default = bench(small, ["none"], bandwidth=True)  # measure_bandwidth's own 1 GiB
    assert default["bandwidth_buffer_bytes"] is None and "(DRAM-sized buffer)" in decode_bench.format_table(default)


# ---- contexts within the model's window ----------------------------------------------------------------

def test_a_decode_step_is_drawn_and_placed_only_within_the_models_window():
    step = f"context must be an integer in 0..{WINDOW - 1} .the model's {WINDOW}-token window less the step's own"
    for call in (lambda c: explore.roofline_point(SMALL, "H100 SXM", context=c),
                 lambda c: pictures.step_stages(SMALL, c),
                 lambda c: explorers.draw_journey(SMALL, c, 0),
                 lambda c: decode_ceiling(SMALL, "H100 SXM", context=c)):
        call(WINDOW - 1)  # the last position is the step's own token
        for bad in (WINDOW, 10**6, -1, True):
            with pytest.raises(ValueError, match=step):
                call(bad)
    explore.kv_memory(SMALL, WINDOW)  # a cache may fill the window
    with pytest.raises(ValueError, match=f"context must be an integer in 1..{WINDOW} .the model's context., got 33"):
        explore.kv_memory(SMALL, WINDOW + 1)


def test_shape_model_takes_loads_dtype_names_and_refuses_the_rest():
    assert next(pictures.shape_model(SMALL, "bf16").parameters()).dtype == torch.bfloat16
    assert pictures.step_stages(SMALL, 0, "fp16") == pictures.step_stages(SMALL, 0, torch.float16)
    with pytest.raises(ValueError, match="dtype must be a torch dtype or one of bf16, "):
        pictures.shape_model(SMALL, "int8")


def test_the_context_sliders_stop_at_the_models_window():
    target = explore.model_configs()["shakespeare-target"]  # 512 positions
    assert explorers.context_stops(target, step=True) == [0, 128, 256]
    assert explorers.context_stops(target, step=False) == [128, 256, 512]
    assert explorers.context_stops(SMALL, step=False) == [WINDOW]  # below 128: the window itself
    big = explore.model_configs()["llama-3.1-8b"]
    assert explorers.context_stops(big, step=True)[-1] == 65536 and explorers.context_stops(big, False)[-1] == 131072


@pytest.mark.parametrize("make, step, default", [(explorers.roofline_explorer, True, 0),
                                                 (explorers.kv_memory_explorer, False, 8192)])
def test_a_context_slider_follows_the_selected_models_window(make, step, default):
    configs = explore.model_configs()
    box = make(fallback=False)
    controls = {c.description: c for c in box.children[0].children}
    context, model = controls["context"], controls["model"]
    assert context.value == default  # the notebooks' starting point is unchanged
    context.value = 65536
    model.value = "shakespeare-target"  # 512 positions: the context moves down to its largest stop, then redraws
    stops = explorers.context_stops(configs["shakespeare-target"], step)
    assert list(context.options) == stops and context.value == stops[-1]
    model.value = "llama-3.1-8b"  # a larger window: every stop back, the context where it was
    assert list(context.options) == explorers.context_stops(configs["llama-3.1-8b"], step)
    assert context.value == stops[-1]


# ---- matrices and controls ----------------------------------------------------------------------------

def test_quant_error_of_zeros_is_zero_and_an_empty_or_non_finite_matrix_is_refused():
    assert explore.quant_error(torch.zeros(4, 32), "int8").relative_error == 0.0
    assert explore.quant_error(torch.zeros(4, 32), "int4", 16).relative_error == 0.0
    for shape in ((0, 32), (4, 0), (32,)):
        with pytest.raises(ValueError, match=rf"w must be a non-empty matrix \[N, K\], got \({shape[0]},"):
            explore.quant_error(torch.randn(*shape), "int8")
    for value in (float("nan"), float("inf")):
        w = torch.randn(4, 32)
        w[1, 3] = value
        with pytest.raises(ValueError, match="w holds NaN or infinite weights"):
            explore.quant_error(w, "int8")


def test_the_explorers_drawings_refuse_a_control_off_its_range():
    with pytest.raises(ValueError, match="k must be an integer in 1..k_max = 16 .draft tokens per round., got 20"):
        explorers.draw_speculative(0.7, 20, 0.1)
    with pytest.raises(ValueError, match="k must be an integer in 1..k_max = 2"):
        explorers.draw_speculative(0.7, 3, 0.1, k_max=2)
    with pytest.raises(ValueError, match="k must be an integer in 1..k_max"):
        explorers.draw_speculative(0.7, 0, 0.1)
    for stage in (-1, 13, True):
        with pytest.raises(ValueError, match=r"stage must be an integer in 0..12 \(the step's 13 stages\), got"):
            explorers.draw_journey(SMALL, 4, stage)
    for bits in (3, 16, True):
        with pytest.raises(ValueError, match="bits must be 8 .int8, a scale per row. or 4"):
            explorers.draw_quant(torch.randn(8, 32), bits, 16)


@pytest.mark.parametrize("rate", [0, -1.0, None, float("inf"), float("nan"), True])
def test_the_batching_simulation_names_its_own_arrival_rate(rate):
    with pytest.raises(ValueError, match=r"arrival_rate must be a finite number > 0 \(requests per engine step\)"):
        explore.simulate_batching(4, rate)


def test_the_speculative_curve_refuses_a_cost_it_cannot_divide_by_and_a_bool_acceptance():
    for cost_ratio in (float("inf"), float("nan"), -0.1, None, "0.1"):
        with pytest.raises(ValueError, match="cost_ratio must be a finite number >= 0"):
            explore.speculative_curve(0.5, cost_ratio)
    with pytest.raises(ValueError, match="acceptance must be a number in .0, 1., got True"):
        explore.speculative_curve(True, 0.1)
    assert explore.speculative_curve(1, 0).best_k == 16  # an int acceptance and a free draft are numbers still


# ---- llmstep batch's windows ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words, innocent", [
    (["--prompt-len", "513:513", "--context", "4"], "prompts of --prompt-len 513 need 513 positions", "--context"),
    (["--prompt-len", "8:16", "--context", "512"], "--context 512 and the step's token need 513 positions",
     "--prompt-len"),
])
def test_llmstep_batch_blames_the_flag_that_does_not_fit(argv, words, innocent):
    with pytest.raises(cli.CommandFailed) as failed:
        cli.main(["batch", *argv])
    assert words in str(failed.value) and innocent not in str(failed.value), str(failed.value)


def test_the_decode_ceiling_is_asked_only_within_the_models_window():
    cfg = LlamaConfig.preset("llama-3-8b")
    assert decode_ceiling(cfg, "H100 SXM", context=8191).tokens_per_second > 0
    for context in (8192, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"context must be an integer in 0..8191 \(the model's 8192-token window"):
            decode_ceiling(cfg, "H100 SXM", context=context)
