"""Continuous batching, measured: a random workload served both ways, and a decode step timed at each batch size."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from numbers import Integral

import torch

from ..cli import exit_on_bad_input
from ..core.device import synchronize
from ..core.model import Llama
from ..engines.batching import POLICIES, ContinuousBatcher, Request

__all__ = ["random_workload", "measure_batch_scaling"]


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


@torch.inference_mode()
def measure_batch_scaling(model: Llama, batch_sizes: Iterable[int] = (1, 2, 4, 8, 16), context: int = 64,
                          repeats: int = 10, compile: bool | None = False) -> list[dict]:
    """Time one decode step at each batch size, every row `context` tokens in: the weights are read once
    per step whatever the batch, so tokens/s grows with the batch until the step stops being memory-bound."""
    from ..core.cost import decode_step_cost

    rows = []
    for batch in batch_sizes:
        batcher = ContinuousBatcher(model, batch, max_len=context + 1, compile=compile)
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=batcher.device)
        positions = torch.full((batch, 1), context, dtype=torch.long, device=batcher.device)
        for _ in range(3):  # warm up (and compile)
            batcher._step(tokens, positions)
        times = []
        for _ in range(repeats):
            synchronize(batcher.device)
            start = time.perf_counter()
            batcher._step(tokens, positions)
            synchronize(batcher.device)
            times.append(time.perf_counter() - start)
        cost = decode_step_cost(model.config, context, model.dtype, batch=batch)
        seconds = statistics.median(times)
        rows.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_second": batch / seconds,
                     "bytes_per_step": cost.bytes, "bytes_per_token": cost.bytes / batch,
                     "flops_per_byte": cost.arithmetic_intensity,
                     "gb_per_second": cost.bytes / seconds / 1e9, "tflops": cost.flops / seconds / 1e12})
    return rows


def _parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None


def _parse_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmstep batch", description="Serve a random workload with static and "
                                "continuous batching, side by side, and time a decode step at each batch size.")
    p.add_argument("--model", default=None, help="checkpoint directory, or target/draft (default: target)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--slots", type=_parse_ints, default=[1, 4, 8], help="batch slots to try, e.g. 1,4,8")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=_parse_range, default=(16, 64), help="LOW:HIGH tokens")
    p.add_argument("--new-tokens", type=_parse_range, default=(8, 128), help="LOW:HIGH tokens")
    p.add_argument("--rate", type=float, default=None, help="arrivals per engine step (default: all at once)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-sizes", type=_parse_ints, default=[1, 2, 4, 8, 16, 32],
                   help="batch sizes for the decode-step timing")
    p.add_argument("--context", type=int, default=64, help="context of the decode-step timing")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the whole record here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    return exit_on_bad_input("batch", _main, args, sys.argv[1:] if argv is None else list(argv))


def _main(args, argv: list[str]) -> dict:
    import platform
    from pathlib import Path

    from .. import __version__
    from ..core.checkpoint import load_model
    from ..lab.hardware import describe

    if args.requests < 1 or (args.threads is not None and args.threads < 1):
        raise ValueError(f"--requests and --threads must be >= 1, got {args.requests} and {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    requests = random_workload(args.requests, model.config.vocab_size, args.prompt_len, args.new_tokens, args.rate,
                               args.seed, args.temperature)
    # Room for every request, up to the model's context (a longer request stops there, as generate does).
    max_len = min(max(len(r.prompt_ids) + r.max_new_tokens for r in requests), model.config.max_seq_len)
    record = {"command": "llmstep batch " + " ".join(argv),
              "model": str(args.model or "target"), "device": describe(model.device)["name"],
              "dtype": str(model.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "versions": {"llmstep": __version__, "torch": torch.__version__, "python": platform.python_version()},
              "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "rate": args.rate, "temperature": args.temperature, "seed": args.seed},
              "runs": [], "batch_scaling": []}
    print(f"llmstep batch: {record['model']} on {record['device']} {record['dtype']}, {args.requests} requests",
          flush=True)
    print(f"{'policy':<11} {'slots':>5} {'steps':>6} {'busy':>6} {'tok/s':>9} {'latency':>9} {'first tok':>10}")
    reference = None
    for n_slots in args.slots:
        batcher = ContinuousBatcher(model, n_slots, max_len, compile=args.compile)
        batcher.run(requests[:1], "continuous")  # warm up (and compile) before timing
        for policy in POLICIES if n_slots > 1 else POLICIES[:1]:
            run = batcher.run(requests, policy)
            tokens = [c.tokens for c in run.completions]
            reference = tokens if reference is None else reference
            summary = run.summary() | {"same_tokens_as_first_run": tokens == reference,
                                       "completions": [asdict(c) for c in run.completions]}
            record["runs"].append(summary)
            print(f"{policy:<11} {n_slots:>5} {run.steps:>6} {run.slot_utilisation:>6.0%} "
                  f"{run.tokens_per_second:>9,.1f} {summary['mean_latency_seconds']:>8.2f}s "
                  f"{summary['mean_first_token_seconds']:>9.2f}s", flush=True)
    print(f"\none decode step, {args.context} tokens of context in every row:")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>9} {'MB/token':>9} {'FLOP/byte':>10}")
    for row in measure_batch_scaling(model, args.batch_sizes, args.context, compile=args.compile):
        record["batch_scaling"].append(row)
        print(f"{row['batch']:>5} {row['step_ms']:>8.2f} {row['tokens_per_second']:>9,.1f} "
              f"{row['bytes_per_token'] / 1e6:>9.2f} {row['flops_per_byte']:>10.1f}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


if __name__ == "__main__":
    main()
