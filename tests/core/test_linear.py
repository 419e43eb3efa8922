"""llmstep.core.linear: nn.Linear's function, widened to float32 for half-precision prompts on CPUs where torch's own
half-precision matmul is its generic loop. Forced on here (`slow`), so these hold on every CPU, AVX-512 or not."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import llmstep
from llmstep.core import fuse, linear
from llmstep.core.linear import WIDEN_ROWS, Linear


@pytest.fixture
def slow(monkeypatch):
    """As on a CPU without bf16 / fp16 instructions: torch's half-precision matmul is the slow loop."""
    monkeypatch.setattr(linear, "_slow_half_gemm", lambda dtype: True)


def calls(monkeypatch) -> list[tuple[torch.dtype, torch.dtype]]:
    """The (input, weight) dtypes of every F.linear that `linear` makes, recorded."""
    seen = []
    recorder = SimpleNamespace(linear=lambda x, w, b=None: seen.append((x.dtype, w.dtype)) or F.linear(x, w, b))
    monkeypatch.setattr(linear, "F", recorder)  # the module's own name for torch.nn.functional, not torch's
    return seen


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s numbers at |x| (float64): 2^(exponent - mantissa bits)."""
    bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(tiny))) - bits)


def assert_a_sum_rounded_once(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> None:
    """Each output is a float32 sum of the exact products (within e = (K + 1) 2^-24 sum|x w| of the exact sum, the
    worst case of any order) rounded once to the dtype (half a step): within half a step + e of the float64 matmul.
    Two roundings (the sum in two halves, each rounded to the dtype) missed it by 1.2-15x (a scratch check)."""
    want = F.linear(x.double(), w.double(), b.double())  # [.., out], exact in float64
    e = (x.shape[-1] + 1) * 2.0**-24 * F.linear(x.double().abs(), w.double().abs(), b.double().abs())
    bound = ulp(want.abs() + e, x.dtype) / 2 + e
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, WIDEN_ROWS - 1, WIDEN_ROWS, 128])
def test_the_result_is_a_float32_sum_of_the_products_rounded_once_either_way(slow, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(300, 576, generator=g).to(dtype)
    b = torch.randn(300, generator=g).to(dtype)
    assert_a_sum_rounded_once(linear.linear(x, w, b), x, w, b)  # ours
    assert_a_sum_rounded_once(F.linear(x, w, b), x, w, b)  # torch's


def test_it_widens_from_widen_rows_rows_of_a_half_precision_input_on_the_cpu(slow, monkeypatch):
    seen = calls(monkeypatch)
    w = torch.randn(32, 64).bfloat16()
    for shape in [(1, 64), (WIDEN_ROWS - 1, 64), (WIDEN_ROWS, 64), (2, WIDEN_ROWS // 2, 64), (1, 1, 40, 64)]:
        linear.linear(torch.randn(shape).bfloat16(), w)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2 + [(torch.float32, torch.float32)] * 3
    seen.clear()
    linear.linear(torch.randn(WIDEN_ROWS, 64), torch.randn(32, 64))  # float32: torch's own GEMM already
    with torch.device("meta"):  # neither a CPU tensor nor a computation
        linear.linear(torch.randn(WIDEN_ROWS, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="same dtype"):  # mixed dtypes: refused as F.linear refuses them
        linear.linear(torch.randn(WIDEN_ROWS, 64).bfloat16(), torch.randn(32, 64))
    assert seen == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                    (torch.bfloat16, torch.float32)]


def test_not_where_torch_has_a_half_precision_kernel(monkeypatch):
    monkeypatch.setattr(linear, "_slow_half_gemm", lambda dtype: False)
    seen = calls(monkeypatch)
    linear.linear(torch.randn(128, 64).bfloat16(), torch.randn(32, 64).bfloat16())
    assert seen == [(torch.bfloat16, torch.bfloat16)]


def test_the_probe_asks_torch_per_dtype_and_whether_onednn_is_on(monkeypatch):
    for dtype, probe in ((torch.bfloat16, "_is_mkldnn_bf16_supported"), (torch.float16, "_is_mkldnn_fp16_supported")):
        has = torch.backends.mkldnn.is_available() and getattr(torch.ops.mkldnn, probe)()
        assert linear._slow_half_gemm(dtype) == (not has)
    monkeypatch.setattr(linear, "_no_half_kernel", lambda dtype: False)  # as on a CPU with AVX-512 BF16
    assert not linear._slow_half_gemm(torch.bfloat16)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # oneDNN turned off: torch takes its loop
    assert not torch.backends.mkldnn.enabled and linear._slow_half_gemm(torch.bfloat16)


def test_what_torch_would_refuse_or_must_differentiate_keeps_torch_s_op(slow, monkeypatch):
    seen = calls(monkeypatch)
    x, w = torch.randn(WIDEN_ROWS, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    with pytest.raises(RuntimeError):  # a float32 bias beside bf16 operands: refused, as by F.linear
        linear.linear(x, w, torch.randn(32))
    with pytest.raises(RuntimeError):  # a 0-d input
        linear.linear(torch.tensor(1.0).bfloat16(), w)
    with pytest.raises(RuntimeError):  # a bias of the wrong length
        linear.linear(x, w, torch.randn(64).bfloat16())
    with pytest.raises(RuntimeError):  # a weight of no rows and the wrong width
        linear.linear(x, torch.randn(0, 63).bfloat16())
    with pytest.raises(RuntimeError):  # a 1-d weight whose length is not x's width
        linear.linear(x, torch.randn(63).bfloat16())
    with torch.enable_grad():  # training: autograd would keep the float32 copies
        linear.linear(x, w.clone().requires_grad_()).sum().backward()
        linear.linear(x, w, torch.randn(32).bfloat16().requires_grad_()).sum().backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 7


def test_a_weight_is_widened_a_block_at_a_time_to_the_same_result(slow, monkeypatch):
    """WIDEN_BLOCK bounds the float32 of a weight held at once (an LM head of 8B's vocabulary is 2 GB widened): a
    200-row weight in blocks of 3 rows (the last one 2), every output still one float32 sum rounded once, each block
    in its place (a block written to the wrong columns, or one left out, misses the bound by far)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 20, 64, generator=g).bfloat16(), torch.randn(200, 64, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    seen = calls(monkeypatch)
    monkeypatch.setattr(linear, "WIDEN_BLOCK", 3 * 64 + 10)  # 3 rows a block
    got = linear.linear(x, w, b)
    assert seen == [(torch.float32, torch.float32)] * 67  # ceil(200 / 3)
    assert_a_sum_rounded_once(got, x, w, b)


def test_a_torch_fx_symbolic_trace_records_the_plain_op(slow):
    """torch.fx's Proxy cannot answer the rule's questions: the trace gets F.linear (tests/cuda_proofs trace so)."""
    traced = torch.fx.symbolic_trace(Linear(64, 32, bias=False))
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"] == [F.linear]


def test_a_compiled_graph_keeps_the_half_precision_matmul(slow):
    """Under torch.compile the rule steps aside: inductor's own GEMMs take the matmul, no float32 copy of W."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = Linear(64, 32, bias=False).bfloat16()
    x = torch.randn(WIDEN_ROWS * 2, 64).bfloat16()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(layer, backend=backend, fullgraph=True)(x)
        assert torch.equal(got, F.linear(x, layer.weight))
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes]
    assert any("linear" in op for op in ops) and not any(op in ("float", "to") for op in ops), ops


def test_the_model_and_its_fused_twin_compute_by_it(slow, monkeypatch):
    """Every matmul of the model goes through `linear` (the blocks', the head's, the fused twin's): a bf16 prompt
    of WIDEN_ROWS tokens widens each one, a one-token step none."""
    cfg = llmstep.LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, hidden_dim=96,
                              max_seq_len=64)
    torch.manual_seed(0)
    model = llmstep.Llama(cfg).bfloat16().eval()
    twin = fuse.fused(model)
    assert type(twin.layers[0].attention.wqkv) is Linear and type(twin.layers[0].feed_forward.w13) is Linear
    seen = calls(monkeypatch)
    tokens = torch.randint(0, 128, (1, WIDEN_ROWS))
    with torch.no_grad():
        model(tokens)
        assert seen == [(torch.float32, torch.float32)] * (2 * 7 + 1)  # 7 a block, and the head
        seen.clear()
        twin(tokens)
        assert seen == [(torch.float32, torch.float32)] * (2 * 4 + 1)  # wqkv, wo, w13, w2 a block
        seen.clear()
        model(tokens[:, :1])
        assert seen == [(torch.bfloat16, torch.bfloat16)] * (2 * 7 + 1)


def _quantized(mode: str, out: int = 96, depth: int = 64):
    from llmstep.core.quantize import Int4Linear, Int8Linear

    torch.manual_seed(0)
    dense = Linear(depth, out, bias=False).bfloat16()
    return Int8Linear.from_linear(dense) if mode == "int8" else Int4Linear.from_linear(dense, 32)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_layer_s_prompt_is_widened_a_block_of_rows_at_a_time(slow, monkeypatch, mode):
    """Past the packed kernels' rows (PACKED_MAX_ROWS) a quantized layer's prompt multiplies in float32 with its
    weight made float32 a block of rows at a time, straight from the codes: no half-precision copy of the weight."""
    from llmstep.core.quantize import PACKED_MAX_ROWS

    layer = _quantized(mode)
    monkeypatch.setattr(linear, "WIDEN_BLOCK", 40 * 64)  # 40 of the 96 rows a block: 40, 40, 16
    seen = []
    monkeypatch.setattr(linear, "F", SimpleNamespace(
        linear=lambda x, w, b=None: seen.append((x.dtype, w.dtype, w.shape[0])) or F.linear(x, w, b)))
    casts = []  # (dtype, shape) of every tensor cast by .to, .float or .bfloat16
    for method in ("to", "float", "bfloat16"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda t, *a, real=real, **k: casts.append((t.dtype, t.shape)) or real(t, *a, **k))
    with torch.no_grad():
        layer(torch.randn(1, PACKED_MAX_ROWS + 1, 64).bfloat16())
    assert seen == [(torch.float32, torch.float32, 40), (torch.float32, torch.float32, 40),
                    (torch.float32, torch.float32, 16)]
    assert casts and not any(tuple(shape) == (96, 64) for _, shape in casts), casts  # no whole weight cast


def test_an_int8_prompt_gives_the_bits_of_its_bf16_weights_widened(slow):
    """int8 codes are exact in bf16 and in float32: widened straight from the codes, the prompt is the same function
    to the bit as the layer's bf16 weights through `linear`, times the scales."""
    layer = _quantized("int8")
    x = torch.randn(3, 20, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), linear.linear(x, layer.weight.bfloat16()) * layer.scales)


def test_an_int4_prompt_multiplies_the_float32_dequantized_weights_rounded_once(slow):
    """int4's weights dequantized in float32 (codes, scale and zero), as its kernels do, not rounded to bf16 first:
    each output within half a bf16 step plus float32's summation error of the float64 matmul of those weights (the
    bf16-rounded weights miss that bound here)."""
    layer = _quantized("int4", out=256, depth=512)
    x = torch.randn(32, 512).bfloat16()
    with torch.no_grad():
        got = layer(x)
        w32 = layer.dequantized(torch.float32)  # [256, 512]
        assert_a_sum_rounded_once(got, x, w32, torch.zeros(256))
        with pytest.raises(AssertionError):  # the old path: weights rounded to bf16 before the matmul
            assert_a_sum_rounded_once(linear.linear(x, w32.bfloat16()), x, w32, torch.zeros(256))


def test_where_torch_has_a_half_precision_gemm_an_int4_prompt_keeps_its_bf16_weights(monkeypatch):
    """Not widened (AVX-512, AMX, or a float32 model): the prompt multiplies the weights dequantized to the input's
    dtype by torch's own matmul, the same function as the layer's eager and compiled dequant path at every row count."""
    monkeypatch.setattr(linear, "_slow_half_gemm", lambda dtype: False)
    layer = _quantized("int4", out=256, depth=512)
    x = torch.randn(32, 512).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.dequantized().to(x.dtype)))
