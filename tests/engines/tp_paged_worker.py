"""One rank of test_paged_batching's tensor-parallel test (torchrun, gloo, CPU).

    torchrun --standalone --nproc-per-node 2 tests/engines/tp_paged_worker.py OUT_DIR CHECKPOINT

Every rank serves the same requests with the paged batcher (`run_batch(kv="paged")`) and with a `PagedSession`
over its shard of the model, and writes their tokens to OUT_DIR/rank{r}.json; the test compares them with one
process's.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from llmstep.core import parallel
from llmstep.engines.batching import Request, run_batch
from llmstep.engines.decoding import NonFiniteLogitsError
from llmstep.engines.session import PagedSession

PROMPTS = ([5, 17, 42, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])


def requests() -> list[Request]:
    return [Request(list(PROMPTS[0]), 10, temperature=0, stop_ids=()),
            Request(list(PROMPTS[1]), 8, temperature=0.8, seed=2, stop_ids=())]


def session_tokens(model) -> list[int]:
    session = PagedSession(model, n_slots=2, block_size=4)
    first = session.submit(requests()[0])
    out = []
    while session.pending:
        out += [o.token for o in session.step() if o.id == first]
    return out


OVERFLOWING = 250  # the token whose layer-0 key overflows on rank 1 alone (`overflow`)


def overflow(model) -> str:
    """Rank 1's layer-0 keys of OVERFLOWING made infinite (its heads alone: rank 0's stay finite), then two requests,
    the second holding that token, run paged -> the NonFiniteLogitsError every rank must raise, naming request 1."""
    tokens = {}
    model.register_forward_pre_hook(lambda module, args: tokens.update(ids=args[0]))

    def keys(module, args, out):  # [1, N, kv*hd]: the rows of the flattened forward's tokens
        if dist.get_rank() == 1:
            out = out.clone()
            out[tokens["ids"] == OVERFLOWING] = float("inf")
        return out

    model.layers[0].attention.wk.register_forward_hook(keys)
    try:
        run_batch(model, [Request(list(PROMPTS[0]), 4, temperature=0, stop_ids=()),
                          Request([5, 17, OVERFLOWING, 9], 4, temperature=0, stop_ids=())],
                  n_slots=2, kv="paged", block_size=4)
    except NonFiniteLogitsError as e:
        return str(e)
    return "no error"


def main() -> None:
    out_dir, path = Path(sys.argv[1]), sys.argv[2]
    parallel.init_from_environment("cpu")
    model = parallel.load_sharded(path, device="cpu", dtype="float32")
    run = run_batch(model, requests(), n_slots=2, kv="paged", block_size=4, prefix_caching=True)
    record = {"kv_heads": model.rank_config.n_kv_heads, "paged": [c.tokens for c in run.completions],
              "session": session_tokens(model), "overflow": overflow(model)}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    parallel.finish()
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads sometimes abort the process (as llmstep.cli)


if __name__ == "__main__":
    main()
