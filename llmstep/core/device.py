"""Pick the device and dtype: CUDA first, then Apple's MPS, then the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["DTYPE_NAMES", "resolve_device", "resolve_dtype", "synchronize", "native_bf16", "half_dtype",
           "last_level_cache", "cpuinfo_fields"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}  # float64: exact parity checks
DTYPE_NAMES = frozenset(_DTYPES)  # every name of a float dtype llmstep accepts, "bf16" and the like included


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None or "auto": the best device here. Otherwise check that the named one is a CPU, a CUDA GPU or MPS, and
    exists."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N, mps or auto ({e})") from None
    if dev.type not in ("cpu", "cuda", "mps"):  # torch names more (xpu, hpu, meta, ...): llmstep runs on none
        raise ValueError(f"device {device!r}: llmstep runs on cpu, cuda, cuda:N or mps (or auto), not {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this PyTorch sees no CUDA GPU")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} asked for, but MPS is not available here")
    return dev


def native_bf16(device: torch.device) -> bool:
    """Whether this CUDA GPU does bfloat16 in hardware (compute capability 8.0 on: A100, H100, RTX 30xx/40xx).
    T4- and V100-class GPUs only emulate it, slowly: torch.cuda.is_bf16_supported() says yes for them too."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def half_dtype(device: str | torch.device) -> torch.dtype:
    """The 16-bit float to run and measure in on `device`: bfloat16 where it is done in hardware (a CUDA GPU of
    compute capability 8.0 on; a CPU: natively with AVX-512 BF16 or AMX, emulated and far slower on one with
    AVX2 alone, which llmstep.lab.hardware measures at a smaller size), float16 on a CUDA GPU
    that only emulates bfloat16 (T4, V100: a bf16 figure there measures the emulation) and on MPS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if native_bf16(device) else torch.float16
    return torch.float16 if device.type == "mps" else torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, stored: str = "bfloat16") -> torch.dtype:
    """The dtype policy. None: float32 on the CPU, where bf16/fp16 matmuls are slow; float16 on MPS; on a CUDA GPU
    the checkpoint's own dtype, except that bfloat16 becomes float16 where the GPU only emulates bfloat16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported: use float32, bfloat16, float16 or float64")
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if device.type == "mps":
            return torch.float16
        want = _DTYPES.get(str(stored), torch.bfloat16)
        if want == torch.bfloat16 and not native_bf16(device):
            return torch.float16
        return want
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use float32, bfloat16, float16 or float64")
    return _DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures the work and not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache(root: str | os.PathLike = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Bytes of the largest data or unified cache Linux lists for CPU 0 under `root` (sysfs: the last-level cache,
    a server's L3, shared by its cores); None where none is listed (another OS, a container without sysfs)."""
    sizes = []
    for d in Path(root).glob("index*"):
        try:
            size, kind = (d / "size").read_text().strip(), (d / "type").read_text().strip()
        except (OSError, ValueError):  # unreadable, or not text (UnicodeDecodeError)
            continue
        number, unit = (size[:-1], size[-1]) if size[-1:] in _UNITS else (size, "")
        if kind != "Instruction" and number.isascii() and number.isdigit():
            sizes.append(int(number) * _UNITS.get(unit, 1))
    return max(sizes, default=None)


def cpuinfo_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's fields ("flags", "cpu family", "model", ...) of /proc/cpuinfo, or of the text `cpuinfo`;
    {} where there is none to read (another OS)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields
