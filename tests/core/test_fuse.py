"""Fused projections (llmstep.core.fuse): the fused twin is the same function as the model, holds no weight
twice, leaves the model's names, shapes, values and state dict as they were, and fusing again copies nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmstep.core.config import LlamaConfig
from llmstep.core.fuse import fuse_rows, fused, fuses_by_default, is_fused
from llmstep.core.quantize import Int4Linear, Int8Linear, QuantConfig, quantize
from llmstep.lab.hardware import random_model

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=160, vocab_size=101, max_seq_len=64)
TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def storage_bytes(*models: nn.Module) -> int:
    """Bytes of the distinct storages behind the models' parameters and buffers: what they hold in memory."""
    seen = {}
    for m in models:
        for t in [*m.parameters(), *m.buffers()]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@torch.no_grad()
def prefill_and_decode(model, steps: int = 4) -> torch.Tensor:
    """The logits of a prefill into a cache and `steps` greedy decode steps after it, stacked [1 + steps, V]."""
    cache = model.new_cache(1, 32)
    logits = [model(TOKENS, cache=cache)[:, -1]]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True), cache=cache)[:, -1])
    return torch.cat(logits)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_fused_twin_computes_the_same_function(dtype, tol):
    model = random_model(CONFIG, device="cpu", dtype=dtype, std=0.1)
    before = prefill_and_decode(model)
    twin = fused(model)
    assert is_fused(twin) and not is_fused(model)
    assert all(b.attention.wq is None and b.feed_forward.w1 is None for b in twin.layers)  # no unfused path left
    torch.testing.assert_close(prefill_and_decode(twin), before, rtol=tol, atol=tol)
    torch.testing.assert_close(prefill_and_decode(model), before, rtol=0, atol=0)  # the model itself: unchanged
    with torch.no_grad():  # a plain causal forward too (no cache)
        torch.testing.assert_close(twin(TOKENS), model(TOKENS), rtol=tol, atol=tol)


def test_no_weight_is_held_twice_and_the_model_keeps_its_state_dict():
    model = random_model(CONFIG, device="cpu", dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    held = storage_bytes(model)
    twin = fused(model)
    assert storage_bytes(model, twin) == held  # the fused rows replaced the separate weights: nothing extra
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)
    a, fa = model.layers[0].attention, twin.layers[0].attention
    assert a.wk.weight.untyped_storage().data_ptr() == fa.wqkv.weight.untyped_storage().data_ptr()
    assert not any(p.requires_grad for p in [*model.parameters(), *twin.parameters()])


def test_fusing_again_copies_nothing_and_in_place_changes_reach_the_twin():
    model = random_model(CONFIG, device="cpu", dtype=torch.float32, std=0.1)
    first = fused(model)
    second = fused(model)  # the rows are back to back already: the same memory, not a new copy
    for f, s in zip(first.layers, second.layers, strict=True):
        assert f.attention.wqkv.weight.data_ptr() == s.attention.wqkv.weight.data_ptr()
        assert f.feed_forward.w13.weight.data_ptr() == s.feed_forward.w13.weight.data_ptr()
    with torch.no_grad():
        model.layers[1].attention.wv.weight.mul_(-2)  # through the model's own (view) weight
        model.layers[0].feed_forward.w3.weight.add_(0.05)
        torch.testing.assert_close(first(TOKENS), model(TOKENS), rtol=1e-5, atol=1e-5)


def test_fuse_rows_stacks_and_repoints_parameters_and_buffers():
    a, b = nn.Linear(4, 3, bias=False), nn.Linear(4, 5, bias=False)
    wa, wb = a.weight.detach().clone(), b.weight.detach().clone()
    whole = fuse_rows([a, b], "weight")
    assert whole.shape == (8, 4) and torch.equal(whole, torch.cat([wa, wb]))
    assert isinstance(a.weight, nn.Parameter) and torch.equal(a.weight, wa) and torch.equal(b.weight, wb)
    assert b.weight.data_ptr() == whole.data_ptr() + 3 * 4 * whole.element_size()


def test_int8_layers_fuse_exactly_and_hold_nothing_twice():
    model = random_model(CONFIG, device="cpu", dtype=torch.float32, std=0.1)
    q8 = quantize(model, QuantConfig("int8"), inplace=False)
    twin8 = fused(q8)
    assert is_fused(twin8) and isinstance(twin8.layers[0].attention.wqkv, Int8Linear)
    assert twin8.layers[0].feed_forward.w13.scales.shape == (2 * CONFIG.hidden_dim,)
    assert twin8.layers[0].attention.wqkv.eager_packed == q8.layers[0].attention.wq.eager_packed  # the same op
    torch.testing.assert_close(prefill_and_decode(twin8), prefill_and_decode(q8), rtol=1e-5, atol=1e-5)
    assert storage_bytes(q8, twin8) == storage_bytes(q8)


# Widths the CPU int4 kernel's 64-row tiles divide (q 128 rows, k and v 64 each, gate and up 256), as every
# Llama's do; CONFIG's k and v (16 rows) do not.
CONFIG64 = LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, vocab_size=101, max_seq_len=64)


def kernel_only(m: nn.Module) -> nn.Module:
    """What Int4Linear.prepare() leaves on CUDA (the kernel's layout alone), made on the CPU."""
    for layer in m.modules():
        if isinstance(layer, Int4Linear) and layer.kernel == "packed":
            layer.weight = None
    return m


@pytest.mark.parametrize("kernel", ["packed", "dequant", "reduce"])
@pytest.mark.parametrize("config", [CONFIG, CONFIG64], ids=["k16", "k64"])
def test_int4_layers_fuse_and_the_twin_computes_the_same_function(kernel, config):
    model = random_model(config, device="cpu", dtype=torch.float32, std=0.1)
    q4 = quantize(model, QuantConfig("int4", 32), kernel=kernel, inplace=False)
    state = {k: v.clone() for k, v in q4.state_dict().items()}
    before = prefill_and_decode(q4)
    twin4 = fused(q4)
    assert is_fused(twin4) and isinstance(twin4.layers[0].attention.wqkv, Int4Linear)
    assert twin4.layers[0].attention.wqkv.kernel == kernel
    assert twin4.layers[0].feed_forward.w13.out_features == 2 * config.hidden_dim
    torch.testing.assert_close(prefill_and_decode(twin4), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefill_and_decode(q4), before, rtol=1e-6, atol=1e-6)  # the parts, re-pointed
    after = q4.state_dict()  # what a checkpoint of the model holds (plain codes): unchanged
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)


@pytest.mark.parametrize("kernel", ["packed", "dequant", "reduce"])
def test_a_fused_int4_twin_holds_nothing_twice_and_fusing_again_copies_nothing(kernel):
    model = random_model(CONFIG64, device="cpu", dtype=torch.float32, std=0.1)
    q4 = quantize(model, QuantConfig("int4", 32), kernel=kernel, inplace=False)
    held = storage_bytes(q4)
    first = fused(q4)
    assert storage_bytes(q4, first) == held  # codes, scales, zeros and kernel layouts: views of the fused rows
    wk, wqkv = q4.layers[0].attention.wk, first.layers[0].attention.wqkv
    assert wk.scales.untyped_storage().data_ptr() == wqkv.scales.untyped_storage().data_ptr()
    if kernel == "packed":
        assert wk.kernel_weight.untyped_storage().data_ptr() == wqkv.kernel_weight.untyped_storage().data_ptr()
        assert wk.scales_and_zeros is None  # the part's table: rebuilt per call from the views
    second = fused(q4)
    assert storage_bytes(q4, first, second) == held
    assert second.layers[1].feed_forward.w13.weight.data_ptr() == first.layers[1].feed_forward.w13.weight.data_ptr()
    torch.testing.assert_close(prefill_and_decode(second), prefill_and_decode(first), rtol=0, atol=0)


def test_int4_layers_holding_only_the_kernel_layout_fuse_from_their_recovered_codes():
    """CUDA's packed int4 layers hold tinygemm's layout alone: fusing recovers their codes and stacks those."""
    model = random_model(CONFIG64, device="cpu", dtype=torch.float32, std=0.1)
    q4 = kernel_only(quantize(model, QuantConfig("int4", 32), inplace=False))
    before = prefill_and_decode(q4)
    twin4 = fused(q4)
    assert is_fused(twin4) and twin4.layers[0].attention.wqkv.kernel == "packed"
    torch.testing.assert_close(prefill_and_decode(twin4), before, rtol=1e-5, atol=1e-5)


def test_an_int4_part_whose_rows_the_cpu_kernels_tiles_do_not_fill_keeps_its_own_layout():
    """Where int4 copies (the module docstring): CONFIG's q rows (64) fill the CPU kernel's 64-row tiles and become
    a view of the fused layout; k and v (16 rows each) do not, and keep their own, checked not assumed."""
    model = random_model(CONFIG, device="cpu", dtype=torch.float32, std=0.1)
    q4 = quantize(model, QuantConfig("int4", 32), inplace=False)
    twin = fused(q4)
    a, wqkv = q4.layers[0].attention, twin.layers[0].attention.wqkv
    shared = wqkv.kernel_weight.untyped_storage().data_ptr()
    assert a.wq.kernel_weight.untyped_storage().data_ptr() == shared
    assert a.wk.kernel_weight.untyped_storage().data_ptr() != shared
    assert a.wk.weight.untyped_storage().data_ptr() == wqkv.weight.untyped_storage().data_ptr()  # codes: views


def test_a_cpu_step_fuses_by_default_where_its_blocks_are_int8_not_where_only_the_head_is():
    model = random_model(CONFIG, device="cpu", dtype=torch.float32)
    assert not fuses_by_default(model, compiled=True)
    assert fuses_by_default(quantize(model, QuantConfig("int8"), inplace=False), compiled=True)
    assert fuses_by_default(quantize(model, QuantConfig("int8", lm_head=True), inplace=False), compiled=True)
    assert not fuses_by_default(quantize(model, QuantConfig("int8"), inplace=False), compiled=False)
    assert not fuses_by_default(quantize(model, QuantConfig("int4", 32), inplace=False), compiled=True)
    assert not fuses_by_default(quantize(model, QuantConfig("int4", 32, lm_head="int8"), inplace=False), compiled=True)


def test_fusing_frees_each_layers_separate_weights_before_stacking_the_next(monkeypatch):
    """Fusing takes the weights plus one group of memory, not the weights plus every group: by the time a group is
    stacked, the separate tensors of every group stacked before it are gone (on the first H200 run an 8B model's
    fusing peaked at 25.2 GB for 16 GB of weights while a list held every old tensor to the end)."""
    import weakref

    import llmstep.core.fuse as fuse

    model = random_model(CONFIG, device="cpu", dtype=torch.float32)
    olds = [weakref.ref(t) for b in model.layers for t in (b.attention.wq.weight, b.attention.wk.weight,
                                                           b.attention.wv.weight, b.feed_forward.w1.weight,
                                                           b.feed_forward.w3.weight)]
    alive_at_each_group, real = [], fuse.torch.cat

    def cat(parts, *args, **kwargs):
        alive_at_each_group.append(sum(r() is not None for r in olds))
        return real(parts, *args, **kwargs)

    monkeypatch.setattr(fuse.torch, "cat", cat)
    twin = fused(model)
    monkeypatch.undo()
    # groups: qkv (3 tensors) then gate|up (2), per layer; at each stacking only the groups not yet stacked live
    assert alive_at_each_group == [10, 7, 5, 2]
    assert all(r() is None for r in olds) and is_fused(twin)
