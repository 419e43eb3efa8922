"""int8 weights times 8-bit activations (llmstep.core.int8a8) and its AVX2 kernel (`mm8` in
llmstep.kernels.cpu_int4a8): the kernel's matmul the reference's function to float32 rounding at every shape, the
extreme codes (-128 weights, +-127 activations) without saturating, a row's output independent of the rows beside it,
and the mode through quantize(), fusion, a checkpoint and a compiled step."""

from __future__ import annotations

import json
import os

import pytest
import torch

import llmstep
from llmstep.core import int4a8, int8a8
from llmstep.core.fuse import fused
from llmstep.core.quant_formats import QuantConfig, QuantizationError, quantize_int8
from llmstep.core.quantize import Int8Linear, quantize
from llmstep.kernels import cpu_int4a8


@pytest.fixture(scope="module")
def ops():
    if not cpu_int4a8.install():
        pytest.skip(f"the 8-bit activation kernels do not build here: {cpu_int4a8.why()}")
    return torch.ops.llmstep_int4a8_avx2


def _rows(M, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(M, K // 32, 1, generator=g).mul(4).expand(M, K // 32, 32).reshape(M, K)  # blocks apart
    x = torch.randn(M, K, generator=g) * scale
    x[0, :32] = 0  # a block of zeros: step 0, codes 0
    return x.to(dtype)


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
def test_the_matmul_is_x_hat_times_the_codes_to_float32_rounding(ops, N, K, M, dtype, scale_dtype):
    x, q = _rows(M, K, dtype, N + K + M), _codes(N, K, N * K)
    scales = torch.rand(N, generator=torch.Generator().manual_seed(M)).add(0.01).to(scale_dtype)
    y = ops.mm8(x, q, scales)
    want, magnitude = _reference(x, q, scales)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    # each block's sum exact, then K / 32 float32 multiply-adds per lane, 8 lanes summed, one scale: a few ulps each
    bound = 2.0**-24 * (K // 32 + 12) * magnitude
    assert ((y.double() - want).abs() <= bound).all()


def test_the_extreme_codes_sum_without_saturating(ops):
    # every activation code +-127 (a block of equal magnitudes), every weight -128: each pair of products is
    # 2 * 128 * 127 = 32,512, the most a 16-bit lane of vpmaddubsw holds; a saturating sum would stop at 32,767
    K = 256
    x = torch.full((2, K), 3.0)
    x[1] = -3.0
    q = torch.full((5, K), -128, dtype=torch.int8)
    scales = torch.ones(5)
    y = ops.mm8(x, q, scales)
    d = 3.0 / 127  # every block's step, as float32 computes it
    want = torch.tensor([[-(d * 127 * 128 * K)], [d * 127 * 128 * K]]).expand(2, 5)
    assert torch.allclose(y, want.float(), rtol=1e-6)
    alt = torch.where(torch.arange(K) % 2 == 0, torch.tensor(-128), torch.tensor(127)).to(torch.int8)
    y2 = ops.mm8(x, alt.expand(5, K).contiguous(), scales)  # -128 and 127 in the same pair
    assert torch.allclose(y2, torch.full((2, 5), d * 127 * (-128 + 127) * K / 2).mul(torch.tensor([[1.0], [-1.0]])),
                          rtol=1e-6)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(ops):
    x, q = _rows(9, 576, torch.bfloat16, 1), _codes(64, 576, 2)
    scales = torch.rand(64).bfloat16()
    together = ops.mm8(x, q, scales)
    for m in (0, 4, 8):
        assert torch.equal(ops.mm8(x[m:m + 1], q, scales)[0], together[m])


def test_a_nan_or_an_infinity_makes_its_row_non_finite_and_leaves_the_others(ops):
    x, q, scales = _rows(3, 128, torch.float32, 3), _codes(16, 128, 4), torch.rand(16)
    clean = ops.mm8(x, q, scales)
    x[0, 70], x[2, 5] = float("nan"), float("inf")
    y = ops.mm8(x, q, scales)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[2]).any()
    assert torch.equal(y[1], clean[1])
    ref = int8a8.matmul(type("L", (), {"kernel": "dequant", "weight": q, "scales": scales})(), x)
    assert not torch.isfinite(ref[0]).any() and not torch.isfinite(ref[2]).any()  # the torch ops' function too


def test_bad_arguments_are_named(ops):
    x, q, s = torch.randn(2, 64), _codes(8, 64, 0), torch.rand(8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.mm8(torch.randn(2, 48), q[:, :48].contiguous(), s)
    with pytest.raises(RuntimeError, match="weights must be contiguous int8"):
        ops.mm8(x, q.to(torch.uint8), s)
    with pytest.raises(RuntimeError, match="weights must be contiguous int8"):
        ops.mm8(x, torch.cat([q, q], 1)[:, ::2], s)
    with pytest.raises(RuntimeError, match=r"scales must be .* \[N\] for N = 8"):
        ops.mm8(x, q, torch.rand(7))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.mm8(x.half(), q, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_computes_the_same_function_with_the_kernel_or_torchs_ops(ops, dtype):
    lin = torch.nn.Linear(256, 96, bias=False).to(dtype)
    layer = Int8Linear.from_linear(lin, activations=8)
    codes, scales = quantize_int8(lin.weight, scale_dtype=dtype)
    assert layer.kernel == "a8" and "activations=8" in repr(layer)
    assert torch.equal(layer.weight, codes) and torch.equal(layer.scales, scales)  # int8's own weights, as they are
    assert layer.state_dict().keys() == {"weight", "scales"}  # nothing else to save or fuse
    x = _rows(4, 256, dtype, 5).view(2, 2, 256)
    with torch.no_grad():
        y = layer(x)
        saved = int8a8._kernel
        int8a8.use_kernel(None)
        try:
            ref = layer(x)
        finally:
            int8a8._kernel = saved
    assert y.shape == ref.shape == (2, 2, 96) and y.dtype == ref.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())
    assert layer(torch.zeros(0, 256, dtype=dtype)).shape == (0, 96)
    asked = Int8Linear.from_linear(lin, kernel="dequant", activations=8)  # torch's ops, as asked
    assert asked.kernel == "dequant" and torch.allclose(asked(x).float(), ref.float(), rtol=tol,
                                                       atol=tol * ref.float().abs().max().item())


def test_without_the_kernel_a_layer_runs_torchs_ops():
    layer = Int8Linear.from_linear(torch.nn.Linear(64, 8, bias=False), activations=8)
    x = torch.randn(3, 64)
    want = (int4a8.fake_quantize(x) @ layer.weight.float().T) * layer.scales
    saved = int8a8._kernel
    int8a8.use_kernel(None)  # as where the kernel cannot be built
    try:
        assert torch.equal(layer(x), want)
    finally:
        int8a8._kernel = saved


def test_the_config_names_parses_and_refuses_it():
    qc = QuantConfig.of("int8-a8+lm_head")
    assert (qc.mode, qc.group_size, qc.activations, qc.lm_head) == ("int8", None, 8, True)
    assert str(qc) == "int8-a8+lm_head" and QuantConfig.of(qc.to_dict()) == qc and QuantConfig.of(str(qc)) == qc
    assert qc.layer("wq") == qc.head == QuantConfig("int8", activations=8)
    assert str(QuantConfig.of("int8-a8+lm_head-int8")) == "int8-a8+lm_head"  # the head in the blocks' own mode
    assert QuantConfig.of("int8-a8").head is None and "activations" not in QuantConfig.of("int8").to_dict()
    with pytest.raises(QuantizationError, match="activations=8"):
        QuantConfig("int8", activations=4)
    with pytest.raises(QuantizationError, match="applies to int4 only"):
        QuantConfig.of("int8-a8", group_size=32)
    with pytest.raises(QuantizationError, match="int8 with 8-bit activations has its own kernel"):
        Int8Linear(64, 64, kernel="packed", activations=8)


def test_a_width_that_is_not_whole_blocks_is_refused_naming_the_layer(tiny_checkpoint):
    model, _ = llmstep.load(tiny_checkpoint, dtype="float32")
    with pytest.raises(QuantizationError, match=r"feed_forward\.w2: in_features 112 is not a multiple of 32"):
        quantize(model, "int8-a8", inplace=False)
    quantize(model, "int8", inplace=False)  # weight-only int8 takes any width


@pytest.fixture(scope="module")
def model128(tmp_path_factory, tokenizer_file):
    """A small GQA model whose widths are whole blocks of 32 (the tiny fixture's MLP is 112 wide)."""
    from conftest import make_checkpoint

    path = tmp_path_factory.mktemp("a8")
    make_checkpoint(path, tokenizer_file, intermediate_size=128, num_hidden_layers=2)
    return llmstep.load(path, dtype="float32")


@torch.no_grad()
def test_a_quantised_model_is_close_to_weight_only_int8_and_fuses_and_saves_exactly(ops, model128, tmp_path):
    model, tok = model128
    a8 = quantize(model, "int8-a8+lm_head", inplace=False)
    w8 = quantize(model, "int8+lm_head", inplace=False)
    layers = [m for m in a8.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 15 and all(m.activations == 8 for m in layers)
    assert all(m.kernel == "a8" for m in a8.layers.modules() if isinstance(m, Int8Linear))
    assert int8a8.describe(a8) == "llmstep_int4a8_avx2::mm8"  # the 300-wide head runs the kernel too
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


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~30 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
def test_a_compiled_step_gives_the_eager_tokens(ops, model128):
    from llmstep.engines.fast import FastDecoder

    model, _ = model128
    a8 = quantize(model, "int8-a8+lm_head", inplace=False)
    prompt = [5, 9, 2, 7, 11]
    eager = FastDecoder(a8, max_len=40, compile=False).generate(prompt, 24, temperature=0).tokens
    assert FastDecoder(a8, max_len=40, compile=True).generate(prompt, 24, temperature=0).tokens == eager
