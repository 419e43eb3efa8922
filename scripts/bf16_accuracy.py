"""Teacher-forced check of the bf16 decode paths against the float32 model (results/README.md, claim 4).

    OMP_NUM_THREADS=2 python scripts/bf16_accuracy.py [--out results/bf16_accuracy.json]
        # ~1 minute on a 2-core CPU (one max-autotune compile); --no-compiled: the eager path alone, seconds

The shipped target continues a random 128-token prompt greedily in float32 for 100 tokens; then the eager and the
compiled bf16 decode steps are fed exactly those tokens, and their logits at each step are compared with float32's.
--out writes the figures as one JSON record, starting with llmstep.lab.runinfo's header (the command, the machine,
the versions).
"""

from __future__ import annotations

import argparse
import sys

PROG = "python scripts/bf16_accuracy.py"
PROMPT, NEW_TOKENS = 128, 100


def parser() -> argparse.ArgumentParser:
    """The flags, parsed before torch or llmstep is imported: --help answers at once."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the figures here as JSON (atomically)")
    p.add_argument("--no-compiled", dest="compiled", action="store_false",
                   help="only the eager bf16 path (no max-autotune compile)")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    from llmstep.core.files import check_output_path

    if args.out is not None:
        try:
            check_output_path(args.out, "--out")  # before the minute of work, not after it
        except ValueError as e:
            p.error(str(e))
    return measure(args.compiled, args.out, argv)


def measure(compiled: bool, out: str | None, argv: list[str]) -> dict:
    import torch

    from llmstep.core.checkpoint import load_model
    from llmstep.core.files import atomic_write_json
    from llmstep.engines.fast import FastDecoder
    from llmstep.lab import runinfo

    load_before = runinfo.load_average()
    with torch.no_grad():
        ref = load_model("target", dtype=torch.float32, device="cpu")
        bf16 = load_model("target", dtype=torch.bfloat16, device="cpu")
        ids = torch.randint(0, ref.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
        seq = FastDecoder(ref, max_len=256, compile=False).generate(
            ids, NEW_TOKENS, temperature=0, stop_ids=()).tokens  # the float32 greedy continuation
        r = ref(torch.tensor([ids + seq]))[0, len(ids) - 1 : -1].float()  # [100, V]: float32 logits at each step
        rows = []
        variants = [("eager bf16", False)] + ([("compiled bf16 (max-autotune)", True)] if compiled else [])
        for name, compiling in variants:
            decoder = FastDecoder(bf16, max_len=256, compile=compiling, mode="max-autotune" if compiling else None)
            decoder.warmup()
            decoder.cache.reset()
            bf16(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1), decoder.cache)  # the prompt but its last token
            steps = [decoder.step(torch.tensor([[t]]), torch.tensor([[len(ids) - 1 + i]])).clone()
                     for i, t in enumerate([ids[-1]] + seq[:-1])]
            o = torch.cat(steps)  # [100, V]
            err = (o - r).abs()
            agree = (o.argmax(-1) == r.argmax(-1)).float().mean()
            kl = (torch.softmax(r, -1) * (torch.log_softmax(r, -1) - torch.log_softmax(o, -1))).sum(-1).mean()
            print(f"{name:30s} max|dlogit| {err.max():.4f} mean {err.mean():.5f}  "
                  f"argmax agrees with fp32 {agree:.1%}  KL {kl:.2e}")
            rows.append({"variant": name, "compiled": compiling, "max_abs_logit_error": float(err.max()),
                         "mean_abs_logit_error": float(err.mean()), "argmax_agreement": float(agree),
                         "kl_from_float32": float(kl)})
    record = runinfo.header("cpu", torch.bfloat16, argv, load_before, prog=PROG) | {
        "model": "target", "prompt_len": PROMPT, "new_tokens": NEW_TOKENS, "seed": 0, "rows": rows}
    if out is not None:
        atomic_write_json(out, record)
    return record


if __name__ == "__main__":
    main()
