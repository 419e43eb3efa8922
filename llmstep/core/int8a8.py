"""int8 weights times 8-bit activations (`QuantConfig("int8", activations=8)`, "int8-a8"): llama.cpp's Q8_0 arithmetic.

llmstep's int8 is weight-only: each weight is widened to a float and multiplied with the activations as they are; on
the AVX2 CPU measured (results/README.md, claim 2, sessions 39-40) that widening (a sign extension, a conversion and
a multiply-add a weight), not memory, bounded the one-row matmul. llama.cpp's Q8_0 matmul first rounds each row of
activations to 8 bits per block of 32, as int4-a8 does (llmstep.core.int4a8: `quantize_activations`, the same codes
and steps), and then takes integer dot products, 32 weights per two integer multiply-adds. This mode declares that
second approximation and computes it exactly, on llmstep's own int8 weights (one scale per output row,
`quantize_int8`):

    y[n] = s[n] * sum_b d_b * sum_{k in b} p_k q[n, k],   x^ = p * d per block of 32 (int4a8.quantize_activations)

On a CPU with AVX2 the matmul is llmstep's integer kernel (`mm8` in llmstep.kernels.cpu_int4a8, built with int4-a8's
and registered here), at every row count, so a row's output never depends on the rows beside it; it reads the
layer's plain [N, K] int8 weights, so the layer keeps one copy of them in the layout every other path (saving,
fusing, dequantising) reads. Elsewhere, or where it cannot be built, `matmul` computes the same function with
torch's ops (x^ times the codes in float32, then the scales: for checking, not for speed). The two agree to
float32 rounding (the kernel sums each block in integers and scales once per block; tests/kernels/test_cpu_int8a8.py).
A CPU mode, as int4-a8: on a GPU the weight-only kernels are the ones to use.

The layers' input widths must be multiples of 32 (a block). Activations with a NaN or an infinity give a non-finite
output row, as the float path does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import int4a8

__all__ = ["width_problem", "prepare", "matmul", "use_kernel", "kernel_op", "describe"]

_kernel: tuple[Callable, str] | None = None  # (op, its name): the CPU kernel, once installed


def use_kernel(kernel: Callable | None, op: str | None = None) -> None:
    """Register the CPU kernel (`kernel(x, q, scales, stream)` -> float32 [M, N]; None: torch's ops) and its op
    name; `stream`: int4a8.streams()."""
    global _kernel
    _kernel = None if kernel is None else (kernel, op or getattr(kernel, "__name__", "kernel"))


def kernel_op() -> str | None:
    """The registered kernel's op name (for records), or None."""
    return None if _kernel is None else _kernel[1]


def width_problem(in_features: int) -> str | None:
    """Why a layer of this width cannot take 8-bit activations (its rows must be whole blocks of 32, the rounding's
    blocks on every path), or None: the one rule `quantize`'s checks and Int8Linear both apply."""
    if in_features % int4a8.BLOCK:
        return (f"in_features {in_features} is not a multiple of {int4a8.BLOCK}, the blocks 8-bit activations are "
                "rounded in")
    return None


def prepare(layer):
    """Int8Linear.prepare of an int8-a8 layer: kernel "a8" where the layer is on a CPU with float32 or bf16 scales
    (the model's dtype, its activations') and the kernel is registered (int4-a8's installer, which builds both, tried
    first); else "dequant" (torch's ops, as also when kernel="dequant" is asked for). The weights stay as they are.
    Returns the layer."""
    fits = (layer.asked != "dequant" and layer.weight.device.type == "cpu"
            and layer.scales.dtype in int4a8.DTYPES)
    if fits and _kernel is None:
        int4a8.install()  # once a process: it remembers a failed build
    layer.kernel = "a8" if fits and _kernel is not None else "dequant"
    layer.eager_packed = False
    return layer


def matmul(layer, x2d: torch.Tensor) -> torch.Tensor:
    """An int8-a8 Int8Linear's x [M, K] -> float32 [M, N]: the kernel where the layer chose it and x is on a CPU in
    float32 or bf16; else x^ times the codes in float32, times the scales."""
    if (layer.kernel == "a8" and _kernel is not None and x2d.device.type == "cpu"
            and x2d.dtype in int4a8.DTYPES):
        return _kernel[0](x2d, layer.weight, layer.scales, int4a8.streams())
    return F.linear(int4a8.fake_quantize(x2d), layer.weight.float()) * layer.scales.float()


def describe(model: torch.nn.Module) -> str | None:
    """What a model's matmuls with 8-bit activations (int8-a8's, and int4-a8's: llmstep.core.int4a8) run, for
    records: the kernels' ops where every such layer has its kernel, "torch ops" where none has, both named where some
    have; None for a model without such layers."""
    ops = {(kernel_op() if m.mode == "int8" else int4a8.kernel_op()) if m.kernel == "a8" else None
           for m in model.modules() if getattr(m, "activations", None)}
    if not ops:
        return None
    kernels = ", ".join(sorted(op for op in ops if op is not None))
    return kernels if None not in ops else "torch ops" if not kernels else f"{kernels}, and torch ops where it cannot"
