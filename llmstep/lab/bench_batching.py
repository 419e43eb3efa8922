"""Continuous batching, measured: a random workload served both ways, and a decode step timed at each batch size.

The command is `llmstep batch` (llmstep.cli.bench).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from functools import partial
from numbers import Integral

import torch

from ..core.cost import model_step_cost
from ..core.model import Llama
from ..engines.batching import POLICIES, BatchRunner, ContinuousBatcher, Request
from . import runinfo

__all__ = ["random_workload", "serve_both_ways", "measure_batch_scaling", "run_batch_bench"]


MAX_REQUESTS = 100_000  # a workload held as Python lists: 1e8 requests of ~40 ids took 5 GB before any work


def random_workload(n_requests: int, vocab_size: int, prompt_len: tuple[int, int] = (16, 64),
                    new_tokens: tuple[int, int] = (8, 128), rate: float | None = None, seed: int = 0,
                    temperature: float = 0.0) -> list[Request]:
    """n_requests with prompt lengths and output lengths drawn uniformly from the given (low, high) ranges,
    random prompt ids, no stop tokens (each writes exactly its new tokens), arriving as a Poisson process
    of `rate` requests per engine step (None: all at step 0). Seeded: the same seed, the same workload."""
    if not isinstance(n_requests, Integral) or isinstance(n_requests, bool) or not 0 <= n_requests <= MAX_REQUESTS:
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
        requests.append(Request(prompt, between(*new_tokens), temperature=temperature, seed=seed + i,
                                arrival=int(clock)))
    return requests


def serve_both_ways(model: Llama, requests: list[Request], slots: Iterable[int] = (1, 4, 8),
                    compile: bool | None = None) -> Iterator[dict]:
    """Serve `requests` with each number of slots under every policy (one slot: continuous only, the policies
    coincide); yield each run's summary as it ends, with its completions and whether its tokens are the first
    run's (they must be: batching changes when a request runs, not what it writes)."""
    # Room for every request, up to the model's context (a longer request stops there, as generate does).
    max_len = min(max(len(r.prompt_ids) + r.max_new_tokens for r in requests), model.config.max_seq_len)
    reference = None
    for n_slots in slots:
        batcher = ContinuousBatcher(model, n_slots, max_len, compile=compile)
        batcher.run(requests[:1], "continuous")  # warm up (and compile) before timing
        for policy in POLICIES if n_slots > 1 else POLICIES[:1]:
            run = batcher.run(requests, policy)
            tokens = [c.tokens for c in run.completions]
            reference = tokens if reference is None else reference
            yield run.summary() | {"same_tokens_as_first_run": tokens == reference,
                                   "completions": [asdict(c) for c in run.completions]}


@torch.inference_mode()
def check_context(context: int, config) -> None:
    """The decode-step timing's context: room for it and the step's own token in the model's context."""
    if not isinstance(context, Integral) or isinstance(context, bool) or not 0 <= context < config.max_seq_len:
        raise ValueError(f"context must be an integer in 0..{config.max_seq_len - 1} (the model's context less "
                         f"the step's own token), got {context!r}")


def measure_batch_scaling(model: Llama, batch_sizes: Iterable[int] = (1, 2, 4, 8, 16), context: int = 64,
                          repeats: int = 10, compile: bool | None = False) -> list[dict]:
    """Time one decode step at each batch size, every row `context` tokens in: the weights are read once
    per step whatever the batch, so tokens/s grows with the batch until the step stops being memory-bound.
    Bytes are the model's as it holds them (float or quantized, llmstep.core.cost.model_step_cost); the step
    time is the median of `repeats` after one untimed step."""
    check_context(context, model.config)
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
                    context: int, compile: bool | None = None, argv: list[str] | None = None,
                    on_run: Callable[[dict, dict], None] | None = None,
                    on_row: Callable[[dict, dict], None] | None = None) -> dict:
    """The batch benchmark's record: a random workload (`workload`: random_workload's arguments by name)
    served both ways with each number of slots, then a decode step timed at each batch size, under the one
    run-metadata header (llmstep.lab.runinfo.header). on_run(record, run) and on_row(record, row), if given,
    are called as each run and each row is added (to print it, to write the record so far)."""
    check_context(context, model.config)  # before the workload runs, not after it
    requests = random_workload(vocab_size=model.config.vocab_size, **workload)
    load_before = runinfo.load_average()
    record = runinfo.header(model.device, model.dtype, argv, load_before) | {
        "model": model_name, "workload": {("requests" if k == "n_requests" else k): v for k, v in workload.items()},
        "runs": [], "batch_scaling": [], "finished": False}
    for run in serve_both_ways(model, requests, slots, compile=compile):
        record["runs"].append(run)
        if on_run is not None:
            on_run(record, run)
    for row in measure_batch_scaling(model, batch_sizes, context, compile=compile):
        record["batch_scaling"].append(row)
        if on_row is not None:
            on_row(record, row)
    record["load_average_1min_before_after"] = [load_before, runinfo.load_average()]
    record["finished"] = True
    return record
