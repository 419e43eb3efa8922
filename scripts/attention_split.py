"""The CPU attention kernel's decode form timed alone with its K/V cache cold, its runs split in chunks or whole.

    PYTHONPATH=. python scripts/attention_split.py --slots 256 --seen 230 --threads 1 2
    PYTHONPATH=. python scripts/attention_split.py --slots 2048 --seen 2000 --splits 0:1 128:8 256:8 --out x.json

A decode step calls `attention_prefix` once a layer, after the weights of a whole layer have streamed past the
caches, so it finds its K/V cache cold. Here each call reads another of `--caches` caches (by default more bytes than
a last-level cache of 32 MiB holds), round after round, every split (`--splits CHUNK:MOST`, kernels/
cpu_attention.py's CHUNK and MOST_CHUNKS; 0:1 whole) timed in each round at each thread count: the median and best
of the rounds' mean call, the Python call's overhead in all. The outputs of every split are checked against the
whole kernel's first (bf16's rounding of float32 sums). The measurement behind cpu_attention.CHUNK; a
maintainer's tool (it calls the op by its ISA's name).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmstep.core.files import atomic_write_json, check_output_path
from llmstep.kernels import cpu_attention
from llmstep.lab import runinfo


def split(text: str) -> tuple[int, int]:
    chunk, _, most = text.partition(":")
    if not (chunk.isdigit() and most.isdigit() and int(most) >= 1):
        raise argparse.ArgumentTypeError(f"a split is CHUNK:MOST (0:1 whole, 128:8 llmstep's), got {text!r}")
    return int(chunk), int(most)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=256, help="the cache's slots (S)")
    p.add_argument("--seen", type=int, default=230, help="the slots each row sees (last + 1)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--rows", type=int, default=3, help="query heads a KV head (SmolLM2: 9 over 3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--caches", type=int, default=0, help="caches read in turn (0: enough for 80 MB)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, nargs="+", default=[2])
    p.add_argument("--splits", type=split, nargs="+",
                   default=[(0, 1), (cpu_attention.CHUNK, cpu_attention.MOST_CHUNKS)])
    p.add_argument("--out", help="also write the figures here (JSON, atomically)")
    a = p.parse_args(argv)
    for flag, value, least in (("--slots", a.slots, 1), ("--kv-heads", a.kv_heads, 1), ("--rows", a.rows, 1),
                               ("--head-dim", a.head_dim, 16), ("--caches", a.caches, 0), ("--rounds", a.rounds, 1),
                               *(("--threads", t, 1) for t in a.threads)):
        if value < least:
            p.error(f"{flag} must be at least {least}, got {value}")
    if not 1 <= a.seen <= a.slots:
        p.error(f"--seen must be 1..--slots ({a.slots}), got {a.seen}")
    if a.head_dim % 16:
        p.error(f"--head-dim must be a multiple of 16, got {a.head_dim}")
    if a.out:
        check_output_path(a.out)
    isa = cpu_attention.isa_here()
    if isa is None:
        raise SystemExit("this CPU runs no build of the attention kernel")
    cpu_attention.build(isa)
    prefix = getattr(torch.ops, cpu_attention.op_name(isa).partition("::")[0]).attention_prefix
    H, R, S, D = a.kv_heads, a.rows, a.slots, a.head_dim
    per_cache = 2 * H * S * D * 2  # K and V in bf16
    n_caches = a.caches or max(2, 80 * 2**20 // per_cache)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, R, D, generator=g).bfloat16()
    ks = [torch.randn(1, H, S, D, generator=g).bfloat16() for _ in range(n_caches)]
    vs = [torch.randn(1, H, S, D, generator=g).bfloat16() for _ in range(n_caches)]
    last, scale = torch.tensor([a.seen - 1]), D ** -0.5
    whole = prefix(q, ks[0], vs[0], last, scale, 0, 1).float()
    for chunk, most in a.splits:  # every split the same function, to bf16's rounding of float32 sums
        torch.testing.assert_close(prefix(q, ks[0], vs[0], last, scale, chunk, most).float(), whole, atol=1e-2,
                                   rtol=1e-2)
    times: dict[tuple[int, int, int], list[float]] = {}
    threads_before = torch.get_num_threads()
    try:
        for _ in range(a.rounds):
            for threads in a.threads:
                torch.set_num_threads(threads)
                for chunk, most in a.splits:
                    t0 = time.perf_counter()
                    for i in range(n_caches):
                        prefix(q, ks[i], vs[i], last, scale, chunk, most)
                    times.setdefault((threads, chunk, most), []).append((time.perf_counter() - t0) / n_caches * 1e6)
    finally:
        torch.set_num_threads(threads_before)
    rows = []
    print(f"attention_prefix ({isa}), bf16, {H} KV heads x {R} rows, head_dim {D}, {a.seen} of {S} slots seen, "
          f"{n_caches} caches of {per_cache / 1024:.0f} KB read in turn, {a.rounds} rounds")
    for (threads, chunk, most), us in times.items():
        med = statistics.median(us)
        print(f"  {threads} threads, chunk {chunk:4d} most {most:2d}: median {med:7.2f} us a call, best {min(us):7.2f}")
        rows.append({"threads": threads, "chunk": chunk, "most": most, "median_us": med, "best_us": min(us),
                     "rounds_us": us})
    if a.out:
        atomic_write_json(a.out, {"command": runinfo.command_line(argv, "python scripts/attention_split.py"),
                                  "machine": runinfo.describe("cpu") | {"cpu_flags": runinfo.cpu_flags()},
                                  "versions": runinfo.versions(), "isa": isa, "kv_heads": H, "rows": R, "slots": S,
                                  "seen": a.seen, "head_dim": D, "caches": n_caches, "calls": rows})


if __name__ == "__main__":
    main()
