"""The model's linear layer: y = x W^T, nn.Linear's function, with one difference in how a CPU computes it.

On a CPU, PyTorch multiplies bfloat16 (and float16) matrices with oneDNN where the CPU has instructions for them
(AVX-512 with BF16 / FP16, AMX); elsewhere (every AVX2-only CPU: AMD before Zen 4, most desktop Intel parts) it
falls back to a generic loop that widens each element to float32 as it goes, sums in float32 and rounds the sum
to bf16 once. That loop is several times slower than float32's own GEMM: at SmolLM2's shapes with 128 rows on a
2-core Zen 1 EPYC (llmstep/core/linear.py's numbers, measured in session 38, torch 2.13), [128, 576] x [576, 576]^T
took 8.9 ms in bf16 and 1.8 ms widened to float32 (weights included), 4.4-5.9x across the shapes, so llmstep's
bf16 prefill ran at a third of llama.cpp's (results/README.md, claim 2).

`linear` widens such a matmul itself: both operands to float32, one float32 GEMM, the result rounded to the
input's dtype. Both sides sum float32 products of the same bf16 numbers and round once, so the two are the same
function up to the order of the float32 additions (tests/core/test_linear.py holds the result to within one
rounding of a float64 matmul, as torch's own). The weight is widened on every call (nothing is kept: the model's
memory is unchanged), which costs more than it saves for a few rows, so it widens from `WIDEN_ROWS` rows up (a
prompt, a batch of 16); a decode step's one row keeps torch's kernel, and a compiled step (engines.compile) never
reaches here: inductor's own GEMM templates take its matmuls.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WIDEN_ROWS", "Linear", "linear", "widens"]

WIDEN_ROWS = 16  # at 16 rows widening measured 1.2-2.1x on the Zen 1's SmolLM2 shapes; at 8, 0.5-1.7x


@functools.cache
def _slow_half_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU matmul in `dtype` (bf16 or fp16) is its generic loop: no oneDNN kernel for it here."""
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    supported = getattr(torch.ops.mkldnn, probe, None)  # torch's own check (mkldnn_bf16_device_check and kin)
    return supported is not None and torch.backends.mkldnn.is_available() and not supported()


def widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` computes x @ weight^T in float32 (see the module's docstring)."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.numel() >= WIDEN_ROWS * x.shape[-1] and not torch.compiler.is_compiling()
            and _slow_half_gemm(x.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [.., in] @ weight [out, in]^T (+ bias [out]) -> [.., out]."""
    if not widens(x, weight):
        return F.linear(x, weight, bias)
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)  # [.., out]: one rounding, as torch's


class Linear(nn.Linear):
    """nn.Linear computed by `linear`: the same parameters, state dict and printout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
