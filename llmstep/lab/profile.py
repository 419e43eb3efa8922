"""A real profiler trace of one decode step, its timeline, and the regime the step sits in.

`llmstep.lab.trace` times stages with hooks that wait for each one; this module asks PyTorch's own profiler
(`torch.profiler`) instead. `profile_step` runs `FastDecoder`'s decode step, eager or compiled, warms it up, then
records one step: every operator the step ran on the host (top level and one level down) and, on a GPU, every
kernel, each with its start and duration in microseconds from the start of the step. `plot_timeline` draws them
as a timeline, one row per kind of event. `profile_ops` is the other view, behind `llmstep profile`: many steps
under the profiler, each operator's self time per step, largest first, and its share by kind (matmul, attention,
elementwise), which says where a compiled step's time goes once its timeline is too dense to read.

`regime` places a measured step in one of three regimes, from its bytes and FLOPs (llmstep.core.cost's
accounting) and the machine's two ceilings:

- **memory**: the step takes about bytes / bandwidth: reading the weights and the KV cache is the work;
- **compute**: it takes about FLOPs / peak: the arithmetic is the work (prefill, large batches);
- **overhead**: it takes far longer than either floor: launching operations, Python, the framework, threads
  waking up. The floors are not the work here; fewer, larger operations (compiling, CUDA graphs) are the cure.

The rule: a step that attains at least `attained` (default one half) of the rate its higher floor allows is bound
by that floor; slower than that, most of its time is neither bytes nor FLOPs, and it is overhead-bound.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from ..core.checks import check_step_context
from ..core.cost import StepCost, model_step_cost
from ..core.device import synchronize
from ..core.model import Llama
from ..engines.decoding import check_int
from ..engines.fast import FastDecoder
from .runinfo import median, spread, time_repeats

__all__ = ["Event", "StepProfile", "Regime", "profile_step", "regime", "plot_timeline", "OpTime", "OpProfile",
           "op_kind", "profile_ops", "decode_rates"]


@dataclass(frozen=True)
class Event:
    name: str  # the operator (aten::mm, a compiled region) or the GPU kernel
    row: str  # "host ops", "host ops, one level down" or "GPU kernels"
    start_us: float  # from the start of the profiled step
    duration_us: float


@dataclass(frozen=True)
class Regime:
    name: str  # "memory", "compute" or "overhead"
    step_seconds: float  # the measured step
    memory_seconds: float  # bytes / bandwidth: the step's floor if only reading mattered
    compute_seconds: float  # FLOPs / peak: its floor if only arithmetic mattered

    @property
    def overhead_seconds(self) -> float:
        """The part of the step neither floor explains."""
        return max(0.0, self.step_seconds - max(self.memory_seconds, self.compute_seconds))

    def __str__(self) -> str:
        return (f"{self.name}-bound: step {1e3 * self.step_seconds:.3f} ms; memory floor "
                f"{1e3 * self.memory_seconds:.3f} ms, compute floor {1e3 * self.compute_seconds:.4f} ms, "
                f"unexplained {1e3 * self.overhead_seconds:.3f} ms")


@dataclass(frozen=True)
class StepProfile:
    events: list[Event]  # sorted by start
    step_seconds: list[float]  # unprofiled steps, every repeat (see `median`, `spread`)
    profiled_seconds: float  # the profiled step, wall clock (the profiler adds its own cost)
    compiled: bool
    compile_seconds: float  # spent in warm-up compiling (0 when eager)
    cost: StepCost  # the step's bytes and FLOPs (llmstep.core.cost.model_step_cost)
    context: int
    device: str

    @property
    def median_seconds(self) -> float:
        return median(self.step_seconds)

    @property
    def spread(self) -> float:
        return spread(self.step_seconds)

    def rows(self) -> list[str]:
        return list(dict.fromkeys(e.row for e in self.events))

    def top(self, n: int = 8, row: str = "host ops") -> list[tuple[str, int, float]]:
        """The n operators of `row` with the most total time: (name, calls, microseconds)."""
        totals: dict[str, list[float]] = {}
        for e in self.events:
            if e.row == row:
                totals.setdefault(e.name, []).append(e.duration_us)
        ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:n]
        return [(name, len(d), sum(d)) for name, d in ranked]

    def regime(self, bandwidth_gb_per_s: float, peak_tflops: float, attained: float = 0.5) -> Regime:
        return regime(self.cost, self.median_seconds, bandwidth_gb_per_s, peak_tflops, attained)


def regime(cost: StepCost, step_seconds: float, bandwidth_gb_per_s: float, peak_tflops: float,
           attained: float = 0.5) -> Regime:
    """Which of memory, compute or overhead bounds a step of `cost` that took `step_seconds` (see the module)."""
    for name, value in (("step_seconds", step_seconds), ("bandwidth_gb_per_s", bandwidth_gb_per_s),
                        ("peak_tflops", peak_tflops)):
        if not value > 0:
            raise ValueError(f"regime: {name} must be positive, got {value!r}")
    if not 0 < attained <= 1:
        raise ValueError(f"regime: attained must be in (0, 1], got {attained!r}")
    memory = cost.bytes / (bandwidth_gb_per_s * 1e9)
    compute = cost.flops / (peak_tflops * 1e12)
    floor = max(memory, compute)
    if floor >= attained * step_seconds:
        name = "memory" if memory >= compute else "compute"
    else:
        name = "overhead"
    return Regime(name, step_seconds, memory, compute)


def _events(prof, start_us: float, gpu: bool) -> list[Event]:
    events = []
    for e in prof.events():
        begin, length = e.time_range.start - start_us, e.time_range.elapsed_us()
        if gpu and e.device_type == torch.autograd.DeviceType.CUDA:
            events.append(Event(e.name, "GPU kernels", begin, length))
        elif e.device_type == torch.autograd.DeviceType.CPU and e.name != "decode step":
            parent = e.cpu_parent
            if parent is not None and parent.name == "decode step":
                events.append(Event(e.name, "host ops", begin, length))
            elif parent is not None and parent.cpu_parent is not None and parent.cpu_parent.name == "decode step":
                events.append(Event(e.name, "host ops, one level down", begin, length))
    return sorted(events, key=lambda e: e.start_us)


@torch.no_grad()
def profile_step(model: Llama, context: int = 64, compile: bool = False, mode: str | None = None,
                 repeats: int = 10) -> StepProfile:
    """Profile one decode step of `model` (batch 1) after `context` tokens, through `FastDecoder`'s step, eager
    or compiled (`mode` as FastDecoder takes it). Also times `repeats` unprofiled steps."""
    # FastDecoder's cache: at least 2 slots, so a step after 1 token or more
    check_step_context(context, model.config.max_seq_len, low=1)
    check_int(repeats, "repeats", low=1)
    decoder = FastDecoder(model, max_len=context + 1, compile=compile, mode=mode)
    compile_seconds = decoder.warmup()
    device = decoder.device
    token = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]
    position = torch.full((1, 1), context, dtype=torch.long, device=device)  # [1, 1]: after `context` tokens
    decoder.cache.lengths.fill_(context)  # the step at `context`: the slots before it hold zeros, which cost the same

    def step():
        return decoder.step(token, position)

    seconds = time_repeats(step, device, repeats, warmup=1)
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    # Kineto (the profiler's C++ side) otherwise writes "profiler_start"/"profiler_stop" lines to stderr on every
    # profile; it reads this when the first profile starts, so a user's own setting wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=activities) as prof:
        with torch.profiler.record_function("decode step"):
            step()
        synchronize(device)
    marks = [e for e in prof.events() if e.name == "decode step" and e.device_type == torch.autograd.DeviceType.CPU]
    if not marks:
        raise RuntimeError("torch.profiler recorded no 'decode step' range; llmstep.lab.profile needs updating")
    start_us = marks[0].time_range.start
    return StepProfile(_events(prof, start_us, gpu), seconds, marks[0].time_range.elapsed_us() / 1e6,
                       decoder.compiled, compile_seconds, model_step_cost(model, context), context, str(device))


def plot_timeline(profiles: dict[str, StepProfile], ax=None, min_us: float = 0.0):
    """One decode step per profile, its events as bars on a shared microsecond axis (one lane per profile and row).
    Events shorter than min_us are left out."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.6 + 0.55 * sum(len(p.rows()) for p in profiles.values())))
    lanes, colours = [], {}
    for label, p in profiles.items():
        for row in p.rows():
            y = len(lanes)
            lanes.append(f"{label}: {row}")
            for e in p.events:
                if e.row == row and e.duration_us >= min_us:
                    colour = colours.setdefault(e.name.split("(")[0][:40], f"C{len(colours) % 10}")
                    ax.barh(y, e.duration_us, left=e.start_us, height=0.7, color=colour, edgecolor="black",
                            linewidth=0.2)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds from the start of the step")
    top = sorted(colours.items())[:12]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for _, c in top], [n for n, _ in top], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), title="operators (first 12)", title_fontsize=7)
    return ax


# ---- operators over many steps (`llmstep profile`) -------------------------------------------------------------

KINDS = (  # (kind, substrings of a profiler op name, lower case): the first match wins. Attention first: an
    #        inductor kernel that fuses a softmax or a batched matmul (bmm) into its name is attention's
    ("attention", ("attention", "sdpa", "flash", "softmax", "bmm")),
    ("matmul", ("linear", "mkldnn", "mm", "matmul", "gemm", "int8pack", "int4pack", "addmm")),
    ("norm/rope/elementwise", ("cpp_fused", "triton", "copy", "add", "mul", "rsqrt", "mean", "pow", "cat", "index",
                               "silu")),
)


def op_kind(name: str) -> str:
    """The kind of work a profiler op name stands for: matmul, attention, norm/rope/elementwise or other."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


@dataclass(frozen=True)
class OpTime:
    name: str  # the operator as torch.profiler names it (aten::mm, an inductor kernel, a compiled region)
    calls_per_step: float
    us_per_step: float  # its self time on the host (time inside it, not in the operators it calls)

    @property
    def kind(self) -> str:
        return op_kind(self.name)


@dataclass(frozen=True)
class OpProfile:
    ops: list[OpTime]  # by self time per step, largest first
    steps: int
    wall_us_per_step: float  # the profiled steps' wall clock (the profiler adds its own cost)

    @property
    def total_us_per_step(self) -> float:
        return sum(op.us_per_step for op in self.ops)

    def by_kind(self) -> dict[str, float]:
        """Self time per step by kind, largest first."""
        out: dict[str, float] = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0.0) + op.us_per_step
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def table(self, n: int = 25) -> str:
        total = self.total_us_per_step or 1.0
        lines = [f"{self.steps} steps profiled: {self.wall_us_per_step:,.0f} us/step wall, "
                 f"{self.total_us_per_step:,.0f} us/step in ops (self time)"]
        lines += [f"  {kind:<24} {us:9,.0f} us/step {100 * us / total:6.1f}%" for kind, us in self.by_kind().items()]
        lines.append(f"{'op':<70} {'calls/step':>10} {'us/step':>9} {'us/call':>8}")
        for op in self.ops[:n]:
            lines.append(f"{op.name[:70]:<70} {op.calls_per_step:10.1f} {op.us_per_step:9.1f} "
                         f"{op.us_per_step / op.calls_per_step:8.2f}")
        return "\n".join(lines)


@torch.no_grad()
def profile_ops(decoder: FastDecoder, context: int, steps: int = 100, warmup: int = 10) -> OpProfile:
    """`steps` decode steps of `decoder` (its logits step: eager or compiled, as the decoder was built) at position
    `context`, after `warmup` unprofiled ones, under torch.profiler: each operator's self host time per step."""
    check_int(context, "context", low=0)
    check_int(steps, "steps", low=1)
    check_int(warmup, "warmup", low=0)
    if context + 1 > decoder.cache.max_len:
        raise ValueError(f"profile_ops: context {context} leaves no room for a token in the decoder's "
                         f"{decoder.cache.max_len}-slot cache")
    device = decoder.device
    token = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]
    position = torch.full((1, 1), context, dtype=torch.long, device=device)  # [1, 1]
    for _ in range(warmup):
        decoder.step(token, position)
    synchronize(device)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # see profile_step
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decoder.step(token, position)
        synchronize(device)
    wall = (time.perf_counter() - start) / steps
    ops = [OpTime(e.key, e.count / steps, e.self_cpu_time_total / steps)
           for e in prof.key_averages() if e.self_cpu_time_total > 0]
    return OpProfile(sorted(ops, key=lambda op: -op.us_per_step), steps, wall * 1e6)


def decode_rates(decoder: FastDecoder, prompt_ids: list[int], new_tokens: int, repeats: int) -> list[float]:
    """Greedy decode tokens/s of `repeats` runs of `decoder.generate` (never stopping early), after one untimed
    run: the rate the profile is read against."""
    check_int(repeats, "repeats", low=1)
    check_int(new_tokens, "new_tokens", low=2)  # the prefill's token, then at least one decode step to time
    decoder.generate(prompt_ids, new_tokens, temperature=0, stop_ids=())
    rates = []
    for _ in range(repeats):
        r = decoder.generate(prompt_ids, new_tokens, temperature=0, stop_ids=())
        rates.append(r.decode_steps / r.decode_seconds)
    return rates
