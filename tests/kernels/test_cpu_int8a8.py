"""int8 weights times 8-bit activations (llmstep.core.int8a8) and its AVX2 kernel (`mm8` in
llmstep.kernels.cpu_int4a8): the kernel's matmul the reference's function to float32 rounding at every shape, the
extreme codes (-128 weights, +-127 activations) without saturating, a row's output independent of the rows beside it,
and the mode through quantize(), fusion, a checkpoint and a compiled step."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import a8_kernel_agrees, a8_rows

import llmstep
from llmstep.core import int4a8, int8a8
from llmstep.core.checkpoint import CheckpointError
from llmstep.core.fuse import fused
from llmstep.core.quant_formats import QuantConfig, QuantizationError, quantize_int8
from llmstep.core.quantize import Int8Linear, quantize, quantize_lm_head


def _codes(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    q[0, :32] = -128  # int8's most negative code, whose magnitude only an unsigned byte holds
    return q


def _reference(x, q, scales):
    """float64 of x^ @ q^T * s, and the same with every term's magnitude (for the float32 rounding bound)."""
    xh = int4a8.fake_quantize(x).double()
    s = scales.double()
    return (xh @ q.double().T) * s, (xh.abs() @ q.double().abs().T) * s.abs()


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("N,K", [(1, 32), (40, 96), (576, 576), (7, 1536)])
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_the_matmul_is_x_hat_times_the_codes_to_float32_rounding(a8_ops, N, K, M, dtype, scale_dtype):
    x, q = a8_rows(M, K, dtype, N + K + M), _codes(N, K, N * K)
    scales = torch.rand(N, generator=torch.Generator().manual_seed(M)).add(0.01).to(scale_dtype)
    y = a8_ops.mm8(x, q, scales)
    want, magnitude = _reference(x, q, scales)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    # each block's sum exact, then K / 32 float32 multiply-adds per lane, 8 lanes summed, one scale: a few ulps each
    bound = 2.0**-24 * (K // 32 + 12) * magnitude
    assert ((y.double() - want).abs() <= bound).all()


def test_the_extreme_codes_sum_without_saturating(a8_ops):
    # every activation code +-127 (a block of equal magnitudes), every weight -128, whose magnitude only an unsigned
    # byte holds: each pair of products is 2 * 128 * 127 = 32,512, inside a 16-bit lane of vpmaddubsw (a kernel that
    # offset the codes to unsigned bytes, q + 128, would saturate there, and one reading -128 as signed would flip it)
    K = 256
    x = torch.full((2, K), 3.0)
    x[1] = -3.0
    q = torch.full((5, K), -128, dtype=torch.int8)
    scales = torch.ones(5)
    y = a8_ops.mm8(x, q, scales)
    d = 3.0 / 127  # every block's step (float32's to within rtol)
    want = torch.tensor([[-(d * 127 * 128 * K)], [d * 127 * 128 * K]]).expand(2, 5)
    assert torch.allclose(y, want.float(), rtol=1e-6)
    alt = torch.where(torch.arange(K) % 2 == 0, torch.tensor(-128), torch.tensor(127)).to(torch.int8)
    y2 = a8_ops.mm8(x, alt.expand(5, K).contiguous(), scales)  # -128 and 127 in the same pair
    assert torch.allclose(y2, torch.full((2, 5), d * 127 * (-128 + 127) * K / 2).mul(torch.tensor([[1.0], [-1.0]])),
                          rtol=1e-6)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(a8_ops):
    x, q = a8_rows(9, 576, torch.bfloat16, 1), _codes(64, 576, 2)
    scales = torch.rand(64).bfloat16()
    together = a8_ops.mm8(x, q, scales)
    for m in (0, 4, 8):
        assert torch.equal(a8_ops.mm8(x[m:m + 1], q, scales)[0], together[m])


def test_a_nan_or_an_infinity_makes_its_row_non_finite_and_leaves_the_others(a8_ops):
    x, q, scales = a8_rows(3, 128, torch.float32, 3), _codes(16, 128, 4), torch.rand(16)
    clean = a8_ops.mm8(x, q, scales)
    x[0, 70], x[2, 5] = float("nan"), float("inf")
    y = a8_ops.mm8(x, q, scales)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[2]).any()
    assert torch.equal(y[1], clean[1])
    ref = int8a8.matmul(type("L", (), {"kernel": "dequant", "weight": q, "scales": scales})(), x)
    assert not torch.isfinite(ref[0]).any() and not torch.isfinite(ref[2]).any()  # the torch ops' function too


def test_bad_arguments_are_named(a8_ops):
    x, q, s = torch.randn(2, 64), _codes(8, 64, 0), torch.rand(8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        a8_ops.mm8(torch.randn(2, 48), q[:, :48].contiguous(), s)
    with pytest.raises(RuntimeError, match="weights must be contiguous int8"):
        a8_ops.mm8(x, q.to(torch.uint8), s)
    with pytest.raises(RuntimeError, match="weights must be contiguous int8"):
        a8_ops.mm8(x, torch.cat([q, q], 1)[:, ::2], s)
    with pytest.raises(RuntimeError, match=r"scales must be .* \[N\] for N = 8"):
        a8_ops.mm8(x, q, torch.rand(7))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        a8_ops.mm8(x.half(), q, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_computes_the_same_function_with_the_kernel_or_torchs_ops(a8_ops, dtype):
    lin = torch.nn.Linear(256, 96, bias=False).to(dtype)
    layer = Int8Linear.from_linear(lin, activations=8)
    codes, scales = quantize_int8(lin.weight, scale_dtype=dtype)
    assert layer.kernel == "a8" and "activations=8" in repr(layer)
    assert torch.equal(layer.weight, codes) and torch.equal(layer.scales, scales)  # int8's own weights, as they are
    assert layer.state_dict().keys() == {"weight", "scales"}  # nothing else to save or fuse
    x, ref = a8_kernel_agrees(layer, int8a8, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    asked = Int8Linear.from_linear(lin, kernel="dequant", activations=8)  # torch's ops, as asked
    assert asked.kernel == "dequant" and torch.allclose(asked(x).float(), ref.float(), rtol=tol,
                                                       atol=tol * ref.float().abs().max().item())


def test_the_config_names_parses_and_refuses_it():
    qc = QuantConfig.of("int8-a8+lm_head")
    assert (qc.mode, qc.group_size, qc.activations, qc.lm_head) == ("int8", None, 8, True)
    assert str(qc) == "int8-a8+lm_head" and QuantConfig.of(qc.to_dict()) == qc and QuantConfig.of(str(qc)) == qc
    assert qc.layer("wq") == qc.head == QuantConfig("int8", activations=8)
    assert str(QuantConfig.of("int8+lm_head-int8")) == "int8+lm_head"  # weight-only: the head as the blocks
    weight_only_head = QuantConfig.of("int8-a8+lm_head-int8")  # under 8-bit activations: a weight-only int8 head
    assert weight_only_head.head == QuantConfig("int8") and str(weight_only_head) == "int8-a8+lm_head-int8"
    assert QuantConfig.of(str(weight_only_head)) == weight_only_head
    assert QuantConfig.of("int8-a8").head is None and "activations" not in QuantConfig.of("int8").to_dict()
    with pytest.raises(QuantizationError, match="activations=8"):
        QuantConfig("int8", activations=4)
    with pytest.raises(QuantizationError, match="applies to int4 only"):
        QuantConfig.of("int8-a8", group_size=32)
    with pytest.raises(QuantizationError, match="int8 with 8-bit activations has its own kernel"):
        Int8Linear(64, 64, kernel="packed", activations=8)
    with pytest.raises(QuantizationError, match="in_features 48 is not a multiple of 32"):
        Int8Linear(48, 64, activations=8)  # as a checkpoint's layer is made, before its weights are read
    with pytest.raises(QuantizationError, match="activations=8 .* got activations=4"):
        Int8Linear(64, 64, activations=4)


def test_where_the_kernel_cannot_be_built_the_layers_run_torchs_ops_and_say_so(monkeypatch):
    monkeypatch.setattr(int8a8, "_kernel", None)
    monkeypatch.setattr(int4a8, "_installer", lambda: False)  # as a failed build answers
    model = torch.nn.Sequential(Int8Linear.from_linear(torch.nn.Linear(64, 8, bias=False), activations=8))
    assert model[0].kernel == "dequant" and int8a8.describe(model) == "torch ops"
    x = torch.randn(3, 64)
    assert torch.equal(model(x), (int4a8.fake_quantize(x) @ model[0].weight.float().T) * model[0].scales)


def test_a_float16_layer_runs_torchs_ops_where_the_kernel_is_built(a8_ops):
    lin = torch.nn.Linear(64, 8, bias=False)
    assert Int8Linear.from_linear(lin, activations=8).kernel == "a8"
    half = Int8Linear.from_linear(lin.half(), activations=8)
    assert half.kernel == "dequant"  # the kernel takes float32 or bf16 scales and activations only
    x = torch.randn(3, 64).half()
    assert torch.equal(half(x), ((int4a8.fake_quantize(x) @ half.weight.float().T) * half.scales.float()).half())


def test_the_op_has_a_meta_kernel_for_compiled_graphs(a8_ops):
    x, q, s = torch.empty(3, 96, device="meta"), torch.empty(40, 96, dtype=torch.int8, device="meta"), torch.empty(40)
    y = a8_ops.mm8(x, q, s.to("meta"))
    assert y.device.type == "meta" and y.shape == (3, 40) and y.dtype == torch.float32


def test_a_width_that_is_not_whole_blocks_is_refused_naming_the_layer(tiny_checkpoint):
    model, _ = llmstep.load(tiny_checkpoint, dtype="float32")
    with pytest.raises(QuantizationError, match=r"feed_forward\.w2: in_features 112 is not a multiple of 32"):
        quantize(model, "int8-a8", inplace=False)
    quantize(model, "int8", inplace=False)  # weight-only int8 takes any width


@torch.no_grad()
def test_a_quantised_model_is_close_to_weight_only_int8_and_fuses_and_saves_exactly(a8_ops, model128, tmp_path):
    model, tok = model128
    a8 = quantize(model, "int8-a8+lm_head", inplace=False)
    w8 = quantize(model, "int8+lm_head", inplace=False)
    layers = [m for m in a8.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 15 and all(m.activations == 8 for m in layers)
    assert all(m.kernel == "a8" for m in a8.layers.modules() if isinstance(m, Int8Linear))
    assert int8a8.describe(a8) == f"{a8_ops.name}::mm8"  # the 300-wide head runs the kernel too
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, weight_only = a8(tokens), w8(tokens)
    # the activations' rounding (a step of max|x| / 127 per block) moves the logits a little, not a lot
    err = (logits - weight_only).norm() / weight_only.norm()
    assert 0 < err < 0.05
    twin = fused(a8)
    assert twin.layers[0].attention.wqkv.activations == 8 and twin.layers[0].feed_forward.w13.kernel == "a8"
    assert torch.equal(twin(tokens), logits)  # q|k|v and gate|up in one matmul each: the same bits
    path = llmstep.save(a8, tmp_path / "a8", tokenizer=tok)
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg["activations"] == 8 and cfg["format_version"] == 3 and cfg["mode"] == "int8"
    loaded, _ = llmstep.load(path, dtype="float32")
    assert loaded.quantization == a8.quantization and torch.equal(loaded(tokens), logits)


@torch.no_grad()
@pytest.mark.parametrize("blocks", ["int4-g32-a8", "int4-g32", "int8"])
def test_an_int8_a8_head_under_other_blocks(a8_ops, model128, tmp_path, blocks):
    """lm_head="int8-a8": the head in int8 with 8-bit activations (llama.cpp's Q8_0 head under its 4-bit blocks)
    whatever the blocks are: the same layer as an int8-a8 model's head, the same model quantised in one call or the
    head afterwards, int4's block kernels (reduce, packed, dequant; a8) beside the head's own, and a checkpoint of
    format 3 that loads to the same bits (and that a format-2 claim cannot load: it would drop the head's rounding)."""
    model, tok = model128
    qc = QuantConfig.of(f"{blocks}+lm_head-int8-a8")
    assert str(qc) == f"{blocks}+lm_head-int8-a8" and QuantConfig.of(qc.to_dict()) == qc
    assert qc.head == QuantConfig("int8", activations=8) and qc.layer("layers.0.attention.wq") == QuantConfig.of(blocks)
    mixed = quantize(model, qc, inplace=False)
    head = mixed.output
    assert type(head) is Int8Linear and head.activations == 8 and head.kernel == "a8"
    own = quantize(model, "int8-a8+lm_head", inplace=False).output  # an int8-a8 model's head
    assert torch.equal(head.weight, own.weight) and torch.equal(head.scales, own.scales)
    h = model.norm(model.tok_embeddings(torch.arange(40).view(2, 20)))
    assert torch.equal(head(h), own(h))
    later = quantize_lm_head(quantize(model, blocks, inplace=False), "int8-a8")
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    logits = mixed(tokens)
    assert later.quantization == qc and torch.equal(later(tokens), logits)
    path = llmstep.save(mixed, tmp_path / "mixed", tokenizer=tok)
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg["format_version"] == 3 and cfg["lm_head"] == "int8-a8"  # a reader of 2 would drop the head's
    loaded, _ = llmstep.load(path, dtype="float32")
    assert loaded.quantization == qc and loaded.output.kernel == "a8" and torch.equal(loaded(tokens), logits)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 2
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="version 2 has no 8-bit activations; the file is damaged"):
        llmstep.load(path)
    if blocks.startswith("int4"):  # int4's own kernels for the blocks, the head's own for the head
        for kernel in ("reduce", "packed", "dequant") if blocks == "int4-g32" else ("a8",):
            other = quantize(model, qc, kernel=kernel, inplace=False)
            assert other.output.kernel == ("dequant" if kernel == "dequant" else "a8")
            assert torch.allclose(other(tokens), logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())


def test_an_lm_head_of_its_own_is_refused_by_name(model128):
    model, _ = model128
    blocks = quantize(model, "int4-g32-a8", inplace=False)
    for bad in ("int4-a8", "int8-a4", "fp8"):
        with pytest.raises(QuantizationError, match=f"head must be True, 'int8', 'int8-a8' or the blocks' mode "
                                                    f"'int4', got '{bad}'"):
            quantize_lm_head(blocks, bad)
    for head, kernel in (("int8-a8", "packed"), ("int8-a8", "reduce"), ("int8", "reduce")):  # the head's own only
        with pytest.raises(QuantizationError, match=f"not {kernel!r}|kernel '{kernel}' is int4's"):
            quantize_lm_head(blocks, head, kernel=kernel)
    assert not isinstance(blocks.output, Int8Linear) and blocks.quantization.lm_head is False  # nothing changed
    with pytest.raises(QuantizationError, match="only '-int8' or '-int8-a8' may follow"):
        QuantConfig.of("int4-g32-a8+lm_head-int4-a8")
    assert QuantConfig.of("int8-a8+lm_head-int8-a8") == QuantConfig.of("int8-a8+lm_head")  # the blocks' own: True


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~30 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
@pytest.mark.parametrize("spec", ["int8-a8+lm_head", "int4-g32-a8"])
def test_a_compiled_step_gives_the_eager_tokens(a8_ops, model128, spec):
    """Both modes with 8-bit activations (int4-a8's too): their ops in a compiled graph (their meta kernels), fused."""
    from llmstep.engines.fast import FastDecoder

    model, _ = model128
    a8 = quantize(model, spec, inplace=False)
    prompt = [5, 9, 2, 7, 11]
    eager = FastDecoder(a8, max_len=40, compile=False).generate(prompt, 24, temperature=0).tokens
    assert FastDecoder(a8, max_len=40, compile=True).generate(prompt, 24, temperature=0).tokens == eager
