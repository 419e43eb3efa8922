"""Weight-only int8/int4 quantisation: bounded rounding, kernels that agree, checkpoints that round-trip,
and errors that name the layer."""

import copy
import json
import re

import pytest
import torch
from conftest import make_checkpoint

import llmstep
from llmstep.core.cost import decode_step_cost, weight_bytes
from llmstep.core.quantize import (
    Int4Linear,
    Int8Linear,
    QuantConfig,
    QuantizationError,
    choose_int4_kernel,
    dequantize_int4,
    dequantize_int8,
    layer_errors,
    linear_names,
    pack_int4,
    prefer_int4_kernel,
    quantize,
    quantize_int4,
    quantize_int8,
    quantize_lm_head,
    unpack_int4,
)

G = 16  # the tiny test model's widths are 64 and 112: 16 divides both


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    model, tok = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    return model, tok


@pytest.fixture(scope="module")
def tied(tmp_path_factory, tokenizer_file):
    """A model whose LM head is its embedding (Llama 3.2 1B/3B)."""
    path = tmp_path_factory.mktemp("tied")
    make_checkpoint(path, tokenizer_file, tie_word_embeddings=True)
    return llmstep.load(path, device="cpu", dtype=torch.float32)


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


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_int4_error_stays_within_half_a_step_where_a_rounded_zero_moves(scale_dtype):
    """A group far from 0 (here 10 + a small spread): its zero rounded to bf16 moves by more than half a step, and
    an end of the group would clamp at q = 0 or 15; the scale widens to reach it."""
    w = torch.cat([(10 + torch.arange(64) / 1024).bfloat16().float(),
                   torch.randn(64, generator=torch.Generator().manual_seed(3)) * 0.01 - 7])[None]  # [1, 128]
    packed, scales, zeros = quantize_int4(w, 32, scale_dtype=scale_dtype)
    err = (dequantize_int4(packed, scales, zeros) - w).abs().view(1, 4, 32).amax(-1)  # [1, groups]
    assert (err <= scales.float() / 2 * (1 + 1e-5)).all(), (err, scales.float() / 2)
    centred = torch.randn(8, 128, generator=torch.Generator().manual_seed(4))  # a usual group: scales as before
    _, s, z = quantize_int4(centred, 32, scale_dtype=scale_dtype)
    g = centred.view(8, 4, 32)
    assert torch.equal(s, ((g.amax(-1) - g.amin(-1)) / 15).to(scale_dtype))


def test_a_numpy_group_size_is_kept_as_a_python_int():
    import numpy as np

    qc = QuantConfig("int4", np.int64(16))
    assert type(qc.group_size) is int and qc.group_size == 16


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
def test_auto_int8_runs_the_packed_op_eagerly_on_a_cpu_and_the_dequant_pattern_when_compiling(monkeypatch):
    """Eager dequantisation widens the whole matrix every call; a compiled step needs the pattern inductor rewrites."""
    from llmstep.core import torch_compat

    lin = torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    auto, plain = Int8Linear.from_linear(lin), Int8Linear.from_linear(lin, kernel="dequant")
    if not auto.eager_packed:
        pytest.skip("no packed int8 kernel in this PyTorch build on the CPU")
    assert auto.kernel == plain.kernel == "dequant" and not plain.eager_packed
    assert not Int8Linear.from_linear(lin.float()).eager_packed  # float32: torch's packed op is the slower there
    assert auto.prepare().eager_packed and auto.prepare().kernel == "dequant"  # prepared again: the same
    x32 = torch.randn(1, 128)  # float32 into a bf16 layer: the op takes one dtype, the dequant path promotes
    torch.testing.assert_close(auto(x32), plain(x32), atol=0, rtol=0)
    calls = []
    real = torch_compat.int8_mm
    monkeypatch.setattr(torch_compat, "int8_mm", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    got = auto(x)
    assert calls == [(1, 128)]  # one row: the packed op
    torch.testing.assert_close(got, plain(x), atol=2e-2, rtol=2e-2)  # bf16 rounding apart
    auto(torch.randn(1, 32, 128, dtype=torch.bfloat16))  # a prompt's rows: dequantise once, the ordinary matmul
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(auto(x), plain(x), atol=0, rtol=0)  # traced: the dequant pattern, exactly
    plain(x)
    assert calls == [(1, 128)]


@torch.no_grad()
def test_bf16_int8_of_a_width_torchs_packed_kernel_cannot_take_never_reaches_it():
    """torch 2.13's CPU _weight_int8pack_mm in bf16 crashes the process at in_features % 8 != 0 and 2 rows: the probe
    in prepare() ran it (quantize itself died), and inductor rewrote the compiled dequant pattern into it (a compiled
    batcher of 2 rows died). Such a layer scales its weights first, inductor's pattern not matched: x @ dequantized."""
    from llmstep.core.quant_formats import dequantize_int8

    lin = torch.nn.Linear(100, 32, bias=False).to(torch.bfloat16)
    layer = Int8Linear.from_linear(lin)  # the process survives
    assert layer.kernel == "dequant" and not layer.eager_packed
    x = torch.randn(2, 100, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, dequantize_int8(layer.weight, layer.scales, torch.bfloat16))
    assert torch.equal(layer(x), want)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), want)  # compiled: the pattern, not the kernel


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
@pytest.mark.parametrize("spec", ["int8", QuantConfig("int4", G, lm_head=True), QuantConfig("int8", lm_head=True),
                                  QuantConfig("int4", G, lm_head="int8")])
@pytest.mark.parametrize("which", ["tiny", "tied"])
def test_quantised_checkpoint_saves_and_loads_to_identical_logits(request, tmp_path, spec, which):
    """llmstep.save of a quantised model, then llmstep.load: the same model, bit for bit, with its tokenizer."""
    model, tok = request.getfixturevalue(which)
    qmodel = quantize(model, spec, inplace=False)
    llmstep.save(qmodel, tmp_path / "q", tokenizer=tok)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["mode"] == QuantConfig.of(spec).mode and cfg["quant_method"] == "llmstep"
    # the oldest format that holds it: an LM head in a mode of its own is version 2, the rest stay readable by 1
    assert cfg["format_version"] == (2 if QuantConfig.of(spec).lm_head == "int8" else 1)
    loaded, loaded_tok = llmstep.load(tmp_path / "q", device="cpu", dtype=torch.float32)
    assert loaded.quantization == QuantConfig.of(spec) and loaded_tok.tok.get_vocab() == tok.tok.get_vocab()
    assert [type(loaded.get_submodule(n)) for n in linear_names(loaded, lm_head=True)] == \
        [type(qmodel.get_submodule(n)) for n in linear_names(qmodel, lm_head=True)]
    tied = qmodel.output.weight is qmodel.tok_embeddings.weight
    assert (loaded.output.weight is loaded.tok_embeddings.weight) == tied
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(4))
    assert torch.equal(loaded(tokens), qmodel(tokens))
    assert weight_bytes(loaded) == weight_bytes(qmodel)


@torch.no_grad()
def test_a_bfloat16_quantised_checkpoint_round_trips_bit_identically(tiny_checkpoint, tmp_path):
    """In the dtype GPUs run: prompt (dequantise + matmul) and one-token decode (the packed kernel, if any)."""
    model, tok = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.bfloat16)
    qmodel = quantize(model, QuantConfig("int4", G, lm_head=True))
    loaded, _ = llmstep.load(llmstep.save(qmodel, tmp_path / "q", tokenizer=tok), device="cpu", dtype=torch.bfloat16)
    assert loaded.layers[0].attention.wq.kernel == qmodel.layers[0].attention.wq.kernel
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(6))
    assert torch.equal(loaded(tokens), qmodel(tokens))
    assert torch.equal(loaded(tokens[:1, :1]), qmodel(tokens[:1, :1]))


def test_a_quantised_checkpoint_can_be_sharded(tiny, tmp_path):
    model, tok = tiny
    qmodel = quantize(model, QuantConfig("int4", G), inplace=False)
    llmstep.save(qmodel, tmp_path / "q", tokenizer=tok, max_shard_bytes=20_000)
    assert len(list((tmp_path / "q").glob("model-*.safetensors"))) > 1
    loaded, _ = llmstep.load(tmp_path / "q", device="cpu", dtype=torch.float32)
    tokens = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(5))
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


def test_a_quantisation_is_named_one_way_and_read_back_from_its_name():
    """str(QuantConfig) is what a record, a checkpoint and a label show; QuantConfig.of reads it back; the head
    in the blocks' own mode has one spelling (True)."""
    for qc in [QuantConfig("int8"), QuantConfig("int8", lm_head=True), QuantConfig("int4", 32),
               QuantConfig("int4", 32, lm_head=True), QuantConfig("int4", 128, lm_head="int8")]:
        assert QuantConfig.of(str(qc)) == qc and QuantConfig.of(qc.to_dict()) == qc
    assert str(QuantConfig("int4", 32, lm_head="int8")) == "int4-g32+lm_head-int8"
    assert QuantConfig("int8", lm_head="int8") == QuantConfig("int8", lm_head=True)
    assert QuantConfig("int4", 32, lm_head="int4") == QuantConfig("int4", 32, lm_head=True)
    assert QuantConfig("int4", 32, lm_head="int8").head == QuantConfig("int8")
    assert QuantConfig("int4", 32, lm_head=True).head == QuantConfig("int4", 32)
    assert QuantConfig("int4", 32).head is None
    for bad, why in [(dict(mode="int8", lm_head="int4"), "an int4 head takes int4 blocks"),
                     (dict(mode="int4", lm_head=1), "got 1"), (dict(mode="int4", lm_head="fp8"), "got 'fp8'")]:
        with pytest.raises(QuantizationError, match=why):
            QuantConfig(**bad)
    with pytest.raises(QuantizationError, match="after '\\+lm_head' only '-int8' or '-int8-a8' may follow"):
        QuantConfig.of("int4+lm_head-int4")


@torch.no_grad()
@pytest.mark.parametrize("kernel", ["auto", "dequant", "reduce"])
def test_an_int8_head_under_int4_blocks(tiny, kernel):
    """lm_head="int8": every block matmul int4, the head int8 (its codes those of an int8 model's head), and
    the same model whether quantised in one call or the head afterwards (quantize_lm_head)."""
    model, _ = tiny
    qc = QuantConfig("int4", G, lm_head="int8")
    mixed = quantize(model, qc, kernel=kernel, inplace=False)
    assert all(isinstance(mixed.get_submodule(n), Int4Linear) for n in linear_names(model))
    assert isinstance(mixed.output, Int8Linear) and mixed.quantization == qc
    q8 = quantize(model, "int8", lm_head=True, inplace=False)
    assert torch.equal(mixed.output.weight, q8.output.weight) and torch.equal(mixed.output.scales, q8.output.scales)
    later = quantize_lm_head(quantize(model, QuantConfig("int4", G), kernel=kernel, inplace=False), "int8")
    assert later.quantization == qc
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(7))
    assert torch.equal(later(tokens), mixed(tokens))
    h = model.norm(model.tok_embeddings(tokens))  # the head alone, on any hidden state: int8 rounding only
    assert float((mixed.output(h) - model.output(h)).norm() / model.output(h).norm()) < 0.01
    with pytest.raises(QuantizationError, match="is int4-g16\\+lm_head-int8"):
        quantize_lm_head(mixed)
    with pytest.raises(QuantizationError, match="is not quantised"):
        quantize_lm_head(model)
    assert isinstance(model.output, torch.nn.Linear)  # nothing changed on refusal


def _rewrite(path, key, change):
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = change(cfg.get(key))
    (path / "config.json").write_text(json.dumps(cfg))


def test_loading_refuses_a_quantised_checkpoint_whose_files_disagree(tiny, tmp_path):
    """Settings, shapes and dtypes are checked from config.json and the headers before any tensor is read;
    each error names the file and the tensor."""
    model, tok = tiny
    path = llmstep.save(quantize(model, "int8", inplace=False), tmp_path / "q8", tokenizer=tok)
    _rewrite(path, "quantization_config", lambda q: q | {"mode": "int4", "group_size": G})  # weights are int8
    with pytest.raises(llmstep.CheckpointError, match=r"model\.safetensors: .*int8.*config\.json says int4-g16; "
                                                      "the files do not belong together"):
        llmstep.load(path, device="cpu")
    _rewrite(path, "quantization_config", lambda q: None)  # a float config.json over quantised weights
    with pytest.raises(llmstep.CheckpointError, match="config.json says none"):
        llmstep.load(path, device="cpu")
    _rewrite(path, "quantization_config", lambda q: "llmstep")
    with pytest.raises(llmstep.CheckpointError, match=r"config\.json: quantization_config must be an object"):
        llmstep.load(path, device="cpu")
    _rewrite(path, "quantization_config", lambda q: {"quant_method": "gptq"})
    with pytest.raises(llmstep.CheckpointError, match=r"config\.json: quantization_config is for 'gptq'"):
        llmstep.load(path, device="cpu")
    _rewrite(path, "quantization_config", lambda q: {"quant_method": "llmstep", "format_version": 99, "mode": "int8"})
    with pytest.raises(llmstep.CheckpointError, match="format version 99"):
        llmstep.load(path, device="cpu")
    _rewrite(path, "quantization_config", lambda q: {"quant_method": "llmstep", "format_version": 1, "mode": "int4",
                                                     "group_size": 16, "lm_head": "int8"})
    with pytest.raises(llmstep.CheckpointError, match="format version 1 has no LM head of its own mode"):
        llmstep.load(path, device="cpu")


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.scales"),
     r"missing tensor model\.layers\.1\.mlp\.down_proj\.scales"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.qweight": torch.zeros(64, 64, dtype=torch.uint8)}),
     r"q_proj\.qweight in model\.safetensors has dtype U8, expected I8"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.scales": torch.ones(3)}),
     r"k_proj\.scales in model\.safetensors has shape \[3\], int8 implies \[16\]"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(16, 64)}),
     r"unexpected tensor model\.layers\.0\.self_attn\.k_proj\.weight"),
])
def test_a_bad_tensor_in_a_quantised_checkpoint_is_named_before_any_is_read(tiny, tmp_path, monkeypatch, change,
                                                                             message):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import llmstep.core.loader as loader

    model, tok = tiny
    path = llmstep.save(quantize(model, "int8", inplace=False), tmp_path / "q8", tokenizer=tok)
    file = path / "model.safetensors"
    with safe_open(file, framework="pt") as f:
        metadata = f.metadata()  # the header's quantisation settings stay as they were
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata=metadata)

    def no_reading(*a, **k):
        raise AssertionError("weights were read before validation finished")

    monkeypatch.setattr(loader, "safe_open", no_reading)
    with pytest.raises(llmstep.CheckpointError, match=message):
        llmstep.load(path, device="cpu")


# ---- int4's single-reduction kernel and how a GPU chooses it (issue 25, item 3) ---------------------------

@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("k,g", [(128, 32), (256, 64), (96, 2)])
def test_the_reduce_kernel_is_dequantise_then_matmul(rows, k, g):
    """kernel="reduce" (both nibbles against the even/odd inputs, scale and zero per group, one sum) computes
    x @ dequantize_int4(...)^T; past PACKED_MAX_ROWS rows (a prompt) it widens the weights once instead."""
    torch.manual_seed(rows)
    lin = torch.nn.Linear(k, 48, bias=False)
    m = Int4Linear.from_linear(lin, group_size=g, kernel="reduce")
    assert m.kernel == "reduce" and m.kernel_weight is None and m.weight.shape == (48, k // 2)
    x = torch.randn(1, rows, k)
    want = x @ dequantize_int4(m.weight, m.scales, m.zeros).T
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.reduce_mm(x[0]), want[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_reduce_kernel_serves_decode_rows_and_keeps_the_input_dtype(monkeypatch):
    lin = torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    m = Int4Linear.from_linear(lin, group_size=32, kernel="reduce")
    calls = []
    real = Int4Linear.reduce_mm
    monkeypatch.setattr(Int4Linear, "reduce_mm", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    y = m(x)
    assert calls == [1] and y.dtype == torch.bfloat16 and y.shape == (1, 1, 64)
    want = x.float() @ m.dequantized().float().T
    assert float((y.float() - want).norm() / want.norm()) < 1e-2  # bf16 output rounding only
    m(torch.randn(1, 64, 128, dtype=torch.bfloat16))  # a prompt: dequantise + matmul
    assert calls == [1]


def test_a_reduce_model_holds_the_same_codes_a_checkpoint_holds(tiny):
    """The reduce kernel reads the plain codes: its state dict is the packed model's, bit for bit."""
    model, _ = tiny
    packed = quantize(model, QuantConfig("int4", G), inplace=False).state_dict()
    reduce = quantize(model, QuantConfig("int4", G), kernel="reduce", inplace=False).state_dict()
    assert packed.keys() == reduce.keys() and all(torch.equal(packed[k], reduce[k]) for k in packed)


def test_the_int4_kernel_rule_prefers_reduce_only_when_clearly_faster():
    assert choose_int4_kernel({"packed": 10.0, "reduce": 9.0}) == "reduce"
    assert choose_int4_kernel({"packed": 10.0, "reduce": 9.8}) == "packed"  # within the 5% margin: noise
    assert choose_int4_kernel({"packed": 10.0, "reduce": 12.0}) == "packed"
    assert choose_int4_kernel({"packed": 10.0}) == "packed" and choose_int4_kernel({"reduce": 3.0}) == "reduce"
    assert choose_int4_kernel({}) == "packed"


def test_auto_picks_the_kernel_measured_for_this_gpu_and_keeps_the_cpus(monkeypatch):
    import llmstep.core.quant_kernels as q

    monkeypatch.setattr(q, "_INT4_KERNEL_BY_GPU", {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda")
    assert q.auto_kernel("int4", cuda) == "packed"  # not measured: tinygemm
    prefer_int4_kernel(cuda, "reduce")
    assert q.auto_kernel("int4", cuda) == "reduce" and q.auto_kernel("int8", cuda) == "dequant"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA T4")
    assert q.auto_kernel("int4", cuda) == "packed"  # another GPU model: its own measurement
    assert q.auto_kernel("int4", torch.device("cpu")) == "packed"
    assert Int4Linear.from_linear(torch.nn.Linear(64, 32, bias=False), group_size=32).kernel == "packed"  # a CPU
    with pytest.raises(QuantizationError, match="chosen per GPU"):
        prefer_int4_kernel("cpu", "reduce")
    with pytest.raises(QuantizationError, match="'packed' or 'reduce'"):
        prefer_int4_kernel(cuda, "dequant")


def test_reduce_is_refused_for_int8():
    with pytest.raises(QuantizationError, match="int4's single-reduction"):
        Int8Linear(64, 32, kernel="reduce")
    with pytest.raises(QuantizationError, match="unknown kernel"):
        Int4Linear(64, 32, 32, kernel="fast")


@pytest.mark.parametrize("rows", [1, 20])  # a decode row, and a prompt (widened to float32 on a CPU)
def test_int8_in_float16_scales_the_weights_before_the_sum_so_nothing_overflows(rows):
    """x @ q^T with codes up to 127 is ~127 / max|w| times the output: past float16's 65504 for an output near 50
    (SmolLM2 in float16 went to inf at its first forward, int8-quantized)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 64, bias=False).half()
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    x = (torch.randn(rows, 1536) * 30).half()
    want = x.float() @ lin.weight.float().T  # [rows, 64], |y| up to ~60 or more
    assert want.abs().max() > 40
    got = Int8Linear.from_linear(lin, kernel="dequant")(x)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("row_max", [1e-3, 1e-4, 1e-5, 1e-6, 0.0])
def test_int8_keeps_its_bound_where_a_float16_scale_is_subnormal(row_max):
    w = torch.linspace(-row_max, row_max, 64).repeat(3, 1).half()  # [3, 64]
    q, scales = quantize_int8(w, torch.float16)
    err = (dequantize_int8(q, scales) - w.float()).abs().amax(dim=1)
    assert torch.isfinite(err).all() and (err <= scales.float() / 2).all(), (err, scales)
    assert q.abs().max() <= 127


@pytest.mark.parametrize("shape", [(64,), (2, 3, 64)])
def test_int8_names_a_weight_that_is_not_a_matrix(shape):
    with pytest.raises(QuantizationError, match=re.escape(f"a matrix [out, in], got a tensor of shape {list(shape)}")):
        quantize_int8(torch.randn(shape))


@pytest.mark.parametrize("make, words", [
    (lambda: Int4Linear(100, 8, 64), "group_size 64 does not divide in_features 100"),
    (lambda: Int4Linear(64, 8, 3), "int4 group_size must be an even integer >= 2, got 3"),
    (lambda: Int4Linear(64, 8, 0), "int4 group_size must be an even integer >= 2, got 0"),
    (lambda: quantize_int4(torch.randn(8, 64), 0), "int4 group_size must be an even integer >= 2, got 0"),
    (lambda: quantize_int4(torch.randn(8, 64), -32), "int4 group_size must be an even integer >= 2, got -32"),
    (lambda: quantize_int4(torch.randn(64), 32), re.escape("a matrix [out, in], got a tensor of shape [64]"))])
def test_the_int4_building_blocks_refuse_a_group_they_cannot_hold(make, words):
    with pytest.raises(QuantizationError, match=words):
        make()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_names_a_layer_whose_weights_are_not_finite(tiny, bad):
    model = copy.deepcopy(tiny[0])
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight[3, 5] = bad  # a NaN would take its whole row's scale
    for spec in ("int8", f"int4-g{G}"):
        with pytest.raises(QuantizationError, match=r"layers\.1\.feed_forward\.w2: its weights hold NaN or Inf"):
            quantize(model, spec, inplace=False)
