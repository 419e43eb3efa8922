"""What an int4 layer holds (issue 12, item 5): its scales and zeros once (views of the packed kernel's
table); on CUDA, where the packed kernel serves every row count, the kernel's layout alone (the plain
codes recovered from it for a checkpoint); and preparing the packed kernel (as a checkpoint load does for
every layer) never widens the whole layer to float."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import llmstep.core.quantize as quantize_module
from llmstep.core.quantize import Int4Linear


def held_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers."""
    storages = {}
    for t in [*module.parameters(), *module.buffers()]:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def linear(n: int = 256, k: int = 512) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=False).requires_grad_(False)


def test_a_packed_int4_layer_holds_its_scales_and_zeros_once():
    m = Int4Linear.from_linear(linear(), group_size=64)
    assert m.kernel == "packed"
    assert m.scales.untyped_storage().data_ptr() == m.scales_and_zeros.untyped_storage().data_ptr()
    assert m.zeros.untyped_storage().data_ptr() == m.scales_and_zeros.untyped_storage().data_ptr()
    assert held_bytes(m) == m.weight.nbytes + m.kernel_weight.nbytes + m.scales_and_zeros.nbytes
    x = torch.randn(3, 512)
    torch.testing.assert_close(m(x), x @ m.dequantized().T, atol=1e-4, rtol=1e-4)  # and it still computes


def test_preparing_the_packed_kernel_never_dequantizes_the_whole_layer(monkeypatch):
    widened = []
    real = quantize_module.dequantize_int4

    def recording(packed, scales, zeros, dtype=torch.float32):
        widened.append(packed.shape[0])
        return real(packed, scales, zeros, dtype)

    monkeypatch.setattr(quantize_module, "dequantize_int4", recording)
    m = Int4Linear.from_linear(linear(n=1024), group_size=64)
    assert m.kernel == "packed" and widened and max(widened) <= quantize_module.CHECK_ROWS < 1024


def kernel_only(m: Int4Linear) -> Int4Linear:
    """What prepare() leaves on CUDA, made on the CPU: the plain codes dropped, the kernel's layout alone."""
    m.weight = None
    return m


def test_a_layer_holding_the_kernel_layout_alone_holds_the_packed_bytes_and_computes_the_same():
    m = Int4Linear.from_linear(linear(), group_size=64)
    codes, state = m.weight.clone(), {k: v.clone() for k, v in m.state_dict().items()}
    x1, x32 = torch.randn(1, 512), torch.randn(32, 512)
    y1, y32 = m(x1), m(x32)
    kernel_only(m)
    assert held_bytes(m) == m.kernel_weight.nbytes + m.scales_and_zeros.nbytes  # one layout
    assert m.nbytes == codes.nbytes + m.scales.nbytes + m.zeros.nbytes
    torch.testing.assert_close(m(x1), y1)
    torch.testing.assert_close(m(x32), y32, atol=1e-4, rtol=1e-4)  # 32 rows through the packed kernel
    assert torch.equal(m.codes(), codes)
    saved = m.state_dict()
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)


@pytest.mark.parametrize("n,k,g", [(64, 64, 32), (128, 128, 64), (256, 1024, 128), (192, 4096, 256)])
def test_the_plain_codes_are_recovered_exactly_from_the_kernel_layout(n, k, g):
    m = Int4Linear.from_linear(linear(n, k), group_size=g)
    assert m.kernel == "packed"
    codes = m.weight.clone()
    assert torch.equal(kernel_only(m).codes(), codes)
