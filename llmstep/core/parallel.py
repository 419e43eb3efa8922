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

Who holds what is one rule (parallel_split.py). `shard(model, group)` makes a rank's model from a loaded one;
`load_sharded(path, group)` is the one loader (llmstep.core.loader) with a RankSlicer, which reads only the
rank's slices of each safetensors tensor (`safe_open(...).get_slice`): no rank holds the whole model. The
model class is unchanged: the modules are swapped and the instance's class becomes TensorParallelLlama (as
FSDP2's fully_shard does), whose one difference is a KV cache of this rank's heads (a per-rank config).
Run it under `torchrun --nproc-per-node N` (gloo on a CPU, NCCL on CUDA GPUs): every rank runs the same
loop on the same (all-gathered) logits, so with one seed (`agree_seed`) all ranks pick the same tokens. The
process group itself (joining it with a bounded timeout, agreeing on a rank's error) is process_group.py: a
load that fails on one rank (its slice of a weight holds a NaN) fails on every rank, with that rank's message.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .checkpoint_layout import Checkpoint, checkpoint_tokenizer, read_checkpoint
from .config import LlamaConfig
from .device import synchronize
from .kv_cache import KVCache
from .linear import Linear, linear
from .loader import Slicer, build, load_dtype, read_state
from .model import Llama, materialize
from .parallel_split import VOCAB_ROWS, Split, check_split, pad_rows, rank_slices, split
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
    local_rank,
    peer_failure,
    rank_device,
    timeout_seconds,
)
from .registry import resolve_model_path
from .tokens import Tokenizer

__all__ = ["ParallelError", "Split", "CommStats", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "ParallelLMHead", "TensorParallelLlama", "check_split", "split", "rank_slices",
           "build_rank_model", "shard", "load_sharded", "load", "launched_by_torchrun", "launched_world_size",
           "init_from_environment", "rank_device", "collective_device", "local_rank", "agree_seed", "finish",
           "is_sharded", "RankFailed", "leaving", "peer_failure", "timeout_seconds", "RankSlicer", "pad_rows"]


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


class ColumnParallelLinear(Linear):
    """Output features out/N of a Linear: y_r = x W_r^T, [.., in] -> [.., out/N]. No communication: what
    follows (attention per head, silu(gate) * up) is local to the rank's slice."""


class RowParallelLinear(Linear):
    """Input features in/N of a Linear: each rank's x_r W_r^T is a partial sum of x W^T; one all-reduce adds
    them. [.., in/N] -> [.., out], the same on every rank."""

    def __init__(self, in_features: int, out_features: int, group=None, stats: CommStats | None = None):
        super().__init__(in_features, out_features, bias=False)
        self.group, self.stats = group, stats if stats is not None else CommStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(linear(x, self.weight), self.group, self.stats)  # [.., out]


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


class ParallelLMHead(Linear):
    """LM-head rows start .. start + rows [rows, dim]: each rank scores its slice of the vocabulary, an
    all-gather concatenates the N slices, the padding columns are cut off: [B, T, dim] -> [B, T, vocab]."""

    def __init__(self, rows: int, dim: int, vocab_size: int, group=None, stats: CommStats | None = None):
        super().__init__(dim, rows, bias=False)
        self.vocab_size, self.group, self.stats = vocab_size, group, stats if stats is not None else CommStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight).contiguous()  # [B, T, rows]
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
        state[name] = pad_rows(piece, s.vocab_rows) if name in ("tok_embeddings.weight", "output.weight") else piece
    return build_rank_model(config, s, state, group, getattr(model, "generation_config", None))


# --------------------------------------------------------------------------------------------------
# Reading only this rank's slices: the one loader (llmstep.core.loader) with a rank's slicer
# --------------------------------------------------------------------------------------------------


class RankSlicer(Slicer):
    """Rank s.rank's rows or columns of each tensor (rank_slices), read from the file alone (safetensors'
    get_slice), its vocabulary rows padded to s.vocab_rows; the norms whole."""

    direct = False  # slices are read on the CPU, then moved

    def __init__(self, config: LlamaConfig, s: Split, group=None):
        self.split, self.group = s, group
        self.slices = rank_slices(config, s)
        if config.tie_embeddings:  # a tied config whose file also holds a head: sliced as the embedding
            self.slices["output.weight"] = self.slices["tok_embeddings.weight"]

    def shape(self, ours: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if ours not in self.slices:
            return shape
        dim, start, stop = self.slices[ours]
        return tuple(stop - start if i == dim else size for i, size in enumerate(shape))

    def need(self, ckpt: Checkpoint, dtype: torch.dtype) -> tuple[int, str]:
        numel = sum(math.prod(self.shape(ours, shape)) for ours, shape, _ in ckpt.tensors[1].values())
        return numel * dtype.itemsize, f"rank {self.split.rank}'s shard of {ckpt.path.name}"

    def read(self, file, name: str, ours: str) -> torch.Tensor:
        view = file.get_slice(name)
        if ours not in self.slices:
            return view[:]
        dim, start, stop = self.slices[ours]
        return view[start:stop] if dim == 0 else view[:, start:stop]  # only those rows' bytes are read

    def place(self, ours: str, t: torch.Tensor) -> torch.Tensor:
        return pad_rows(t, self.split.vocab_rows) if ours in VOCAB_ROWS else t

    def all_ranks(self, flag: bool) -> bool:
        every = torch.tensor([int(flag)], device=collective_device(self.group))
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.group)
        return bool(every.item())

    def materialize(self, config: LlamaConfig, state: dict[str, torch.Tensor], generation_config: dict
                    ) -> TensorParallelLlama:
        return build_rank_model(config, self.split, state, self.group, generation_config)


def load_sharded(path: str | os.PathLike | Checkpoint | None = None, group=None, device=None, dtype=None
                 ) -> TensorParallelLlama:
    """This rank's shard of a float checkpoint (a directory, or one already read), read slice by slice from its
    safetensors files: a rank reads (and holds) about 1/N of the layers' bytes plus the replicated norms;
    `model.bytes_read` says how many.

    The world size is checked against the heads from config.json before any weight is read. Every rank reads its
    own slices and then agrees with the others (process_group.agreeing): one rank's error is every rank's."""
    rank, world = _rank_world(group)
    with agreeing(group):
        ckpt = path if isinstance(path, Checkpoint) else _checkpoint(path)
        if ckpt.quantization is not None:
            raise ParallelError(f"{ckpt.path} is quantised; tensor parallelism in llmstep splits float checkpoints "
                                "only")
        s = split(ckpt.config, rank, world)  # refuses a world size that cannot split the model, before any read
        slicer = RankSlicer(ckpt.config, s, group)
        device = rank_device(device)
        dtype = load_dtype(ckpt.config, device, dtype)
        state, taken = read_state(ckpt, device, dtype, slicer, progress=False)
    model = build(ckpt, state, dtype, slicer)  # a tied head: tied only if equal on every rank (a collective)
    model.bytes_read = taken
    return model


def _checkpoint(path) -> Checkpoint:
    path = resolve_model_path(path)
    if path.is_file():
        raise ParallelError(f"{path} is a GGUF file; tensor parallelism reads Hugging Face checkpoints slice by "
                            "slice: load it in one process, or write it as one with llmstep.save")
    return read_checkpoint(path)


def load(path: str | os.PathLike | None = None, group=None, device=None, dtype=None
         ) -> tuple[TensorParallelLlama, Tokenizer]:
    """(this rank's model, tokenizer): `llmstep.load` tensor-parallel. The directory is read once; its config
    and tokenizer are checked first."""
    world = _rank_world(group)[1]
    with agreeing(group):
        ckpt = _checkpoint(path)
        check_split(ckpt.config, world)
        tokenizer = checkpoint_tokenizer(ckpt)
    return load_sharded(ckpt, group, device, dtype), tokenizer
