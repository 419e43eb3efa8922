"""What the explorers compute (llmstep.lab.explore), each function on its own, and the widgets' wiring without a
browser: a control's change redraws the output (tests/browser/ checks the same in JupyterLab)."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch

matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402

import llmstep  # noqa: E402
from llmstep.core.config import LlamaConfig  # noqa: E402
from llmstep.core.cost import decode_step_cost, kv_cache_bytes, model_bytes  # noqa: E402
from llmstep.core.rope import inv_frequencies  # noqa: E402
from llmstep.engines.speculative import expected_speedup  # noqa: E402
from llmstep.lab import explore, explorers, pictures, trace  # noqa: E402
from llmstep.lab.hardware import DATASHEETS  # noqa: E402
from llmstep.lab.roofline import attainable_tflops  # noqa: E402

LLAMA8B = LlamaConfig.preset("llama-3.1-8b")
H100 = DATASHEETS["H100 SXM"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_the_models_on_offer_are_the_shipped_ones_and_the_presets():
    configs = explore.model_configs()
    assert {"shakespeare-target", "shakespeare-draft", "llama-3.1-8b", "llama-3-70b"} <= set(configs)
    assert configs["shakespeare-target"] == llmstep.LlamaConfig.from_hf(llmstep.core.checkpoint.resolve_model_path(
        "target"))


def test_a_decode_step_at_batch_1_is_memory_bound_and_runs_at_the_bandwidth():
    p = explore.roofline_point(LLAMA8B, H100, "bfloat16", batch=1, context=0)
    cost = decode_step_cost(LLAMA8B, 0, "bfloat16")
    assert p.bound == "memory" and p.step_seconds == pytest.approx(cost.bytes / (H100.memory_gb_per_s * 1e9))
    assert p.intensity == pytest.approx(cost.arithmetic_intensity)
    assert p.attainable_tflops == pytest.approx(attainable_tflops(H100, p.intensity))
    assert p.tokens_per_second == pytest.approx(1 / p.step_seconds)


def test_a_large_batch_meets_the_compute_ceiling():
    p = explore.roofline_point(LLAMA8B, H100, "bfloat16", batch=1024, context=0)
    cost = decode_step_cost(LLAMA8B, 0, "bfloat16", batch=1024)
    assert p.bound == "compute" and p.attainable_tflops == H100.tensor_tflops
    assert p.step_seconds == pytest.approx(cost.flops / (H100.tensor_tflops * 1e12))
    assert p.tokens_per_second == pytest.approx(1024 / p.step_seconds)
    # Context adds KV bytes per sequence: intensity falls again.
    assert explore.roofline_point(LLAMA8B, H100, batch=1024, context=8192).intensity < p.intensity
    with pytest.raises(ValueError, match="batch"):
        explore.roofline_point(LLAMA8B, H100, batch=0)


@pytest.mark.parametrize("pair", [0, 5, 63])
def test_rope_turns_a_pair_by_position_times_its_frequency(pair):
    r = explore.rope_rotation(LLAMA8B, 100, pair)
    f = float(inv_frequencies(LLAMA8B.head_dim, LLAMA8B.rope_theta, LLAMA8B.rope_scaling)[pair])
    assert r.inv_freq == pytest.approx(f) and r.angle == pytest.approx(100 * f)
    # llmstep computes the angles in float32, as the model does: 100 * f rounds at ~1e-5
    assert r.trail[-1].tolist() == pytest.approx([math.cos(100 * f), math.sin(100 * f)], abs=1e-5)
    assert r.trail.norm(dim=-1).tolist() == pytest.approx([1.0] * len(r.trail))  # a rotation keeps lengths
    assert len(r.trail) == 65 and r.wavelength == pytest.approx(2 * math.pi / f)


def test_llama31_scaling_slows_the_low_frequencies_only():
    scaled = explore.rope_rotation(LLAMA8B, 10, 63)
    plain = explore.rope_rotation(LLAMA8B.replace(rope_scaling=None), 10, 63)
    assert scaled.wavelength == pytest.approx(plain.wavelength * LLAMA8B.rope_scaling.factor)
    assert explore.rope_rotation(LLAMA8B, 10, 0).wavelength == pytest.approx(
        explore.rope_rotation(LLAMA8B.replace(rope_scaling=None), 10, 0).wavelength)
    with pytest.raises(ValueError, match="pair must be below head_dim / 2 = 64"):
        explore.rope_rotation(LLAMA8B, 10, 64)


def test_kv_memory_is_the_cost_modules():
    m = explore.kv_memory(LLAMA8B, 8192, 4, "bfloat16")
    assert m.kv_bytes == kv_cache_bytes(LLAMA8B, 4, 8192, "bfloat16") and m.weights_bytes == model_bytes(LLAMA8B)
    assert m.per_token_bytes == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, 2 bytes each
    assert m.total_bytes == m.kv_bytes + m.weights_bytes
    with pytest.raises(ValueError, match="context"):
        explore.kv_memory(LLAMA8B, 0)


@pytest.fixture(scope="module")
def shipped():
    return llmstep.load("target", device="cpu", dtype=torch.float32)


def test_the_attention_pattern_is_what_the_model_computes(shipped):
    model, tok = shipped
    ids = tok.encode("ROMEO:\nBut soft, what light")
    layer = 2
    w = explore.attention_weights(model, ids, layer)  # [H, T, T]
    T = len(ids)
    assert w.shape == (model.config.n_heads, T, T)
    assert torch.allclose(w.sum(-1), torch.ones(model.config.n_heads, T))
    assert (w.triu(1) == 0).all()  # causal: no query sees a later key
    # Rebuild the attention block's output from these weights and compare with what the model produced.
    seen = {}
    attn = model.layers[layer].attention
    pre = attn.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    post = attn.register_forward_hook(lambda m, args, out: seen.update(out=out))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        pre.remove()
        post.remove()
    c = model.config
    v = attn.wv(seen["x"]).view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(c.n_rep, dim=1)
    mixed = (w[None] @ v).transpose(1, 2).reshape(1, T, c.n_heads * c.head_dim)  # [1, T, H*hd]
    torch.testing.assert_close(attn.wo(mixed), seen["out"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="layer"):
        explore.attention_weights(model, ids, c.n_layers)


@pytest.mark.parametrize("call, named", [
    (lambda m: explore.attention_weights(m, [1, 2, 10**6], 0), "outside the vocabulary"),
    (lambda m: explore.attention_weights(m, [1.5, 2], 0), "must be integers"),
    (lambda m: explore.rope_rotation(m.config, 3, 0, trail=-5), "trail"),
    (lambda m: pictures.plot_cache_growth(m.config, m.config.max_seq_len, 10), "prompt_len"),
    (lambda m: trace.trace_step(m, context=2, prompt_ids=[1, 2, 10**6]), "outside the vocabulary"),
])
def test_the_lab_helpers_refuse_bad_arguments_by_name(shipped, call, named):
    """Each was an IndexError or RuntimeError from deep inside torch or matplotlib."""
    with pytest.raises(ValueError, match=named):
        call(shipped[0])  # (model, tokenizer)


def test_quantization_error_and_bytes_come_from_the_quantizer():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    int8 = explore.quant_error(w, "int8")
    assert int8.bits_per_weight == pytest.approx(8 + 16 / 512)  # codes + one bf16 scale per row
    points = {g: explore.quant_error(w, "int4", g) for g in (16, 64, 256)}
    for g, p in points.items():
        assert p.bits_per_weight == pytest.approx(4 + 2 * 16 / g)  # codes + a bf16 scale and zero per group
    # Smaller groups cost bytes and buy accuracy; int8 is far closer than any int4.
    assert points[16].relative_error < points[64].relative_error < points[256].relative_error
    assert int8.relative_error < points[16].relative_error / 4
    assert int8.error.shape == w.shape and int8.max_error == pytest.approx(float(int8.error.abs().max()))
    assert explore.quant_options(384) == [("int8", None), ("int4", 16), ("int4", 32), ("int4", 64), ("int4", 128)]
    with pytest.raises(ValueError, match="group_size"):
        explore.quant_error(w, "int4", 3)


def test_the_speculative_curve_is_the_theory():
    curve = explore.speculative_curve(0.8, 0.05, 12)
    assert curve.speedups == pytest.approx([expected_speedup(0.8, k, 0.05) for k in range(1, 13)])
    assert curve.best_k == max(range(1, 13), key=lambda k: curve.speedups[k - 1])
    assert explore.speculative_curve(0.0, 0.5, 3).speedups == pytest.approx([1 / (0.5 * k + 1) for k in (1, 2, 3)])
    assert explore.speculative_curve(1.0, 0.0, 4).tokens_per_forward == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="acceptance"):
        explore.speculative_curve(1.5, 0.1)


def test_the_speculative_curve_divides_by_the_verify_cost():
    curve = explore.speculative_curve(0.75, 0.1, 8, verify_cost=1.5)
    assert curve.speedups == pytest.approx([expected_speedup(0.75, k, 0.1, 1.5) for k in range(1, 9)])
    assert curve.best_k == max(range(1, 9), key=lambda k: curve.speedups[k - 1]) and curve.verify_cost == 1.5
    # A dearer verification favours a larger k: it is paid once a round, whatever k.
    assert curve.best_k > explore.speculative_curve(0.75, 0.1, 8).best_k
    with pytest.raises(ValueError, match="verify_cost"):
        explore.speculative_curve(0.7, 0.1, 8, verify_cost=0)


def test_the_speculative_explorer_starts_at_the_values_given_and_answers_its_verify_cost():
    box = explorers.speculative_explorer(0.74, 0.2, fallback=False, verify_cost=1.62, k=5)
    assert summary(box).startswith("a = 0.74, k = 5, draft costs 0.20 of a target forward, verifying k + 1 tokens "
                                   "1.62:")
    assert f"speedup {expected_speedup(0.74, 5, 0.2, 1.62):.2f}x" in summary(box)
    verify = next(c for c in box.children[0].children if c.description == "verify cost")
    verify.value = 1.0
    assert f"speedup {expected_speedup(0.74, 5, 0.2, 1.0):.2f}x" in summary(box)
    wide = explorers.speculative_explorer(0.7, 1.4, fallback=False, verify_cost=6.0)  # the sliders widen
    assert "draft costs 1.40 of a target forward, verifying k + 1 tokens 6.00" in summary(wide)
    with pytest.raises(ValueError, match="k must be"):
        explorers.speculative_explorer(k=17)


def test_the_batching_simulation_is_what_run_batch_does_with_a_model():
    from llmstep.engines.batching import run_batch
    from llmstep.lab.bench_batching import random_workload

    torch.manual_seed(0)
    tiny = llmstep.Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64,
                                     max_seq_len=256))
    workload = random_workload(10, 64, prompt_len=(8, 48), new_tokens=(4, 96), rate=0.35, seed=3)
    for policy in ("continuous", "static"):
        served = run_batch(tiny, workload, n_slots=3, policy=policy, compile=False)
        simulated = explore.simulate_batching(3, 0.35, n_requests=10, policy=policy, seed=3)
        assert simulated.timeline == served.timeline and simulated.prefills == served.prefills


def test_the_batching_simulation_is_the_schedulers_and_repeatable():
    run = explore.simulate_batching(3, 0.5, n_requests=12, seed=1)
    again = explore.simulate_batching(3, 0.5, n_requests=12, seed=1)
    assert run.timeline == again.timeline and run.prefills == again.prefills
    assert all(4 <= len(c.tokens) <= 96 and c.stop_reason == "length" for c in run.completions)
    assert all(len(row) == 3 for row in run.timeline)
    arrivals = [c.arrival for c in run.completions]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    static = explore.simulate_batching(3, 0.5, n_requests=12, policy="static", seed=1)
    assert static.steps > run.steps and static.slot_utilisation < run.slot_utilisation
    busier = explore.simulate_batching(3, 5.0, n_requests=12, seed=1)
    assert busier.summary()["mean_latency_steps"] > run.summary()["mean_latency_steps"]  # a longer queue
    with pytest.raises(ValueError, match="arrival_rate must be a finite number > 0"):  # its own name, not
        explore.simulate_batching(3, 0.0)  # random_workload's `rate` (which offers None, refused here)
    with pytest.raises(ValueError, match="policy"):
        explore.simulate_batching(3, 1.0, policy="fifo")


def test_the_batching_simulation_refuses_arrivals_past_the_steps_a_run_records_as_the_batchers_do():
    """A rate this low spreads requests over millions of idle steps, each a row of the timeline."""
    from llmstep.engines.request import MAX_ARRIVAL_STEP

    assert explore.simulate_batching(2, 1e-6, n_requests=2).completions[1].arrival == 240_466  # within the limit
    with pytest.raises(ValueError, match=rf"arrival_rate 1e-06 spreads the 3 requests too far: request 2: arrival "
                                         rf"step 1,608,434 is past the {MAX_ARRIVAL_STEP:,} steps a run records"):
        explore.simulate_batching(2, 1e-6, n_requests=3)



def test_the_batching_explorer_shows_the_queue_the_scheduler_recorded():
    """Beside the slots, the queue: requests waiting at each engine step, read from the run's own record."""
    run = explore.simulate_batching(2, 1.0, n_requests=12, seed=1)
    fig, text = explorers.draw_batching(2, 1.0, "continuous", n_requests=12, seed=1)
    slots, queue = fig.axes
    assert slots.images[0].get_array().shape == (2, run.steps)  # the slots' timeline above
    assert list(queue.lines[0].get_ydata()) == run.queued  # the queue below, step by step
    assert max(run.queued) > 0 and f"queue at most {max(run.queued)} waiting" in text  # 12 requests, 2 slots: a queue
    waited = [c.queued_steps for c in run.completions]
    assert f"{sum(waited) / len(waited):.1f} steps waited on average" in text
    idle = explore.simulate_batching(16, 0.1, n_requests=6, seed=1)  # more slots than requests: nobody waits
    _, text = explorers.draw_batching(16, 0.1, "continuous", n_requests=6, seed=1)
    assert max(idle.queued) == 0 and "queue at most 0 waiting" in text

# ---- the widgets, without a browser ---------------------------------------------------------------------

def summary(box) -> str:
    return box.children[-1].outputs[0]["text"]


def first_slider(box):
    import ipywidgets as widgets

    return next(c for c in box.children[0].children if isinstance(c, widgets.IntSlider | widgets.FloatSlider |
                                                                   widgets.SelectionSlider | widgets.FloatLogSlider))


def nudge(slider) -> None:
    import ipywidgets as widgets

    if isinstance(slider, widgets.SelectionSlider):
        slider.index = slider.index + 1 if slider.index + 1 < len(slider.options) else slider.index - 1
    else:
        step = slider.step
        slider.value = slider.value + step if slider.value + step <= slider.max else slider.value - step


@pytest.mark.parametrize("name", sorted(explorers.EXPLORERS))
def test_every_explorer_redraws_when_a_slider_moves(name):
    box = explorers.EXPLORERS[name](fallback=False)
    out = box.children[-1]
    assert [o["output_type"] for o in out.outputs] == ["stream", "display_data"]
    assert out.outputs[1]["data"]["image/png"]  # a figure, as PNG
    before = summary(box)
    nudge(first_slider(box))
    assert summary(box) != before
    assert not plt.get_fignums()  # every figure drawn was closed


def test_the_attention_explorer_redraws_per_head(shipped):
    model, tok = shipped
    box = explorers.attention_explorer(model, tok, "ROMEO:\nBut soft", fallback=False)
    before = summary(box)
    box.children[0].children[1].value = 3  # head
    assert summary(box) != before and summary(box).startswith("layer 0, head 3")


def test_a_broken_callback_is_not_silent():
    import ipywidgets as widgets

    def draw(x):
        if x != 1:
            raise RuntimeError("broken")
        return plt.figure(), f"x = {x}"

    box = explorers.explorer(draw, {"x": widgets.IntSlider(value=1)}, fallback=False)
    assert summary(box) == "x = 1\n"
    with pytest.raises(RuntimeError, match="broken"):
        box.children[0].children[0].value = 2
    assert summary(box) == "x = 1\n"  # the output stays as it was: the browser test sees no change


def test_the_fallback_shows_the_starting_point_without_a_kernel(capsys):
    explorers.speculative_explorer()
    shown = capsys.readouterr().out
    assert "a = 0.70, k = 4" in shown  # the summary, printed where no widget can render


def test_the_journey_walks_the_stages_of_the_config():
    from llmstep.lab.pictures import step_stages

    rows = step_stages(LLAMA8B, 512)
    fig, text = explorers.draw_journey(LLAMA8B, 512, 6, "Llama-3.1-8B")
    assert text.startswith(f"7/{len(rows)} attention (x32): q [1, 32, 1, 128], K, V [1, 8, 513, 128]")
    box = explorers.journey_explorer(LLAMA8B, context=512, fallback=False)
    stage = box.children[0].children[1]
    stage.value = len(rows) - 1
    assert summary(box).startswith(f"{len(rows)}/{len(rows)} sampling")


def test_the_journey_with_a_trace_shows_each_stages_measured_time(shipped):
    from llmstep.lab.pictures import step_stages
    from llmstep.lab.trace import trace_step

    model, _ = shipped
    trace = trace_step(model, context=16, repeats=2)
    rows = step_stages(model.config, 16, trace.dtype, trace)
    for r in rows:  # the meta-device model's bytes are the traced model's
        assert r.bytes == pytest.approx(trace.row(r.stage).bytes) and r.seconds == trace.row(r.stage).seconds
    box = explorers.journey_explorer(model.config, context=16, trace=trace, fallback=False)
    box.children[0].children[1].value = 6
    assert summary(box).strip().endswith(f"measured {trace.row('attention').seconds * 1e3:.3f} ms")
    with pytest.raises(ValueError, match="trace was taken after 16 tokens"):
        step_stages(model.config, 17, trace.dtype, trace)


@pytest.mark.parametrize("n_measured", [0, 1, 7, 12])
def test_the_chosen_step_is_the_one_square_however_many_points_are_measured(n_measured):
    """Notebooks 00 and 05 tell the learner to watch "the square": 05 passes seven measured points (nine on CUDA)."""
    measured = [(0.5 * (i + 1), 0.01, f"point {i}") for i in range(n_measured)]
    fig, _ = explorers.draw_roofline("llama-3.1-8b", H100, "bfloat16", 1, 0, points=measured)
    markers = {line.get_label(): line.get_marker() for line in fig.axes[0].get_lines() if line.get_marker() != "None"}
    assert markers.pop("llama-3.1-8b, batch 1") == "s"
    assert len(markers) == n_measured and "s" not in markers.values()


def test_the_journey_explorer_starts_on_a_preset_without_the_shipped_models(monkeypatch):
    """A copy of the package without data/ has only the presets on offer."""
    from llmstep.lab import explorers

    monkeypatch.setattr(explore, "model_configs", lambda: {name: llmstep.LlamaConfig.preset(name)
                                                           for name in llmstep.core.config.PRESETS})
    assert explorers.journey_explorer(fallback=False) is not None


def test_the_attention_pattern_needs_the_separate_projections(shipped):
    from llmstep.core.fuse import fused

    model, tok = shipped
    with pytest.raises(ValueError, match="give the model before fusing"):
        explore.attention_weights(fused(model), tok.encode("ROMEO:"), 0)


def test_the_explorers_refuse_sizes_no_widget_draws_by_name():
    """k_max = 10**9 ran for ever, 10**9 simulated slots and a trail of 10**9 positions ran out of memory."""
    with pytest.raises(ValueError, match=f"k_max must be at most {explore.MAX_K:,}"):
        explore.speculative_curve(0.8, 0.1, explore.MAX_K + 1)
    assert len(explore.speculative_curve(0.8, 0.1, explore.MAX_K).speedups) == explore.MAX_K
    with pytest.raises(ValueError, match=f"n_slots must be at most {explore.MAX_SIM_SLOTS:,}"):
        explore.simulate_batching(explore.MAX_SIM_SLOTS + 1, 0.5, n_requests=2)
    assert explore.simulate_batching(explore.MAX_SIM_SLOTS, 0.5, n_requests=2).n_slots == explore.MAX_SIM_SLOTS
    with pytest.raises(ValueError, match=f"trail must be at most {explore.MAX_TRAIL:,} positions"):
        explore.rope_rotation(LLAMA8B, 10**12, 0, trail=explore.MAX_TRAIL + 1)
    assert len(explore.rope_rotation(LLAMA8B, 10**12, 0, trail=explore.MAX_TRAIL).trail) == explore.MAX_TRAIL + 1
