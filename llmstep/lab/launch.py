"""The command that runs `llmstep` in child processes: one process, or N ranks under torchrun (tensor parallelism).

A child process chooses its own device when it is not told one, and under torchrun every rank chooses alone: on
a machine with one GPU each of two ranks would pick CUDA and NCCL, and rank 1 would ask for a GPU that is not
there. So the command names the device and the dtype for every child, chosen once, here:

- `rank_device(ranks, device)`: CUDA (NCCL) only when every rank has a GPU of its own (ranks <= GPUs), else
  the CPU (gloo), where any number of ranks runs;
- `llmstep_command(args, ranks, device, dtype)`: `python -m llmstep ARGS --device D --dtype T`, under
  `launcher(ranks)` (`torch.distributed.run --standalone --nproc-per-node N` when ranks > 1).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ..core.device import resolve_device, resolve_dtype
from ..engines.decoding import check_int

__all__ = ["rank_device", "backend", "launcher", "llmstep_command"]


def rank_device(ranks: int, device: str | torch.device | None = None) -> torch.device:
    """The device type every rank of a `ranks`-process run takes. None: CUDA when this machine has a GPU per rank,
    else the CPU. A device named is checked: CUDA for more ranks than GPUs is refused (a rank would have none)."""
    check_int(ranks, "ranks", low=1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None or device == "auto":
        return torch.device("cuda" if 0 < ranks <= gpus else "cpu")
    dev = resolve_device(device)
    if dev.type == "mps" and ranks > 1:
        raise ValueError("tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not on MPS")
    if dev.type == "cuda" and ranks > gpus:
        raise ValueError(f"{ranks} ranks on CUDA need a GPU each; this machine has {gpus}: "
                         "run them on the CPU (device='cpu') or with fewer ranks")
    return torch.device(dev.type)  # each rank takes its own GPU (LOCAL_RANK): no index in a command shared by all


def backend(device: torch.device) -> str:
    """The process group's backend a rank on `device` joins (llmstep.core.parallel.init_from_environment)."""
    return "nccl" if device.type == "cuda" else "gloo"


def launcher(ranks: int = 1, python: str = sys.executable) -> list[str]:
    """What starts `ranks` Python processes: the interpreter alone for 1, torchrun (standalone: one machine) for more.
    A script run under it chooses its own device: name it there."""
    check_int(ranks, "ranks", low=1)
    if ranks == 1:
        return [python]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]


def llmstep_command(args: Sequence[str], ranks: int = 1, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, python: str = sys.executable) -> list[str]:
    """argv for `llmstep ARGS` in `ranks` processes (1: a plain child; more: torchrun), every one told the device
    (`rank_device`) and the dtype (None: that device's default, llmstep.core.device.resolve_dtype)."""
    args = [str(a) for a in args]
    given = [a for a in args if a.split("=")[0] in ("--device", "--dtype")]
    if given:
        raise ValueError(f"{given[0]} in args: pass device= and dtype= instead (every child gets them)")
    dev = rank_device(ranks, device)
    dtype_name = str(resolve_dtype(dtype, dev)).removeprefix("torch.")
    return [*launcher(ranks, python), "-m", "llmstep", *args, "--device", dev.type, "--dtype", dtype_name]
