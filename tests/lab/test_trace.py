"""llmstep.trace: the stages cover the whole step, bytes and FLOPs agree with llmstep.cost."""

import pytest
import torch

import llmstep
from llmstep import Llama, LlamaConfig
from llmstep.core.cost import decode_step_cost, model_step_cost
from llmstep.core.quantize import QuantConfig, quantize
from llmstep.lab.trace import STAGES, plot_trace, stage_costs, trace_step

CFG = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=112, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Llama(CFG).eval()


def test_trace_covers_every_stage_and_sums_to_the_step(model):
    t = trace_step(model, context=16, repeats=2)
    assert [r.stage for r in t.rows] == list(STAGES)
    assert all(r.seconds >= 0 for r in t.rows)
    assert t.step_seconds > 0 and t.traced_seconds > 0
    assert sum(r.share for r in t.rows) == pytest.approx(1.0)
    assert t.row("qkv projection").calls == 3 * CFG.n_layers
    assert t.row("rope").calls == 2 * CFG.n_layers


def test_trace_bytes_and_flops_equal_llmstep_cost(model):
    t = trace_step(model, context=10, repeats=1)
    cost = decode_step_cost(CFG, context=10, dtype=model.dtype)
    assert sum(r.bytes for r in t.rows) == pytest.approx(cost.bytes)
    assert sum(r.flops for r in t.rows) == pytest.approx(cost.flops)
    assert t.row("attention").bytes == pytest.approx(cost.kv_bytes)
    assert 0 < t.busy_fraction(1.0) < 1


@pytest.mark.parametrize("tied", [False, True])
def test_stage_costs_match_cost_for_tied_and_untied_heads(tied):
    cfg = CFG.replace(tie_embeddings=tied)
    torch.manual_seed(0)
    costs = stage_costs(Llama(cfg).to(torch.bfloat16).eval(), 5)
    assert sum(b for b, _ in costs.values()) == pytest.approx(decode_step_cost(cfg, 5).bytes)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_trace_of_a_quantized_model_counts_the_bytes_it_holds(model, mode):
    """The step of a quantized model reads its codes and scales, not float weights: the trace says so."""
    q = quantize(model, QuantConfig(mode, 16 if mode == "int4" else None), inplace=False)
    t = trace_step(q, context=6, repeats=1)
    assert t.cost.bytes == pytest.approx(model_step_cost(q, 6).bytes)
    assert sum(r.bytes for r in t.rows) == pytest.approx(model_step_cost(q, 6).bytes)
    assert t.cost.bytes < decode_step_cost(CFG, 6, model.dtype).bytes
    wq = q.layers[0].attention.wq
    assert t.row("o projection").bytes == pytest.approx(CFG.n_layers * q.layers[0].attention.wo.nbytes)
    assert t.row("qkv projection").bytes < trace_step(model, context=6, repeats=1).row("qkv projection").bytes
    assert wq.nbytes < model.layers[0].attention.wq.weight.nbytes
    assert sum(r.flops for r in t.rows) == pytest.approx(decode_step_cost(CFG, 6).flops)


def test_trace_leaves_the_model_untouched(model):
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(tokens)
    trace_step(model, context=3, repeats=1)
    assert llmstep.core.attention.F is torch.nn.functional
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(tokens), before)


def test_trace_at_context_zero_and_from_a_prompt(model):
    assert trace_step(model, context=0, repeats=1).context == 0
    assert trace_step(model, context=4, repeats=1, prompt_ids=[5, 6, 7, 8, 9]).context == 4


def test_bad_arguments_are_rejected(model):
    with pytest.raises(ValueError, match="context"):
        trace_step(model, context=-1)
    with pytest.raises(ValueError, match=r"in 0..63 \(the model.s 64-token window less the step.s own token\), got 64"):
        trace_step(model, context=CFG.max_seq_len)
    with pytest.raises(ValueError, match="repeats"):
        trace_step(model, context=2, repeats=0)
    with pytest.raises(ValueError, match="temperature"):
        trace_step(model, context=2, temperature=-1)
    with pytest.raises(ValueError, match="prompt_ids"):
        trace_step(model, context=4, prompt_ids=[1, 2])
    t = trace_step(model, context=2, repeats=1)
    with pytest.raises(KeyError, match="no stage"):
        t.row("dropout")
    with pytest.raises(ValueError, match="peak"):
        t.busy_fraction(0)


def test_plot_trace_draws_one_bar_pair_per_stage(model):
    import matplotlib
    matplotlib.use("Agg")
    ax = plot_trace(trace_step(model, context=4, repeats=1), peak_tflops=1.0)
    assert len(ax.patches) == 2 * len(STAGES)


def test_a_traced_step_runs_the_forward_once_per_repeat_like_an_ordinary_step(model):
    """The marks wrap the ordinary forward: a trace that forked the forward or doubled the work would run it more
    often. Counted, not timed (a timing bound fails on a loaded machine)."""
    tokens = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: tokens.append(args[0].shape[1]),
                                             with_kwargs=True)
    try:
        trace_step(model, context=8, repeats=3)
    finally:
        handle.remove()
    assert tokens == [8] + [1] * (1 + 3) + [1] * 3  # the prefill, warm-up + 3 ordinary steps, 3 traced steps


def test_a_fused_model_traces_with_its_joined_projections(model):
    """fused() sets wq, wk, wv (and w1, w3) to None: the trace hooks wqkv (and w13) instead, at the same bytes."""
    from llmstep.core.fuse import fused

    t = trace_step(fused(model), context=10, repeats=1)
    plain = stage_costs(model, 10)
    assert t.row("qkv projection").calls == CFG.n_layers  # one matmul a layer
    for stage in ("qkv projection", "mlp (SwiGLU)"):
        assert t.row(stage).bytes == pytest.approx(plain[stage][0])
