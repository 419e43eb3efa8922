"""The measuring pieces of a first GPU check (scripts/gpu_probe.py), each one a question a slow figure raises.

- `gpu_state`: which torch, CUDA, cuDNN, Triton and driver ran, and the SM clock when it was read (nvidia-smi):
  a figure from a throttled or differently built machine explains itself;
- `no_recompiles`: a timed window in which a recompile is an error, not a silent minute inside the timing
  (torch.compiler.set_stance("fail_on_recompile"), public since torch 2.6);
- `time_calls`: seconds per call over several runs, timed with CUDA events on a GPU (no host round trip in the
  figure), the wall clock elsewhere;
- `profile_steps`: one decode step's kernels, the time the GPU is busy and the share it idles, from torch.profiler
  (two runs some steps apart, differenced): a step slower than its bytes allow shows whether the kernels or the
  gaps between them are to blame;
- `teacher_forced_agreement`: the compiled loop's tokens against the eager model's choice at every position,
  given the same history, so one early divergence does not hide the rest;
- `SyncCounter`: the host syncs a block of code asks for;
- `attention_kernels`: which of SDPA's kernels ran (flash, memory-efficient, cuDNN, math), from a profile's names.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..core.device import synchronize
from ..core.model import Llama, materialize
from .runinfo import timing

__all__ = ["SMI_FIELDS", "gpu_state", "parse_nvidia_smi", "no_recompiles", "time_calls", "kernel_summary",
           "per_step", "kernel_totals", "top_kernels", "profile_steps", "teacher_forced_agreement", "float32_twin",
           "SyncCounter", "ATTENTION_KERNELS", "attention_kernels"]

# What nvidia-smi reports per GPU (`nvidia-smi --help-query-gpu`): the driver, and the clocks a run ran at.
TOP_KERNELS = 12  # kernels listed per profiled step (`top_kernels`)
SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw")


def parse_nvidia_smi(text: str, fields: Sequence[str] = SMI_FIELDS) -> dict:
    """The first GPU's line of `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` as a dict."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(fields):
        raise ValueError(f"nvidia-smi gave {len(values)} values for {len(fields)} fields: {line!r}")
    out = {}
    for field, value in zip(fields, values, strict=True):
        try:
            out[field] = float(value) if field not in ("name", "driver_version") else value
        except ValueError:  # "[N/A]", "[Not Supported]"
            out[field] = None
    return out


def gpu_state() -> dict:
    """torch's, CUDA's, cuDNN's and Triton's versions, and nvidia-smi's driver and clocks (None where absent,
    with the reason)."""
    state = {"torch": torch.__version__, "cuda": torch.version.cuda,
             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        import triton

        state["triton"] = triton.__version__
    except ImportError:
        state["triton"] = None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return state | {"nvidia_smi": None, "nvidia_smi_error": "nvidia-smi not found"}
    try:
        r = subprocess.run([smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return state | {"nvidia_smi": parse_nvidia_smi(r.stdout)}
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return state | {"nvidia_smi": None, "nvidia_smi_error": f"{type(e).__name__}: {e}"[:200]}


@contextlib.contextmanager
def no_recompiles():
    """Inside: any torch.compile'd function that would compile again raises instead (a timed window's guard)."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def time_calls(fn: Callable[[], object], device: str | torch.device, calls: int, runs: int = 3) -> dict:
    """Seconds per call of fn() over `runs` runs of `calls` calls each (after one untimed call): CUDA events
    around each run on a GPU, so the figure is the device's time, not the host's; `runinfo.timing` of them."""
    device = torch.device(device)
    fn()
    per_call = []
    for _ in range(runs):
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / 1e3 / calls)  # elapsed_time is in milliseconds
        else:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - t) / calls)
    return timing(per_call)


# Each SDPA kernel by the names a profile shows for it: the ATen op a host-side call records (eager, or an extern
# kernel of a compiled step), and the GPU kernel's own name (all a CUDA graph's replay leaves). The GPU names are
# PyTorch 2.13's (flash: pytorch_flash::flash_fwd*; efficient: fmha_cutlassF*; cuDNN: cudnn_generated_*sdpa*).
ATTENTION_KERNELS = {"flash": ("_scaled_dot_product_flash_attention", "flash_fwd"),
                     "efficient": ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward",
                                   "fmha_cutlass"),
                     "cudnn": ("_scaled_dot_product_cudnn_attention", "cudnn_generated"),
                     "math": ("_scaled_dot_product_attention_math",)}


def attention_kernels(names: Sequence[str]) -> dict[str, int]:
    """How many of `names` (a profile's op and kernel names) are each SDPA kernel's (ATTENTION_KERNELS); the
    kernels that never ran are left out."""
    counts: dict[str, int] = {}
    for name in names:
        for kernel, marks in ATTENTION_KERNELS.items():
            if any(mark in name for mark in marks):
                counts[kernel] = counts.get(kernel, 0) + 1
                break
    return counts


def kernel_summary(kernels: Sequence[tuple[float, float]], wall_us: float) -> dict:
    """From (start_us, duration_us) of every kernel of a run that took `wall_us`: how many ran, and for how long at
    least one was running (overlaps counted once)."""
    busy, end = 0.0, float("-inf")
    for start, duration in sorted(kernels):
        stop = start + duration
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return {"kernels": len(kernels), "busy_us": busy, "wall_us": wall_us}


def per_step(short: dict, long: dict, steps: int) -> dict:
    """Two `kernel_summary`s of runs `steps` decode steps apart, as one step's share: what is common to both
    (the prompt's prefill, setting up) cancels. idle_share: the part of a step's wall time no kernel runs."""
    wall = (long["wall_us"] - short["wall_us"]) / steps
    busy = (long["busy_us"] - short["busy_us"]) / steps
    return {"kernels_per_step": (long["kernels"] - short["kernels"]) / steps, "gpu_busy_us_per_step": busy,
            "step_wall_us": wall, "idle_share": min(1.0, max(0.0, 1 - busy / wall)) if wall > 0 else None}


def profile_steps(run: Callable[[int], object], device: str | torch.device, steps: int = 8, base: int = 2) -> dict:
    """One decode step's kernels under torch.profiler, through public calls only: run(n) generates n tokens;
    run(base) and run(base + steps) are profiled and their difference divided by `steps` (`per_step`). On a CPU
    there are no kernels: it counts the top-level operators instead (`kind` says which)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    gpu = device.type == "cuda"
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # Kineto's start/stop lines on stderr, as in lab.profile
    cuda = torch.autograd.DeviceType.CUDA
    summaries, by_name = [], []
    for n in (base, base + steps):
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            synchronize(device)
            t = time.perf_counter()
            run(n)
            synchronize(device)
            wall_us = (time.perf_counter() - t) * 1e6
        events = [e for e in prof.events() if (e.device_type == cuda if gpu else e.cpu_parent is None)]
        summaries.append(kernel_summary([(e.time_range.start, e.time_range.elapsed_us()) for e in events], wall_us))
        by_name.append(kernel_totals([(e.name, e.time_range.elapsed_us()) for e in events]))
        attention = attention_kernels([e.name for e in prof.events()])  # of the longer run: it did every step kind
    return per_step(*summaries, steps) | {"kind": "GPU kernels" if gpu else "top-level CPU ops", "steps": steps,
                                          "attention_kernels": attention, "top": top_kernels(*by_name, steps)}


def kernel_totals(kernels: Sequence[tuple[str, float]]) -> dict[str, tuple[int, float]]:
    """From (name, duration_us) of every kernel of a run: name -> (calls, total us)."""
    totals: dict[str, tuple[int, float]] = {}
    for name, us in kernels:
        calls, total = totals.get(name, (0, 0.0))
        totals[name] = (calls + 1, total + us)
    return totals


def top_kernels(short: dict, long: dict, steps: int, n: int = TOP_KERNELS) -> list[dict]:
    """The `n` kernels that take the most of one decode step: two `kernel_totals` of runs `steps` steps apart,
    their difference per step (what the prefill and setting up ran cancels), the longest first. Where the step's
    time goes, kernel by kernel: a matmul far below the copy bandwidth shows here by name."""
    rows = []
    for name, (calls, us) in long.items():
        calls0, us0 = short.get(name, (0, 0.0))
        per_step_us = (us - us0) / steps
        if calls > calls0 and per_step_us > 0:  # a kernel the steps ran (as many calls in both: the prefill's)
            rows.append({"name": name, "us_per_step": per_step_us, "calls_per_step": (calls - calls0) / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])[:n]


@torch.no_grad()
def teacher_forced_agreement(model: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int],
                             reference: torch.nn.Module | None = None) -> dict:
    """The share of `generated` (a compiled loop's greedy tokens after `prompt`) that the eager `model` picks
    too, each position given the same history (one causal forward over prompt + generated[:-1]).

    Two computations in bf16 round differently (a compiled step keeps float32 inside a fused kernel where eager
    rounds to bf16 between operators), and on random weights the top two logits are often closer than that
    rounding: the share alone cannot tell rounding from a wrong function. `reference`, the same model in float32
    (`float32_twin`), can: it adds how often each of them picks the float32 model's token
    (`compiled_vs_float32`, `eager_vs_float32`, and the positions where only one of them does): a compiled step
    that computes the same function agrees with it as often as eager does."""
    if not generated:
        return {"agreement": None, "positions": 0, "first_difference": None}
    device = next(model.parameters()).device
    ids = torch.tensor([*prompt, *generated[:-1]], device=device)[None]  # [1, T]
    picks = model(ids)[0, len(prompt) - 1:].argmax(-1).tolist()  # the eager choice at each generated position
    same = [a == b for a, b in zip(picks, generated, strict=True)]
    out = {"agreement": sum(same) / len(same), "positions": len(same),
           "first_difference": next((i for i, s in enumerate(same) if not s), None)}
    if reference is not None:
        truth = reference(ids)[0, len(prompt) - 1:].argmax(-1).tolist()  # [T - len(prompt) + 1]
        compiled_right = [a == t for a, t in zip(generated, truth, strict=True)]
        eager_right = [a == t for a, t in zip(picks, truth, strict=True)]
        out["compiled_vs_float32"] = sum(compiled_right) / len(truth)
        out["eager_vs_float32"] = sum(eager_right) / len(truth)
        # the positions where only one of them picks float32's token: what a paired test of the two reads
        out["only_compiled_right"] = sum(c and not e for c, e in zip(compiled_right, eager_right, strict=True))
        out["only_eager_right"] = sum(e and not c for c, e in zip(compiled_right, eager_right, strict=True))
    return out


def float32_twin(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a Llama) with its own weights widened to float32, on its device: the reference
    `teacher_forced_agreement` reads rounding against. A quantized linear becomes its dequantized weight computed
    in float32 (codes times scales, unrounded): the function a weight-only quantized model stands for. Takes four
    bytes a weight of memory more, for as long as it is held."""
    from ..core.quantize import QuantLinear

    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    config = model.config
    if "output" in quantized and config.tie_embeddings:  # a quantized head has tensors of its own
        config = replace(config, tie_embeddings=False)
    with torch.device("meta"):
        names = list(Llama(config).state_dict())  # the plain model's names: what materialize expects
    state = {}
    for name in names:
        owner, _, _ = name.rpartition(".")
        if name == "output.weight" and config.tie_embeddings:
            continue  # the embedding's own tensor again (materialize ties it): not a second float32 copy
        if owner in quantized:
            state[name] = model.get_submodule(owner).dequantized(torch.float32)
        else:
            state[name] = model.get_parameter(name).float()
    return materialize(config, state)


class SyncCounter:
    """Counts host syncs a block of code asks for: Tensor.item/tolist/__bool__/__int__/__float__ and
    torch.cuda.synchronize (what llmstep's loops call; a kernel's own syncs are not seen)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __init__(self):
        self.count = 0

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            self.count += 1
            return fn(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def counting(self):
        saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        saved_sync = torch.cuda.synchronize
        try:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, self._wrap(fn))
            torch.cuda.synchronize = self._wrap(saved_sync)
            yield self
        finally:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)
            torch.cuda.synchronize = saved_sync
