"""How often bf16's rounding alone moves a random model's greedy token (results/gpu/README.md, on the first H200
run's compiled-vs-eager share of 0.83).

    OMP_NUM_THREADS=2 python scripts/random_weights_agreement.py --out results/gpu/cpu_random_agreement_s24.json

A random bf16 model (N(0, 0.02) weights, as the GPU probe's) continues a 128-token prompt greedily for 256 tokens
with FastDecoder, eager and then compiled; each run's tokens are read teacher-forced against the model's own
full-sequence forward (`agreement`) and both against its float32 twin (`llmstep.lab.probe`): the probe's measures,
on a CPU, at a width a CPU compiles in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llmstep.core.config import LlamaConfig
from llmstep.core.files import atomic_write
from llmstep.engines.fast import FastDecoder
from llmstep.lab import runinfo
from llmstep.lab.hardware import random_model
from llmstep.lab.probe import float32_twin, teacher_forced_agreement


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--out", default=None, help="a JSON record (default: print only)")
    args = ap.parse_args(argv)
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=args.dim // 256,
                      hidden_dim=args.dim * 7 // 2, vocab_size=args.vocab, max_seq_len=512)
    model = random_model(cfg, "cpu", torch.bfloat16)
    reference = float32_twin(model)
    prompt, rows = list(range(1, 129)), []
    for compiled in (False, True):
        start = time.perf_counter()
        decoder = FastDecoder(model, max_len=len(prompt) + 256, compile=compiled)
        decoder.warmup()
        tokens = list(decoder.generate(prompt, 256, temperature=0.0, stop_ids=()).tokens)
        with torch.no_grad():
            row = {"compiled": compiled, **teacher_forced_agreement(model, prompt, tokens, reference)}
        rows.append(row | {"seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        record = {"command": "python scripts/random_weights_agreement.py " + " ".join(argv or []),
                  "config": {"dim": args.dim, "layers": args.layers, "vocab": args.vocab},
                  "machine": runinfo.machine(torch.device("cpu"), torch.bfloat16), "rows": rows}
        with atomic_write(args.out) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
