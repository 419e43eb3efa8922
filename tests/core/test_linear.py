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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, WIDEN_ROWS - 1, WIDEN_ROWS, 128])
def test_the_result_is_a_float32_sum_of_the_products_rounded_once_either_way(slow, dtype, rows):
    """Widened or not, each output is a float32 sum of the exact products (within e = (K + 1) 2^-24 sum|x w| of the
    exact sum, the worst case of any order) rounded once to `dtype` (half a step): so within half a step + e of the
    float64 matmul. Two roundings (the sum in two halves, each rounded to `dtype`) miss this by 1.2-15x."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(300, 576, generator=g).to(dtype)
    b = torch.randn(300, generator=g).to(dtype)
    want = F.linear(x.double(), w.double(), b.double())  # [rows, 300], exact in float64
    e = 577 * 2.0**-24 * F.linear(x.double().abs(), w.double().abs(), b.double().abs())  # float32's sums, any order
    bound = ulp(want.abs() + e, dtype) / 2 + e
    for got in (linear.linear(x, w, b), F.linear(x, w, b)):  # ours, torch's
        assert got.dtype == dtype and got.shape == (rows, 300)
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (err / bound).max()


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


def test_the_probe_asks_torch_per_dtype():
    for dtype, probe in ((torch.bfloat16, "_is_mkldnn_bf16_supported"), (torch.float16, "_is_mkldnn_fp16_supported")):
        assert linear._slow_half_gemm(dtype) == (not getattr(torch.ops.mkldnn, probe)())


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
