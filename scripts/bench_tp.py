"""The tensor-parallel CPU record (results/tp.json, results/tp.md): per-token decode time and all-reduce share at
1, 2 and 4 processes (torchrun, gloo, one thread each: a rank is one core), for two random-weight shapes, with
the decode-time model's prediction beside each (llmstep.lab.bench_tp.predict_cpu), rounds interleaved. The record
starts with llmstep.lab.runinfo's header (the command, machine, versions, load average before and after).

    PYTHONPATH=. python scripts/bench_tp.py --rounds 2 --out results/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from llmstep.cli.args import decode_tokens, parse_ints, positive_int
from llmstep.core.files import atomic_write_json, check_output_path
from llmstep.lab import bench_tp, runinfo

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # name -> llmstep bench arguments (random weights); both split over 1, 2 and 4 ranks
    "target-8-heads": ["--model", "target", "--set", "n_heads=8", "head_dim=48"],  # 12.6M params, 50 MB float32
    "llama-3.2-1b-4-layers": ["--preset", "llama-3.2-1b", "--set", "n_layers=4", "vocab_size=32000",
                              "tie_embeddings=false"],  # 374M params, 1.5 GB float32
}


def run(shape: str, n: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "llmstep",
               "bench", *SHAPES[shape], "--dtype", "float32", "--threads", "1", "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--json", str(out)]
        env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        print(done.stdout.strip().splitlines()[-1], flush=True)
        return json.loads(out.read_text()) | {"shape": shape}


def ranks(text: str) -> list[int]:
    """--ranks: process counts, each >= 1 and given once, 1 among them (every prediction scales the 1-rank time)."""
    values = parse_ints(text)
    if 1 not in values:
        raise argparse.ArgumentTypeError(f"must include 1 (the 1-rank time every prediction starts from), got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    """Every flag is checked, and --out, before the first torchrun starts."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python scripts/bench_tp.py", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--ranks", type=ranks, default=[1, 2, 4], help="process counts, comma-separated, 1 among them")
    p.add_argument("--prompt-len", type=positive_int, default=16)
    p.add_argument("--new-tokens", type=decode_tokens, default=32)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--out", default="results/tp.json")
    args = p.parse_args(argv)
    check_output_path(args.out, "--out")
    load_before = runinfo.load_average()
    ns = args.ranks
    cores = os.cpu_count()
    runs = []
    for r in range(args.rounds):  # interleaved: every shape and N once per round
        for shape in SHAPES:
            for n in ns:
                runs.append(run(shape, n, args) | {"round": r})
    rows = []
    for shape in SHAPES:
        one = [x for x in runs if x["shape"] == shape and x["world_size"] == 1]
        t1 = runinfo.median([x["per_token_seconds"]["median"] for x in one])
        for n in ns:
            mine = [x for x in runs if x["shape"] == shape and x["world_size"] == n]
            per_token = [x["per_token_seconds"]["median"] for x in mine]
            alone = runinfo.median([x["all_reduce_seconds_alone"] for x in mine])
            predicted = bench_tp.predict_cpu({"per_token_seconds": {"median": t1},
                                              "all_reduces_per_token": mine[0]["all_reduces_per_token"]},
                                             n, alone, cores)
            rows.append({"shape": shape, "ranks": n, "ms_per_token": runinfo.median(per_token) * 1e3,
                         "ms_per_token_runs": [t * 1e3 for t in per_token], "spread": runinfo.spread(per_token),
                         "all_reduce_share": runinfo.median([x["all_reduce_share"]["median"] for x in mine]),
                         "all_reduce_us_alone": alone * 1e6, "predicted_ms_per_token": predicted * 1e3,
                         "weight_mb_per_rank": mine[0]["weight_bytes_per_rank"] / 1e6,
                         "load_average_before_after": [x["load_average_1min_before_after"] for x in mine]})
            print(f"{shape:<24} N={n}  measured {rows[-1]['ms_per_token']:8.2f} ms/token  "
                  f"predicted {rows[-1]['predicted_ms_per_token']:8.2f}  all-reduce share "
                  f"{rows[-1]['all_reduce_share']:.0%}", flush=True)
    record = runinfo.header("cpu", torch.float32, argv, load_before, prog="python scripts/bench_tp.py") | {
        "cores": cores, "rows": rows, "runs": runs, "gpu_model": bench_tp.prediction_table()}
    atomic_write_json(args.out, record, default=str)
    return record


if __name__ == "__main__":
    main()
