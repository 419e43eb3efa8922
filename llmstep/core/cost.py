"""What one token costs: parameters, bytes and FLOPs, from the config alone.

Every figure in the course (the roofline, the trace, the CLI summary, the notebooks) comes from here,
so they agree. Bytes are per decode step at batch 1: each weight is read once per step, whatever the
batch, while the KV cache is read once per sequence.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checks import check_int
from .config import LlamaConfig
from .device import DTYPE_NAMES, resolve_dtype
from .norm import RMSNorm

__all__ = ["param_counts", "n_params", "as_dtype", "dtype_bytes", "StepCost", "decode_step_cost", "kv_bytes_per_token",
           "weight_bytes", "model_step_cost", "mean_step_cost", "step_bytes", "step_bytes_by_context", "training_bytes",
           "model_bytes", "checkpoint_bytes", "kv_cache_bytes", "free_memory_bytes", "check_fits", "MemoryBudgetError"]


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or a float dtype's name as load takes it ("bfloat16", "bf16", "half", ...: core.device's
    names); any other name, or another type, is refused with the choices."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return resolve_dtype(dtype, torch.device("cpu"))  # a name, never "auto": no device's policy applies
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or one of {', '.join(sorted(DTYPE_NAMES))}, got {dtype!r}")
    return dtype


def dtype_bytes(dtype: torch.dtype | str) -> float:
    """Bytes per element of a torch dtype (or a float dtype's name: `as_dtype`)."""
    return torch.empty((), dtype=as_dtype(dtype)).element_size()


def param_counts(config: LlamaConfig) -> dict[str, int]:
    """Parameters per component, the whole stack (all layers) for the per-layer parts."""
    c = config
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    counts = {
        "embedding": c.vocab_size * c.dim,
        "attention": c.n_layers * (c.dim * q_dim + 2 * c.dim * kv_dim + q_dim * c.dim),  # wq, wk, wv, wo
        "mlp": c.n_layers * 3 * c.dim * c.hidden_dim,  # w1 (gate), w3 (up), w2 (down)
        "norms": (2 * c.n_layers + 1) * c.dim,  # two RMSNorm per block, one final
        "lm_head": 0 if c.tie_embeddings else c.vocab_size * c.dim,
    }
    return counts


def n_params(config: LlamaConfig) -> int:
    return sum(param_counts(config).values())


def kv_bytes_per_token(config: LlamaConfig, dtype: torch.dtype | str = torch.bfloat16) -> float:
    """KV-cache bytes one token adds: a key and a value vector per KV head per layer."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype_bytes(dtype)


def model_bytes(config: LlamaConfig, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """Bytes of a float model's weights in memory (a tied head counted once)."""
    return int(n_params(config) * dtype_bytes(dtype))


def checkpoint_bytes(config: LlamaConfig, dtype: torch.dtype | str = torch.bfloat16, qc=None) -> int:
    """Bytes of a checkpoint's model in memory: float (`qc` None, = model_bytes) or quantized by `qc`
    (llmstep.core.quantize.QuantConfig: its mode, group_size, lm_head). A quantized matmul [N, K] holds int8
    codes N*K bytes and N scales, or int4 codes N*K/2 bytes and N*K/g scales and zeros; scales, zeros,
    norms and the embedding in `dtype`. A quantized head has its own tensors, also when tied, in its own mode."""
    float_bytes = model_bytes(config, dtype)
    if qc is None:
        return float_bytes
    c, db = config, dtype_bytes(dtype)
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    matmuls = c.n_layers * [(q_dim, c.dim), (kv_dim, c.dim), (kv_dim, c.dim), (c.dim, q_dim),  # wq wk wv wo
                            (c.hidden_dim, c.dim), (c.hidden_dim, c.dim), (c.dim, c.hidden_dim)]  # w1 w3 w2
    replaced = sum(n * k for n, k in matmuls)  # float elements the codes replace

    def codes(n: int, k: int, mode: str, group_size: int | None) -> int:  # codes, scales (and zeros) of [N, K]
        return n * k + n * db if mode == "int8" else n * k // 2 + 2 * n * (k // group_size) * db

    quantized = sum(codes(n, k, qc.mode, qc.group_size) for n, k in matmuls)
    if qc.head is not None:
        quantized += codes(c.vocab_size, c.dim, qc.head.mode, qc.head.group_size)
        replaced += 0 if c.tie_embeddings else c.vocab_size * c.dim  # a tied table stays for the embedding
    return int(float_bytes - replaced * db + quantized)


def kv_cache_bytes(config: LlamaConfig, batch_size: int, max_len: int, dtype: torch.dtype | str = torch.bfloat16
                   ) -> int:
    """Bytes of a preallocated KV cache of batch_size sequences x max_len positions (llmstep.core.kv_cache)."""
    return int(batch_size * max_len * kv_bytes_per_token(config, dtype))


# ---- does it fit? ------------------------------------------------------------------------------------

class MemoryBudgetError(ValueError):
    """An allocation refused before it is made: the estimate is larger than the device's free memory."""


def _cgroup_free_bytes() -> int | None:
    """What a container's memory limit (cgroup v2) still allows, or None where there is no limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    return int(limit) - int(used) if limit.isdigit() and used.isdigit() else None


def _address_space_free_bytes() -> int | None:
    """What `ulimit -v` (RLIMIT_AS) still allows this process to map, or None where it sets no limit."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        mapped = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmSize:"))  # kB
    except (ImportError, OSError, ValueError, StopIteration):
        return None
    return max(0, limit - mapped)


def free_memory_bytes(device: torch.device | str) -> int | None:
    """Memory a new allocation can take on `device`: CUDA's free memory (torch.cuda.mem_get_info), the CPU's
    available RAM (MemAvailable, and a container's limit, and what `ulimit -v` leaves), MPS's recommended budget;
    None where unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":  # and what torch's caching allocator holds unused: free to it, not to the driver
        return torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    if dev.type == "mps":
        try:
            return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
        except (AttributeError, RuntimeError):
            return None
    if dev.type != "cpu":
        return None  # meta and other devices: nothing is allocated, or nothing is known
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    if free is None and hasattr(os, "sysconf"):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            free = None
    limits = [n for n in (free, _cgroup_free_bytes(), _address_space_free_bytes()) if n is not None]
    return min(limits) if limits else None


def check_fits(nbytes: float, device: torch.device | str, what: str) -> None:
    """Refuse, before allocating, `what` of about `nbytes` bytes that the device's free memory cannot hold.

    The one memory check of the package: model builders, KV caches and the benchmarks' presets call it. Where
    the free memory is unknown it lets the allocation go ahead."""
    if torch.device(device).type == "meta":
        return  # shapes only: nothing is allocated
    free = free_memory_bytes(device)
    if free is not None and nbytes > free:
        raise MemoryBudgetError(f"{what} needs about {nbytes / 1e9:,.2f} GB, but {torch.device(device)} has "
                                f"{free / 1e9:,.2f} GB free: choose a smaller model, dtype, batch or context")


def training_bytes(config: LlamaConfig, batch_size: int, seq_len: int) -> float:
    """A lower bound on what one float32 training step holds: the weights, their gradients and AdamW's two
    moments (4 copies of every parameter), and the logits of a batch with their gradient (2 x batch x seq x
    vocab). The activations of every layer come on top."""
    return 4 * 4 * n_params(config) + 2 * 4 * batch_size * seq_len * config.vocab_size


@dataclass(frozen=True)
class StepCost:
    """The cost of one decode step with `context` tokens already in the cache (of every sequence in the batch)."""

    weight_bytes: float  # weights streamed from memory: every matrix once, one embedding row
    kv_bytes: float  # KV cache read by attention
    flops: float  # multiply-adds counted as 2 FLOPs

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved: ~1 for FP16 decode, far left of every GPU's ridge point."""
        return self.flops / self.bytes


def decode_step_cost(config: LlamaConfig, context: int = 0, dtype: torch.dtype | str = torch.bfloat16,
                     weight_bytes_per_param: float | None = None, batch: int = 1, qc=None) -> StepCost:
    """Bytes and FLOPs of generating one token after `context` tokens, for each of `batch` sequences.

    `qc` (llmstep.core.quantize.QuantConfig) counts the weights as a checkpoint quantized by it holds them
    (`checkpoint_bytes`: codes, scales and zeros, the rest in `dtype`): what `weight_bytes` of that model reads.
    `weight_bytes_per_param` instead overrides every weight's storage size (1 for int8, ~0.5 for int4). The KV
    cache stays in `dtype`. A batch reads the weights once and its own KV cache per sequence, and does every
    sequence's arithmetic: its intensity grows ~batch-fold.
    """
    check_int(batch, "batch", low=1)
    check_int(context, "context")  # tokens in the cache: a whole number (mean_step_cost averages two steps' costs)
    if qc is not None and weight_bytes_per_param is not None:
        raise ValueError("give qc (a quantized checkpoint's layout) or weight_bytes_per_param, not both")
    counts = param_counts(config)
    matmul_params = counts["attention"] + counts["mlp"] + config.vocab_size * config.dim
    attn_flops = 4 * config.n_layers * config.n_heads * config.head_dim * (context + 1)  # q.k and p.v
    if weight_bytes_per_param is None:
        # The weights as held, less the embedding table but for the one row a step gathers, unless a tied float
        # head streams the table whole (that row among it).
        streams_table = config.tie_embeddings and (qc is None or qc.head is None)
        table = 0 if streams_table else (config.vocab_size - 1) * config.dim * dtype_bytes(dtype)
        weights = checkpoint_bytes(config, dtype, qc) - table
    else:
        weights = (matmul_params + counts["norms"] + (0 if config.tie_embeddings else config.dim)) \
            * weight_bytes_per_param
    return StepCost(
        weight_bytes=weights,
        kv_bytes=batch * (context + 1) * kv_bytes_per_token(config, dtype),
        flops=batch * (2 * matmul_params + attn_flops),
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step of this model streams, as it is held in memory: every matrix in its
    stored form, the norms, one embedding row. A quantized linear (llmstep.core.quantize) reports its stored
    bytes (codes, scales, zeros) as `.nbytes`; a float model gives decode_step_cost(...).weight_bytes exactly.
    """
    total, seen = 0, set()
    for m in model.modules():
        if isinstance(m, nn.Linear | RMSNorm):
            if id(m.weight) not in seen:
                seen.add(id(m.weight))
                total += m.weight.nbytes
        elif hasattr(m, "nbytes") and hasattr(m, "in_features"):  # a quantized linear
            total += m.nbytes
    emb = model.tok_embeddings.weight
    if id(emb) not in seen:  # not streamed by a tied, unquantized LM head: one row is gathered
        total += emb.shape[1] * emb.element_size()
    return total


def model_step_cost(model: nn.Module, context: int = 0, batch: int = 1) -> StepCost:
    """`decode_step_cost` of a model in memory: its weights as stored (float or quantized), its KV cache's dtype."""
    base = decode_step_cost(model.config, context, dtype=model.dtype, batch=batch)
    return StepCost(weight_bytes=weight_bytes(model), kv_bytes=base.kv_bytes, flops=base.flops)


def mean_step_cost(model: nn.Module, prompt_len: int, new_tokens: int) -> StepCost:
    """`model_step_cost` of the mean decode step of a greedy run of new_tokens after a prompt_len-token prompt (as
    llmstep.lab.bench times it): step i (1 <= i < new_tokens) runs with prompt_len + i - 1 tokens cached. A step's
    KV bytes and FLOPs grow linearly with its context, so the mean step's are the mean of the first step's and the
    last's: those of the mean context, prompt_len + (steps - 1) / 2."""
    steps = max(new_tokens - 1, 1)
    first, last = (model_step_cost(model, context=prompt_len + i) for i in (0, steps - 1))
    return StepCost(first.weight_bytes, (first.kv_bytes + last.kv_bytes) / 2, (first.flops + last.flops) / 2)


def step_bytes(model: nn.Module, context: int = 0) -> float:
    """Bytes one decode forward of `model` reads with `context` tokens cached, float or quantized."""
    return model_step_cost(model, context=context).bytes


def step_bytes_by_context(model: nn.Module, context: int = 0) -> Callable[[int], float]:
    """bytes(c): what one decode step of `model` reads with c tokens in its cache (`step_bytes`), linear in c (the
    weights, plus the same KV bytes per cached token): two walks over the modules per run."""
    at = step_bytes(model, context)
    per_token = step_bytes(model, context + 1) - at
    return lambda c: at + (c - context) * per_token
