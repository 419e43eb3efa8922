"""A quantised model moved with nn.Module's .to() / .cuda() / .cpu() / .half() / .to_empty(): each layer's kernel
layout is built for one device and dtype, so the layers build it again where they land (llmstep.core.quant_layouts
.moved), from the kernel the caller asked for. Proven on a CPU: CUDA as fake tensors (torch's own shape checks of
tinygemm's ops), a layer prepared on CUDA as tinygemm's layout computed on the CPU (test_int4_memory.tinygemm_layout),
dtype moves and the meta device for real."""

from __future__ import annotations

import pytest
import torch
from test_int4_memory import random_codes, tinygemm_here, tinygemm_layout  # noqa: F401 (a fixture)
from torch import nn

from llmstep.core import int4a8, int8a8, quant_layouts
from llmstep.core.config import LlamaConfig
from llmstep.core.quantize import Int4Linear, Int8Linear, QuantizationError, quantize
from llmstep.lab.hardware import random_model

CUDA = torch.device("cuda")
TINY = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=32)


@pytest.fixture
def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def int4(n: int = 128, k: int = 256, dtype=torch.bfloat16, **kw) -> Int4Linear:
    torch.manual_seed(0)
    return Int4Linear.from_linear(nn.Linear(k, n, bias=False).to(dtype).requires_grad_(False), 64, **kw)


def same_codes(m: Int4Linear, dtype: torch.dtype) -> Int4Linear:
    """A layer prepared afresh from m's codes and its scales and zeros converted to dtype."""
    fresh = Int4Linear(m.in_features, m.out_features, m.group_size, dtype=dtype, kernel=m.asked,
                       activations=m.activations)
    fresh.weight, fresh.scales, fresh.zeros = m.codes().clone(), m.scales.to(dtype), m.zeros.to(dtype)
    return fresh.prepare()


def test_an_int4_model_quantised_on_the_cpu_builds_tinygemms_layout_when_moved_to_cuda(fake_mode, monkeypatch):
    """The issue: quantised on the CPU, moved with .to_empty / .to("cuda"), the layers kept kernel="packed" and the CPU
    kernel's [N, K/2] uint8 layout, which tinygemm refuses ("w must be a 4D tensor")."""
    model = nn.Sequential(int4(128, 256), int4(64, 128))
    codes = [m.weight.clone() for m in model]
    assert all(m.kernel == "packed" and m.kernel_weight.dim() == 2 for m in model)
    built = []  # what prepare() builds on the new device: fake tensors, torch's packing op's own shape

    def recording(q, kind, in_features=None, tiles=None):
        built.append((kind, q.device.type, tuple(q.shape), real(q, kind, in_features, tiles)))
        return built[-1][-1]

    real = quant_layouts.int4_pack
    monkeypatch.setattr(quant_layouts, "int4_pack", recording)
    with fake_mode:
        model.to_empty(device=CUDA)
        assert not any(m.kernel_weight is not None and m.kernel_weight.dim() == 2 for m in model)  # no CPU layout
        for m, (kind, device, shape, layout), plain in zip(model, built, codes, strict=True):
            assert (kind, device, shape) == ("tinygemm", "cuda", (m.out_features, m.in_features))
            assert layout.dim() == 4 and layout.dtype == torch.int32  # one tinygemm takes:
            x = torch.zeros(1, m.in_features, dtype=torch.bfloat16, device=CUDA)
            sz = torch.empty(m.in_features // 64, m.out_features, 2, dtype=torch.bfloat16, device=CUDA)
            assert torch._weight_int4pack_mm(x, layout, 64, sz).shape == (1, m.out_features)
            # fake tensors have no values for prepare()'s check of the kernel: the fallback, never the CPU layout
            assert m.asked == "auto" and m.kernel == "dequant" and m.kernel_weight is None
            assert m.weight.device.type == "cuda" and m.weight.shape == plain.shape


@pytest.mark.usefixtures("tinygemm_here")
def test_a_layer_prepared_on_cuda_moved_to_the_cpu_reads_its_codes_back_and_builds_the_cpu_layout():
    """What CUDA's prepare() leaves (tinygemm's layout alone, the codes dropped; here computed on the CPU) moved with
    .to(): the codes are read back from tinygemm's layout where it was built, and the CPU kernel's layout built from
    them, the codes kept (the CPU kernel serves few rows). A float32 move makes it rebuild on this CPU."""
    n, k, g = 128, 256, 64
    codes = random_codes(n, k)
    m = Int4Linear(k, n, g, dtype=torch.bfloat16)  # kernel "auto"
    m.scales, m.zeros = torch.rand(n, k // g, dtype=torch.bfloat16) + 0.1, torch.rand(n, k // g, dtype=torch.bfloat16)
    m.weight, m.kernel, m.kernel_weight = None, "packed", tinygemm_layout(codes, 8)
    m.scales_and_zeros = torch.stack([m.scales, m.zeros], -1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    m.to(torch.float32)
    assert m.kernel == "packed" and m.kernel_weight.shape == (n, k // 2) and torch.equal(m.weight, codes)
    assert torch.equal(m.state_dict()["weight"], codes)
    x = torch.randn(3, k)
    assert torch.equal(m(x), same_codes(m, torch.float32)(x))


def test_a_dtype_move_rebuilds_the_layout_with_the_same_codes_and_converted_scales_held_once():
    m = int4(128, 256, torch.float32)
    codes = m.weight.clone()
    m.to(torch.bfloat16)
    assert m.kernel == "packed" and m.scales_and_zeros.dtype == torch.bfloat16 and torch.equal(m.weight, codes)
    table = m.scales_and_zeros.untyped_storage().data_ptr()  # scales and zeros still views of the kernel's table
    assert m.scales.untyped_storage().data_ptr() == table == m.zeros.untyped_storage().data_ptr()
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert torch.equal(m(x), same_codes(m, torch.bfloat16)(x))
    assert torch.equal(m.state_dict()["weight"], codes)


def test_a_move_that_changes_nothing_keeps_the_layout_it_has():
    m = int4()
    layout = m.kernel_weight
    m.to("cpu")
    m.share_memory()
    assert m.kernel_weight is layout and m.kernel_weight.is_shared()


def test_a_model_moved_to_the_meta_device_and_back_computes_the_same_once_loaded():
    model = quantize(random_model(TINY, device="cpu", dtype=torch.float32), "int4-g32")
    inv_freq = model.inv_freq.clone()  # not in the state dict: the config's
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 5, 9]])
    want = model(ids)
    model.to("meta")
    assert model(ids.to("meta")).shape == want.shape  # shapes only: no kernel, no layout on the meta device
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert all(m.kernel == "dequant" and m.kernel_weight is None and m.weight is not None for m in layers)
    model.to_empty(device="cpu")
    model.load_state_dict(state)
    model.inv_freq = inv_freq
    torch.testing.assert_close(model(ids), want, atol=1e-4, rtol=1e-4)  # no stale layout: dequantised codes
    for m in layers:
        m.prepare()
    assert all(m.kernel == "packed" for m in layers) and torch.equal(model(ids), want)  # the kernel's, again


def test_an_int8_layer_settles_its_kernel_again_where_it_moves(fake_mode, monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False).to(torch.bfloat16).requires_grad_(False)
    m = Int8Linear.from_linear(lin)
    assert m.eager_packed  # bf16 on a CPU: the packed op outside a compiled graph
    m.to(torch.float32)
    assert not m.eager_packed and m.kernel == "dequant"  # float32: dequantise + matmul, as a float32 layer's
    monkeypatch.setattr(int8a8, "_kernel", (lambda *a: None, "a8_stub"))  # int8-a8's CPU kernel, registered
    a8 = Int8Linear.from_linear(lin, activations=8)
    assert a8.kernel == "a8"
    with fake_mode:
        a8.to_empty(device=CUDA)
    assert a8.kernel == "dequant" and a8.asked == "auto"  # a CPU kernel: torch's ops on CUDA
    a8 = Int8Linear.from_linear(lin, activations=8).to("meta")
    assert a8.kernel == "dequant"  # no kernel on the meta device
    a8.to_empty(device="cpu")
    assert a8.kernel == "dequant"  # from the meta device as it was: prepare() once it holds its weights
    assert a8.prepare().kernel == "a8"


def test_an_int4_a8_layer_reads_its_codes_back_and_drops_the_cpu_kernels_layout_where_it_has_none(monkeypatch):
    monkeypatch.setattr(int4a8, "_kernel", (lambda *a: None, "a8_stub"))  # int4-a8's CPU kernel, registered
    m = int4(64, 128, activations=8)
    codes = m.codes().clone()
    assert m.kernel == "a8" and m.weight is None
    m.to(torch.float32)
    assert m.kernel == "a8" and m.scales_and_zeros.dtype == torch.float32 and torch.equal(m.codes(), codes)
    m.to("meta")
    assert m.kernel == "dequant" and m.kernel_weight is None and m.weight.shape == codes.shape


def test_a_conversion_of_the_codes_is_refused_by_name():
    m = int4()
    with pytest.raises(QuantizationError, match=r"Int4Linear \[128, 256\].*torch.uint8 codes into torch.float32"):
        m.type(torch.float32)
    assert m.weight.dtype == torch.uint8


def test_a_move_that_fails_part_way_is_named_at_the_next_forward_and_mended_by_the_next_move():
    """A move can fail after the layout was dropped (CUDA out of memory halfway through a model): the forward then
    says so by name, and a .to() back, which changes nothing of the scales, prepares the layer again."""
    m = int4(dtype=torch.bfloat16)
    if m.kernel != "packed":
        pytest.skip("no packed int4 kernel in this PyTorch build on the CPU")
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    want = m(x)
    moves = []

    def fails_second(t):  # a float32 move that dies at the layer's second real tensor
        moves.append(t.numel())
        if sum(n > 0 for n in moves) == 2:
            raise RuntimeError("out of memory")
        return t.float() if t.is_floating_point() else t

    with pytest.raises(RuntimeError, match="out of memory"):
        m._apply(fails_second)
    with pytest.raises(QuantizationError, match=r"Int4Linear \[128, 256\] holds no layout \(a move failed part-way\)"):
        m(x)
    m.to(torch.bfloat16)
    assert m.kernel == "packed" and m.kernel_weight is not None
    assert torch.equal(m(x), want)
