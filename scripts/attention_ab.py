"""A/B of attention's masked path in the compiled CPU decode step (results/cpu_amd.md).

    python scripts/attention_ab.py old   # the mask given to SDPA together with enable_gqa (before session 4)
    python scripts/attention_ab.py new   # query heads sharing a KV head folded into its rows (llmstep.core.attention)

Both run this tree's FastDecoder, compiled (default mode), on the shipped model in bfloat16, 2 threads, 256 new
tokens, and print the median decode tokens/s of 5 runs. Run them alternately, more than once: the machine drifts.
"""

import sys

import torch
import torch.nn.functional as F
from llmstep.fast import FastDecoder

import llmstep
import llmstep.core.attention as attention


def masked_with_enable_gqa(q, k, v, mask):
    """The old call: SDPA broadcasts the KV heads itself, and with a mask that means its math path."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None or isinstance(mask, str):
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask == attention.CAUSAL, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def main(which: str) -> None:
    if which not in ("old", "new"):
        sys.exit("usage: python scripts/attention_ab.py old|new")
    if which == "old":
        attention.sdpa = masked_with_enable_gqa
    torch.set_num_threads(2)
    model, tok = llmstep.load("target", device="cpu", dtype="bfloat16")
    ids = tok.encode("ROMEO:\nBut soft, what light through yonder window breaks?\n", bos=True)
    decoder = FastDecoder(model, compile=True, max_len=512)
    decoder.warmup()
    decoder.generate(ids, 8, temperature=0, stop_ids=())
    rates = []
    for _ in range(5):
        result = decoder.generate(ids, 256, temperature=0, stop_ids=())
        rates.append(result.decode_steps / result.decode_seconds)
    print(which, f"{sorted(rates)[2]:.1f} tok/s (median of 5)", [round(r, 1) for r in rates])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
