"""The drafts of speculative decoding, from a command-line word: the target's first N layers ("self-N"), a
quantized twin of the target ("self-int8", "self-int4"), or another checkpoint ("draft" is the shipped one).

`parse_draft` reads the word without loading anything (the CLI refuses a bad one before the target loads);
`resolve_draft` makes the draft. The acceptance rule and the loops are in llmstep/engines/speculative.py.
"""

from __future__ import annotations

import torch

from ..core import quantize
from ..core.checkpoint import load
from ..core.checks import is_int
from ..core.kv_cache import KVCache
from ..core.model import Llama
from ..core.tokens import Tokenizer

__all__ = ["LayerSkipDraft", "parse_draft", "resolve_draft", "check_same_tokenizer"]


class LayerSkipDraft(Llama):
    """The target's first n_layers blocks, then its final norm and LM head, sharing its weights: a draft for any
    model, with no second checkpoint (self-speculative decoding: Zhang et al. 2023, "Draft & Verify"; Elhoushi et
    al. 2024, "LayerSkip"), with its own, shallower KV cache. An early exit the model was not trained for agrees
    with the full stack less often than a trained draft does, and the LM head is read in full: a smaller gain.
    """

    def __init__(self, target: Llama, n_layers: int):
        if not is_int(n_layers) or not 1 <= n_layers <= target.config.n_layers:
            raise ValueError(f"a layer-skip draft keeps 1..{target.config.n_layers} of the target's layers, "
                             f"got {n_layers!r}")
        torch.nn.Module.__init__(self)
        n_layers = int(n_layers)  # a numpy integer too
        self.config = target.config.replace(n_layers=n_layers)
        if getattr(target, "rank_config", None) is not None:  # a shard's draft: this rank's heads (core.parallel)
            self.rank_config = target.rank_config.replace(n_layers=n_layers)
        self.tok_embeddings = target.tok_embeddings  # the same modules: no weight is copied
        self.layers = torch.nn.ModuleList(target.layers[:n_layers])
        self.norm, self.output = target.norm, target.output
        self.register_buffer("inv_freq", target.inv_freq, persistent=False)
        self.generation_config = getattr(target, "generation_config", {})
        self.train(target.training)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """Its own cache of its n_layers layers, of this rank's heads where the target is a tensor-parallel shard."""
        max_len = self.config.max_seq_len if max_len is None else max_len
        return KVCache(getattr(self, "rank_config", self.config), batch_size, max_len, device=self.device,
                       dtype=self.dtype)


def parse_draft(spec: str, n_layers: int | None = None) -> tuple[str, int | str]:
    """A draft's command-line word, read without loading anything: ("layers", N) for "self-N" (the target's first
    N layers; checked against `n_layers` when given), ("quantized", "int8" | "int4") for "self-int8" / "self-int4",
    ("checkpoint", spec) for anything else (a path, or "draft": the shipped one)."""
    if not spec:
        raise ValueError("draft '': give self-N, self-int8, self-int4 or a checkpoint directory ('draft' is the "
                         "shipped one)")
    if spec.startswith("self-int"):
        mode = spec.removeprefix("self-")
        if mode not in ("int8", "int4"):
            raise ValueError(f"draft {spec!r}: the quantized self-drafts are self-int8 and self-int4")
        return "quantized", mode
    if spec.startswith("self-"):
        n = spec.removeprefix("self-")
        if not n.isascii() or not n.isdigit() or n != str(int(n)):  # isdigit alone takes "²", which int() refuses
            raise ValueError(f"draft {spec!r}: write self-N with N the number of layers to keep")
        if not 1 <= int(n) <= (n_layers or int(n)):
            raise ValueError(f"draft {spec!r}: a layer-skip draft keeps 1..{n_layers or 'n_layers'} of the target's "
                             f"layers")
        return "layers", int(n)
    return "checkpoint", spec


def resolve_draft(spec: str, target: Llama, tokenizer: Tokenizer | None = None, device=None, dtype=None) -> Llama:
    """A draft from a command-line word (see `parse_draft`). A loaded checkpoint must share the target's
    tokenizer."""
    kind, value = parse_draft(spec, target.config.n_layers)
    if kind == "quantized":
        # A twin sharing the float model's embeddings and norms, with its matmuls (LM head included) quantized.
        return quantize.quantize(target, value, lm_head=True, inplace=False)
    if kind == "layers":
        return LayerSkipDraft(target, value)
    draft, draft_tokenizer = load(spec, device=device or target.device, dtype=dtype or target.dtype)
    if tokenizer is not None:
        check_same_tokenizer(draft_tokenizer, tokenizer, spec)
    return draft


def check_same_tokenizer(draft_tokenizer: Tokenizer, tokenizer: Tokenizer, where: str) -> None:
    """A draft checkpoint's tokenizer must be the target's: the same strings at the same ids."""
    if draft_tokenizer.tok.get_vocab() != tokenizer.tok.get_vocab():
        raise ValueError(f"the draft at {where} uses a different tokenizer from the target's: speculative "
                         "decoding needs both models to read and write the same token ids")
