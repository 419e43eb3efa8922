"""The paged KV cache's claims, measured (issue 15; results/paged.md): prefix caching on a shared 256-token
system prompt, sequences served at equal cache memory (paged vs contiguous slots sized for the longest
request), and chunked prefill's effect on the running sequences' inter-token latency when a long prompt
arrives. Token counts and engine steps are deterministic; seconds depend on the machine and its load.

    PYTHONPATH=. python scripts/bench_paged.py --out results/paged_cpu.json [--model target] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from llmstep.cli.args import int_between, positive_int
from llmstep.core.checkpoint import load_model
from llmstep.core.files import atomic_write_json, check_output_path
from llmstep.engines.decoding import CACHE_ROUNDING
from llmstep.lab import runinfo
from llmstep.lab.bench_batching import (
    MAX_REQUESTS,
    check_chunked_prefill,
    measure_capacity,
    measure_chunked_prefill,
    measure_prefix_caching,
    random_workload,
    schedule_capacity,
    shared_prefix_workload,
)

PARTS = ("prefix", "capacity", "sweep", "chunked")
CHUNKED = {"running": 4, "new_tokens": 48, "long_prompt": 384, "arrival": 8, "chunks": (None, 64, 16)}


def parts_of(text: str) -> list[str]:
    """--parts: some of PARTS, comma-separated, each once."""
    parts = text.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(map(repr, unknown))}: "
                                         f"comma-separated, of {','.join(PARTS)}")
    if len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"a part is given twice in {text!r}")
    return parts


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="python scripts/bench_paged.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--requests", type=int_between(1, MAX_REQUESTS), default=16,
                   help="requests of the prefix and capacity workloads")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of the chunked-prefill timing")
    p.add_argument("--parts", type=parts_of, default=list(PARTS), help="which measurements, comma-separated, of "
                   + ",".join(PARTS))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    check_chunked_prefill(repeats=args.repeats, **CHUNKED)
    check_output_path(args.out, "--out")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    vocab = model.config.vocab_size
    record = runinfo.header(model.device, model.dtype, argv, runinfo.load_average(),
                            prog="python scripts/bench_paged.py") | {"model": args.model or "target"}

    def save(key: str, value) -> None:
        record[key] = value
        record["load_average_1min_before_after"][1] = runinfo.load_average()
        atomic_write_json(args.out, record, default=str)
        print(key, value, flush=True)

    parts = set(args.parts)
    if "prefix" in parts:  # 1. A shared 256-token system prompt (16 full blocks), about a request per engine step.
        requests = shared_prefix_workload(args.requests, vocab, system_len=256, user_len=(8, 32), new_tokens=(4, 16))
        save("prefix_caching", measure_prefix_caching(model, requests, n_slots=8, block_size=16))
    if "capacity" in parts:  # 2. Equal memory: contiguous slots sized for the longest request, or the same
        # positions in blocks of 16, the model run for seed 1. Then ("sweep") the schedules alone for seeds 0-19: slots
        # of the longest request exactly (2 and 4 of them), and 4 slots as ContinuousBatcher sizes them (256 positions).
        requests = random_workload(args.requests, vocab, prompt_len=(8, 32), new_tokens=(4, 160), seed=1)
        save("capacity", measure_capacity(model, requests, contiguous_slots=2, block_size=16))
    if "sweep" in parts:
        sweep = {}
        for slots, rounding in ((2, 1), (4, 1), (4, CACHE_ROUNDING)):
            rows = [schedule_capacity(random_workload(args.requests, vocab, (8, 32), (4, 160), seed=s),
                                      model.config.max_seq_len, slots, 16, rounding) for s in range(20)]
            ratios = sorted(r["sequences_ratio"] for r in rows if r["sequences_ratio"] is not None)
            sweep[f"{slots}_slots_rounded_to_{rounding}"] = {  # no ratio (all fit at once every time): null
                "ratios": ratios, "workloads_where_memory_limits_paged": len(ratios),
                "workloads_where_all_fit_at_once": len(rows) - len(ratios),
                "median": statistics.median(ratios) if ratios else None, "min": ratios[0] if ratios else None,
                "max": ratios[-1] if ratios else None, "at_least_2x": sum(r >= 2 for r in ratios)}
        save("capacity_schedule_sweep", sweep)
    if "chunked" in parts:  # 3. Four sequences decoding when a 384-token prompt arrives: whole, or in chunks.
        save("chunked_prefill", measure_chunked_prefill(model, repeats=args.repeats, **CHUNKED))
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
