"""Where a compiled CPU decode step's time goes, sampled by Linux perf instead of torch.profiler.

    PYTHONPATH=. python scripts/perf_split.py --model smollm2-135m-instruct --dtype bfloat16 --seconds 15
    PYTHONPATH=. python scripts/perf_split.py --quantize int4-g64+lm_head-int8 --by-symbol

`llmstep profile --kernel-profile` times each of inductor's kernels by a record around it, and those records (and the
kernel context the C++ wrapper builds for each under that flag) inflate the time between kernels. This script runs
`FastDecoder`'s compiled step of greedy decoding unprofiled, in a loop, while `perf record` samples the process, and
splits each thread's samples: the one-row matmuls (the bf16 dot kernel's `micro_gemm_rows`), inductor's other kernels
by name, OpenMP (a thread waiting at a barrier or for work), and the host code around the kernels (Python, libtorch,
the C library's malloc). Needs `perf` and permission to sample (root, or kernel.perf_event_paranoid <= 1).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import llmstep
from llmstep.cli.args import quantization
from llmstep.core.cost import model_step_cost
from llmstep.core.quantize import quantize
from llmstep.engines.fast import FastDecoder
from llmstep.kernels import cpu_gemm
from llmstep.lab import runinfo
from llmstep.lab.hardware import measure_bandwidth


def classify(symbol: str, dso: str) -> str:
    """One sample's place: a kernel of the compiled step (by kind), OpenMP, or the host library it ran in."""
    if compiled(dso):
        if "micro_gemm_rows" in symbol:
            return "kernel: one-row matmuls (dot kernel)"
        if "index_copy" in symbol:
            return "kernel: rope, cache write, float32 K/V copies"
        if "softmax" in symbol:
            return "kernel: masked softmax and its matmuls"
        if "argmax" in symbol:
            return "kernel: greedy pick"
        return "kernel: other"
    name = Path(dso).name
    if name.startswith("libgomp"):
        return "OpenMP (waiting)"
    if name.startswith("libpython") or name.startswith("perf-"):
        return "host: Python"
    if name.startswith("libc.so") or name.startswith("ld-linux"):
        return "host: C library (malloc, free)"
    if name == "[kernel.kallsyms]":
        return "host: the OS kernel (futex, page faults)"
    if name.startswith(("libtorch", "libc10")):
        return "host: libtorch (tensor handles, dispatch)"
    return f"host: {name}"


_resolved = functools.cache(os.path.realpath)  # once per path, not per sample: each costs a few system calls


def compiled(dso: str) -> bool:
    """Whether a library is one inductor compiled (the step's kernels): under its default cache directory, or under
    TORCHINDUCTOR_CACHE_DIR's (both sides resolved, as perf records them)."""
    if not dso.endswith(".so"):
        return False
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return "torchinductor" in dso or bool(cache) and _resolved(dso).startswith(os.path.join(_resolved(cache), ""))


def by_symbol(symbol: str, dso: str) -> str:
    """One sample's function and library (--by-symbol): where inside a place of `classify` the time goes. The
    compiled step's library is named "STEP" (its file name is a hash); the function's offset is dropped."""
    return f"{'STEP' if compiled(dso) else Path(dso).name}: {re.sub(r'[+]0x[0-9a-f]+$', '', symbol)}"


def count(script: str, pid: int, place: Callable[[str, str], str] = classify) -> dict[str, collections.Counter]:
    """`perf script -F tid,ip,sym,dso` output -> each thread's samples counted by `place` (the main thread,
    `pid`, as "main")."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        parts = line.split(None, 2)  # tid, ip, "symbol+offset (dso)"
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        where = re.search(r"\(([^)]*)\)\s*$", parts[2])
        dso = where.group(1) if where else "?"
        symbol = parts[2][: where.start()].strip() if where else parts[2]
        threads["main" if int(parts[0]) == pid else f"thread {parts[0]}"][place(symbol, dso)] += 1
    return threads


def split(perf_data: Path, pid: int, place: Callable[[str, str], str] = classify) -> dict[str, collections.Counter]:
    """perf's samples of each thread of `pid`, counted by `place`."""
    script = subprocess.run(["perf", "script", "-i", str(perf_data), "-F", "tid,ip,sym,dso"], check=True,
                            capture_output=True, text=True).stdout
    return count(script, pid, place)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="target")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", default="none", type=quantization,
                   help="a quantization of the model's linears: int8+lm_head, int4-g64+lm_head-int8, ...")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--by-symbol", action="store_true", help="count samples by function, not by kind")
    p.add_argument("--frequency", type=int, default=1999, help="samples per second per thread")
    p.add_argument("--stream", choices=["rule", "on", "off"], default="rule",
                   help="whether the one-row matmuls stream the weights past the caches (kernels/cpu_gemm.py's "
                        "streams_weights; default: its rule)")
    a = p.parse_args()
    if shutil.which("perf") is None:
        sys.exit("perf_split.py needs Linux perf (apt-get install linux-perf)")
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    model, _ = llmstep.load(a.model, device="cpu", dtype=a.dtype)
    if a.quantize != "none":
        model = quantize(model, a.quantize)
    decoder = FastDecoder(model, compile=True)
    prompt = [random.Random(0).randrange(100, 1000) for _ in range(128)]
    with cpu_gemm.streaming({"rule": None, "on": True, "off": False}[a.stream]):
        decoder.generate(prompt, max_new_tokens=128, temperature=0.0)  # compiles; the cache holds 256 tokens
    with torch.inference_mode():  # the mode FastDecoder compiled its step in (Dynamo guards it)
        step = decoder._advance_step((0.0, 0, 1.0))
        advance = step.unguarded()  # the greedy step, as the decode loop calls it
    if advance is step:
        sys.exit("perf_split.py: Step.unguarded() found no compiled code to call")

    @torch.inference_mode()  # as FastDecoder's loop
    def decode() -> float:  # the 127 steps after the prompt (prefill not sampled) -> tokens/s
        decoder._position.fill_(len(prompt))
        start = time.perf_counter()
        for _ in range(127):
            advance()
        return 127 / (time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        recorder = subprocess.Popen(["perf", "record", "-q", "-F", str(a.frequency), "-p", str(os.getpid()), "-o",
                                     str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attached
        rates, end = [], time.perf_counter() + a.seconds
        while time.perf_counter() < end:
            rates.append(decode())
        recorder.send_signal(signal.SIGINT)  # perf writes its file and exits
        recorder.wait(timeout=120)
        threads = split(data, os.getpid(), by_symbol if a.by_symbol else classify)
    rates.sort()
    rate = rates[len(rates) // 2]
    weight_bytes = float(model_step_cost(model, context=len(prompt)).weight_bytes)
    copy = measure_bandwidth("cpu", nbytes=2**30, kind="copy")
    what = (f"{a.model} {a.dtype}" + (f" {a.quantize}" if a.quantize != "none" else "")
            + (f", streaming {a.stream}" if a.stream != "rule" else ""))
    print(f"{what}, {a.threads} threads, compiled: decode {rate:.1f} tok/s, {1e3 / rate:.1f} ms a step "
          f"(median of {len(rates)} runs of 127 steps after a 128-token prompt, sampled by perf at {a.frequency} Hz); "
          f"{weight_bytes / 1e6:.0f} MB of weights a step, {weight_bytes * rate / 1e9:.1f} GB/s against a copy "
          f"bandwidth of {copy:.1f} GB/s measured after")
    print(f"machine: {runinfo.machine(torch.device('cpu'))}")
    for name, counts in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counts.values())
        if total < 100:
            continue
        print(f"{name}: {total} samples")
        for place, n in counts.most_common():
            if n / total >= 0.003:
                print(f"  {place:<48} {100 * n / total:5.1f}%")


if __name__ == "__main__":
    main()
