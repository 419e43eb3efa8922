"""What a compiled CPU decode step costs around its kernels (scripts/README.md).

    python scripts/overhead_cpu.py bfloat16 --rounds 20 --tokens 64 --threads 1

One FastDecoder (the shipped target model, compiled, default options, greedy; int8 / int4 quantised from
bfloat16), its decode step called --tokens times in a row in each of these ways, the ways alternated --rounds
times in one process (a shared machine slows them alike); every call timed alone, median and 10th / 90th
percentiles of the microseconds per call:

- step:        the step as a compiled call (`Step.__call__`: torch.compile's wrapper, Dynamo's frame hook
               evaluating every guard, the compiled code);
- no-guards:   the same under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`;
- unguarded:   `Step.unguarded()`: Dynamo's compiled code called directly, its guards evaluated once before;
- loop / loop-guarded: FastDecoder's own loop (`generate`, decode_seconds / decode_steps), as it is
               (it calls `unguarded()`) and with `unguarded` replaced by the guarded step (the loop before).

step - no-guards is the guards' cost; no-guards - unguarded is the wrapper's and frame hook's. Every way must
write the same tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import llmstep
from llmstep.core.quantize import quantize
from llmstep.engines.compile import Step
from llmstep.engines.fast import FastDecoder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dtype", choices=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.rounds < 2:
        p.error(f"argument --rounds: at least 2 (the paired ratio's quartiles need two rounds), got {a.rounds}")
    torch.set_num_threads(a.threads)
    model, _ = llmstep.load("target", device="cpu", dtype="bfloat16" if a.dtype in ("int8", "int4") else a.dtype)
    if a.dtype in ("int8", "int4"):
        quantize(model, a.dtype)
    decoder = FastDecoder(model, compile=True, max_len=256)
    decoder.warmup()
    step = decoder._advance_step((0, 0, 1.0))
    ids = torch.randint(0, 8192, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    n = a.tokens

    def run(call, stance: bool = False) -> tuple[list[float], list[int]]:
        """n calls from position 0, each timed alone -> (us per call, the tokens written)."""
        decoder._reset()
        decoder._history[0] = ids[0]
        us = []
        with torch.compiler.set_stance(skip_guard_eval_unsafe=stance):
            for _ in range(n):
                t = time.perf_counter()
                call()
                us.append((time.perf_counter() - t) * 1e6)
        return us, decoder._history[: n + 1].tolist()

    def loop(guarded: bool) -> tuple[list[float], list[int]]:
        if guarded:
            Step.unguarded, original = (lambda self: self), Step.unguarded
        try:
            r = decoder.generate(ids[:1], n + 1, temperature=0, stop_ids=())
        finally:
            if guarded:
                Step.unguarded = original
        return [r.decode_seconds / r.decode_steps * 1e6], [ids[0], *r.tokens[:n]]

    with torch.inference_mode():  # the mode FastDecoder compiles and runs its steps in (Dynamo guards it)
        unguarded = step.unguarded()
        if unguarded is step:
            raise SystemExit("Step.unguarded() found no compiled code to call")
        ways = {"step": lambda: run(step), "no-guards": lambda: run(step, stance=True),
                "unguarded": lambda: run(unguarded), "loop": lambda: loop(False),
                "loop-guarded": lambda: loop(True)}
        times: dict[str, list[float]] = {w: [] for w in ways}
        tokens: dict[str, list[int]] = {}
        for _ in range(a.rounds):
            for w, way in ways.items():
                us, tokens[w] = way()
                times[w] += us
    same = all(v == tokens["step"] for v in tokens.values())
    load = open("/proc/loadavg").read().split()[:3]
    print(f"{a.dtype}, {a.threads} threads, {a.rounds} rounds of {n} steps, tokens equal across ways: {same}, "
          f"load average {' '.join(load)} at the end")
    print(f"  {'':12s} {'median':>8s} {'p10':>8s} {'p90':>8s}  us per step (per call; loops: per run)")
    for w, v in times.items():
        q = statistics.quantiles(v, n=10)
        print(f"  {w:12s} {statistics.median(v):8.1f} {q[0]:8.1f} {q[-1]:8.1f}")
    ratio = [x / y for x, y in zip(times["loop-guarded"], times["loop"], strict=True)]
    print(f"  loop-guarded / loop, paired per round: median {statistics.median(ratio):.3f} "
          f"[{min(ratio):.3f}, {max(ratio):.3f}]")


if __name__ == "__main__":
    main()
