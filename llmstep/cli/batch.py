"""`llmstep batch`: static vs continuous batching on a random workload, and a decode step at each batch size
(llmstep.lab.bench_batching)."""

from __future__ import annotations

import argparse

import torch

from ..core.files import atomic_write_json, check_output_path
from ..lab import bench_batching, runinfo
from .args import (
    add_attention_arg,
    check_window,
    int_between,
    nonneg_int,
    parse_ints,
    parse_range,
    positive_float,
    positive_int,
    seed,
    temperature,
    threads,
)


def add_commands(sub) -> None:
    b = sub.add_parser("batch", help="static vs continuous batching on a random workload",
                       description="Serve a random workload with static and continuous batching, side by side, "
                                   "and time a decode step at each batch size.")
    b.add_argument("--model", default=None, help="checkpoint directory, or target/draft (default: target)")
    b.add_argument("--device", default=None)
    b.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)")
    b.add_argument("--threads", type=threads, default=None, help="CPU threads (default: torch's)")
    b.add_argument("--slots", type=parse_ints, default=[1, 4, 8], help="batch slots to try, e.g. 1,4,8")
    b.add_argument("--requests", type=int_between(1, bench_batching.MAX_REQUESTS), default=32)
    b.add_argument("--prompt-len", type=parse_range, default=(16, 64), help="LOW:HIGH tokens")
    b.add_argument("--new-tokens", type=parse_range, default=(8, 128), help="LOW:HIGH tokens")
    b.add_argument("--rate", type=positive_float, default=None, help="arrivals per engine step (default: all at once)")
    b.add_argument("--temperature", type=temperature, default=0.0)
    b.add_argument("--batch-sizes", type=parse_ints, default=[1, 2, 4, 8, 16, 32],
                   help="batch sizes for the decode-step timing")
    b.add_argument("--context", type=nonneg_int, default=64, help="context of the decode-step timing")
    b.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on CUDA only; the paged step runs eager)")
    b.add_argument("--kv", choices=["contiguous", "paged"], default="contiguous",
                   help="KV cache layout: a max_len row per slot, or a pool of blocks")
    b.add_argument("--block-size", type=positive_int, default=None, help="--kv paged: positions per block (16)")
    b.add_argument("--kv-blocks", type=positive_int, default=None,
                   help="--kv paged: blocks in the pool (default: the memory of the contiguous slots)")
    b.add_argument("--prefix-caching", action="store_true", help="--kv paged: share and keep full blocks of a prefix")
    b.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="--kv paged: most prompt tokens per engine step (default: whole prompts)")
    b.add_argument("--seed", type=seed, default=0)
    b.add_argument("--json", default=None, help="write the whole record here")
    add_attention_arg(b)
    b.set_defaults(run=run_batch)


def _write_json(path: str | None, record: dict) -> None:
    """The record as JSON, atomically (a run interrupted mid-write keeps the last complete record)."""
    if path:
        atomic_write_json(path, record, default=str)


def check_batch(args, workload: dict) -> None:
    """What the runs would refuse once the model is loaded (or, --batch-sizes, once the workload has run), refused
    from its config alone, no weight read: a prompt or the step's context past the model's context, a block longer
    than it, a --kv-blocks pool that one of the workload's requests does not fit, and the model with the largest
    KV cache any run allocates (the most --slots, the pool, the largest of --batch-sizes) past the free memory."""
    from ..core.checkpoint import read_config, read_quant_config, resolve_model_path
    from ..core.cost import check_fits, checkpoint_bytes, kv_cache_bytes
    from ..core.device import resolve_device
    from ..core.loader import load_dtype
    from ..core.paged_kv import BOOKKEEPING_BYTES_PER_BLOCK, check_block_size
    from ..engines.batching import check_slots, pool_blocks
    from ..engines.decoding import budget
    from ..engines.kv_manager import check_fits as check_pool_fits
    from ..engines.request import check_arrival

    path = resolve_model_path(args.model)
    config = read_config(path)
    context = config.max_seq_len
    # each flag on its own, so the message names the one at fault: a prompt may fill the context (its one new token
    # ends it); the step timing needs its context and one token
    check_window(args.prompt_len[1], f"prompts of --prompt-len {args.prompt_len[1]}", config=config)
    check_window(args.context + 1, f"--context {args.context} and the step's token", config=config)
    device = resolve_device(args.device)
    dtype = load_dtype(config, device, args.dtype)
    requests = bench_batching.random_workload(vocab_size=config.vocab_size, **workload)  # the runs' own (seeded)
    for i, r in enumerate(requests):  # a rate so low the arrivals spread past what a run records
        try:
            check_arrival(r.arrival)
        except ValueError as e:
            raise ValueError(f"--rate {args.rate:g}: request {i}: {e}; raise --rate (arrivals per engine step) or "
                             "lower --requests") from None
    slots = max(args.slots)
    # measure_batch_scaling's runner: the largest batch, each row its context and the step's token
    caches = [(kv_cache_bytes(config, max(args.batch_sizes), args.context + 1, dtype),
               f"--batch-sizes {max(args.batch_sizes)} x {args.context + 1} positions")]
    lengths = [(len(r.prompt_ids), r.max_new_tokens) for r in requests]
    if args.kv == "paged":
        block_size = args.block_size or 16
        check_block_size(block_size, context, "--block-size")
        if args.kv_blocks is not None:
            for i, (prompt, new) in enumerate(lengths):
                try:
                    check_pool_fits(prompt, budget(prompt, new, context).tokens, args.kv_blocks, block_size, index=i)
                except ValueError as e:
                    raise ValueError(f"--kv-blocks {args.kv_blocks}: {e} (--prompt-len, --new-tokens and --seed "
                                     "draw the requests)") from None
        check_slots(slots, args.kv_blocks, "--slots")
        blocks = pool_blocks(lengths, slots, block_size, context, args.kv_blocks)  # the largest pool (most slots)
        caches.append((kv_cache_bytes(config, blocks, block_size, dtype) + blocks * BOOKKEEPING_BYTES_PER_BLOCK,
                       f"a paged pool of {blocks:,} blocks x {block_size} positions"))
    else:
        longest = bench_batching.slot_len(lengths, context)
        caches.append((kv_cache_bytes(config, slots, longest, dtype), f"--slots {slots} x {longest} positions"))
    weights = checkpoint_bytes(config, dtype, read_quant_config(path))
    cache, what = max(caches)
    check_fits(weights + cache, device, f"the model ({weights / 1e9:,.2f} GB) with its largest KV cache ({what}, "
               f"{str(dtype).removeprefix('torch.')})")


def run_batch(args, argv) -> dict:
    from ..core.checkpoint import load_model

    if args.json is not None:  # "" too: refused as the folder it names, not skipped
        check_output_path(args.json, "--json")  # before any work: a late failure would lose the run
    kv = {"kv": args.kv} | {k: v for k, v in (("block_size", args.block_size), ("kv_blocks", args.kv_blocks),
                                                ("prefix_caching", args.prefix_caching or None),
                                                ("prefill_chunk", args.prefill_chunk)) if v is not None}
    if args.kv == "contiguous" and len(kv) > 1:  # before the model loads
        raise ValueError(f"--{', --'.join(k.replace('_', '-') for k in kv if k != 'kv')} set the paged KV cache: "
                         "add --kv paged")
    if args.kv == "paged" and args.compile:
        raise ValueError("--compile: the paged step runs eager (its shapes change every step)")
    workload = {"n_requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "rate": args.rate, "seed": args.seed, "temperature": args.temperature}
    check_batch(args, workload)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    machine = runinfo.machine(model.device, model.dtype)
    print(f"llmstep batch: {args.model or 'target'} on {machine.get('device_name', machine['cpu'])} "
          f"{machine['dtype']}, {args.requests} requests, {args.kv} KV cache", flush=True)
    print(f"{'policy':<11} {'slots':>5} {'steps':>6} {'busy':>6} {'tok/s':>9} {'latency':>9} {'first tok':>10}")

    def on_run(record: dict, run: dict) -> None:
        _write_json(args.json, record)  # after every run: an interrupt keeps the runs that finished
        print(f"{run['policy']:<11} {run['slots']:>5} {run['engine_steps']:>6} {run['slot_utilisation']:>6.0%} "
              f"{run['tokens_per_second']:>9,.1f} {run['mean_latency_seconds']:>8.2f}s "
              f"{run['mean_first_token_seconds']:>9.2f}s", flush=True)
        if args.kv == "paged":
            print(f"{'':<11} kv: peak {run['kv_peak_blocks_used']}/{run['kv_blocks_total']} blocks of "
                  f"{run['kv_block_size']}, {run['kv_prefill_tokens']:,} prompt tokens computed, "
                  f"{run['kv_prefix_hit_tokens']:,} found cached, {run['kv_preemptions']} preemptions", flush=True)

    def on_row(record: dict, row: dict) -> None:
        if len(record["batch_scaling"]) == 1:
            print(f"\none decode step, {args.context} tokens of context in every row:")
            print(f"{'batch':>5} {'step ms':>8} {'tok/s':>9} {'MB/token':>9} {'FLOP/byte':>10}")
        print(f"{row['batch']:>5} {row['step_ms']:>8.2f} {row['tokens_per_second']:>9,.1f} "
              f"{row['bytes_per_token'] / 1e6:>9.2f} {row['flops_per_byte']:>10.1f}", flush=True)

    record = bench_batching.run_batch_bench(model, str(args.model or "target"), workload, args.slots,
                                            args.batch_sizes, args.context, compile=args.compile, argv=argv,
                                            kv=kv, on_run=on_run, on_row=on_row)
    _write_json(args.json, record)
    return record
