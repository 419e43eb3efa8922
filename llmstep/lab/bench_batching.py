"""Continuous batching, measured: a random workload served both ways, and a decode step timed at each batch size;
and the paged KV cache's three claims (notebook 10, results/paged.md): prefix caching on a shared system prompt,
sequences that fit in equal memory, and chunked prefill's effect on the running sequences' inter-token latency.

The command is `llmstep batch` (llmstep.cli.bench); the paged claims run from scripts/bench_paged.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from functools import partial

import torch

from ..core import attention_backend
from ..core.checks import check_int, check_step_context, is_int
from ..core.cost import model_step_cost
from ..core.model import Llama
from ..engines.batching import POLICIES, BatchRunner, Request, make_batcher, max_slots, run_batch
from ..engines.decoding import budget, cache_len
from ..engines.kv_manager import KVCacheManager
from ..engines.scheduler import BatchRun, Completion, Job, Scheduler
from . import runinfo

__all__ = ["random_workload", "serve_both_ways", "measure_batch_scaling", "run_batch_bench", "shared_prefix_workload",
           "measure_prefix_caching", "measure_capacity", "measure_chunked_prefill", "check_chunked_prefill",
           "percentile", "schedule_capacity"]


MAX_REQUESTS = 100_000  # a workload held as Python lists: 1e8 requests of ~40 ids took 5 GB before any work


def random_workload(n_requests: int, vocab_size: int, prompt_len: tuple[int, int] = (16, 64),
                    new_tokens: tuple[int, int] = (8, 128), rate: float | None = None, seed: int = 0,
                    temperature: float = 0.0) -> list[Request]:
    """n_requests with prompt lengths and output lengths drawn uniformly from the given (low, high) ranges,
    random prompt ids, no stop tokens (each writes exactly its new tokens), arriving as a Poisson process
    of `rate` requests per engine step (None: all at step 0). Seeded: the same seed, the same workload."""
    if not is_int(n_requests) or not 0 <= n_requests <= MAX_REQUESTS:
        raise ValueError(f"n_requests must be an integer in 0..{MAX_REQUESTS:,}, got {n_requests!r}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got ({lo}, {hi})")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 requests per step (or None: all at once), got {rate}")
    g = torch.Generator().manual_seed(seed)

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    requests, clock = [], 0.0
    for i in range(n_requests):
        if rate is not None and i:
            clock += float(torch.empty(1).exponential_(rate, generator=g))
        prompt = torch.randint(0, vocab_size, (between(*prompt_len),), generator=g).tolist()
        requests.append(Request(prompt, between(*new_tokens), temperature=temperature, seed=seed + i, stop_ids=(),
                                arrival=int(clock)))
    return requests


def slot_len(lengths: Iterable[tuple[int, int]], context: int) -> int:
    """The slots of each contiguous row `serve_both_ways` gives its batchers, the one rule (`llmstep batch` checks the
    memory with it before the model loads): room for every (prompt length, max_new_tokens) request, up to the
    model's context (a longer request stops there, as generate does)."""
    return min(max(p + n for p, n in lengths), context)


def serve_both_ways(model: Llama, requests: list[Request], slots: Iterable[int] = (1, 4, 8),
                    compile: bool | None = None, kv: dict | None = None) -> Iterator[dict]:
    """Serve `requests` with each number of slots under every policy (one slot: continuous only, the policies
    coincide); yield each run's summary as it ends, with its completions and whether its tokens are the first
    run's (they must be: batching changes when a request runs, not what it writes). kv: make_batcher's cache
    options (kv="paged", block_size, ...)."""
    kv = dict(kv or {})
    paged = kv.get("kv", "contiguous") == "paged"
    max_len = None if paged else slot_len([(len(r.prompt_ids), r.max_new_tokens) for r in requests],
                                          model.config.max_seq_len)
    reference = None
    for n_slots in slots:
        batcher = make_batcher(model, n_slots, max_len, compile, **kv)
        batcher.run(requests[:1], "continuous")  # warm up (and compile) before timing
        for policy in POLICIES if n_slots > 1 else POLICIES[:1]:
            run = batcher.run(requests, policy)
            tokens = [c.tokens for c in run.completions]
            reference = tokens if reference is None else reference
            yield run.summary() | {"same_tokens_as_first_run": tokens == reference,
                                   "completions": [asdict(c) for c in run.completions]}


@torch.inference_mode()
def measure_batch_scaling(model: Llama, batch_sizes: Iterable[int] = (1, 2, 4, 8, 16), context: int = 64,
                          repeats: int = 10, compile: bool | None = False) -> list[dict]:
    """Time one decode step at each batch size, every row `context` tokens in: the weights are read once
    per step whatever the batch, so tokens/s grows with the batch until the step stops being memory-bound.
    Bytes are the model's as it holds them (float or quantized, llmstep.core.cost.model_step_cost); the step
    time is the median of `repeats` after one untimed step."""
    check_step_context(context, model.config.max_seq_len)
    rows = []
    for batch in batch_sizes:
        runner = BatchRunner(model, batch, max_len=context + 1, compile=compile)
        runner.warmup()  # compile (on CUDA, record the graph) before timing
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=runner.device)
        positions = torch.full((batch, 1), context, dtype=torch.long, device=runner.device)
        step = partial(runner.step, tokens, positions)
        seconds = runinfo.median(runinfo.time_repeats(step, runner.device, repeats, warmup=1))
        cost = model_step_cost(model, context, batch=batch)
        rows.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_second": batch / seconds,
                     "bytes_per_step": cost.bytes, "bytes_per_token": cost.bytes / batch,
                     "flops_per_byte": cost.arithmetic_intensity,
                     "gb_per_second": cost.bytes / seconds / 1e9, "tflops": cost.flops / seconds / 1e12})
    return rows


def run_batch_bench(model: Llama, model_name: str, workload: dict, slots: Iterable[int], batch_sizes: Iterable[int],
                    context: int, compile: bool | None = None, argv: list[str] | None = None, kv: dict | None = None,
                    on_run: Callable[[dict, dict], None] | None = None,
                    on_row: Callable[[dict, dict], None] | None = None) -> dict:
    """The batch benchmark's record: a random workload (`workload`: random_workload's arguments by name)
    served both ways with each number of slots, then a decode step timed at each batch size, under the one
    run-metadata header (llmstep.lab.runinfo.header). on_run(record, run) and on_row(record, row), if given,
    are called as each run and each row is added (to print it, to write the record so far). kv: the cache's
    options (serve_both_ways)."""
    check_step_context(context, model.config.max_seq_len)  # before the workload runs, not after it
    requests = random_workload(vocab_size=model.config.vocab_size, **workload)
    load_before = runinfo.load_average()
    record = runinfo.header(model.device, model.dtype, argv, load_before) | {
        "model": model_name, "workload": {("requests" if k == "n_requests" else k): v for k, v in workload.items()},
        "kv": dict(kv or {"kv": "contiguous"}), "runs": [], "batch_scaling": [], "finished": False}
    for run in serve_both_ways(model, requests, slots, compile=compile, kv=kv):
        record["runs"].append(run)
        if on_run is not None:
            on_run(record, run)
    for row in measure_batch_scaling(model, batch_sizes, context, compile=compile):
        record["batch_scaling"].append(row)
        if on_row is not None:
            on_row(record, row)
    record["load_average_1min_before_after"] = [load_before, runinfo.load_average()]
    record["attention"] = attention_backend.describe(model.device)  # now: compiling a CPU step installs its kernel
    record["finished"] = True
    return record


# ---- the paged KV cache's claims -------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the sorted values (numpy's default). No values,
    a value that is not a finite number (a NaN sorts anywhere) and q outside 0..100 are refused (ValueError)."""
    if isinstance(q, bool) or not (isinstance(q, int | float) and 0 <= q <= 100):  # a NaN q fails the comparison
        raise ValueError(f"percentile q must be a number in 0..100, got {q!r}")
    v = sorted(runinfo.finite_values(values, "percentile values"))
    x = (len(v) - 1) * q / 100
    lo = int(x)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)


def shared_prefix_workload(n_requests: int, vocab_size: int, system_len: int = 256, user_len: tuple[int, int] = (8, 32),
                           new_tokens: tuple[int, int] = (8, 32), rate: float | None = 1.0, seed: int = 0
                           ) -> list[Request]:
    """random_workload's requests, each prompt behind the same system_len-token system prompt (greedy)."""
    system = random_workload(1, vocab_size, (system_len, system_len), seed=seed + 10_000)[0].prompt_ids
    requests = random_workload(n_requests, vocab_size, user_len, new_tokens, rate, seed)
    for r in requests:
        r.prompt_ids = system + r.prompt_ids
    return requests


def _check_requests(requests: list[Request]) -> None:
    if not requests:
        raise ValueError("the paged benchmarks need at least one request, got none")


def _same_tokens(a: BatchRun, b: BatchRun) -> bool:
    return [c.tokens for c in a.completions] == [c.tokens for c in b.completions]


def measure_prefix_caching(model: Llama, requests: list[Request], n_slots: int = 8, block_size: int = 16,
                           kv_blocks: int | None = None) -> dict:
    """The same requests on the paged cache without and with prefix caching: prompt tokens computed, tokens
    found cached, mean time to first token, and whether the tokens are the same (they must be)."""
    _check_requests(requests)
    runs = {on: run_batch(model, requests, n_slots, kv="paged", block_size=block_size, kv_blocks=kv_blocks,
                          prefix_caching=on) for on in (False, True)}
    row = {"requests": len(requests), "n_slots": n_slots, "block_size": block_size,
           "same_tokens": _same_tokens(runs[False], runs[True])}
    for on, run in runs.items():
        name = "cached" if on else "uncached"
        row[name] = {k: run.kv_stats[k] for k in ("prefill_tokens", "prefix_hit_tokens", "blocks_total")} | {
            "mean_first_token_seconds": statistics.fmean(c.first_token_seconds for c in run.completions),
            "seconds": run.seconds, "engine_steps": run.steps}
    row["prefill_tokens_cut"] = row["uncached"]["prefill_tokens"] / row["cached"]["prefill_tokens"]
    return row


def measure_capacity(model: Llama, requests: list[Request], contiguous_slots: int = 4, block_size: int = 16) -> dict:
    """Equal cache memory two ways: contiguous_slots slots each sized for the longest request, or the same
    positions as blocks of block_size (no cap on sequences). How many sequences each runs at once: the peak,
    and the mean over the steps that leave a request waiting (memory is the limit then; the ratio compares
    these, None where either never left a request waiting); in how many engine steps, with the same tokens."""
    _check_requests(requests)
    slot_len = max(cache_len(len(r.prompt_ids), r.max_new_tokens, model.config.max_seq_len) for r in requests)
    kv_blocks = contiguous_slots * slot_len // block_size
    contiguous = run_batch(model, requests, contiguous_slots, max_len=slot_len, compile=False)
    slots = min(len(requests), max_slots(kv_blocks))  # no cap on sequences: as many as may ever run
    paged = run_batch(model, requests, slots, kv="paged", block_size=block_size, kv_blocks=kv_blocks)
    row = {"requests": len(requests), "slot_len": slot_len, "positions": contiguous_slots * slot_len,
           "block_size": block_size, "kv_blocks": kv_blocks, "same_tokens": _same_tokens(contiguous, paged)}
    for name, run in (("contiguous", contiguous), ("paged", paged)):
        running = [sum(i >= 0 for i in step) for step in run.timeline]
        row[name] = {"peak_sequences": max(running), "mean_sequences_while_full": _mean_running_while_full(run),
                     "engine_steps": run.steps, "seconds": run.seconds, "tokens_per_second": run.tokens_per_second,
                     "peak_blocks_used": run.kv_stats["peak_blocks_used"],
                     "preemptions": run.kv_stats["preemptions"]}
    row["sequences_ratio"] = _ratio(row["paged"]["mean_sequences_while_full"],
                                    row["contiguous"]["mean_sequences_while_full"])
    return row


def _mean_running_while_full(run: BatchRun) -> float | None:
    """Sequences running per step over the steps that leave a request waiting; None if none does (all fit: JSON
    has no NaN)."""
    busy = [sum(i >= 0 for i in step) for step, waiting in zip(run.timeline, run.queued, strict=True) if waiting]
    return statistics.fmean(busy) if busy else None


def _ratio(paged: float | None, contiguous: float | None) -> float | None:
    """paged / contiguous sequences while full; None where either never filled (nothing to compare)."""
    return None if paged is None or not contiguous else paged / contiguous


def schedule_capacity(requests: list[Request], context: int, contiguous_slots: int = 4, block_size: int = 16,
                      rounding: int = 1) -> dict:
    """measure_capacity's counts without a model: requests without stop tokens make exactly their tokens, so
    the schedules (and so the sequences running at every step) do not depend on which tokens; the schedulers
    run with a made-up token. Fast enough to sweep many workloads (tests hold it equal to measure_capacity).
    rounding: the slots' length rounded up to it (ContinuousBatcher's own sizing: decoding.CACHE_ROUNDING)."""
    _check_requests(requests)
    slot_len = max(cache_len(len(r.prompt_ids), r.max_new_tokens, context, rounding=rounding) for r in requests)
    if any(r.stop_ids for r in requests):
        raise ValueError("schedule_capacity needs requests without stop tokens (their schedule depends on tokens)")

    def jobs() -> list[Job]:
        return [Job(Completion(id=i, prompt_ids=list(r.prompt_ids), arrival=r.arrival),
                    budget(len(r.prompt_ids), r.max_new_tokens, context), set()) for i, r in enumerate(requests)]

    ticks = iter(range(10**9))
    contiguous = Scheduler(jobs(), contiguous_slots, KVCacheManager(contiguous_slots, slot_len),
                           clock=lambda: float(next(ticks))).dry_run(0)
    kv_blocks = contiguous_slots * slot_len // block_size
    paged = Scheduler(jobs(), len(requests), KVCacheManager(kv_blocks, block_size),
                      clock=lambda: float(next(ticks))).dry_run(0)
    c, p = _mean_running_while_full(contiguous), _mean_running_while_full(paged)
    return {"slot_len": slot_len, "kv_blocks": kv_blocks, "contiguous_mean_sequences_while_full": c,
            "paged_mean_sequences_while_full": p, "sequences_ratio": _ratio(p, c), "contiguous_steps": contiguous.steps,
            "paged_steps": paged.steps, "preemptions": paged.kv_stats["preemptions"]}


def check_chunked_prefill(running: int, new_tokens: int, long_prompt: int, arrival: int,
                          chunks: Iterable[int | None], repeats: int) -> None:
    """measure_chunked_prefill's settings, each refused (ValueError naming it) before any run: a latency between
    tokens needs two tokens a request, and a chunk is None or >= 1 and given once."""
    for name, value, low in (("running", running, 1), ("new_tokens", new_tokens, 2), ("long_prompt", long_prompt, 1),
                             ("arrival", arrival, 0), ("repeats", repeats, 1)):
        check_int(value, name, low=low)
    chunks = list(chunks)
    if not chunks:
        raise ValueError("chunks must name at least one prefill chunk (None: the prompt whole), got none")
    for chunk in chunks:
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise ValueError(f"each prefill chunk must be None or an integer >= 1, got {chunk!r}")
    if len(set(chunks)) != len(chunks):
        raise ValueError(f"each prefill chunk must be given once, got {chunks}")


def measure_chunked_prefill(model: Llama, running: int = 4, new_tokens: int = 96, long_prompt: int = 400,
                            arrival: int = 16, chunks: Iterable[int | None] = (None, 64, 16), repeats: int = 3,
                            seed: int = 0) -> list[dict]:
    """`running` short requests decode while a long_prompt-token prompt arrives at engine step `arrival`:
    the running requests' inter-token latency (the seconds of each engine step in which they make a token
    after their first), p50, p99 and max, for each prefill chunk (None: the prompt whole), runs interleaved
    `repeats` times (medians of the runs' percentiles). Every argument is checked before any run."""
    chunks = tuple(chunks)  # read once: a generator is not drained by the check
    check_chunked_prefill(running, new_tokens, long_prompt, arrival, chunks, repeats)
    short = random_workload(running, model.config.vocab_size, (8, 16), (new_tokens, new_tokens), seed=seed)
    long = random_workload(1, model.config.vocab_size, (long_prompt, long_prompt), (4, 4), seed=seed + 1)[0]
    long.arrival = arrival
    requests = short + [long]
    samples: dict = {chunk: [] for chunk in chunks}
    tokens: dict = {}
    for _ in range(repeats):
        for chunk in chunks:  # interleaved: a slow moment of a shared machine falls on every setting alike
            run = run_batch(model, requests, running + 1, kv="paged", prefill_chunk=chunk)
            gaps = [run.step_seconds[s] for i in range(running)
                    for s in [s for s, row in enumerate(run.timeline) if i in row][1:]]
            samples[chunk].append((percentile(gaps, 50), percentile(gaps, 99), max(gaps),
                                   run.completions[-1].first_token_seconds))
            tokens.setdefault(chunk, [c.tokens for c in run.completions])
    reference = next(iter(tokens.values()))
    return [{"prefill_chunk": chunk, "itl_p50_ms": 1e3 * statistics.median(s[0] for s in rows),
             "itl_p99_ms": 1e3 * statistics.median(s[1] for s in rows),
             "itl_max_ms": 1e3 * statistics.median(s[2] for s in rows),
             "long_prompt_first_token_ms": 1e3 * statistics.median(s[3] for s in rows),
             "p99_runs_ms": [1e3 * s[1] for s in rows], "same_tokens": tokens[chunk] == reference}
            for chunk, rows in samples.items()]
