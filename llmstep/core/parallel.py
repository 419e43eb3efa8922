"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053) on torch.distributed: every weight
matrix split over the N ranks of a process group; the same model code, with sharded modules swapped in.

Megatron's two cuts per block, each paid for with one all-reduce of the residual stream [B, T, dim]:
- attention: wq, wk, wv split by output features (column-parallel: each rank computes its own heads and
  attends over its own cache, no communication); wo split by input features (row-parallel: each rank's heads
  give a partial sum of the output, and an all-reduce adds the N partial sums);
- feed-forward: w1 and w3 column-parallel (a slice of hidden_dim each; silu(gate) * up is elementwise, so it
  stays local), w2 row-parallel with one all-reduce.
KV heads are split like the query heads; with fewer KV heads than ranks (MQA) each rank holds the one KV head
its query heads read, replicated on N / n_kv_heads ranks. The embedding and the LM head are split over the
vocabulary, padded with zero rows to a multiple of N: an id outside a rank's rows reads zeros (masked) and an
all-reduce assembles each token's row; the head's logit slices are all-gathered and the padding cut off.
The norms are replicated (dim numbers each).

`shard(model, group)` makes a rank's model from a loaded one; `load_sharded(path, group)` reads only the
rank's slices of each safetensors tensor (`safe_open(...).get_slice`): no rank holds the whole model. The
model class is unchanged: the modules are swapped and the instance's class becomes TensorParallelLlama (as
FSDP2's fully_shard does), whose one difference is a KV cache of this rank's heads (a per-rank config).
Run it under `torchrun --nproc-per-node N` (gloo on a CPU, NCCL on CUDA GPUs): every rank runs the same
loop on the same (all-gathered) logits, so with one seed (`agree_seed`) all ranks pick the same tokens. The
process group itself (joining it with a bounded timeout, agreeing on a rank's error) is process_group.py: a
load that fails on one rank (its slice of a weight holds a NaN) fails on every rank, with that rank's message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from .checkpoint import CheckpointError, read_generation_config, read_quant_config, resolve_model_path, validate
from .checks import is_int
from .config import LlamaConfig
from .cost import check_fits
from .device import resolve_dtype, synchronize
from .kv_cache import KVCache
from .model import Llama, materialize
from .process_group import (
    ParallelError,
    RankFailed,
    agree_seed,
    agreeing,
    collective_device,
    finish,
    init_from_environment,
    launched_by_torchrun,
    launched_world_size,
    leaving,
    peer_failure,
    rank_device,
    timeout_seconds,
)
from .tokens import Tokenizer

__all__ = ["ParallelError", "Split", "CommStats", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "ParallelLMHead", "TensorParallelLlama", "check_split", "split", "rank_slices",
           "build_rank_model", "shard", "load_sharded", "load", "launched_by_torchrun", "launched_world_size",
           "init_from_environment", "rank_device", "collective_device", "agree_seed", "finish", "is_sharded",
           "RankFailed", "leaving", "peer_failure", "timeout_seconds"]


# --------------------------------------------------------------------------------------------------
# Who holds what: one rule, used by shard (slicing tensors in memory) and load_sharded (slicing files)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """What rank `rank` of `world` holds."""

    rank: int
    world: int
    heads: int  # query heads per rank: n_heads / world
    kv_heads: int  # KV heads this rank holds: n_kv_heads / world, or 1 when there are fewer KV heads than ranks
    kv_start: int  # its first KV head
    hidden: int  # SwiGLU units per rank: hidden_dim / world
    vocab_rows: int  # embedding / LM head rows per rank: ceil(vocab / world), the last rank's padded with zeros


def check_split(config: LlamaConfig, world_size: int) -> None:
    """Refuse a world size that cannot split the heads, the KV heads or the feed-forward: before any loading."""
    if not is_int(world_size) or world_size < 1:
        raise ParallelError(f"the world size must be a positive integer, got {world_size!r}")
    N, c = world_size, config
    if c.n_heads % N:
        raise ParallelError(f"cannot split {c.n_heads} query heads over {N} ranks: the world size must divide "
                            f"n_heads (try {', '.join(str(d) for d in _divisors(c.n_heads) if d > 1)})")
    if c.n_kv_heads % N and N % c.n_kv_heads:
        raise ParallelError(f"cannot split {c.n_kv_heads} KV heads over {N} ranks: the world size must divide "
                            "n_kv_heads, or n_kv_heads divide the world size (then each KV head is replicated)")
    if c.hidden_dim % N:
        raise ParallelError(f"cannot split the feed-forward's {c.hidden_dim} units over {N} ranks: "
                            "the world size must divide hidden_dim")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def split(config: LlamaConfig, rank: int, world_size: int) -> Split:
    check_split(config, world_size)
    if not 0 <= rank < world_size:
        raise ParallelError(f"rank {rank} is outside the world of {world_size} ranks")
    heads = config.n_heads // world_size
    if config.n_kv_heads % world_size == 0:
        kv_heads = config.n_kv_heads // world_size
        kv_start = rank * kv_heads
    else:  # fewer KV heads than ranks: this rank's query heads all read one KV head (n_rep >= heads)
        kv_heads, kv_start = 1, rank * heads // (config.n_heads // config.n_kv_heads)
    return Split(rank, world_size, heads, kv_heads, kv_start, config.hidden_dim // world_size,
                 -(-config.vocab_size // world_size))


def rank_slices(config: LlamaConfig, s: Split) -> dict[str, tuple[int, int, int]]:
    """llmstep state name -> (dim, start, stop): the rows (dim 0) or columns (dim 1) of the full tensor this
    rank holds. Names not listed (the norms) are replicated whole."""
    hd, r = config.head_dim, s.rank
    q = (r * s.heads * hd, (r + 1) * s.heads * hd)
    kv = (s.kv_start * hd, (s.kv_start + s.kv_heads) * hd)
    h = (r * s.hidden, (r + 1) * s.hidden)
    vocab = (0, r * s.vocab_rows, min((r + 1) * s.vocab_rows, config.vocab_size))
    out = {"tok_embeddings.weight": vocab}
    if not config.tie_embeddings:
        out["output.weight"] = vocab
    for i in range(config.n_layers):
        p = f"layers.{i}."
        out |= {p + "attention.wq.weight": (0, *q), p + "attention.wk.weight": (0, *kv),
                p + "attention.wv.weight": (0, *kv), p + "attention.wo.weight": (1, *q),
                p + "feed_forward.w1.weight": (0, *h), p + "feed_forward.w3.weight": (0, *h),
                p + "feed_forward.w2.weight": (1, *h)}
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary slice [n, dim] padded with zero rows to [rows, dim] (the last rank's, when N does not divide)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])


# --------------------------------------------------------------------------------------------------
# The sharded modules
# --------------------------------------------------------------------------------------------------


@dataclass
class CommStats:
    """What the collectives of one rank's model did: calls, payload bytes, seconds (timing on when `timing`)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    timing: bool = False
    world: int = 0  # the group's size (0: not known, communicate); set by build_rank_model
    by_kind: dict = field(default_factory=dict)  # "all_reduce" / "all_gather" -> calls

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds, self.by_kind = 0, 0, 0.0, {}

    def run(self, kind: str, t: torch.Tensor, op: Callable[[], None]) -> None:
        if self.world == 1:  # one rank: the sum and the concatenation of one piece are that piece
            return
        if self.timing:
            synchronize(t.device)
            start = time.perf_counter()
        op()
        if self.timing:
            synchronize(t.device)
            self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += t.nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


def _all_reduce(x: torch.Tensor, group, stats: CommStats) -> torch.Tensor:
    stats.run("all_reduce", x, lambda: dist.all_reduce(x, group=group))  # in place: the sum over ranks
    return x


class ColumnParallelLinear(nn.Linear):
    """Output features out/N of a Linear: y_r = x W_r^T, [.., in] -> [.., out/N]. No communication: what
    follows (attention per head, silu(gate) * up) is local to the rank's slice."""


class RowParallelLinear(nn.Linear):
    """Input features in/N of a Linear: each rank's x_r W_r^T is a partial sum of x W^T; one all-reduce adds
    them. [.., in/N] -> [.., out], the same on every rank."""

    def __init__(self, in_features: int, out_features: int, group=None, stats: CommStats | None = None):
        super().__init__(in_features, out_features, bias=False)
        self.group, self.stats = group, stats if stats is not None else CommStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(F.linear(x, self.weight), self.group, self.stats)  # [.., out]


class VocabParallelEmbedding(nn.Module):
    """Rows start .. start + rows of the embedding [rows, dim]: ids outside them read zeros, one all-reduce
    gives every rank each id's row."""

    def __init__(self, rows: int, dim: int, start: int, group=None, stats: CommStats | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.group, self.stats = start, group, stats if stats is not None else CommStats()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [B, T]
        outside = (local < 0) | (local >= self.weight.shape[0])  # another rank's ids: masked
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)  # [B, T, dim]
        return _all_reduce(x, self.group, self.stats)


class ParallelLMHead(nn.Linear):
    """LM-head rows start .. start + rows [rows, dim]: each rank scores its slice of the vocabulary, an
    all-gather concatenates the N slices, the padding columns are cut off: [B, T, dim] -> [B, T, vocab]."""

    def __init__(self, rows: int, dim: int, vocab_size: int, group=None, stats: CommStats | None = None):
        super().__init__(dim, rows, bias=False)
        self.vocab_size, self.group, self.stats = vocab_size, group, stats if stats is not None else CommStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()  # [B, T, rows]
        if self.stats.world == 1:
            return local[..., :self.vocab_size]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        self.stats.run("all_gather", local, lambda: dist.all_gather(parts, local, group=self.group))
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]  # [B, T, N * rows] -> [B, T, vocab]


class TensorParallelLlama(Llama):
    """One rank's Llama (made by `shard` or `load_sharded`, never constructed): the same forward, sharded
    modules, and a KV cache of this rank's heads. `config` stays the whole model's (its vocabulary, context
    and layer count are the rules every loop checks); `rank_config` has this rank's head counts."""

    rank_config: LlamaConfig
    split: Split
    comm: CommStats

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        max_len = self.config.max_seq_len if max_len is None else max_len
        return KVCache(self.rank_config, batch_size, max_len, device=self.device, dtype=self.dtype)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, TensorParallelLlama)


def _swap(model: Llama, config: LlamaConfig, s: Split, group, stats: CommStats) -> None:
    """Replace a meta Llama's modules by this rank's shards (shapes only) and make it a TensorParallelLlama."""
    hd, dim = config.head_dim, config.dim
    with torch.device("meta"):
        for block in model.layers:
            a, f = block.attention, block.feed_forward
            a.n_heads, a.n_kv_heads = s.heads, s.kv_heads  # Attention reads its own head counts
            a.wq = ColumnParallelLinear(dim, s.heads * hd, bias=False)  # [heads*hd, dim]
            a.wk = ColumnParallelLinear(dim, s.kv_heads * hd, bias=False)  # [kv_heads*hd, dim]
            a.wv = ColumnParallelLinear(dim, s.kv_heads * hd, bias=False)
            a.wo = RowParallelLinear(s.heads * hd, dim, group, stats)  # [dim, heads*hd]
            f.w1 = ColumnParallelLinear(dim, s.hidden, bias=False)  # [hidden/N, dim]
            f.w3 = ColumnParallelLinear(dim, s.hidden, bias=False)
            f.w2 = RowParallelLinear(s.hidden, dim, group, stats)  # [dim, hidden/N]
        model.tok_embeddings = VocabParallelEmbedding(s.vocab_rows, dim, s.rank * s.vocab_rows, group, stats)
        model.output = ParallelLMHead(s.vocab_rows, dim, config.vocab_size, group, stats)
    model.__class__ = TensorParallelLlama
    model.rank_config = config.replace(n_heads=s.heads, n_kv_heads=s.kv_heads, head_dim=hd)
    model.split, model.comm = s, stats


def build_rank_model(config: LlamaConfig, s: Split, state: dict[str, torch.Tensor], group=None,
                     generation_config: dict | None = None) -> TensorParallelLlama:
    """Rank s.rank's model from its tensors (rank_slices' shapes, vocabulary rows padded to s.vocab_rows):
    materialize with the rank's modules swapped in; a tied head is the embedding's own slice again."""
    stats = CommStats(world=s.world)
    if config.tie_embeddings:
        state = state | {"output.weight": state["tok_embeddings.weight"]}
    model = materialize(config, state, generation_config, swap=lambda meta: _swap(meta, config, s, group, stats))
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise ParallelError("no process group: run under torchrun (torch.distributed.init_process_group), "
                            "or call init_from_environment() first")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(model: Llama, group=None) -> TensorParallelLlama:
    """This rank's shard of a float Llama that every rank holds whole (a new model; drop the whole one).

    For a checkpoint on disk, `load_sharded` reads only the rank's slices instead."""
    if getattr(model, "quantization", None) is not None or isinstance(model, TensorParallelLlama):
        raise ParallelError("shard takes a float, unsharded Llama (quantised or already sharded models are not split)")
    rank, world = _rank_world(group)
    config = model.config
    s = split(config, rank, world)
    full = model.state_dict()
    state = {}
    for name, tensor in full.items():
        if name == "output.weight" and config.tie_embeddings:
            continue
        dim, start, stop = rank_slices(config, s).get(name, (0, 0, tensor.shape[0]))
        piece = tensor.narrow(dim, start, stop - start).clone()  # its own memory: the whole model can go
        state[name] = _pad_rows(piece, s.vocab_rows) if name in ("tok_embeddings.weight", "output.weight") else piece
    return build_rank_model(config, s, state, group, getattr(model, "generation_config", None))


# --------------------------------------------------------------------------------------------------
# Reading only this rank's slices
# --------------------------------------------------------------------------------------------------


def load_sharded(path: str | os.PathLike | None = None, group=None, device=None, dtype=None) -> TensorParallelLlama:
    """This rank's shard of a float checkpoint, read slice by slice from its safetensors files: a rank reads
    (and holds) about 1/N of the layers' bytes plus the replicated norms; `model.bytes_read` says how many.

    The world size is checked against the heads from config.json before any weight is read. Every rank reads its
    own slices and then agrees with the others (process_group.agreeing): one rank's error is every rank's."""
    rank, world = _rank_world(group)
    with agreeing(group):
        path, config, s, state, read, generation_config, both = _read_shard(path, rank, world, device, dtype)
    if both:  # as load_model: tied only when the file's head equals the embedding, on every rank's slice
        same = torch.tensor([int(torch.equal(state["output.weight"], state["tok_embeddings.weight"]))],
                            device=collective_device(group))
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
        if same.item():
            del state["output.weight"]
        else:
            config = config.replace(tie_embeddings=False)
    model = build_rank_model(config, s, state, group, generation_config)
    model.bytes_read = read
    return model


def _read_shard(path, rank: int, world: int, device, dtype):
    """load_sharded's local work, no collective: check the files, read this rank's slices -> (path, config,
    split, state, bytes read, generation config, whether a tied config's file also holds a head)."""
    path = resolve_model_path(path)
    if path.is_file():
        raise ParallelError(f"{path} is a GGUF file; tensor parallelism reads Hugging Face checkpoints slice by "
                            "slice: load it in one process, or write it as one with llmstep.save")
    config = LlamaConfig.from_hf(path)
    if read_quant_config(path) is not None:
        raise ParallelError(f"{path} is quantised; tensor parallelism in llmstep splits float checkpoints only")
    s = split(config, rank, world)  # refuses a world size that cannot split the model, before reading weights
    device = rank_device(device)
    dtype = resolve_dtype(dtype, device, config.torch_dtype)
    found, expected = validate(path, config)
    generation_config = read_generation_config(path)
    slices = rank_slices(config, s)
    both = config.tie_embeddings and "lm_head.weight" in expected  # a tied config whose file also has a head
    if both:
        slices["output.weight"] = slices["tok_embeddings.weight"]
    rank_bytes = sum(_slice_numel(shape, slices.get(ours)) for ours, shape, _ in expected.values())
    check_fits(rank_bytes * torch.empty((), dtype=dtype).element_size(), device,
               f"rank {rank}'s shard of {path.name}")

    state: dict[str, torch.Tensor] = {}
    read = 0
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(found[name][0], []).append(name)
    try:
        for file, names in by_file.items():
            with safe_open(path / file, framework="pt", device="cpu") as f:
                for name in names:
                    ours = expected[name][0]
                    t = _read_slice(f.get_slice(name), slices.get(ours))
                    read += t.nbytes
                    t = t.to(device=device, dtype=dtype)
                    if not torch.isfinite(t).all():
                        raise CheckpointError(f"{path / file}: tensor {name} holds NaN or Inf values in "
                                              f"{str(dtype).removeprefix('torch.')}; the checkpoint is damaged")
                    state[ours] = _pad_rows(t, s.vocab_rows) if ours in ("tok_embeddings.weight", "output.weight") \
                        else t
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: could not read the weights ({e})") from None
    return path, config, s, state, read, generation_config, both


def _slice_numel(shape: tuple[int, ...], sl: tuple[int, int, int] | None) -> int:
    n = 1
    for i, size in enumerate(shape):
        n *= (sl[2] - sl[1]) if sl is not None and sl[0] == i else size
    return n


def _read_slice(view, sl: tuple[int, int, int] | None) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) start:stop of a safetensors tensor, reading only those bytes' rows."""
    if sl is None:
        return view[:]
    dim, start, stop = sl
    return view[start:stop] if dim == 0 else view[:, start:stop]


def load(path: str | os.PathLike | None = None, group=None, device=None, dtype=None
         ) -> tuple[TensorParallelLlama, Tokenizer]:
    """(this rank's model, tokenizer): `llmstep.load` tensor-parallel. Config and tokenizer are checked first."""
    world = _rank_world(group)[1]
    with agreeing(group):
        path = resolve_model_path(path)
        if path.is_file():
            raise ParallelError(f"{path} is a GGUF file; tensor parallelism reads Hugging Face checkpoints slice by "
                                "slice: load it in one process, or write it as one with llmstep.save")
        config = LlamaConfig.from_hf(path)
        check_split(config, world)
        tokenizer = Tokenizer.from_dir(path)
        if tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(f"{path}: tokenizer.json has {tokenizer.vocab_size} tokens, "
                                  f"but the model's vocabulary is {config.vocab_size}")
        tokenizer.padded_vocab_size = config.vocab_size  # as checkpoint.check_files
    return load_sharded(path, group, device, dtype), tokenizer
