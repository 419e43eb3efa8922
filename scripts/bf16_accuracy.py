"""Teacher-forced check of the bf16 decode paths against the float32 model (results/README.md, claim 4).

    OMP_NUM_THREADS=2 python scripts/bf16_accuracy.py     # ~1 minute on a 2-core CPU (one max-autotune compile)

The shipped target continues a random 128-token prompt greedily in float32 for 100 tokens; then the eager and the
compiled bf16 decode steps are fed exactly those tokens, and their logits at each step are compared with float32's.
"""

import torch

from llmstep.core.checkpoint import load_model
from llmstep.engines.fast import FastDecoder


@torch.no_grad()
def main() -> None:
    ref = load_model("target", dtype=torch.float32, device="cpu")
    bf16 = load_model("target", dtype=torch.bfloat16, device="cpu")
    ids = torch.randint(0, 8192, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = FastDecoder(ref, max_len=256, compile=False).generate(
        ids, 100, temperature=0, stop_ids=()).tokens  # the float32 greedy continuation
    r = ref(torch.tensor([ids + seq]))[0, len(ids) - 1 : -1].float()  # [100, V]: float32 logits at each step
    for name, compiled in [("eager bf16", False), ("compiled bf16 (max-autotune)", True)]:
        decoder = FastDecoder(bf16, max_len=256, compile=compiled, mode="max-autotune" if compiled else None)
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


if __name__ == "__main__":
    main()
