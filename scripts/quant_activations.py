"""What routing a float32 model's int8 / int4 matmuls through bf16 activations on a CPU costs in accuracy
(llmstep.core.quantize.matmul_dtype; results/cpu_amd.md, session 6).

    python scripts/quant_activations.py        # a few seconds, eager, 1 thread

The shipped target in float32 continues a random 128-token prompt greedily for 100 tokens; then the float32
model quantised to int8 and to int4 (llmstep.quantize) is fed exactly those tokens, one decode step each (the
packed kernels' path), once with float32 activations inside the quantised matmuls (the route before session 6)
and once with bf16 ones (the route now). Each is compared with the float32 model's logits at the 100 continuation
positions: relative logit error ||z_q - z|| / ||z||, argmax agreement, KL(float32 || quantised); and the
bf16 route with the float32-activation route of the same weights (what bf16 rounding adds).
"""

import torch

import llmstep.core.quantize as quantize_mod
from llmstep.core.checkpoint import load_model
from llmstep.engines.fast import FastDecoder


def compare(name: str, o: torch.Tensor, r: torch.Tensor) -> None:
    """o, r [N, V] float32 logits."""
    rel = (o - r).norm() / r.norm()
    agree = (o.argmax(-1) == r.argmax(-1)).float().mean()
    kl = (torch.softmax(r, -1) * (torch.log_softmax(r, -1) - torch.log_softmax(o, -1))).sum(-1).mean()
    print(f"  {name:44s} rel. logit error {rel:.4f}  argmax agrees {agree:6.1%}  KL {kl:.2e}")


def decode_logits(model, ids: list[int], seq: list[int]) -> torch.Tensor:
    """The prompt but its last token prefilled, then one decode step per token ([ids[-1]] + seq[:-1]): the
    logits before each token of seq [len(seq), V], from the decode path (one row: the packed kernels)."""
    cache = model.new_cache(1, len(ids) + len(seq))
    model(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1), cache)
    steps = [model(torch.tensor([[t]]), torch.tensor([[len(ids) - 1 + i]]), cache)[0]
             for i, t in enumerate([ids[-1]] + seq[:-1])]
    return torch.cat(steps).float()


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    ref = load_model("target", dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 8192, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = FastDecoder(ref, max_len=256, compile=False).generate(ids, 100).tokens  # float32's greedy continuation
    r = decode_logits(ref, ids, seq)  # [100, V]
    route = quantize_mod.matmul_dtype
    for mode in ("int8", "int4"):
        quantize_mod.matmul_dtype = lambda dtype, device: dtype  # float32 activations throughout (the old route)
        try:
            f32 = decode_logits(quantize_mod.quantize(ref, mode, inplace=False), ids, seq)
        finally:
            quantize_mod.matmul_dtype = route
        bf16 = decode_logits(quantize_mod.quantize(ref, mode, inplace=False), ids, seq)
        print(f"{mode} (from float32), decode steps at the float32 model's 100 greedy tokens:")
        compare("float32 activations vs the float32 model", f32, r)
        compare("bf16 activations vs the float32 model", bf16, r)
        compare("bf16 activations vs float32 activations", bf16, f32)


if __name__ == "__main__":
    main()
