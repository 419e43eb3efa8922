"""The model's linear layer: y = x W^T, nn.Linear's function, with one difference in how a CPU computes it.

On a CPU, PyTorch multiplies bfloat16 (and float16) matrices with oneDNN where its own check passes (AVX-512 cores,
AMX, AVX-NE-CONVERT; `torch.ops.mkldnn._is_mkldnn_bf16_supported`, which `linear` asks); on other CPUs (AMD before
Zen 4, most desktop Intel parts: AVX2 alone) it falls back to a generic loop that widens each element to float32 as it
goes, sums in float32 and rounds each sum to bf16 once. That loop is several times slower than float32's own GEMM:
on a 2-core Zen 1 EPYC at SmolLM2's five matmul shapes with 128 rows, 3.6-4.3x slower than the same products
widened to float32, the weight's widening included (SmolLM2's whole bf16 prefill 3.8x: `scripts/prefill_cpu.py`,
results/README.md, claim 2, session 38), and llmstep's bf16 prefill ran at a third of llama.cpp's.

`linear` widens such a matmul itself: both operands to float32, float32 GEMMs, each result rounded once to the
input's dtype. Both sides sum float32 products of the same bf16 numbers and round once, so the two are the same
function up to the order of the float32 additions (tests/core/test_linear.py holds both, torch's and this, within
half a step of the dtype plus float32's summation error of a float64 matmul). The weight is widened on every call,
`WIDEN_BLOCK` of its elements at a time (at most that much float32 of it held at once: no second copy of a weight,
an LM head's included), which costs more than it saves for a few rows, so it widens from `WIDEN_ROWS` rows up (a
prompt, a step of 16 sequences); a decode step's one row keeps torch's kernel. So does anything torch.compile
traces (`is_compiling`: inductor's own GEMMs take those matmuls), a torch.fx symbolic trace (its Proxy takes
the plain op), and an autograd graph (its saved tensors would be the float32 copies). In half precision on such a
CPU a row's bits may so depend on whether it is multiplied among 16 rows or more (a batched step, a long verify)
or fewer: the same function up to float32's order of additions, as between any two matmul kernels.

The quantized layers (core.quantize) take the same rule (`widens_rows`) for their prompts, their weights made float32
a block of rows at a time straight from the codes (`widened`): int8's exactly as widening its bf16 copy would give
them (the same bits, without the copy); int4's dequantized in float32, as its kernels dequantize, not rounded to the
activations' dtype first as the layer's other prompt path (torch's half-precision matmul) does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WIDEN_BLOCK", "WIDEN_ROWS", "Linear", "linear", "widened", "widens", "widens_rows"]

WIDEN_ROWS = 16  # widening: 1.2-1.8x at 16 rows on SmolLM2's shapes (the Zen 1), 0.70-1.5x at 8
WIDEN_BLOCK = 1 << 20  # weight elements widened at a time: 4 MiB of float32
_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _no_half_kernel(dtype: torch.dtype) -> bool:
    """Whether torch has no oneDNN kernel for CPU matmuls in `dtype` (bf16 or fp16) on this CPU or build."""
    if not torch.backends.mkldnn.is_available():
        return True
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    supported = getattr(torch.ops.mkldnn, probe, None)  # torch's own check (mkldnn_bf16_device_check and kin)
    return supported is not None and not supported()  # a torch without the check: assume its kernel


def _slow_half_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU matmul in `dtype` is its generic loop: no oneDNN kernel, or oneDNN turned off."""
    return not torch.backends.mkldnn.enabled or _no_half_kernel(dtype)


def widens_rows(x: torch.Tensor) -> bool:
    """Whether x's matmul is computed in float32 (see the module's docstring), whatever the weight: a half-precision
    prompt of `WIDEN_ROWS` rows or more, eager, on a CPU without torch's half-precision GEMM, not in an autograd graph.
    Asked on every eager matmul: the checks that settle most calls come first (a float32 model's at the dtype, a decode
    step's at the row count). A quantized layer asks it before it dequantizes (its rows widened by `widened`)."""
    if isinstance(x, torch.fx.Proxy) or x.dtype not in _HALF:
        return False
    if x.dim() < 2 or x.numel() < WIDEN_ROWS * x.shape[-1] or torch.compiler.is_compiling() or x.device.type != "cpu":
        return False
    return not (torch.is_grad_enabled() and x.requires_grad) and _slow_half_gemm(x.dtype)


def widens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` computes x @ weight^T (+ bias) in float32: `widens_rows`, and a weight (and bias) of x's
    dtype that F.linear takes: shapes it would refuse keep F.linear, and its error."""
    return (widens_rows(x) and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1]))
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (weight, bias))))


def widened(x: torch.Tensor, rows_of: Callable[[slice], torch.Tensor], out_features: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., in] @ W^T (+ bias) -> [.., out_features] in x's dtype, multiplied in float32, each sum rounded once:
    rows_of(rows) gives W's rows `rows` in float32 ([rows, in]), `WIDEN_BLOCK` elements of W or so at a time (a
    layer's weight widened, or a quantized one's dequantized: never a whole float32 copy of W held)."""
    x32 = x.float()  # [.., in]
    y = x.new_empty(*x.shape[:-1], out_features)  # [.., out] in x's dtype
    step = max(1, WIDEN_BLOCK // max(1, x.shape[-1]))  # weight rows a block
    for start in range(0, out_features, step):
        rows = slice(start, min(start + step, out_features))
        y[..., rows] = F.linear(x32, rows_of(rows), None if bias is None else bias[rows].float())  # [.., rows]
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [.., in] @ weight [out, in]^T (+ bias [out]) -> [.., out]."""
    if not widens(x, weight, bias):
        return F.linear(x, weight, bias)
    return widened(x, lambda rows: weight[rows].float(), weight.shape[0], bias)


class Linear(nn.Linear):
    """nn.Linear computed by `linear`: the same parameters, state dict and printout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
