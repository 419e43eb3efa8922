"""What every measurement records beside its numbers, and how it summarises repeated timings.

A figure without its machine, its versions and its command cannot be compared with another; a single
timing says little on a machine that other processes share. The benchmarks (bench, bench_speculative,
bench_batching) take all of that from here, so their records read alike:

- `machine(device, dtype)`: the CPU, its cores, torch's threads, the device and the dtype;
- `versions()`: llmstep, torch and python (and whatever else a record names);
- `load_average()`: the 1-minute load average, recorded before and after a run (other work skews timings);
- `command_line(argv)`: the command that made a record, as one could type it again;
- `median(values)` and `spread(values)`: the summary of repeated timings.
"""

from __future__ import annotations

import os
import platform
import shlex
from collections.abc import Sequence

import torch

from .._version import __version__
from .hardware import describe

__all__ = ["machine", "versions", "load_average", "command_line", "median", "spread", "timing"]


def machine(device: str | torch.device, dtype: torch.dtype | None = None) -> dict:
    """The machine a run measured: the CPU's name and cores, torch's CPU threads, the device (and its name
    when it is not the CPU) and the dtype."""
    device = torch.device(device)
    info = {"cpu": describe("cpu")["name"], "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device)}
    if device.type != "cpu":
        info["device_name"] = describe(device)["name"]
    if dtype is not None:
        info["dtype"] = str(dtype).removeprefix("torch.")
    return info


def versions(**extra: str | None) -> dict:
    """llmstep's, torch's and python's versions, plus any named in `extra` (e.g. transformers=...)."""
    return {"llmstep": __version__, "torch": torch.__version__, "python": platform.python_version()} | extra


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none, e.g. Windows)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def command_line(argv: Sequence[str], prog: str = "llmstep") -> str:
    """The command as a shell would take it again: `llmstep bench --preset llama-3.2-1b ...`."""
    return " ".join([prog, shlex.join(argv)]) if argv else prog


def median(values: Sequence[float]) -> float:
    """The middle of repeated timings; of an even count the upper middle, so it is always a measured run."""
    if not values:
        raise ValueError("median of no timings")
    return sorted(values)[len(values) // 2]


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of repeated timings: 0.05 means the runs lie within 5% of each other."""
    return (max(values) - min(values)) / median(values)


def timing(values: Sequence[float]) -> dict:
    """A record of repeated timings: their median, spread and every run."""
    return {"median": median(values), "spread": spread(values), "all_runs": list(values)}
