"""Continuous batching, measured: a random workload served both ways, and a decode step timed at each batch size.

The command is `llmstep batch` (llmstep.cli.bench).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from numbers import Integral

import torch

from ..core.device import synchronize
from ..core.model import Llama
from ..engines.batching import POLICIES, BatchRunner, ContinuousBatcher, Request

__all__ = ["random_workload", "serve_both_ways", "measure_batch_scaling"]


def random_workload(n_requests: int, vocab_size: int, prompt_len: tuple[int, int] = (16, 64),
                    new_tokens: tuple[int, int] = (8, 128), rate: float | None = None, seed: int = 0,
                    temperature: float = 0.0) -> list[Request]:
    """n_requests with prompt lengths and output lengths drawn uniformly from the given (low, high) ranges,
    random prompt ids, no stop tokens (each writes exactly its new tokens), arriving as a Poisson process
    of `rate` requests per engine step (None: all at step 0). Seeded: the same seed, the same workload."""
    if not isinstance(n_requests, Integral) or n_requests < 0:
        raise ValueError(f"n_requests must be an integer >= 0, got {n_requests!r}")
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
def measure_batch_scaling(model: Llama, batch_sizes: Iterable[int] = (1, 2, 4, 8, 16), context: int = 64,
                          repeats: int = 10, compile: bool | None = False) -> list[dict]:
    """Time one decode step at each batch size, every row `context` tokens in: the weights are read once
    per step whatever the batch, so tokens/s grows with the batch until the step stops being memory-bound."""
    from ..core.cost import decode_step_cost

    rows = []
    for batch in batch_sizes:
        runner = BatchRunner(model, batch, max_len=context + 1, compile=compile)
        runner.warmup()  # compile (on CUDA, record the graph) before timing
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=runner.device)
        positions = torch.full((batch, 1), context, dtype=torch.long, device=runner.device)
        times = []
        for _ in range(repeats):
            synchronize(runner.device)
            start = time.perf_counter()
            runner.step(tokens, positions)
            synchronize(runner.device)
            times.append(time.perf_counter() - start)
        cost = decode_step_cost(model.config, context, model.dtype, batch=batch)
        seconds = statistics.median(times)
        rows.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_second": batch / seconds,
                     "bytes_per_step": cost.bytes, "bytes_per_token": cost.bytes / batch,
                     "flops_per_byte": cost.arithmetic_intensity,
                     "gb_per_second": cost.bytes / seconds / 1e9, "tflops": cost.flops / seconds / 1e12})
    return rows
