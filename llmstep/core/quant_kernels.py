"""Which matmul a quantized layer runs when its caller does not say (`kernel="auto"`), per mode and device.

int4 on CUDA has two: PyTorch's tinygemm ("packed") and llmstep's single reduction ("reduce"); scripts/gpu_probe.py
times both at one row on a GPU and records the pick for that GPU model here (`prefer_int4_kernel`). A GPU not
measured keeps tinygemm, a CPU its packed kernel; int8 dequantises (the layers in llmstep.core.quantize). Layers
with 8-bit activations have their own kernel ("a8": llmstep.core.int8a8, int4a8). And which layers torch's packed
int8 kernel must never be given (`int8_mm_fits`: it crashes the process on some widths).
"""

from __future__ import annotations

import torch

from .quant_formats import QuantizationError

__all__ = ["choose_int4_kernel", "prefer_int4_kernel", "auto_kernel", "int8_mm_fits", "REDUCE_MARGIN"]

# int4's kernel per GPU model, as measured: scripts/gpu_probe.py times tinygemm ("packed") and "reduce" at one row and
# records `choose_int4_kernel`'s pick (`prefer_int4_kernel`); a GPU not measured keeps tinygemm, a CPU its packed one.
_INT4_KERNEL_BY_GPU: dict[str, str] = {}
REDUCE_MARGIN = 0.05  # "reduce" replaces tinygemm only when 5% faster: closer than that, timing noise decides


def choose_int4_kernel(us_per_call: dict[str, float], margin: float = REDUCE_MARGIN) -> str:
    """The selection rule: from microseconds per one-row matmul of "packed" (tinygemm) and "reduce", "reduce"
    where it is faster by more than `margin`, else "packed"; a kernel missing from the timings (it failed) loses."""
    packed, reduce = us_per_call.get("packed"), us_per_call.get("reduce")
    if reduce is None:
        return "packed"
    if packed is None:
        return "reduce"
    return "reduce" if reduce < (1 - margin) * packed else "packed"


def prefer_int4_kernel(device: torch.device | str, kernel: str | None) -> None:
    """Record `kernel` ("packed" or "reduce"; None forgets) as int4's `kernel="auto"` on this CUDA device's model
    of GPU, for every Int4Linear prepared after this in the process."""
    device = torch.device(device)
    if device.type != "cuda":
        raise QuantizationError(f"int4's kernel is chosen per GPU; {device} keeps its packed kernel")
    if kernel not in ("packed", "reduce", None):
        raise QuantizationError(f"int4's measured kernel is 'packed' or 'reduce', got {kernel!r}")
    name = torch.cuda.get_device_name(device)
    if kernel is None:
        _INT4_KERNEL_BY_GPU.pop(name, None)
    else:
        _INT4_KERNEL_BY_GPU[name] = kernel


def auto_kernel(mode: str, device: torch.device | None = None) -> str:
    """Which matmul to use when the caller does not say. int8: dequantise + matmul (compile fuses the widening into
    the matmul on CUDA, gpt-fast's path, and rewrites it to _weight_int8pack_mm on a CPU for bf16, which an eager
    bf16 CPU call runs itself: `Int8Linear.prepare`). int4: the packed kernels (tinygemm on CUDA, _for_cpu on a
    CPU): dequantising a whole int4 matrix per token would read more bytes than the float weights; on a GPU whose
    measurement chose it (`prefer_int4_kernel`), "reduce". No packed kernel here: prepare() falls back to dequant."""
    if mode != "int4":
        return "dequant"
    if device is not None and device.type == "cuda" and _INT4_KERNEL_BY_GPU:
        return _INT4_KERNEL_BY_GPU.get(torch.cuda.get_device_name(device), "packed")
    return "packed"


def int8_mm_fits(in_features: int, dtype: torch.dtype) -> bool:
    """Whether torch_compat.int8_mm (torch's _weight_int8pack_mm) may be given a layer of this width and dtype: torch
    2.13's CPU kernel in bf16 with in_features not a multiple of 8 crashes the process (a segfault at 2 or >= 4 rows,
    measured; float32 and float16 run). Such a layer never runs it, nor the dequantise + matmul pattern inductor
    rewrites into it (Int8Linear.forward)."""
    return dtype is not torch.bfloat16 or in_features % 8 == 0
