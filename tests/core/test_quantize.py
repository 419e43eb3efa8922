"""Weight-only int8/int4 quantisation: bounded rounding, kernels that agree, checkpoints that round-trip,
and errors that name the layer."""

import json

import pytest
import torch

import llmstep
from llmstep.core.cost import decode_step_cost, weight_bytes
from llmstep.core.quantize import (
    Int4Linear,
    Int8Linear,
    QuantConfig,
    QuantizationError,
    dequantize_int4,
    dequantize_int8,
    layer_errors,
    linear_names,
    load_quantized,
    pack_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    save_quantized,
    unpack_int4,
)

G = 16  # the tiny test model's widths are 64 and 112: 16 divides both


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    model, tok = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    return model, tok


def test_int8_round_trip_error_is_at_most_half_a_step_per_element():
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 48)[:, None]
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-5)).all()
    assert int(q.abs().max()) == 127  # each row's largest weight uses the whole range


def test_int4_round_trip_error_is_at_most_half_a_step_per_group():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) + torch.linspace(-2, 2, 128)
    packed, scales, zeros = quantize_int4(w, group_size=32)
    assert packed.dtype == torch.uint8 and packed.shape == (32, 64)  # two values per byte
    assert scales.shape == zeros.shape == (32, 4)
    err = (dequantize_int4(packed, scales, zeros) - w).abs().view(32, 4, 32)
    assert (err <= scales[..., None] / 2 * (1 + 1e-5) + 1e-6).all()


def test_int4_packing_puts_the_even_index_in_the_high_nibble_and_unpacks_exactly():
    q = torch.randint(0, 16, (5, 12), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6)
    assert int(packed[0, 0]) == int(q[0, 0]) * 16 + int(q[0, 1])
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("cls,kw", [(Int8Linear, {}), (Int4Linear, {"group_size": 32})])
def test_packed_kernels_agree_with_dequantise_then_matmul(cls, kw):
    lin = torch.nn.Linear(128, 64, bias=False)
    x = torch.randn(3, 5, 128)
    ref = cls.from_linear(lin, kernel="dequant", **kw)
    packed = cls.from_linear(lin, kernel="packed", **kw)
    if packed.kernel != "packed":
        pytest.skip(f"no packed {cls.__name__} kernel in this PyTorch build on the CPU")
    torch.testing.assert_close(packed(x), ref(x), atol=1e-4, rtol=1e-4)
    # and both are the float matmul up to the rounding of the weights
    assert (ref(x) - lin(x)).norm() / lin(x).norm() < 0.1


@torch.no_grad()
@pytest.mark.parametrize("spec,tolerance", [("int8", 0.01), (QuantConfig("int4", G), 0.10),
                                            (QuantConfig("int4", G, lm_head=True), 0.12)])
def test_quantised_logits_stay_within_stated_tolerance_of_float(tiny, spec, tolerance):
    """Relative logit error ||z_q - z|| / ||z||: under 1% for int8, under 10% (12% with the LM head) for int4.

    These are random Gaussian weights, the worst case: 16 of them span ~3.5 standard deviations, so a
    4-bit step is ~0.23 sigma and the rounding error ~7% of the weights' spread (int8: ~0.6%). Trained
    weights are rounded no worse; the notebook measures what that does to perplexity."""
    model, _ = tiny
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    qmodel = quantize(model, spec, inplace=False)
    ref, got = model(tokens), qmodel(tokens)
    assert float((got - ref).norm() / ref.norm()) < tolerance
    assert isinstance(model.layers[0].attention.wq, torch.nn.Linear)  # inplace=False left the float model alone


def test_a_quantized_generation_reports_the_bytes_its_steps_really_read(tiny):
    model, tok = tiny
    q4 = quantize(model, QuantConfig("int4", G, lm_head=True), inplace=False)
    stored = sum(m.nbytes for m in q4.modules() if isinstance(m, Int4Linear))  # the quantized layers' own count
    assert stored > 0 and weight_bytes(q4) < weight_bytes(model)
    for m, name in ((model, "float"), (q4, "int4")):
        g = llmstep.generate(m, tok, "hello", max_new_tokens=4, temperature=0, stop_ids=[])
        steps = len(g.step_seconds)
        contexts = range(len(g.prompt_ids), len(g.prompt_ids) + steps)
        kv = sum(decode_step_cost(m.config, context=c, dtype=m.dtype).kv_bytes for c in contexts)
        assert g.decode_bytes == pytest.approx(steps * weight_bytes(m) + kv), name
    # the int4 model's count holds the packed layers' bytes, not the float matrices they replaced
    float_matrices = sum(model.get_submodule(n).weight.nbytes for n in linear_names(model, lm_head=True))
    assert weight_bytes(model) - weight_bytes(q4) == float_matrices - stored


def test_every_matmul_is_swapped_and_bytes_shrink(tiny):
    model, _ = tiny
    assert weight_bytes(model) == decode_step_cost(model.config, dtype=torch.float32).weight_bytes
    q8 = quantize(model, "int8", inplace=False)
    q4 = quantize(model, QuantConfig("int4", G, lm_head=True), inplace=False)
    names = linear_names(model)
    assert len(names) == 7 * model.config.n_layers
    assert all(isinstance(q8.get_submodule(n), Int8Linear) for n in names)
    assert isinstance(q4.output, Int4Linear) and not isinstance(q8.output, Int8Linear)
    matrices = sum(model.get_submodule(n).weight.numel() for n in names)
    # int8 saves 3 of every 4 fp32 bytes of the block matrices (plus a scale per row)
    assert weight_bytes(model) - weight_bytes(q8) == pytest.approx(3 * matrices, rel=0.05)
    assert weight_bytes(q4) < weight_bytes(q8) < weight_bytes(model)
    errors = layer_errors(model, q4)
    assert set(errors) == set(names) | {"output"} and all(0 < e < 0.2 for e in errors.values())


@torch.no_grad()
@pytest.mark.parametrize("spec", ["int8", QuantConfig("int4", G, lm_head=True)])
def test_quantised_checkpoint_saves_and_loads_to_identical_logits(tiny, tmp_path, spec):
    model, tok = tiny
    qmodel = quantize(model, spec, inplace=False)
    save_quantized(qmodel, tmp_path / "q", tokenizer=tok)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["mode"] == QuantConfig.of(spec).mode and cfg["quant_method"] == "llmstep"
    loaded = load_quantized(tmp_path / "q", device="cpu", dtype=torch.float32, expect=spec)
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(4))
    assert torch.equal(loaded(tokens), qmodel(tokens))


def test_bad_settings_are_refused_naming_the_layer(tiny):
    model, _ = tiny
    with pytest.raises(QuantizationError, match=r"layers\.0\.feed_forward\.w2: group_size 32 does not divide "
                                                r"in_features 112"):
        quantize(model, "int4", group_size=32, inplace=False)
    with pytest.raises(QuantizationError, match="unknown quantization mode 'int3'"):
        quantize(model, "int3", inplace=False)
    odd = llmstep.Llama(model.config.replace(hidden_dim=113))
    with pytest.raises(QuantizationError, match=r"layers\.0\.feed_forward\.w2: in_features 113 is odd"):
        quantize(odd, QuantConfig("int4", G))
    with pytest.raises(QuantizationError, match="group_size applies to int4 only"):
        QuantConfig("int8", 64)
    assert isinstance(model.layers[0].feed_forward.w2, torch.nn.Linear)  # nothing changed on refusal


def test_loading_refuses_a_checkpoint_that_does_not_match_its_settings(tiny, tmp_path, tiny_checkpoint):
    model, _ = tiny
    path = save_quantized(quantize(model, "int8", inplace=False), tmp_path / "q8")
    with pytest.raises(QuantizationError, match="quantised as int8, but int4-g64 was asked for"):
        load_quantized(path, device="cpu", expect="int4")
    with pytest.raises(QuantizationError, match="float checkpoint"):
        load_quantized(tiny_checkpoint, device="cpu")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] |= {"mode": "int4", "group_size": G}  # config.json no longer matches the weights
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match="do not belong together"):
        load_quantized(path, device="cpu")


def test_plain_load_of_a_quantised_checkpoint_points_to_load_quantized(tiny, tmp_path):
    model, _ = tiny
    path = save_quantized(quantize(model, "int8", inplace=False), tmp_path / "q8")
    with pytest.raises(llmstep.CheckpointError, match="quantised checkpoint .*load_quantized"):
        llmstep.load(path)
