"""Speculative decoding, measured: decode rate with and without the draft, in the same process.

`bench` times the teaching loops (any temperature, adaptive k), `bench_compiled` the fast loops (greedy,
compiled); both interleave their runs and report medians (with their spread, llmstep.lab.runinfo). The command is
`llmstep speculative --bench` (llmstep.cli.bench).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.checks import check_int
from ..core.model import Llama
from ..core.tokens import Tokenizer
from ..engines.decoding import room
from ..engines.fast import FastDecoder, FastSpeculator
from ..engines.generate import generate
from ..engines.speculative import (
    Rounds,
    check_costs_args,
    check_k,
    draft_cost_ratio,
    expected_tokens_per_forward,
    measure_costs,
    speculative_generate,
)
from . import runinfo
from .bench import matching_prefix

__all__ = ["BENCH_PROMPTS", "bench", "bench_compiled"]

COST_CONTEXT = 64  # the cached tokens `bench` times a round's forwards after (measure_costs' default)

BENCH_PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
                 "KING HENRY:\nOnce more unto the breach",
                 "First Citizen:\nBefore we proceed any further, hear me speak.\n"]


def bench(target: Llama, draft: Llama, tokenizer: Tokenizer, ks: Iterable[int] = (1, 2, 3, 4, 6, 8),
          prompts: Iterable[str] = BENCH_PROMPTS, max_new_tokens: int = 200, temperature: float = 0.0,
          repeats: int = 3, log=print, on_repeat=None, argv: list[str] | None = None) -> dict:
    """Decode tokens/s of the target alone and with the draft at each k (and adaptive), same prompts.

    Runs are interleaved (target, then each k, repeated) so slow drift of the machine hits all alike;
    a rate is the median over repeats of the total decode rate over the prompts, a speedup the median
    over repeats of the rate over the target's rate in the same repeat. Adaptive k uses the draft's
    forward costs measured by `measure_costs` before the runs. on_repeat(report), if given, gets the report of
    the repeats so far after each one (with "repeats_done"), to be written as the run goes. The report carries
    runinfo.header's run metadata (argv: the command that ran it, if any).
    """
    prompts, ks = _check(prompts, ks, max_new_tokens, repeats, tokenizer, target.config.max_seq_len)
    check_costs_args(target, draft, max(ks), COST_CONTEXT, k_name="max(ks)")  # before any work
    load_before = runinfo.load_average()  # other processes on the machine skew every timing: record them
    configs = [("target", None)] + [(f"k={k}", k) for k in ks] + [("adaptive", max(ks))]
    rates: dict[str, list[float]] = {name: [] for name, _ in configs}
    stats: dict[str, dict] = {}
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=0, stop_ids=[])
    generate(target, tokenizer, prompts[0], **kw | {"max_new_tokens": 8})  # warm up both models
    speculative_generate(target, draft, tokenizer, prompts[0], 2, **kw | {"max_new_tokens": 8})
    cost_ratio, verify_costs = measure_costs(target, draft, k_max=max(ks), context=COST_CONTEXT)
    log(f"a draft forward costs {cost_ratio:.3f} target forwards; verifying k+1 tokens costs "
        + ", ".join(f"{v:.2f}" for v in verify_costs[1:]) + f" one-token forwards for k = 1..{max(ks)}")
    def report() -> dict:
        results = {name: stats.get(name, {}) | _summary(rates, name) for name, _ in configs}
        return _report(target, draft, load_before, argv) | dict(
            measured_cost_ratio=cost_ratio, measured_verify_costs=verify_costs, temperature=temperature,
            max_new_tokens=max_new_tokens, prompts=prompts, repeats=repeats, results=results)

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
        if on_repeat is not None and r + 1 < repeats:
            on_repeat(report() | {"repeats_done": r + 1})
    return report()


def bench_compiled(target: Llama, draft: Llama, tokenizer: Tokenizer, ks: Iterable[int] = (1, 2, 3, 4),
                   prompts: Iterable[str] = BENCH_PROMPTS, max_new_tokens: int = 200, repeats: int = 3,
                   mode: str | None = None, log=print, on_repeat=None, argv: list[str] | None = None) -> dict:
    """`bench` for the fast loops, greedy: `llmstep.fast.FastDecoder` (the target alone) against a
    `FastSpeculator` per k, every one compiled with the same settings. Same prompts, interleaved repeats,
    medians; each run's tokens are compared with the target-alone run's. on_repeat: as for `bench`."""
    # the target alone runs in the speculators' cache size, which the draft's context may bound
    prompts, ks = _check(prompts, ks, max_new_tokens, repeats, tokenizer,
                         min(target.config.max_seq_len, draft.config.max_seq_len))
    prompts = [tokenizer.encode(p) for p in prompts]
    max_len = min(target.config.max_seq_len, draft.config.max_seq_len,
                  max(len(p) for p in prompts) + max_new_tokens + max(ks) + 1)
    load_before = runinfo.load_average()
    runners: dict = {"target": FastDecoder(target, max_len=max_len, compile=True, mode=mode)}
    runners |= {f"k={k}": FastSpeculator(target, draft, k=k, max_len=max_len, compile=True, mode=mode) for k in ks}
    compile_seconds = {}
    for name, runner in runners.items():
        log(f"compiling {name} ...")
        compile_seconds[name] = runner.warmup()
        runner.generate(prompts[0], 8, temperature=0, stop_ids=())  # first-call allocations out of the timed runs
    reference = [runners["target"].generate(p, max_new_tokens, temperature=0, stop_ids=()).tokens for p in prompts]
    rates: dict[str, list[float]] = {name: [] for name in runners}
    stats: dict[str, dict] = {}

    def report() -> dict:
        results = {name: stats.get(name, {}) | _summary(rates, name) | {"compile_seconds": compile_seconds[name]}
                   for name in runners}
        return _report(target, draft, load_before, argv) | dict(
            temperature=0.0, compiled=True, compile_mode=mode, max_new_tokens=max_new_tokens,
            new_tokens_compared_with_target_alone=max_new_tokens, prompts=[tokenizer.decode(p) for p in prompts],
            repeats=repeats, results=results)

    for r in range(repeats):
        for name, runner in runners.items():
            runs = [runner.generate(p, max_new_tokens, temperature=0, stop_ids=()) for p in prompts]
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
        if on_repeat is not None and r + 1 < repeats:
            on_repeat(report() | {"repeats_done": r + 1})
    return report()


def _check(prompts: Iterable[str], ks: Iterable[int], max_new_tokens: int, repeats: int,
           tokenizer: Tokenizer | None = None, context: int | None = None) -> tuple[list, list]:
    """The benchmarks' settings as lists, refused by name before anything runs (a rate needs decode steps), and
    (given the tokenizer and the positions a run may fill) the longest prompt's max_new_tokens inside them
    (`decoding.room`): a run cut short by the context would time, and record, fewer tokens than asked."""
    prompts, ks = list(prompts), list(ks)
    if not prompts or not ks:
        raise ValueError("give at least one prompt and one k")
    # 3: the first token comes from the prefill, and a round must leave room for its own token after a proposal
    check_int(max_new_tokens, "max_new_tokens", low=3)
    check_int(repeats, "repeats", low=1)
    for k in ks:
        check_k(k)
    if len(set(ks)) < len(ks):
        twice = next(k for k in ks if ks.count(k) > 1)
        raise ValueError(f"k = {twice} is given twice; give each k once")
    if tokenizer is not None:
        longest = max(len(tokenizer.encode(p)) for p in prompts)
        if max_new_tokens > room(longest, context):
            raise ValueError(f"max_new_tokens {max_new_tokens} after the longest prompt ({longest} tokens) needs "
                             f"{longest + max_new_tokens - 1} positions; the context holds {context}")
    return prompts, ks


def _summary(rates: dict[str, list[float]], name: str) -> dict:
    """One configuration's decode rate over the repeats: median, spread, every run, and (beside the target
    alone) its speedup, the median over repeats of its rate over the target's in the same repeat."""
    out = {"decode_tokens_per_second": runinfo.median(rates[name]), "spread": runinfo.spread(rates[name]),
           "all_runs": list(rates[name])}
    if name != "target":
        out["speedup"] = runinfo.median([a / b for a, b in zip(rates[name], rates["target"], strict=True)])
    return out


def _report(target: Llama, draft: Llama, load_before: float | None, argv: list[str] | None) -> dict:
    """What both benchmarks record: runinfo.header's run metadata, and the models. "hardware" repeats the
    header's machine and load average in the layout notebook 08 and the stored results read."""
    head = runinfo.header(target.device, target.dtype, argv, load_before)
    return head | dict(
        target=dict(n_params=sum(p.numel() for p in target.parameters()), config=target.config.to_hf()),
        draft=dict(n_params=sum(p.numel() for p in draft.parameters()), config=draft.config.to_hf()),
        bytes_ratio=draft_cost_ratio(target, draft),
        hardware=head["machine"] | {"load_average_1min_before_after": head["load_average_1min_before_after"]},
    )
