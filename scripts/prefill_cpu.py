"""A half-precision prompt on the CPU: torch's bf16 matmul against llmstep.core.linear's widening (scripts/README.md).

    python scripts/prefill_cpu.py --model smollm2-135m-instruct --rows 8 16 32 128 --rounds 5 --json out.json

Two parts, both in one process, 2 threads. First each of the model's matmul shapes alone (its block's four, and the
LM head), x [rows, in] @ W [out, in]^T in `--dtype`: torch's F.linear against `linear.linear` with the widening forced
on at every row count (both operands widened to float32 on every call, the weight included), --rounds timings of
0.2 s each, interleaved (which side first alternating), their medians, and the largest absolute difference between
the two. Then the model's eager prefill of a random --prompt-len prompt (its last token's logits, as an engine's
prefill computes them), torch's matmul (the widening forced off) against the widening forced on (at linear's own
WIDEN_ROWS), interleaved likewise, with each side's largest logit difference from the float32 model and whether its
argmax is float32's. The module's state, torch's threads and grad mode are as they were after it, error or not.
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


def matmul_shapes(c) -> dict[str, tuple[int, int]]:
    """A block's four matmul shapes and the LM head's, [out, in]."""
    return {"wq": (c.n_heads * c.head_dim, c.dim), "wk": (c.n_kv_heads * c.head_dim, c.dim),
            "w1": (c.hidden_dim, c.dim), "w2": (c.dim, c.hidden_dim), "head": (c.vocab_size, c.dim)}


def time_shape(name: str, x: torch.Tensor, w: torch.Tensor, rounds: int) -> dict:
    """x @ w^T by torch's F.linear and by linear.linear (forced to widen), interleaved, which first alternating."""
    sides = {"torch": lambda: F.linear(x, w), "widened": lambda: linear.linear(x, w)}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in (("torch", "widened") if r % 2 == 0 else ("widened", "torch")):
            times[side].append(seconds(sides[side]))
    t_torch, t_wide = statistics.median(times["torch"]), statistics.median(times["widened"])
    diff = (F.linear(x, w).float() - linear.linear(x, w).float()).abs().max().item()
    (rows, k), n = x.shape, w.shape[0]
    print(f"{name:>4} [{rows:>4}, {k}] x [{n}, {k}]^T: torch {t_torch * 1e6:>9.0f} us, "
          f"widened {t_wide * 1e6:>9.0f} us, {t_torch / t_wide:5.2f}x (largest difference {diff:.3g})")
    return {"matmul": name, "out": w.shape[0], "in": w.shape[1], "rows": x.shape[0], "torch_us": t_torch * 1e6,
            "widened_us": t_wide * 1e6, "speedup": t_torch / t_wide, "max_abs_diff": diff,
            "rounds_us": {side: [t * 1e6 for t in ts] for side, ts in times.items()}}


def time_prefill(model, name: str | None, prompt_len: int, rounds: int, g: torch.Generator) -> dict:
    """The model's eager prefill of a random prompt, torch's matmul (the rule forced off) against linear's widening
    (forced on), interleaved, which first alternating; each side's last logits against the float32 model's."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=g)
    ref = llmstep.load(name, device="cpu", dtype=torch.float32)[0](ids, last_only=True).double()
    result: dict[str, dict] = {"torch": {"seconds": []}, "widened": {"seconds": []}}
    for r in range(rounds):
        for side in (("torch", "widened") if r % 2 == 0 else ("widened", "torch")):
            linear._slow_half_gemm = forced(side == "widened")
            start = time.perf_counter()
            logits = model(ids, last_only=True).double()
            result[side]["seconds"].append(time.perf_counter() - start)
            result[side] |= {"max_abs_logit_diff_vs_float32": (logits - ref).abs().max().item(),
                             "argmax_is_float32s": logits.argmax().item() == ref.argmax().item()}
    for side, rec in result.items():
        rec["tokens_per_second"] = prompt_len / statistics.median(rec["seconds"])
        print(f"prefill of {prompt_len} tokens, {side}: {rec['tokens_per_second']:,.1f} tok/s (median of {rounds}), "
              f"largest logit difference from float32 {rec['max_abs_logit_diff_vs_float32']:.3f}, argmax float32's: "
              f"{rec['argmax_is_float32s']}")
    return result


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
    dtype = getattr(torch, a.dtype)
    rule, widen_rows, threads = linear._slow_half_gemm, linear.WIDEN_ROWS, torch.get_num_threads()
    out = runinfo.header("cpu", dtype, argv, runinfo.load_average(), prog=PROG) | {
        "model": a.model or "shipped", "torch_slow_half_gemm": rule(dtype), "shapes": [], "prefill": {}}
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            model = llmstep.load(a.model, device="cpu", dtype=dtype)[0]
            g = torch.Generator().manual_seed(0)
            linear._slow_half_gemm, linear.WIDEN_ROWS = forced(True), 1  # widened at every row count
            for name, (n, k) in matmul_shapes(model.config).items():
                w = torch.randn(n, k, generator=g).to(dtype)
                for rows in a.rows:
                    x = torch.randn(rows, k, generator=g).to(dtype)
                    out["shapes"].append(time_shape(name, x, w, a.rounds))
            linear.WIDEN_ROWS = widen_rows  # the prefill under linear's own rows rule, forced on or off
            out["prefill"] = time_prefill(model, a.model, a.prompt_len, a.rounds, g)
    finally:
        linear._slow_half_gemm, linear.WIDEN_ROWS = rule, widen_rows
        torch.set_num_threads(threads)
    out["load_average_1min_before_after"][1] = runinfo.load_average()
    if a.json:
        atomic_write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
