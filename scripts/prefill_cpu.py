"""A half-precision prompt on the CPU: torch's bf16 matmul against llmstep.core.linear's widening (scripts/README.md).

    python scripts/prefill_cpu.py --model smollm2-135m-instruct --rows 8 16 32 128 --rounds 5 --json out.json

Two parts, both in one process, 2 threads. First each of the model's matmul shapes alone (its block's four, and the
LM head), x [rows, in] @ W [out, in]^T in `--dtype`: torch's F.linear against `linear.linear` with the widening forced
on (widening both operands to float32 on every call, the weight included), the median of --rounds timings of
0.2 s each, and the largest difference between the two in the dtype's steps. Then the model's eager prefill of a
random --prompt-len prompt (its last token's logits, as an engine's prefill computes them), torch's matmul
(the widening forced off) against llmstep's default, interleaved for --rounds, with each side's largest logit
difference from the float32 model and whether its argmax is float32's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import llmstep
from llmstep.core import linear
from llmstep.core.files import atomic_write_json, check_output_path
from llmstep.lab import runinfo

PROG = "python scripts/prefill_cpu.py"


def seconds(fn, budget: float = 0.2) -> float:
    fn()  # warm-up
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < budget:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def forced(on: bool):
    """linear's rule, forced on (widen wherever the rows and dtype allow) or off (torch's matmul always)."""
    return lambda dtype: on


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a registry name or folder (default: the shipped model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the timings here (atomically)")
    a = p.parse_args(argv)
    if a.json is not None:
        try:
            check_output_path(a.json, "--json")
        except ValueError as e:
            p.error(str(e))
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, a.dtype)
    model, _ = llmstep.load(a.model, device="cpu", dtype=dtype)
    c = model.config
    shapes = {"wq": (c.n_heads * c.head_dim, c.dim), "wk": (c.n_kv_heads * c.head_dim, c.dim),
              "w1": (c.hidden_dim, c.dim), "w2": (c.dim, c.hidden_dim), "head": (c.vocab_size, c.dim)}
    g = torch.Generator().manual_seed(0)
    rule = linear._slow_half_gemm
    out = runinfo.header("cpu", dtype, argv, runinfo.load_average(), prog=PROG) | {
        "model": a.model or "shipped", "torch_slow_half_gemm": rule(dtype), "shapes": [], "prefill": {}}
    try:
        linear._slow_half_gemm = forced(True)
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, generator=g).to(dtype)
            for rows in a.rows:
                x = torch.randn(rows, k, generator=g).to(dtype)
                t_torch = statistics.median(seconds(lambda x=x, w=w: F.linear(x, w)) for _ in range(a.rounds))
                t_wide = statistics.median(seconds(lambda x=x, w=w: linear.linear(x, w)) for _ in range(a.rounds))
                steps = (F.linear(x, w).float() - linear.linear(x, w).float()).abs().max().item()
                row = {"matmul": name, "out": n, "in": k, "rows": rows, "torch_us": t_torch * 1e6,
                       "widened_us": t_wide * 1e6, "speedup": t_torch / t_wide, "max_abs_diff": steps}
                out["shapes"].append(row)
                print(f"{name:>4} [{rows:>4}, {k}] x [{n}, {k}]^T: torch {t_torch * 1e6:>9.0f} us, widened "
                      f"{t_wide * 1e6:>9.0f} us, {t_torch / t_wide:5.2f}x (largest difference {steps:.3g})")
        ids = torch.randint(0, c.vocab_size, (1, a.prompt_len), generator=g)
        ref = llmstep.load(a.model, device="cpu", dtype=torch.float32)[0](ids, last_only=True).double()
        times: dict[str, list[float]] = {"torch": [], "widened": []}
        for _ in range(a.rounds):
            for side, on in (("torch", False), ("widened", True)):
                linear._slow_half_gemm = forced(on)
                start = time.perf_counter()
                logits = model(ids, last_only=True)
                times[side].append(time.perf_counter() - start)
                out["prefill"][side] = {"max_abs_logit_diff_vs_float32": (logits.double() - ref).abs().max().item(),
                                        "argmax_is_float32s": logits.argmax().item() == ref.argmax().item()}
        for side, ts in times.items():
            med = statistics.median(ts)
            out["prefill"][side] |= {"seconds": ts, "tokens_per_second": a.prompt_len / med}
            print(f"prefill of {a.prompt_len} tokens, {side}: {a.prompt_len / med:,.1f} tok/s (median of {a.rounds}), "
                  f"{out['prefill'][side]}")
    finally:
        linear._slow_half_gemm = rule
    out["load_average_1min_before_after"][1] = runinfo.load_average()
    if a.json:
        atomic_write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
