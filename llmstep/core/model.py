"""The LLaMA 3 decoder: embedding -> n_layers x (RMSNorm, attention, RMSNorm, SwiGLU) -> RMSNorm -> LM head.

One forward path serves prefill and decode: prefill is T prompt tokens at positions 0..T-1, decode is
one token at position t. Both write their keys and values into the cache when one is given.

`materialize` is the one way a Llama is made from tensors that already exist (a checkpoint's, random
ones, a quantised twin's): every builder in the package goes through it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .attention import CAUSAL, Attention, Mask, causal_mask
from .config import LlamaConfig
from .cost import check_fits, model_bytes
from .kv_cache import Cache, KVCache
from .linear import Linear
from .mlp import FeedForward
from .norm import RMSNorm
from .rope import config_inv_frequencies, rope_cos_sin

__all__ = ["Block", "Llama", "LAST", "all_finite", "check_model", "materialize"]

LAST = slice(-1, None)  # Llama.forward's keep: the last token's logits only, [B, 1, vocab]


class Block(nn.Module):
    """A pre-norm residual block: h = x + attention(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)  # HF: input_layernorm
        self.attention = Attention(config)  # HF: self_attn
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)  # HF: post_attention_layernorm
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)  # HF: mlp

    def forward(self, x, cos, sin, positions, mask: Mask | torch.Tensor, cache=None, layer=0, kv_len=None,
                static=False):
        h = x + self.attention(self.attention_norm(x), cos, sin, positions, mask, cache, layer, kv_len, static)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The LLaMA 3 decoder: token embedding, `config.n_layers` blocks (RMSNorm, grouped-query attention with RoPE,
    RMSNorm, SwiGLU, each with its residual), a final RMSNorm and the LM head; the same function as transformers'
    LlamaForCausalLM. `forward(tokens [B, T]) -> logits [B, T, vocab]`, with or without a KV cache (`new_cache`);
    `llmstep.load` builds one from a checkpoint, `Llama(config)` one of random weights."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        device, dtype = torch.get_default_device(), torch.get_default_dtype()  # where nn.Module puts the weights
        check_fits(model_bytes(config, dtype), device, f"a Llama of {config.dim}x{config.n_layers} in "
                   f"{str(dtype).removeprefix('torch.')}")  # the meta device (shapes only) is never refused
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)  # HF: embed_tokens (vocab, dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size, bias=False)  # LM head, HF: lm_head (vocab, dim)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotation speeds, derived from the config, never saved: [head_dim/2] float32.
        self.register_buffer("inv_freq", config_inv_frequencies(config), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """An empty KV cache on the model's device and dtype, for up to max_len positions."""
        max_len = self.config.max_seq_len if max_len is None else max_len
        return KVCache(self.config, batch_size, max_len, device=self.device, dtype=self.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: Cache | None = None,
                keep: torch.Tensor | slice | None = None, *, static: bool = False,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab], or [B, K, vocab] for the token indices `keep` picks (a tensor
        [K], or LAST: [B, 1, vocab]). last_only=True is keep=LAST.

        positions [B, T] or [T]: where these tokens sit in their sequences. Default: 0..T-1 without a
        cache, continuing after the cache's lengths with one. With no cache this is a plain causal forward. A
        paged cache takes one flattened row [1, N] of several sequences' tokens, as its `plan` laid them out
        (llmstep.core.paged_kv). static: the engine traces this forward for a compiler (llmstep.engines.compile):
        fixed shapes (a contiguous cache attends every slot, masked), no value read back to the host, attention
        as ops the compiler can fuse (`attention.sdpa`). Exact either way.
        """
        if isinstance(keep, bool) or (last_only and keep is not None):
            raise TypeError(f"keep picks token indices (a tensor [K], or LAST), got keep={keep!r}"
                            f"{' with last_only' if last_only else ''}: last_only=True is keep=LAST")
        keep = LAST if last_only else keep
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(f"cache must be a llmstep KV cache (kv_cache.Cache: model.new_cache(), a PagedKVCache), "
                            f"got {type(cache).__name__}")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            got = (f"a {tokens.dim()}-d {str(tokens.dtype).removeprefix('torch.')} tensor {list(tokens.shape)}"
                   if isinstance(tokens, torch.Tensor) else type(tokens).__name__)
            raise TypeError(f"tokens must be token ids [batch, seq] (an int64 or int32 tensor), got {got}"
                            + (": one sequence is tokens[None]" if isinstance(tokens, torch.Tensor) and
                               tokens.dim() == 1 else ""))
        B, T = tokens.shape
        if tokens.device.type == "cpu" and not static and not torch.compiler.is_compiling() and tokens.numel():
            low, high = tokens.aminmax()  # on the CPU, no device to wait for: an id outside the table is named
            if low < 0 or high >= self.config.vocab_size:  # (the engines check ids on every device, first)
                row, i = ((tokens < 0) | (tokens >= self.config.vocab_size)).nonzero()[0].tolist()
                raise ValueError(f"token id {int(tokens[row, i])} at [{row}, {i}] is outside the vocabulary "
                                 f"(0..{self.config.vocab_size - 1})")
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"the KV cache holds {cache.batch_size} sequences but the tokens hold {B}: "
                             "give each sequence its row (cache.slot(i) is row i alone)")
        if cache is None:
            # The keys are these tokens: at 0..T-1 a causal mask needs no tensor (SDPA's is_causal).
            default_positions = positions is None
            positions = (torch.arange(T, device=tokens.device) if default_positions else positions).expand(B, T)
            # the mask is by position, so positions must rise along each row: else a token would see later ones
            # (left padding's repeated positions among them: give each row its own tokens instead)
            if not default_positions and T > 1 and not bool((positions[:, 1:] > positions[:, :-1]).all()):
                row, i = (positions[:, 1:] <= positions[:, :-1]).nonzero()[0].tolist()
                raise ValueError(f"row {row}'s position {int(positions[row, i + 1])} after {int(positions[row, i])}: "
                                 "positions must rise along each row without a cache (the causal mask is by position)")
            mask, kv_len = CAUSAL if default_positions else Mask(causal_mask(positions, positions)), None  # [B,1,T,T]
        else:
            # The cache says what these positions attend over (kv_cache.KVCache.mask, paged_kv.PagedKVCache.mask)
            positions = (cache.positions(T) if positions is None else positions).expand(B, T)  # [B, T]
            mask, kv_len = cache.mask(positions, static)

        x = self.tok_embeddings(tokens)  # [B, T, dim]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # [B, T, head_dim]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, mask, cache, i, kv_len, static)
        if cache is not None:
            cache.advance(positions)
            x = cache.mark_lost(x)  # [B, T, dim]
        if keep is not None:
            x = x[:, keep]  # [B, K, dim]: only the tokens whose next token is wanted
        return self.output(self.norm(x))  # [B, T or K, vocab]


def check_model(model, call: str | None = None) -> None:
    """`model` is a llmstep model (its config a LlamaConfig: a Llama, quantized or sharded), else a TypeError naming
    the call and what it got: generate(tokenizer, model) and save(model, tokenizer, path) are easy to write."""
    if not isinstance(getattr(model, "config", None), LlamaConfig):
        raise TypeError(f"{call + ': ' if call else ''}model must be a llmstep model (llmstep.load returns (model, "
                        f"tokenizer)), got {type(model).__name__}")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a weight is finite: one NaN would turn every later token into the argmax of NaNs.
    (min and max in one pass: NaN and Inf both show there, and it reads the tensor once, unlike isfinite.)"""
    return t.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all())


def materialize(config: LlamaConfig, state: dict[str, torch.Tensor], generation_config: dict | None = None,
                swap: Callable[[Llama], None] | None = None) -> Llama:
    """A Llama for inference that holds `state`'s tensors themselves (no copy, nothing allocated twice).

    The model is built on the meta device (shapes only); `swap(model)` may replace modules there first
    (quantised linears). The state dict is then assigned, not copied; a tied LM head is made the
    embedding's own tensor again; inv_freq is recomputed from the config on the weights' device. The
    model comes back in eval mode with requires_grad off: inference never builds an autograd graph.
    """
    with torch.device("meta"):
        model = Llama(config)
    if swap is not None:
        swap(model)
    tied = config.tie_embeddings and isinstance(model.output, nn.Linear)  # a quantised head has its own tensors
    if tied:
        state = state | {"output.weight": state["tok_embeddings.weight"]}
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = config_inv_frequencies(config).to(model.device)
    model.generation_config = dict(generation_config or {})
    return model.eval().requires_grad_(False)
