"""Speculative decoding, measured: decode rate with and without the draft, in the same process.

`bench` times the teaching loops (any temperature, adaptive k), `bench_compiled` the fast loops (greedy,
compiled); both interleave their runs and report medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from ..core.model import Llama
from ..core.tokens import Tokenizer
from ..engines.speculative import (
    FastSpeculator,
    Rounds,
    draft_cost_ratio,
    expected_tokens_per_forward,
    measure_costs,
    resolve_draft,
    speculative_generate,
)
from .hardware import describe

__all__ = ["BENCH_PROMPTS", "bench", "bench_compiled"]



BENCH_PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
                 "KING HENRY:\nOnce more unto the breach",
                 "First Citizen:\nBefore we proceed any further, hear me speak.\n"]


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def bench(target: Llama, draft: Llama, tokenizer: Tokenizer, ks: Iterable[int] = (1, 2, 3, 4, 6, 8),
          prompts: Iterable[str] = BENCH_PROMPTS, max_new_tokens: int = 200, temperature: float = 0.0,
          repeats: int = 3, log=print) -> dict:
    """Decode tokens/s of the target alone and with the draft at each k (and adaptive), same prompts.

    Runs are interleaved (target, then each k, repeated) so slow drift of the machine hits all alike;
    a rate is the median over repeats of the total decode rate over the prompts, a speedup the median
    over repeats of the rate over the target's rate in the same repeat. Adaptive k uses the draft's
    forward costs measured by `measure_costs` before the runs.
    """
    from .generate import generate

    prompts, ks = list(prompts), list(ks)
    load_before = _load_average()  # other processes on the machine skew every timing: record them
    configs = [("target", None)] + [(f"k={k}", k) for k in ks] + [("adaptive", max(ks))]
    rates: dict[str, list[float]] = {name: [] for name, _ in configs}
    stats: dict[str, dict] = {}
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=0, stop_ids=[])
    generate(target, tokenizer, prompts[0], **kw | {"max_new_tokens": 8})  # warm up both models
    speculative_generate(target, draft, tokenizer, prompts[0], 2, **kw | {"max_new_tokens": 8})
    cost_ratio, verify_costs = measure_costs(target, draft, k_max=max(ks))
    log(f"a draft forward costs {cost_ratio:.3f} target forwards; verifying k+1 tokens costs "
        + ", ".join(f"{v:.2f}" for v in verify_costs[1:]) + f" one-token forwards for k = 1..{max(ks)}")
    for r in range(repeats):
        for name, k in configs:
            tokens = seconds = 0.0
            runs = []
            for prompt in prompts:
                if k is None:
                    g = generate(target, tokenizer, prompt, **kw)
                else:
                    g = speculative_generate(target, draft, tokenizer, prompt, k, adaptive=name == "adaptive",
                                             cost_ratio=cost_ratio, verify_costs=verify_costs, **kw)
                    runs.append(g)
                tokens += len(g.step_seconds)
                seconds += g.decode_seconds
            rates[name].append(tokens / seconds)
            if runs:
                proposed = sum(g.draft_forwards for g in runs)
                rounds = sum(g.rounds for g in runs)
                accepted = sum(sum(g.accepted) for g in runs)
                examined = sum(g.examined for g in runs)
                a = accepted / examined
                earlier = stats.get(name)
                stats[name] = dict(
                    k=k, acceptance_rate=a, tokens_per_target_forward=sum(sum(g.produced) for g in runs) / rounds,
                    theory_tokens_per_forward=sum(expected_tokens_per_forward(a, kr) for g in runs
                                                  for kr in g.proposed) / rounds,
                    mean_k=proposed / rounds,
                    draft_seconds_per_forward=sum(g.draft_seconds for g in runs) / max(proposed, 1),
                    target_seconds_per_forward=sum(g.target_seconds for g in runs) / rounds)
                if earlier:  # the tokens are the same in every repeat; keep the least disturbed timings
                    for key in ("draft_seconds_per_forward", "target_seconds_per_forward"):
                        stats[name][key] = min(stats[name][key], earlier[key])
            log(f"repeat {r + 1}/{repeats} {name:>9}: {rates[name][-1]:7.1f} tok/s")
    results = {"target": {"decode_tokens_per_second": _median(rates["target"]), "all_runs": rates["target"]}}
    for name, _ in configs[1:]:
        paired = [a / b for a, b in zip(rates[name], rates["target"], strict=True)]
        results[name] = stats[name] | {"decode_tokens_per_second": _median(rates[name]), "speedup": _median(paired),
                                       "all_runs": rates[name]}
    return _report(target, draft, load_before) | dict(
        measured_cost_ratio=cost_ratio, measured_verify_costs=verify_costs, temperature=temperature,
        max_new_tokens=max_new_tokens, prompts=prompts, repeats=repeats, results=results)


def bench_compiled(target: Llama, draft: Llama, tokenizer: Tokenizer, ks: Iterable[int] = (1, 2, 3, 4),
                   prompts: Iterable[str] = BENCH_PROMPTS, max_new_tokens: int = 200, repeats: int = 3,
                   mode: str | None = None, log=print) -> dict:
    """`bench` for the fast loops, greedy: `llmstep.fast.FastDecoder` (the target alone) against a
    `FastSpeculator` per k, every one compiled with the same settings. Same prompts, interleaved repeats,
    medians; each run's tokens are compared with the target-alone run's."""
    from ..lab.bench import matching_prefix
    from .fast import FastDecoder

    prompts, ks = [tokenizer.encode(p, bos=True) for p in prompts], list(ks)
    max_len = min(target.config.max_seq_len, draft.config.max_seq_len,
                  max(len(p) for p in prompts) + max_new_tokens + max(ks) + 1)
    load_before = _load_average()
    runners: dict = {"target": FastDecoder(target, max_len=max_len, compile=True, mode=mode)}
    runners |= {f"k={k}": FastSpeculator(target, draft, k=k, max_len=max_len, compile=True, mode=mode) for k in ks}
    compile_seconds = {}
    for name, runner in runners.items():
        log(f"compiling {name} ...")
        compile_seconds[name] = runner.warmup()
        runner.generate(prompts[0], 8)  # first-call allocations out of the timed runs
    reference = [runners["target"].generate(p, max_new_tokens).tokens for p in prompts]
    rates: dict[str, list[float]] = {name: [] for name in runners}
    stats: dict[str, dict] = {}
    for r in range(repeats):
        for name, runner in runners.items():
            runs = [runner.generate(p, max_new_tokens) for p in prompts]
            rates[name].append(sum(g.decode_steps for g in runs) / sum(g.decode_seconds for g in runs))
            if name != "target":
                rounds = Rounds(proposed=[n for g in runs for n in g.proposed],
                                accepted=[n for g in runs for n in g.accepted],
                                produced=[n for g in runs for n in g.produced])
                stats[name] = dict(k=runner.k, acceptance_rate=rounds.acceptance_rate,
                                   tokens_per_target_forward=rounds.tokens_per_target_forward,
                                   theory_tokens_per_forward=rounds.theory_tokens_per_forward,
                                   matching_tokens=[matching_prefix(g.tokens, ref)
                                                    for g, ref in zip(runs, reference, strict=True)])
            log(f"repeat {r + 1}/{repeats} {name:>9}: {rates[name][-1]:7.1f} tok/s")
    results = {"target": {"decode_tokens_per_second": _median(rates["target"]), "all_runs": rates["target"],
                          "compile_seconds": compile_seconds["target"]}}
    for name in list(runners)[1:]:
        paired = [a / b for a, b in zip(rates[name], rates["target"], strict=True)]
        results[name] = stats[name] | {"decode_tokens_per_second": _median(rates[name]), "speedup": _median(paired),
                                       "all_runs": rates[name], "compile_seconds": compile_seconds[name]}
    return _report(target, draft, load_before) | dict(
        temperature=0.0, compiled=True, compile_mode=mode, max_new_tokens=max_new_tokens,
        new_tokens_compared_with_target_alone=max_new_tokens, prompts=[tokenizer.decode(p) for p in prompts],
        repeats=repeats, results=results)


def _report(target: Llama, draft: Llama, load_before: float | None) -> dict:
    """What both benchmarks record about the models, the machine and the versions."""
    return dict(
        target=dict(n_params=sum(p.numel() for p in target.parameters()), config=target.config.to_hf()),
        draft=dict(n_params=sum(p.numel() for p in draft.parameters()), config=draft.config.to_hf()),
        bytes_ratio=draft_cost_ratio(target, draft),
        hardware=dict(cpu=describe("cpu")["name"], cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                      device=str(target.device), dtype=str(target.dtype).removeprefix("torch."),
                      load_average_1min_before_after=[load_before, _load_average()]),
        versions=dict(torch=torch.__version__, python=platform.python_version()),
    )


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m llmstep.speculative",
                                description="measure speculative decoding against the target alone")
    p.add_argument("--bench", action="store_true", help="run the benchmark (the only action)")
    p.add_argument("--target", default="target", help="target checkpoint (default: the shipped one)")
    p.add_argument("--draft", default="draft", help="draft checkpoint or self-N (default: the shipped draft)")
    p.add_argument("--ks", default="1,2,3,4,6,8", help="comma-separated draft lengths")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: float32 on a CPU)")
    p.add_argument("--compile", action="store_true",
                   help="the fast loops (static caches, compiled steps), greedy, fixed k; no adaptive k")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune (see llmstep.fast)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: PyTorch's choice)")
    p.add_argument("--out", default="results/speculative_cpu.json")
    args = p.parse_args(argv)
    if not args.bench:
        p.error("nothing to do: pass --bench")
    from ..core.checkpoint import load

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load(args.target, device=args.device, dtype=args.dtype)
    draft = resolve_draft(args.draft, target, tokenizer)
    ks = [int(k) for k in args.ks.split(",")]
    if args.compile:
        if args.temperature != 0:
            p.error("--compile measures greedy decoding: leave --temperature at 0")
        report = bench_compiled(target, draft, tokenizer, ks=ks, max_new_tokens=args.max_new_tokens,
                                repeats=args.repeats, mode=args.compile_mode)
    else:
        report = bench(target, draft, tokenizer, ks=ks, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, repeats=args.repeats)
    report["command"] = "python -m llmstep.speculative " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\n{'':>9} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/fwd':>8} {'theory':>7}")
    for name, r in report["results"].items():
        if name == "target":
            print(f"{name:>9} {r['decode_tokens_per_second']:8.1f} {1:8.2f}")
        else:
            print(f"{name:>9} {r['decode_tokens_per_second']:8.1f} {r['speedup']:8.2f} {r['acceptance_rate']:7.1%} "
                  f"{r['tokens_per_target_forward']:8.2f} {r['theory_tokens_per_forward']:7.2f}"
                  + (f"  same tokens as the target alone: {r['matching_tokens']}" if "matching_tokens" in r else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
