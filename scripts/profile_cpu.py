"""Where a compiled CPU decode step's time goes, per kernel (results/profile_cpu_amd.md).

    python scripts/profile_cpu.py float32                      # FastDecoder(model, compile=True), the default
    python scripts/profile_cpu.py bfloat16 --set max_autotune=True --set cpp_wrapper=False
    python scripts/profile_cpu.py int8 --rate-only              # tok/s only (median of --repeats runs)
    python scripts/profile_cpu.py bfloat16 --no-dot              # without engines/cpu_gemm's bf16 dot-product kernel

The shipped target model in the given dtype (int8 / int4: quantised from bfloat16 by llmstep.quantize),
2 threads, a 128-token prompt, 128 new tokens. `--set key=value` overrides one of engines/compile.py's
inductor options for the CPU (Python literals). First the decode rate, median of --repeats runs; then, unless
--rate-only, torch.profiler over --steps steps, each inductor C++ kernel recorded by name
(`cpp.enable_kernel_profile`), the top ops by self CPU time per step, and their share by kind.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time

import torch

import llmstep
import llmstep.engines.compile as compile_mod
from llmstep.core.quantize import quantize
from llmstep.engines import cpu_gemm
from llmstep.engines.fast import FastDecoder

KINDS = (  # (kind, substrings of a profiler op name), first match wins
    ("matmul", ("linear", "mkldnn", "mm", "gemm", "int8pack", "int4pack", "addmm")),
    ("attention", ("attention", "sdpa", "flash", "softmax", "bmm")),
    ("norm/rope/elementwise", ("cpp_fused", "copy", "add", "mul", "rsqrt", "mean", "pow", "cat", "index", "silu")),
)


def kind(name: str) -> str:
    low = name.lower()
    for k, keys in KINDS:
        if any(s in low for s in keys):
            return k
    return "other"


def build(dtype: str, overrides: dict) -> tuple[FastDecoder, list[int]]:
    base = "bfloat16" if dtype in ("int8", "int4") else dtype
    model, _ = llmstep.load("target", device="cpu", dtype=base)
    if dtype in ("int8", "int4"):
        quantize(model, dtype)
    if overrides:
        original = compile_mod.compile_options

        def patched(device, mode=None, tune=True):
            return original(device, mode, tune) | overrides

        compile_mod.compile_options = patched
    decoder = FastDecoder(model, compile=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (128,), generator=gen).tolist()
    return decoder, ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dtype", choices=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--set", action="append", default=[], help="inductor option key=value (a Python literal)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rate-only", action="store_true")
    p.add_argument("--kernel-profile", action="store_true", help="name inductor's C++ kernels in the profile")
    p.add_argument("--no-dot", action="store_true", help="compile without engines/cpu_gemm's bf16 kernel")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    overrides = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.set)}
    if a.kernel_profile:
        overrides["cpp.enable_kernel_profile"] = True
    decoder, ids = build(a.dtype, overrides)
    t = time.perf_counter()
    with cpu_gemm.withheld(a.no_dot):  # held to the end: the profiled
        run(decoder, ids, a, t)  # step is the guarded one, which may compile once more


def run(decoder: FastDecoder, ids: list[int], a: argparse.Namespace, t: float) -> None:
    decoder.warmup()
    print(f"compile {time.perf_counter() - t:.1f} s", file=sys.stderr)
    decoder.generate(ids, 8, temperature=0, stop_ids=())
    rates = []
    for _ in range(a.repeats):
        r = decoder.generate(ids, 128, temperature=0, stop_ids=())
        rates.append(r.decode_steps / r.decode_seconds)
    print(f"{a.dtype} {a.set}: median {statistics.median(rates):.1f} tok/s, "
          f"min {min(rates):.1f}, max {max(rates):.1f} ({a.repeats} runs of 128 tokens)")
    if a.rate_only:
        return
    token = torch.zeros(1, 1, dtype=torch.long)
    position = torch.full((1, 1), 128, dtype=torch.long)
    with torch.no_grad():
        for _ in range(10):
            decoder.step(token, position)
        t = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(a.steps):
                decoder.step(token, position)
        wall = (time.perf_counter() - t) / a.steps
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / a.steps
    print(f"profiled: {wall * 1e6:.0f} us/step wall, {total:.0f} us/step in ops (self CPU)")
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind(e.key)] = by_kind.get(kind(e.key), 0.0) + e.self_cpu_time_total / a.steps
    for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:24s} {us:8.0f} us/step  {100 * us / total:5.1f}%")
    print(f"{'op':70s} {'calls/step':>10s} {'us/step':>9s} {'us/call':>8s}")
    for e in events[:25]:
        us = e.self_cpu_time_total / a.steps
        print(f"{e.key[:70]:70s} {e.count / a.steps:10.1f} {us:9.1f} {us * a.steps / e.count:8.2f}")


if __name__ == "__main__":
    main()
