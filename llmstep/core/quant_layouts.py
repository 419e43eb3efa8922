"""The packed kernels' weight layouts (llmstep.core.quantize): int4's built per device, the plain codes read back from
one in a few rows of memory, and every quantised layer prepared again when nn.Module moves it.

int4's packed kernels each want the codes in an order of their own: torch's CPU kernel [N, K/2] uint8 (blocks of 32
or 64 rows, its build's vector width: PyTorch's weight_to_int4pack_kernel), tinygemm on CUDA [N/8, K/(16 t), 32, t/2]
int32 (tiles of 8 rows by 16 t inputs, t = inner_k_tiles: matrix_to_m16n8k16_Bint4_layout), int4-a8's CPU kernel
[N/8, 4 K] uint8 (tiles of 32 rows: llmstep.core.int4a8.layout). Each only moves 4-bit codes about, and lays out
blocks of whole rows one after another, every full block the same way. `recover_codes` reads the codes back by that:
where one block of ROWS rows sends each code (packing codes that spell each position's index, 4 bits at a time), a
second block checked to go the same way, then the layout unpacked a few blocks at a time, each packed again to check
it. Scratch: a few blocks, not ~30 bytes a weight (13 GiB for Llama 3 8B's int4 LM head on CUDA). The last block may
hold fewer rows (the CPU kernel packs a short one differently): it is mapped on its own.

A layer's layout fits the device and dtype prepare() built it for. nn.Module's .to() and its kin move every tensor
through `_apply`, which the quantised layers hand to `moved`: the codes read back on the old device, the layouts
dropped, the plain tensors moved, prepare() run again where they land (a kernel the caller asked for, not the one
"auto" chose for the old device). A CPU-quantised model moved to CUDA gets tinygemm's layout; a float32 one moved to
bf16, the same codes with its scales converted.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from . import int4a8, torch_compat
from .quant_formats import QuantizationError, nibbles, pack_int4, unpack_int4

__all__ = ["ROWS", "BATCH", "inner_k_tiles", "int4_pack", "int4_codes", "recover_codes", "moved"]

ROWS = 64  # rows a block: whole blocks of every layout above (CPU 16, 32 or 64 by build, tinygemm 8, int4-a8 32)
BATCH = 1 << 20  # codes unpacked at a time (whole blocks, at least one): the scratch's size, a few MiB


def inner_k_tiles(in_features: int) -> int:
    """tinygemm's k-tiles a row of 32-bit words holds: its largest that divides the row (K % (16 t) == 0)."""
    return 8 if in_features % 128 == 0 else 4 if in_features % 64 == 0 else 2


def int4_pack(q: torch.Tensor, kind: str, in_features: int | None = None, tiles: int | None = None) -> torch.Tensor:
    """Codes [n, K] (0..15) -> the weight-only packed kernel's layout: kind "tinygemm" (CUDA; bf16 activations, K a
    multiple of `tiles` * 16, tiles by default `inner_k_tiles(in_features)`, n of 8) or "cpu"."""
    if kind == "tinygemm":
        return torch_compat.int4_pack_cuda(pack_int4(q).contiguous(), tiles or inner_k_tiles(in_features))
    return torch_compat.int4_pack_cpu(q.to(torch.int32))


def int4_codes(layer) -> torch.Tensor:
    """An Int4Linear's plain codes [N, K/2] read back from the layout it holds: int4-a8's (kernel "a8"), tinygemm's
    (the 4-D one) or the CPU kernel's; QuantizationError, naming the layer, where that cannot be done here."""
    layout, n, k = layer.kernel_weight, layer.out_features, layer.in_features
    name = f"Int4Linear [{n}, {k}]"
    if layer.kernel == "a8":
        kind, pack = "int4-a8's", lambda q: int4a8.layout(q, layer.scales[:len(q)], layer.zeros[:len(q)])[0]
    elif layout.dim() == 4:
        kind, pack = "tinygemm's (CUDA)", partial(int4_pack, kind="tinygemm", tiles=layout.shape[-1] * 2)
    else:
        kind, pack = "the CPU kernel's", partial(int4_pack, kind="cpu")
    try:
        return recover_codes(pack, layout, n, k, name)
    except NotImplementedError as e:  # that kernel's packing has no implementation for this device
        raise QuantizationError(
            f"{name} holds {kind} layout on {layout.device}, where it cannot be packed to read its codes back "
            f"({str(e).splitlines()[0][:120]}): move a quantised layer with .to() from the device it was prepared "
            "on (that rebuilds its layout), or load it from a checkpoint") from None


def _sources(pack: Callable, rows: int, k: int, device: torch.device) -> torch.Tensor:
    """For the layout of a [rows, k] matrix: each 4-bit value's code, as row * k + column ([rows * k], int32 where
    that holds them)."""
    dtype = torch.int32 if rows * k < 2**31 else torch.long
    index = torch.arange(rows * k, dtype=dtype, device=device)  # [rows * k]
    where = torch.zeros_like(index)
    for shift in range(0, max(1, (rows * k - 1).bit_length()), 4):
        where |= nibbles(pack(((index >> shift) & 15).to(torch.uint8).view(rows, k))).to(dtype) << shift
    return where


def _inverse(where: torch.Tensor) -> torch.Tensor:
    """The layout position of each code, from `_sources`' code at each layout position."""
    inv = torch.zeros_like(where)
    # not a permutation (a layout that is more than codes moved about): some code read wrong, which the check finds
    inv[where.clamp(max=where.numel() - 1).long()] = torch.arange(where.numel(), dtype=inv.dtype, device=inv.device)
    return inv


def recover_codes(pack: Callable, layout: torch.Tensor, n: int, k: int, name: str = "the layer") -> torch.Tensor:
    """Plain codes [n, k/2] (pack_int4's layout) from `layout`, the layout `pack` (codes [r, k] -> layout) made of an
    [n, k] matrix; in blocks of ROWS rows where a two-block probe shows the layout is so made, else in one block."""
    data = layout.contiguous().view(torch.uint8).flatten()  # the layout's bytes, nibbles() reads them
    if data.numel() * 2 != n * k:
        raise QuantizationError(f"{name}: its kernel layout {tuple(layout.shape)} {layout.dtype} holds "
                                f"{data.numel() * 2} 4-bit codes, not {n} x {k}")
    step = ROWS if n > ROWS else n
    tail = n % step
    where = _sources(pack, step + (tail or step) if n > step else n, k, data.device)  # one block, then the next
    head, rest = where[:step * k], where[step * k:] - step * k
    if n > step and not (head.max() < step * k and rest.min() >= 0 and (tail or torch.equal(rest, head))):
        step, tail, head = n, 0, _sources(pack, n, k, data.device)  # not in whole blocks of rows: as one block
    out = torch.empty(n, k // 2, dtype=torch.uint8, device=data.device)  # [n, k/2]

    def unpack(start: int, blocks: int, rows: int, inv: torch.Tensor) -> None:  # rows start.. of `blocks` blocks
        part = data[start * k // 2: (start + blocks * rows) * k // 2]  # their bytes
        codes = pack_int4(nibbles(part).view(blocks, -1).index_select(1, inv).view(blocks * rows, k))
        if not torch.equal(pack(unpack_int4(codes)).contiguous().view(torch.uint8).flatten(), part):
            raise QuantizationError(f"{name}: the kernel's layout does not unpack to plain codes")
        out[start: start + blocks * rows] = codes

    full, per, inv = n // step, max(1, BATCH // (step * k)), _inverse(head)  # whole blocks, blocks at a time
    for block in range(0, full, per):
        unpack(block * step, min(per, full - block), step, inv)
    if tail:
        unpack(full * step, 1, tail, _inverse(rest))
    return out


def moved(layer, fn: Callable, apply: Callable):
    """nn.Module._apply of a quantised layer (.to(), .cuda(), .cpu(), .half(), .to_empty(), ...); `apply`:
    nn.Module's own. Where `fn` takes the layer's floats to another device or dtype, the layout prepare() built for
    the old ones does not fit: an int4 layer's plain codes are read back on the old device and its layouts dropped,
    then the codes, scales and zeros move and prepare() settles the kernel again for the new device and dtype (from
    the one asked for: "auto" chosen anew) and builds its layout (from CUDA to the CPU after the copies have landed:
    non_blocking=True returns before). Moved as they are: tensors that stay where they are (share_memory(), a .to()
    to their own device; a layer whose move failed part-way, its layout dropped, is prepared again there), and a layer
    on the meta device, which holds no values to build from (materialize and the loaders prepare() a layer once it
    holds its codes). `.to_empty()` leaves values to be loaded: prepare() the layer after loading them."""
    before, codes = layer.scales, torch.int8 if layer.mode == "int8" else torch.uint8
    if before.device.type == "meta":
        return apply()
    after = fn(torch.empty(0, dtype=before.dtype, device=before.device))  # where fn takes the layer's floats
    if (got := fn(torch.empty(0, dtype=codes, device=before.device)).dtype) != codes:
        raise QuantizationError(f"{type(layer).__name__} [{layer.out_features}, {layer.in_features}]: this "
                                f"conversion would turn its {codes} codes into {got}; convert a quantised model's "
                                "floats with .to(dtype) (or .half(), .bfloat16(), .float())")
    if (after.device, after.dtype) == (before.device, before.dtype):
        apply()
        dropped = layer.mode == "int4" and layer.kernel in ("packed", "a8") and layer.kernel_weight is None
        return layer.prepare() if dropped else layer
    if layer.mode == "int4":
        layer.weight = layer.codes()  # [N, K/2], read back where its layout was built
        layer.kernel_weight = layer.scales_and_zeros = None
    apply()
    if before.device.type == "cuda" and after.device.type != "cuda":
        torch.cuda.synchronize(before.device)  # a non_blocking copy to the host has landed before prepare() reads it
    return layer.prepare()
