"""One rank of the tensor-parallel tests (tests/core/test_parallel.py runs it under torchrun, gloo, CPU).

    torchrun --standalone --nproc-per-node N tests/core/tp_worker.py OUT_DIR CHECKPOINT...

For each checkpoint every rank computes, with the whole model (the oracle, loaded by llmstep.load) and with its
shard (llmstep.core.parallel.load_sharded): the prefill logits of a fixed prompt, then eight greedy decode
steps through the KV cache, each step's logits compared; greedy and seeded-sampled generations; what the rank
read from the files and holds. Each rank writes OUT_DIR/rank{r}.json; the test reads and asserts.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from llmstep.core import parallel
from llmstep.core.checkpoint import load
from llmstep.engines.drafts import LayerSkipDraft
from llmstep.engines.generate import generate
from llmstep.engines.speculative import speculative_generate

PROMPT = "Shall I compare thee to a summer's day?"
STEPS = 8


def layer_matrix_bytes(model) -> int:
    """Bytes of the blocks' matrices (wq wk wv wo w1 w2 w3) this model holds."""
    return sum(p.nbytes for name, p in model.named_parameters() if name.startswith("layers.") and "norm" not in name)


@torch.inference_mode()
def compare(path: str) -> dict:
    full, tokenizer = load(path, device="cpu", dtype="float32")
    tp = parallel.load_sharded(path, device="cpu", dtype="float32")
    ids = torch.tensor([tokenizer.encode(PROMPT)])  # [1, T]
    cf, ct = full.new_cache(1, ids.shape[1] + STEPS + 1), tp.new_cache(1, ids.shape[1] + STEPS + 1)
    lf, lt = full(ids, cache=cf), tp(ids, cache=ct)  # [1, T, vocab]
    diffs = [(lf - lt).abs().max().item()]
    x = lf[:, -1].argmax(-1, keepdim=True)  # [1, 1]: decode the oracle's greedy tokens through both caches
    for _ in range(STEPS):
        lf, lt = full(x, cache=cf), tp(x, cache=ct)
        diffs.append((lf - lt).abs().max().item())
        x = lf[:, -1].argmax(-1, keepdim=True)
    tp.comm.reset()
    tp(x, cache=ct)  # one more decode step: which collectives it ran
    step_collectives = dict(tp.comm.by_kind)
    greedy = dict(max_new_tokens=12, temperature=0.0)
    # A fixed seed: a drawn one could pick an id past the 300-token tokenizer (the vocabularies here are larger),
    # which the tokenizer cannot decode; agree_seed's drawn seed is recorded and compared across ranks instead.
    sampled = dict(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=parallel.agree_seed(7))
    out = {
        "max_abs_diff": max(diffs), "logits_shape": list(lt.shape), "vocab": full.config.vocab_size,
        "greedy_full": generate(full, tokenizer, PROMPT, **greedy).tokens,
        "greedy_tp": generate(tp, tokenizer, PROMPT, **greedy).tokens,
        "sampled_full": generate(full, tokenizer, PROMPT, **sampled).tokens,
        "sampled_tp": generate(tp, tokenizer, PROMPT, **sampled).tokens,
        # a layer-skip draft of the shard: its cache of this rank's heads (GQA's 2 KV heads are 1 a rank)
        "speculative_tp": speculative_generate(tp, LayerSkipDraft(tp, 1), tokenizer, PROMPT, k=3, **greedy).tokens,
        "bytes_read": tp.bytes_read,
        "param_bytes": sum(p.nbytes for p in tp.parameters()),
        "full_param_bytes": sum(p.nbytes for p in full.parameters()),
        "layer_bytes": layer_matrix_bytes(tp), "full_layer_bytes": layer_matrix_bytes(full),
        "cache_bytes": ct.nbytes, "full_cache_bytes": cf.nbytes,
        "kv_heads": tp.rank_config.n_kv_heads, "heads": tp.rank_config.n_heads,
        "tied": tp.output.weight is tp.tok_embeddings.weight,
        "drawn_seed": parallel.agree_seed(None), "step_collectives": step_collectives, "n_layers": full.config.n_layers,
    }
    return out


def main() -> None:
    out_dir, paths = Path(sys.argv[1]), sys.argv[2:]
    parallel.init_from_environment("cpu")
    rank = dist.get_rank()
    record = {"world": dist.get_world_size(), "checkpoints": {p: compare(p) for p in paths}}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    parallel.finish()
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads sometimes abort the process (as llmstep.cli)


if __name__ == "__main__":
    main()
