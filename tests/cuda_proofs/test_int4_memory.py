"""What an int4 layer holds (issue 12, item 5): its scales and zeros once (views of the packed kernel's
table); on CUDA, where the packed kernel serves every row count, the kernel's layout alone (the plain
codes recovered from it for a checkpoint); and preparing the packed kernel (as a checkpoint load does for
every layer) never widens the whole layer to float."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import llmstep.core.quantize as quantize_module
from llmstep.core.quantize import Int4Linear, pack_int4, unpack_int4


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


# ---- reading the codes back in a few rows of memory (issue: 13 GiB to read back Llama 3 8B's int4 LM head) ----------

def tinygemm_layout(codes: torch.Tensor, tiles: int) -> torch.Tensor:
    """torch._convert_weight_to_int4pack on CUDA, computed on the CPU after PyTorch's matrix_to_m16n8k16_Bint4_layout
    (NVIDIA's branch): plain codes [N, K/2] (pack_int4's) -> [N/8, K/(16 tiles), 32, tiles/2] int32. Lane t of a tile
    of 8 rows takes row t / 4 and, of each two k-tiles of 8 bytes, bytes t % 4 and t % 4 + 4; its word holds the four
    bytes' low nibbles at bits 16, 20, 24, 28 and their high nibbles at bits 0, 4, 8, 12."""
    n, half = codes.shape
    # [tile of rows, row, tile of 16 * tiles inputs, pair of k-tiles, k-tile, byte + 4, byte % 4]
    v = codes.view(n // 8, 8, half // (8 * tiles), tiles // 2, 2, 2, 4).long()
    v = v.permute(0, 2, 1, 6, 3, 4, 5).reshape(n // 8, half // (8 * tiles), 32, tiles // 2, 4)  # lane t = row * 4 + t%4
    word = sum(((v[..., i] & 15) << (16 + 4 * i)) | ((v[..., i] >> 4) << (4 * i)) for i in range(4))
    return (word - ((word >> 31) << 32)).to(torch.int32)  # the same 32 bits, as int32


@pytest.fixture
def tinygemm_here(monkeypatch):
    """torch_compat.int4_pack_cuda as tinygemm_layout, so a layer holding tinygemm's layout reads back on the CPU."""
    from llmstep.core import torch_compat

    monkeypatch.setattr(torch_compat, "int4_pack_cuda", tinygemm_layout)


def probes(monkeypatch) -> list[int]:
    """The row counts quant_layouts maps the kernel's packing on, recorded."""
    from llmstep.core import quant_layouts

    rows, real = [], quant_layouts._sources
    monkeypatch.setattr(quant_layouts, "_sources", lambda pack, r, k, dev: rows.append(r) or real(pack, r, k, dev))
    return rows


def random_codes(n: int, k: int) -> torch.Tensor:
    torch.manual_seed(n * 7 + k)
    return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)  # [n, k/2]


@pytest.mark.parametrize("n,k", [(8, 32), (64, 128), (136, 256), (200, 192), (1024, 512), (4104, 64)])
def test_the_plain_codes_are_recovered_exactly_from_tinygemms_layout_a_block_of_rows_at_a_time(
        tinygemm_here, monkeypatch, n, k):
    from llmstep.core.quant_layouts import ROWS, inner_k_tiles

    codes, tiles = random_codes(n, k), inner_k_tiles(k)
    layout = tinygemm_layout(codes, tiles)
    assert layout.shape == torch._convert_weight_to_int4pack(codes.to("meta"), tiles).shape  # torch's own shape
    m = Int4Linear(k, n, 32, dtype=torch.bfloat16, kernel="packed")
    m.weight, m.kernel_weight = None, layout  # what prepare() leaves on CUDA
    rows = probes(monkeypatch)
    assert torch.equal(m.codes(), codes)
    assert rows == [n if n <= ROWS else ROWS + (n % ROWS or ROWS)]  # one block and the next: the layout's period


@pytest.mark.parametrize("n,k", [(16, 64), (80, 128), (208, 96), (1024, 256)])
def test_the_plain_codes_are_recovered_exactly_from_the_cpu_layout_with_a_last_block_of_fewer_rows(monkeypatch, n, k):
    from llmstep.core.quant_layouts import ROWS

    m = Int4Linear.from_linear(linear(n, k), group_size=32)
    assert m.kernel == "packed"
    codes, rows = m.weight.clone(), probes(monkeypatch)
    assert torch.equal(kernel_only(m).codes(), codes)
    assert max(rows) <= 2 * ROWS


def test_the_plain_codes_are_recovered_exactly_from_int4_a8s_layout():
    from llmstep.core import int4a8

    n, k, g = 104, 128, 32  # 13 vectors of 8 columns: three tiles of four and one of one (int4a8.layout)
    codes = random_codes(n, k)
    m = Int4Linear(k, n, g, dtype=torch.bfloat16, activations=8)
    m.scales, m.zeros = torch.rand(n, k // g, dtype=torch.bfloat16), torch.rand(n, k // g, dtype=torch.bfloat16)
    m.kernel_weight, m.scales_and_zeros = int4a8.layout(unpack_int4(codes), m.scales, m.zeros)
    m.weight, m.kernel = None, "a8"
    assert torch.equal(m.codes(), codes)


def test_a_layout_not_made_of_blocks_of_rows_is_read_back_as_one_block():
    from llmstep.core.quant_layouts import recover_codes

    n, k = 192, 64
    codes = random_codes(n, k)

    def pack(q):  # codes [r, k] -> every nibble of the matrix in reverse: no block of rows is its own
        return pack_int4(q.flip(0).flip(1).contiguous())

    assert torch.equal(recover_codes(pack, pack(unpack_int4(codes)), n, k), codes)


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages torch's ops allocate while it is held and that are still alive, and their peak
    (each storage counted once, freed when it is; `outside`: tensors made before, whose storages are not counted)."""

    def __init__(self, outside: list[torch.Tensor]):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0
        self.outside = {t.untyped_storage().data_ptr() for t in outside}

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s.data_ptr()
                if s.nbytes() and key not in self.live and key not in self.outside:
                    self.live[key] = s.nbytes()
                    self.now += s.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(s, self._free, key)
        return out


def test_reading_the_codes_back_takes_a_few_blocks_of_scratch_not_bytes_per_weight():
    """The old recovery held index arrays of N*K int64 (~30 bytes a weight: 13 GiB for an 8B model's int4 LM head on
    CUDA, where fuse.py reads every q/k/v and gate/up part back); now a probe of two blocks of rows and a batch."""
    from llmstep.core.quant_layouts import BATCH, ROWS

    n, k = 2048, 4096
    m = Int4Linear(k, n, 64, dtype=torch.bfloat16, kernel="packed")
    m.weight, m.scales = random_codes(n, k), torch.rand(n, k // 64, dtype=torch.bfloat16) + 0.1
    m.prepare()
    codes = m.weight.clone()
    kernel_only(m)
    with LiveBytes([m.kernel_weight, m.scales_and_zeros]) as live:
        got = m.codes()
    assert torch.equal(got, codes)
    scratch = live.peak - codes.nbytes  # the codes themselves are the answer
    bound = 16 * (2 * ROWS * k + BATCH)  # 16 bytes a code of the probe's two blocks and of a batch
    assert scratch <= bound < 8 * n * k, f"{scratch / 2**20:.0f} MiB"  # 8 * n * k: one int64 a weight, 64 MiB


def test_a_layout_built_for_another_device_is_refused_by_name_not_by_a_kernel_error():
    """What torch.load(map_location="cpu") of a pickled CUDA-prepared layer holds (nn.Module's .to() rebuilds it)."""
    from llmstep.core.quantize import QuantizationError

    n, k, g = 128, 128, 64
    m = Int4Linear(k, n, g, dtype=torch.bfloat16, kernel="packed")
    m.weight, m.kernel_weight = None, tinygemm_layout(random_codes(n, k), 8)
    m.scales_and_zeros = torch.zeros(k // g, n, 2, dtype=torch.bfloat16)
    with pytest.raises(QuantizationError, match=r"Int4Linear \[128, 128\] holds a layout built for another device"):
        m(torch.zeros(1, k, dtype=torch.bfloat16))
    with pytest.raises(QuantizationError, match=r"Int4Linear \[128, 128\] holds tinygemm's \(CUDA\) layout on cpu"):
        m.state_dict()
