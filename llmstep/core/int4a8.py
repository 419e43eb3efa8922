"""int4 weights times 8-bit activations (`QuantConfig(..., activations=8)`, "int4-g32-a8"): llama.cpp's arithmetic.

llmstep's int4 is weight-only: the codes are widened to floats and multiplied with the activations as they are.
llama.cpp's CPU matmuls for its 4-bit files (Q4_0, Q4_1) first round each row of activations to 8 bits per block of
32 (its Q8_0 / Q8_1) and then take integer dot products, 32 weights per two integer multiply-adds, where the float
path spends a conversion and a multiply-add a weight. That is a second approximation, of the activations, on top of
the weights'; this mode declares it and computes it exactly:

    y = x^ @ W^T,  x^ = p * d per block of 32 inputs,  d = max|x| / 127,  p = round(x / d) in -127..127

with W the int4 weights dequantised ((q - 8) * s + z per group), every step in float32 (`quantize_activations`:
the codes and steps bit for bit those of llmstep's kernel). On a CPU with AVX2 the matmul is llmstep's integer kernel
(llmstep.kernels.cpu_int4a8, built and registered when the first such layer is prepared on a CPU), at every row
count, so a row's output never depends on the rows beside it; elsewhere, or where it cannot be built, `matmul`
computes the same function with torch's ops (the dequantised weights times x^, in float32: for checking, not for
speed, since it widens every weight each call). The two agree to float32 rounding (the kernel sums each block in
integers and scales once per block; tests/kernels/test_cpu_int4a8.py). It is a CPU mode: on a GPU the weight-only
int4 kernels are the ones to use.

The group size must be a multiple of 32 (a group is whole blocks). Activations with a NaN or an infinity give a
non-finite output row, as the float path does.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from .quant_formats import unpack_int4

__all__ = ["BLOCK", "TILE", "DTYPES", "quantize_activations", "fake_quantize", "layout", "supports", "prepare",
           "matmul", "use_kernel", "use_installer", "install", "kernel_op", "with_activations", "streaming", "streams"]

BLOCK = 32  # activations per 8-bit step (llama.cpp's QK8_0)
TILE = 4  # vectors of 8 columns the kernel takes together, their weights one stream
DTYPES = (torch.float32, torch.bfloat16)  # the activations the integer kernels take (and a layer's scales: its model's)
_kernel: tuple[Callable, str] | None = None  # (op, its name): the CPU kernel, once installed
_installer: Callable[[], bool] | None = None  # builds and registers it, int8-a8's too (kernels.cpu_int4a8.install)
# `streaming` holds it, in this thread (or asyncio task) alone: the one-row calls prefetch their weights past the
# outer caches
_stream: contextvars.ContextVar[bool] = contextvars.ContextVar("llmstep_int4a8_stream", default=False)


@contextlib.contextmanager
def streaming(on: bool) -> Iterator[None]:
    """While held (in this thread), the kernels' one-row calls traced or run here stream their weights past the
    outer caches (`_MM_HINT_NTA`) instead of into the L1: a compiled decode step whose weights outgrow the last-level
    cache is traced under it (engines.compile.streams_weights). A hint: the same bits."""
    token = _stream.set(bool(on))
    try:
        yield
    finally:
        _stream.reset(token)


@torch.compiler.assume_constant_result
def streams() -> bool:
    """Whether the kernels' one-row calls stream their weights now (`streaming`). A compiled step reads it once, as
    it is traced, and keeps it (no guard: held while the step is traced, not while it runs)."""
    return _stream.get()


def use_installer(install: Callable[[], bool] | None) -> None:
    """Register what builds and registers the CPU kernel: `prepare` calls it for the first layer that can use it,
    so every matmul of a run, the first prompt's too, takes the same path."""
    global _installer
    _installer = install


def install() -> bool:
    """Build and register the CPU kernels of 8-bit activations (int4-a8's and int8-a8's: one library) where an
    installer is registered; whether it ran and succeeded. A failed build is remembered: it is tried once a process."""
    return _installer is not None and bool(_installer())


def use_kernel(kernel: Callable | None, op: str | None = None) -> None:
    """Register the CPU kernel (`kernel(x, w, sz, group_size, stream)` -> float32 [M, N]; None: torch's ops) and its
    op name."""
    global _kernel
    _kernel = None if kernel is None else (kernel, op or getattr(kernel, "__name__", "kernel"))


def kernel_op() -> str | None:
    """The registered kernel's op name (for records), or None."""
    return None if _kernel is None else _kernel[1]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> codes p [..., K] (float32, integers in -127..127) and steps d [..., K/32]
    (float32): d = max|x| / 127 per block of 32, p = round-half-even(x * (1 / d)), p = 0 where d is 0 or 1 / d is not
    finite (a block below 4e-37: its codes 0). A block with a NaN has a NaN step."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"8-bit activations take blocks of {BLOCK} inputs: {x.shape[-1]} is not a multiple of it")
    xb = x.float().unflatten(-1, (-1, BLOCK))  # [..., K/32, 32]
    d = xb.abs().amax(dim=-1) / 127  # [..., K/32]
    inv = 1 / d
    inv = torch.where((d != 0) & torch.isfinite(inv), inv, torch.zeros_like(d))
    p = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127)
    return p.flatten(-2), d


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x^ = p * d (float32), the activations the int4-a8 and int8-a8 matmuls multiply."""
    p, d = quantize_activations(x)
    return (p.unflatten(-1, (-1, BLOCK)) * d.unsqueeze(-1)).flatten(-2)


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the kernel's layout holds these shapes: 8 columns to a vector, groups of whole blocks."""
    return out_features % 8 == 0 and in_features % group_size == 0 and group_size % BLOCK == 0


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N/8, R, B] per vector of 8 columns -> the same bytes per tile of TILE vectors, row by row: [N/8, R * B]
    (tile after tile, each [R, vectors in the tile, B]; the last tile may hold fewer)."""
    v, R, B = t.shape
    full = v // TILE * TILE
    parts = [t[:full].view(-1, TILE, R, B).transpose(1, 2).reshape(-1), t[full:].transpose(0, 1).reshape(-1)]
    return torch.cat(parts).view(v, R * B)


def layout(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain codes [N, K] (0..15), scales and zeros [N, K/g] -> the kernel's weights, [N/8, 4 K] uint8, and scales
    and zeros, [N/8, 16 K/g] (bf16 where the scales are, else float32), each in tiles of TILE vectors of 8 columns:
    for each 8 inputs, each vector's 32 bytes, lane c's 4 holding inputs k..k+3 of column c in their low nibbles and
    k+4..k+7 in their high ones; for each group, each vector's 8 scales then 8 zeros. A tile's bytes lie in the
    order the kernel reads them: each thread's share of a matrix is one stream."""
    N, K = codes.shape
    G = scales.shape[1]
    q = codes.to(torch.uint8).view(N // 8, 8, K // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [N/8, K/8, 8 cols, 4, lo|hi]
    w = (q[..., 0] | (q[..., 1] << 4)).reshape(N // 8, K // 8, 32)
    dtype = torch.bfloat16 if scales.dtype == torch.bfloat16 else torch.float32
    sz = torch.stack([scales.to(dtype).view(N // 8, 8, G), zeros.to(dtype).view(N // 8, 8, G)], dim=1)
    return _tiles(w), _tiles(sz.permute(0, 3, 1, 2).reshape(N // 8, G, 16))


def prepare(layer, codes: torch.Tensor):
    """Int4Linear.prepare of an int4-a8 layer (its plain codes [N, K/2]): where the layer is on a CPU, its shapes fit
    and the kernel is registered (the installer tried first), the kernel's layout alone (kernel "a8": the plain codes
    dropped, recovered from it by `Int4Linear.codes` when asked for); else the codes ("dequant": torch's ops, as
    also when kernel="dequant" is asked for). Returns the layer."""
    fits = (layer.asked != "dequant" and codes.device.type == "cpu" and layer.scales.dtype in DTYPES
            and supports(layer.out_features, layer.in_features, layer.group_size))  # a float16 model: torch's ops
    if fits and _kernel is None:
        install()  # once a process: it remembers a failed build
    if fits and _kernel is not None:
        layer.kernel_weight, layer.scales_and_zeros = layout(unpack_int4(codes), layer.scales, layer.zeros)
        layer.kernel, layer.weight = "a8", None
    else:
        layer.kernel_weight = layer.scales_and_zeros = None
        layer.kernel, layer.weight = "dequant", codes
    return layer


def matmul(layer, x2d: torch.Tensor) -> torch.Tensor:
    """An int4-a8 Int4Linear's x [M, K] -> float32 [M, N]: the kernel where it is registered, the layout built and x
    on a CPU in float32 or bf16; else x^ times the dequantised weights in float32."""
    if (_kernel is not None and layer.kernel_weight is not None and x2d.device.type == "cpu"
            and x2d.dtype in DTYPES):
        return _kernel[0](x2d, layer.kernel_weight, layer.scales_and_zeros, layer.group_size, streams())
    return F.linear(fake_quantize(x2d), layer.dequantized(torch.float32))


def with_activations(model: torch.nn.Module) -> torch.nn.Module:
    """A model with int4 blocks (quantised, or a GGUF file's Q4 blocks kept: `keep_quantized`) given 8-bit activations
    in place: every int4 layer's, its `quantization` saying so. Its weights are untouched: llama.cpp's arithmetic on
    llama.cpp's own blocks. Refused for a model without int4 blocks or with groups that are not whole blocks of 32;
    a layer that fails to convert leaves every layer as it was. A fused twin made before (a decoder's) keeps its
    weight-only layers: build the decoder again; fusing the model again fuses the converted layers."""
    from .quant_formats import QuantConfig, QuantizationError

    qc = getattr(model, "quantization", None)
    if qc is None or qc.mode != "int4" or qc.activations:
        raise QuantizationError(f"8-bit activations go on int4 blocks with weight-only activations; this model is "
                                f"{qc or 'not quantised'}")
    new = QuantConfig(qc.mode, qc.group_size, qc.lm_head, 8)  # refuses a group size that is not whole blocks
    layers = [m for m in model.modules() if getattr(m, "mode", None) == "int4" and m.activations is None]
    if _kernel is None and any(m.scales.device.type == "cpu" for m in layers):
        install()  # the build first: nothing is changed while it runs
    saved = [(m, dict(m.__dict__), {k: getattr(m, k) for k in ("weight", "kernel_weight", "scales_and_zeros")})
             for m in layers]
    try:
        for m in layers:
            m.codes()  # the plain codes recoverable from any layout, before this layer changes
            m.__dict__.pop("_fused_into", None)  # a fused twin of the weight-only layer is not this layer's
            m.activations, m.kernel, m.asked = 8, "auto", "auto"
            m.prepare()
    except BaseException:
        for m, attrs, buffers in saved:  # every layer back as it was
            m.__dict__.clear()
            m.__dict__.update(attrs)
            for k, v in buffers.items():
                setattr(m, k, v)
        raise
    model.quantization = new
    return model
