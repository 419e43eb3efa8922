"""`llmstep serve` under load, every model and setting in one command (issue 27; results/serve.md).

For each model (default: the shipped one, and SmolLM2-135M-Instruct when pulled), `llmstep serve` is started as
a child process on a free loopback port, and `llmstep.serve.loadgen` (the load generator of `llmstep bench-serve`)
sends it, after one warm-up request:

1. the load curve: random prompts at each --rate (Poisson arrivals; inf: all at once), on the default server
   (prefix caching on, chunked prefill of 256 tokens);
2. the shared system prompt: every request starts with the same --shared-prefix tokens, then 8-16 of its own, and
   asks for 8-16 new tokens, at --shared-rate, against four servers: prefix caching on/off x chunked prefill
   (--chunk tokens a step) on/off. The warm-up puts the system prompt in the cache first, as a server running for
   a while would have it.

Each server is stopped with SIGTERM before the next starts, so only one runs at a time. The record (one JSON)
starts with llmstep.lab.runinfo's header; each run names its server's options from /health. Seconds depend on the
machine and on everything else it runs: record on a quiet one.

    PYTHONPATH=. python scripts/bench_serve.py --out results/serve_cpu.json [--models target,smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmstep.cli.args import nonneg_int, parse_range, positive_int, seed
from llmstep.cli.serve import rates
from llmstep.core import registry
from llmstep.core.files import atomic_write_json, check_output_path
from llmstep.lab import runinfo
from llmstep.serve import loadgen

ROOT = Path(__file__).resolve().parents[1]
START_SECONDS = 300.0  # loading SmolLM2 from its GGUF on a busy 2-core machine: a bound, not a measurement
SMOL = "smollm2-135m-instruct"


class Server:
    """`python -m llmstep serve --port 0 FLAGS` in a child process; its URL read from the line it prints when ready."""

    def __init__(self, flags: list[str]):
        self.log = tempfile.TemporaryFile("w+")
        env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "llmstep", "serve", "--port", "0", *flags], cwd=ROOT,
                                     env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + START_SECONDS
        while True:  # "llmstep serve: ... at http://127.0.0.1:PORT/v1 ..."
            self.log.seek(0)
            said = self.log.read()
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", said)
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llmstep serve {' '.join(flags)} did not start: {said[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(60)
        self.log.close()


def measure(flags: list[str], rates: list[float], requests: int, prompt_len: tuple[int, int],
            new_tokens: tuple[int, int], seed: int, shared_prefix: int = 0) -> dict:
    """One warm-up request (another seed, the same system prompt), then loadgen.bench at each rate."""
    server = Server(flags)
    try:
        asyncio.run(loadgen.run_load(server.url, math.inf, 1, prompt_len, (4, 4), seed + 1,
                                     shared_prefix=shared_prefix))
        record = loadgen.bench(server.url, rates, requests, prompt_len, new_tokens, seed,
                               log=lambda m: print(f"  {m}", flush=True), shared_prefix=shared_prefix)
    finally:
        server.stop()
    for run in record["runs"]:  # JSON has no infinity
        run["rate_per_second"] = "inf" if math.isinf(run["rate_per_second"]) else run["rate_per_second"]
    return record | {"serve_flags": flags}


def one_rate(text: str) -> float:
    """--shared-rate: one rate per second > 0 (inf: all at once), as --rate's each."""
    values = rates(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one rate per second, got {text!r}")
    return values[0]


def model_names(text: str) -> list[str]:
    """--models: comma-separated names or paths, none empty."""
    names = text.split(",")
    if not all(n.strip() for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated model names or paths, none empty, got {text!r}")
    return names


def main(argv: list[str]) -> dict:
    """Every flag is checked while the arguments are parsed, and --out before any server starts."""
    p = argparse.ArgumentParser(prog="python scripts/bench_serve.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=model_names, default=None,
                   help=f"comma-separated names or paths llmstep.load takes (default: target, and {SMOL} if pulled)")
    p.add_argument("--threads", type=positive_int, default=None, help="the servers' CPU threads (default: torch's)")
    p.add_argument("--slots", type=positive_int, default=8)
    p.add_argument("--rate", type=rates, default=[1.0, 2.0, 4.0, 8.0, math.inf], help="the load curve's rates")
    p.add_argument("--requests", type=positive_int, default=24, help="requests per run")
    p.add_argument("--prompt-len", type=parse_range, default=(16, 64), help="LOW:HIGH tokens (N: N:N)")
    p.add_argument("--new-tokens", type=parse_range, default=(16, 64), help="LOW:HIGH tokens (N: N:N)")
    p.add_argument("--shared-prefix", type=nonneg_int, default=256, help="the system prompt's tokens (0: skip part 2)")
    p.add_argument("--shared-rate", type=one_rate, default=4.0, help="requests per second of part 2 (inf: at once)")
    p.add_argument("--chunk", type=positive_int, default=64, help="prompt tokens per step when chunked prefill is on")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    check_output_path(args.out, "--out")
    models = args.models or ["target"] + ([SMOL] if registry.present(SMOL) else [])
    record = runinfo.header("cpu", None, argv, runinfo.load_average(), prog="python scripts/bench_serve.py")
    record["models"] = {}
    for name in models:
        print(f"== {name}", flush=True)
        base = ["--model", name, "--slots", str(args.slots)]
        base += ["--threads", str(args.threads)] if args.threads else []
        runs = {"load_curve": measure(base, args.rate, args.requests, args.prompt_len, args.new_tokens, args.seed)}
        if args.shared_prefix:
            runs["shared_prefix"] = {}
            for caching in (True, False):
                for chunk in (args.chunk, None):
                    flags = base + ([] if caching else ["--no-prefix-caching"]) + (
                        ["--prefill-chunk", str(chunk)] if chunk else ["--no-chunked-prefill"])
                    key = f"prefix caching {'on' if caching else 'off'}, chunked prefill {chunk or 'off'}"
                    print(f" {key}", flush=True)
                    runs["shared_prefix"][key] = measure(flags, [args.shared_rate], args.requests, (8, 16), (8, 16),
                                                         args.seed, args.shared_prefix)
        record["models"][name] = runs
        record["load_average_1min_before_after"][1] = runinfo.load_average()
        atomic_write_json(args.out, record, default=str)  # what is done so far survives a later failure
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
