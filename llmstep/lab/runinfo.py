"""What every measurement records beside its numbers, and how it times and summarises repeated runs.

A figure without its machine, its versions and its command cannot be compared with another; a single
timing says little on a machine that other processes share. The measuring tools take these from here, so
their records read alike and their timings mean the same: hardware and trace time with `time_repeats`
(hardware keeps the fastest run, trace the median), bench times transformers' generate() with it and
bench_batching its batched step (the median); bench, bench_speculative and bench_batching start their records
with `header`; the loops' own rates (FastDecoder, the speculative loops) are timed by the engines and
summarised here with `median` and `spread`.

- `describe(device)`: the device llmstep would use, in a few fields a learner can read;
- `machine(device, dtype)`: the CPU, its cores, torch's threads, the device and the dtype;
- `header(device, dtype, argv, load_before, prog=)`: the one run-metadata block of every benchmark's record (with
  the attention backend asked for: llmstep.core.attention_backend.describe); a script's names itself by `prog`;
- `time_repeats(fn, device, repeats, warmup)`: fn() timed `repeats` times after `warmup` untimed runs;
- `versions()`: llmstep, torch and python (and whatever else a record names);
- `load_average()`: the 1-minute load average, recorded before and after a run (other work skews timings);
- `command_line(argv)`: the command that made a record, as one could type it again;
- `median(values)` and `spread(values)`: the summary of repeated timings (`timing`: both and every run); no
  timings, or one that is not a finite number, is refused by name (`finite_values`).
"""

from __future__ import annotations

import math
import numbers
import os
import platform
import shlex
import time
from collections.abc import Callable, Sequence

import torch

from .._version import __version__
from ..core import attention_backend
from ..core.checks import check_int
from ..core.device import cpuinfo_fields, native_bf16, resolve_device, synchronize

__all__ = ["CPU_FLAGS", "cpu_flags", "describe", "machine", "header", "time_repeats", "versions", "load_average",
           "command_line", "finite_values", "median", "spread", "timing"]


def describe(device: str | torch.device | None = None) -> dict[str, str | int | float | None]:
    """The device llmstep would use here, in a few fields a learner can read."""
    dev = resolve_device(device)
    info: dict[str, str | int | float | None] = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info |= {"name": props.name, "memory_gb": props.total_memory / 1e9,
                 "multiprocessors": props.multi_processor_count,
                 "compute_capability": f"{props.major}.{props.minor}",
                 "bf16": native_bf16(dev)}  # in hardware: T4 and V100 only emulate it
    elif dev.type == "mps":
        info |= {"name": f"Apple GPU ({platform.machine()})", "memory_gb": None}
    else:
        name = platform.processor() or platform.machine()
        try:  # Linux: the model name is in /proc/cpuinfo; platform.processor() is often empty
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        try:
            memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        except (ValueError, OSError, AttributeError):
            memory_gb = None
        info |= {"name": name, "memory_gb": memory_gb, "cpu_cores": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()}
    return info


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of CPU_FLAGS the CPU advertises (the first `flags` line of /proc/cpuinfo, or of the text `cpuinfo`; []
    where there is none): the kind of CPU a figure was measured on, since the kernels a step runs differ between
    AVX2, AVX-512 BF16 and AMX."""
    flags = set(cpuinfo_fields(cpuinfo).get("flags", "").split())
    return [flag for flag in CPU_FLAGS if flag in flags]


def cpu_model(cpuinfo: str | None = None) -> str | None:
    """The first processor's family and model ("family 25 model 17") from /proc/cpuinfo (or the text `cpuinfo`);
    None where either is missing. Cloud VMs name every generation "AMD EPYC": this tells a Zen 4 from a Zen 5."""
    fields = cpuinfo_fields(cpuinfo)
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def machine(device: str | torch.device, dtype: torch.dtype | None = None) -> dict:
    """The machine a run measured: the CPU's name, family and model (`cpu_model`), its vector flags (`cpu_flags`)
    and cores, torch's CPU threads, the device (and its name when it is not the CPU) and the dtype."""
    device = torch.device(device)
    info = {"cpu": describe("cpu")["name"], "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
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
    """The command as a shell would take it again: `llmstep bench --preset llama-3.2-1b ...`; a script's with its
    own prog (`python scripts/bench_paged.py`), written as typed, not quoted."""
    return " ".join([prog, shlex.join(argv)]) if argv else prog


def header(device: str | torch.device, dtype: torch.dtype | None, argv: Sequence[str] | None,
           load_before: float | None, *, prog: str = "llmstep", **versions_extra: str | None) -> dict:
    """The run metadata every benchmark's record starts with: the command (`command_line(argv, prog)`: a script
    passes its own prog, e.g. "python scripts/bench_paged.py", and its arguments), the machine, the versions and the
    1-minute load average before the run and now (taken when the record is finished), and the attention backend
    (what was asked; on CUDA the kernels PyTorch may pick from)."""
    return {"command": None if argv is None else command_line(argv, prog), "machine": machine(device, dtype),
            "versions": versions(**versions_extra), "load_average_1min_before_after": [load_before, load_average()],
            "attention": attention_backend.describe(device)}



def time_repeats(fn: Callable[[], object], device: str | torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` runs of fn(), after `warmup` untimed runs (allocator, kernels, lazy
    inits, compilation), the device synchronised around each. Callers summarise: the fastest run (STREAM's
    convention, the least disturbed by everything else the machine does) or the `median`."""
    check_int(repeats, "repeats", low=1)
    check_int(warmup, "warmup")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def finite_values(values: Sequence[float], what: str = "timings") -> list[float]:
    """values as a list, refused (ValueError naming `what`) where there are none or one is not a finite number:
    a NaN sorts anywhere, so the middle of values holding one depends on their order."""
    values = list(values)
    if not values:
        raise ValueError(f"no {what} to summarise")
    for v in values:
        if isinstance(v, bool) or not (isinstance(v, numbers.Real) and math.isfinite(v)):
            raise ValueError(f"{what} must be finite numbers, got {v!r} among {len(values)}")
    return values


def median(values: Sequence[float]) -> float:
    """The middle of repeated timings; of an even count the upper middle, so it is always a measured run. No
    values, or a value that is not a finite number, is refused by a ValueError (`finite_values`)."""
    values = finite_values(values)
    return sorted(values)[len(values) // 2]


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of repeated timings: 0.05 means the runs lie within 5% of each other. Runs all alike
    spread 0 (all zero included: an all-reduce share of one process); runs that differ around a median of 0 have no
    relative spread, a ValueError, as are no runs or a run that is not a finite number."""
    values = finite_values(values)
    low, high, middle = min(values), max(values), median(values)
    if low == high:
        return 0.0
    if middle == 0:
        raise ValueError(f"the spread of timings whose median is 0 is undefined (they run from {low} to {high})")
    return (high - low) / middle


def timing(values: Sequence[float]) -> dict:
    """A record of repeated timings: their median, spread and every run."""
    return {"median": median(values), "spread": spread(values), "all_runs": list(values)}
