"""The tensor-parallel CPU record (results/tp.json, results/tp.md): per-token decode time and all-reduce share at
1, 2 and 4 processes (torchrun, gloo, one thread each: a rank is one core), for two random-weight shapes, with
the decode-time model's prediction beside each (llmstep.lab.bench_tp.predict_cpu), rounds interleaved.

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

from llmstep.core.files import atomic_write_json
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/tp.json")
    args = p.parse_args()
    ns = [int(n) for n in args.ranks.split(",")]
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
    atomic_write_json(args.out, {"cores": cores, "rows": rows, "runs": runs,
                                 "gpu_model": bench_tp.prediction_table()}, default=str)


if __name__ == "__main__":
    main()
