"""What the notebooks' explorers compute: pure functions, one per widget, each tested on its own.

The widgets (llmstep.lab.explorers) only move sliders and draw; every number they show comes from here,
and everything here comes from the package: the roofline from llmstep.lab.roofline and llmstep.core.cost,
RoPE from llmstep.core.rope, memory from llmstep.core.cost, attention from the model's own projections,
quantization from llmstep.core.quantize, speculative decoding's theory from llmstep.engines.speculative,
and the batching timeline from llmstep.engines.scheduler, driven with made-up tokens (no model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core import quantize
from ..core.checkpoint import DATA_DIR, SHIPPED
from ..core.checks import check_step_context, is_finite_number, is_int
from ..core.config import PRESETS, LlamaConfig
from ..core.cost import decode_step_cost, kv_bytes_per_token, kv_cache_bytes, model_bytes
from ..core.model import Llama
from ..core.rope import apply_rope, config_inv_frequencies, rope_cos_sin
from ..engines.decoding import budget, check_int, check_prompt_ids
from ..engines.kv_manager import KVCacheManager
from ..engines.scheduler import POLICIES, BatchRun, Completion, Job, Scheduler
from ..engines.speculative import best_k, check_costs, check_k, expected_speedup, expected_tokens_per_forward
from .bench_batching import random_workload
from .hardware import Chip, as_chip
from .roofline import attainable_tflops

__all__ = ["model_configs", "RooflinePoint", "roofline_point", "RopeRotation", "rope_rotation", "KVMemory",
           "kv_memory", "attention_weights", "QuantPoint", "quant_error", "quant_options", "SpeculativeCurve",
           "speculative_curve", "simulate_batching"]


def model_configs() -> dict[str, LlamaConfig]:
    """The shapes the explorers offer: the shipped models (their config.json) and the Llama 3.x presets."""
    configs = {}
    for name in SHIPPED.values():
        path = DATA_DIR / "models" / name / "config.json"
        if path.is_file():  # a copy of the package without its data/ has no shipped models
            configs[name] = LlamaConfig.from_hf(path)
    return configs | {name: LlamaConfig.preset(name) for name in PRESETS}


# ---- the roofline (00, 05) --------------------------------------------------------------------------

@dataclass(frozen=True)
class RooflinePoint:
    """One decode step of a batch on a chip, if it ran at the roof."""

    intensity: float  # FLOPs per byte the step moves
    attainable_tflops: float  # the roof there: min(peak, bandwidth x intensity)
    step_seconds: float  # the slower of reading the bytes and doing the FLOPs
    tokens_per_second: float  # batch tokens per step
    bound: str  # "memory" or "compute": which ceiling the step meets

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.step_seconds


def roofline_point(config: LlamaConfig, chip: Chip | str, dtype: torch.dtype | str = "bfloat16", batch: int = 1,
                   context: int = 0) -> RooflinePoint:
    """Where a decode step of `batch` sequences after `context` tokens sits on `chip`'s roofline
    (llmstep.core.cost.decode_step_cost's bytes and FLOPs, llmstep.lab.roofline's roof)."""
    check_int(batch, "batch", low=1)
    check_step_context(context, config.max_seq_len)
    chip = as_chip(chip)
    cost = decode_step_cost(config, context, dtype, batch=batch)
    memory_s = cost.bytes / (chip.memory_gb_per_s * 1e9)
    compute_s = cost.flops / (chip.tensor_tflops * 1e12)
    seconds = max(memory_s, compute_s)
    return RooflinePoint(cost.arithmetic_intensity, attainable_tflops(chip, cost.arithmetic_intensity), seconds,
                         batch / seconds, "memory" if memory_s >= compute_s else "compute")


# ---- RoPE (02) ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeRotation:
    pair: int
    inv_freq: float  # radians per position (after Llama 3.1's scaling, if the config has it)
    wavelength: float  # positions per full turn: 2 pi / inv_freq
    angle: float  # radians turned at `position` (not wrapped)
    trail: torch.Tensor  # [position + 1, 2]: the pair (x_i, x_{i + hd/2}) of a unit vector, rotated to 0..position
    wavelengths: torch.Tensor  # [head_dim / 2]: every pair's wavelength, for context


MAX_TRAIL = 10_000  # the longest trail rope_rotation draws: trail x head_dim float64 numbers, three times (cos, sin, x)


def rope_rotation(config: LlamaConfig, position: int, pair: int, trail: int = 64) -> RopeRotation:
    """Pair `pair` of a head vector, (1, 0) at position 0, rotated by llmstep.core.rope to positions
    max(0, position - trail) .. position: the path the widget draws on the unit circle (trail at most MAX_TRAIL)."""
    check_int(position, "position")
    check_int(pair, "pair")
    check_int(trail, "trail")
    if trail > MAX_TRAIL:
        raise ValueError(f"trail must be at most {MAX_TRAIL:,} positions (a path the widget can draw), got {trail:,}")
    if pair >= config.head_dim // 2:
        raise ValueError(f"pair must be below head_dim / 2 = {config.head_dim // 2}, got {pair}")
    inv_freq = config_inv_frequencies(config)  # [hd/2]
    positions = torch.arange(max(0, position - trail), position + 1)[None]  # [1, P]
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float64)  # [1, P, hd]
    x = torch.zeros(1, 1, positions.shape[1], config.head_dim, dtype=torch.float64)  # [B=1, heads=1, P, hd]
    x[..., pair] = 1.0
    rotated = apply_rope(x, cos, sin)[0, 0]  # [P, hd]
    half = config.head_dim // 2
    f = float(inv_freq[pair])
    return RopeRotation(pair, f, 2 * math.pi / f, position * f, rotated[:, [pair, pair + half]],
                        2 * math.pi / inv_freq.double())


# ---- memory (03) -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVMemory:
    weights_bytes: int
    kv_bytes: int  # a cache of batch x context positions
    per_token_bytes: float  # one position of one sequence

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes


def kv_memory(config: LlamaConfig, context: int, batch: int = 1, dtype: torch.dtype | str = "bfloat16") -> KVMemory:
    """The weights and a KV cache of `batch` sequences x `context` positions (llmstep.core.cost), `context` at most
    the model's window."""
    if not is_int(context) or not 1 <= context <= config.max_seq_len:
        raise ValueError(f"context must be an integer in 1..{config.max_seq_len} (the model's context), "
                         f"got {context!r}")
    check_int(batch, "batch", low=1)
    return KVMemory(model_bytes(config, dtype), kv_cache_bytes(config, batch, context, dtype),
                    kv_bytes_per_token(config, dtype))


# ---- the attention pattern (03) ---------------------------------------------------------------------

@torch.inference_mode()
def attention_weights(model: Llama, ids: list[int] | torch.Tensor, layer: int) -> torch.Tensor:
    """The attention probabilities of every head of block `layer` over a prompt: [n_heads, T, T], row t the
    weights query t gives keys 0..t (causal: the rest are 0). Computed from what the model's own attention
    receives in a forward (captured with a pre-hook): its projections, RoPE, softmax(q k^T / sqrt(hd))."""
    check_int(layer, "layer")
    if layer >= model.config.n_layers:
        raise ValueError(f"layer must be below n_layers = {model.config.n_layers}, got {layer}")
    ids = check_prompt_ids(ids, model.config.vocab_size, math.inf)  # integers in the vocabulary; length below
    tokens = torch.tensor([ids], device=model.device)  # [1, T]
    if not 1 <= tokens.shape[1] <= model.config.max_seq_len:
        raise ValueError(f"the prompt must hold 1..{model.config.max_seq_len} tokens, got {tokens.shape[1]}")
    seen = {}
    attn = model.layers[layer].attention
    if attn.wq is None:  # core.fuse.fused joined them into wqkv
        raise ValueError("attention_weights reads wq and wk apart: give the model before fusing (core.fuse.fused)")
    handle = attn.register_forward_pre_hook(lambda m, args: seen.update(args=args))  # returns None: args unchanged
    try:
        model(tokens)
    finally:
        handle.remove()
    x, cos, sin = seen["args"][:3]  # x [1, T, dim] (normed), cos/sin [1, T, hd]
    T, c = tokens.shape[1], model.config
    q = attn.wq(x).view(1, T, c.n_heads, c.head_dim).transpose(1, 2)  # [1, H, T, hd]
    k = attn.wk(x).view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [1, KV, T, hd]
    q, k = apply_rope(q, cos, sin).float(), apply_rope(k, cos, sin).float()
    k = k.repeat_interleave(c.n_rep, dim=1)  # [1, H, T, hd]: query head h reads KV head h // n_rep
    scores = q @ k.transpose(-2, -1) / c.head_dim ** 0.5  # [1, H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)[0].cpu()  # [H, T, T]


# ---- quantization (07) ------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantPoint:
    mode: str
    group_size: int | None
    bits_per_weight: float  # stored bytes (codes, scales, zeros) x 8 / weights
    relative_error: float  # ||w - dequantized|| / ||w|| (Frobenius)
    max_error: float  # the largest |w - dequantized| of any weight
    error: torch.Tensor  # [N, K]: w - dequantized, for the histogram


def quant_error(w: torch.Tensor, mode: str, group_size: int | None = None,
                scale_dtype: torch.dtype = torch.bfloat16) -> QuantPoint:
    """Quantize w [N, K] with llmstep.core.quantize (int8 per row, or int4 per group of `group_size`), widen it
    back and measure the error; scales (and zeros) stored in scale_dtype, as in a model of that dtype. An all-zero
    w is stored exactly: relative error 0."""
    qc = quantize.QuantConfig(mode, group_size)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or 0 in w.shape:
        raise ValueError(f"w must be a non-empty matrix [N, K], got {tuple(w.shape) if hasattr(w, 'shape') else w!r}")
    w = w.detach().float().cpu()
    if not torch.isfinite(w).all():
        raise ValueError("w holds NaN or infinite weights: a quantization error is measured on finite ones")
    if qc.mode == "int8":
        codes, scales = quantize.quantize_int8(w, scale_dtype)
        stored, back = codes.nbytes + scales.nbytes, quantize.dequantize_int8(codes, scales)
    else:
        packed, scales, zeros = quantize.quantize_int4(w, qc.group_size, scale_dtype)
        stored, back = packed.nbytes + scales.nbytes + zeros.nbytes, quantize.dequantize_int4(packed, scales, zeros)
    err = w - back  # [N, K]
    norm, err_norm = float(w.norm()), float(err.norm())
    relative = err_norm / norm if norm else 0.0  # w all zeros: stored exactly (err_norm 0 too)
    return QuantPoint(qc.mode, qc.group_size, 8 * stored / w.numel(), relative, float(err.abs().max()), err)


def quant_options(in_features: int) -> list[tuple[str, int | None]]:
    """The settings the widget offers for a matrix of `in_features` inputs: int8, and int4 at every power-of-two
    group size from 16 to in_features that divides it."""
    sizes = [g for g in (2 ** i for i in range(4, 20)) if g <= in_features and in_features % g == 0]
    return [("int8", None)] + [("int4", g) for g in sizes]


# ---- speculative decoding (08) ----------------------------------------------------------------------

@dataclass(frozen=True)
class SpeculativeCurve:
    acceptance: float
    cost_ratio: float
    speedups: list[float]  # speedups[k - 1]: the expected speedup with k draft tokens per round
    tokens_per_forward: list[float]  # the same for the tokens one target forward yields
    best_k: int
    verify_cost: float = 1.0  # a (k+1)-token target forward, in one-token forwards (the same for every k)

    @property
    def best_speedup(self) -> float:
        return self.speedups[self.best_k - 1]


MAX_K = 1024  # the longest speculative_curve: lists of k_max speedups (k_max = 10**9 ran for ever)


def speculative_curve(acceptance: float, cost_ratio: float, k_max: int = 16,
                      verify_cost: float = 1.0) -> SpeculativeCurve:
    """Expected speedup over target-only decoding for k = 1..k_max (Leviathan et al.; llmstep.engines.speculative),
    when a draft forward costs `cost_ratio` target forwards and verifying k+1 tokens costs `verify_cost` one-token
    forwards, for every k (1: a memory-bound verification; notebook 08 measures it)."""
    if not (is_finite_number(acceptance) and 0 <= acceptance <= 1):
        raise ValueError(f"acceptance must be a number in [0, 1], got {acceptance!r}")
    if not (is_finite_number(verify_cost) and verify_cost > 0):
        raise ValueError(f"verify_cost must be a finite number > 0 (one-token forwards), got {verify_cost!r}")
    if cost_ratio is None:  # check_costs lets None by (a draft not measured yet); a curve needs its cost
        raise ValueError("cost_ratio must be a finite number >= 0 (a draft forward in target forwards), got None")
    check_costs(cost_ratio, None)
    check_k(k_max)
    if k_max > MAX_K:
        raise ValueError(f"k_max must be at most {MAX_K:,} draft tokens per round (a curve to draw), "
                         f"got {k_max:,}")
    ks = range(1, k_max + 1)
    return SpeculativeCurve(acceptance, cost_ratio,
                            [expected_speedup(acceptance, k, cost_ratio, verify_cost) for k in ks],
                            [expected_tokens_per_forward(acceptance, k) for k in ks],
                            best_k(acceptance, cost_ratio, k_max, [verify_cost]), verify_cost)


# ---- batching (09) -----------------------------------------------------------------------------------

MAX_SIM_SLOTS = 1024  # simulate_batching's most slots: past its requests they sit idle, yet each is in every row


def simulate_batching(n_slots: int, arrival_rate: float, n_requests: int = 24, policy: str = "continuous",
                      seed: int = 0, new_tokens: tuple[int, int] = (4, 96),
                      prompt_len: tuple[int, int] = (8, 48)) -> BatchRun:
    """llmstep.engines.scheduler's schedule for llmstep.lab.bench_batching.random_workload's requests (Poisson
    arrivals, `arrival_rate` per engine step; lengths drawn from the ranges; the same seed, the same workload),
    driven as ContinuousBatcher.run drives it with a made-up token in place of the model's. Slots are long enough
    for every request, so each makes all its new tokens: the timeline is the one `run_batch` gives for the same
    workload (tests/lab/test_explorers.py checks it), in no time and without a model."""
    check_int(n_slots, "n_slots", low=1)
    if n_slots > MAX_SIM_SLOTS:  # every engine step is a row of n_slots in the timeline
        raise ValueError(f"n_slots must be at most {MAX_SIM_SLOTS:,} (every engine step records a row of them), "
                         f"got {n_slots:,}")
    check_int(n_requests, "n_requests", low=1)
    if not (is_finite_number(arrival_rate) and arrival_rate > 0):  # random_workload's None (all at once) too
        raise ValueError(f"arrival_rate must be a finite number > 0 (requests per engine step), got {arrival_rate!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown batching policy {policy!r}: choose one of {', '.join(POLICIES)}")
    requests = random_workload(n_requests, 2, prompt_len, new_tokens, arrival_rate, seed)  # refuses a bad range
    slot_len = prompt_len[1] + new_tokens[1]
    jobs = [Job(Completion(id=i, prompt_ids=r.prompt_ids, arrival=r.arrival),
                budget(len(r.prompt_ids), r.max_new_tokens, slot_len), set()) for i, r in enumerate(requests)]
    ticks = iter(range(10**9))
    kv = KVCacheManager(n_slots, slot_len)  # ContinuousBatcher's: a slot is one block
    try:  # the scheduler refuses an arrival past the steps a run records, as the batchers do
        scheduler = Scheduler(jobs, n_slots, kv, policy=policy, clock=lambda: float(next(ticks)))
    except ValueError as e:
        raise ValueError(f"arrival_rate {arrival_rate!r} spreads the {n_requests} requests too far: {e}") from None
    return scheduler.dry_run(1)  # steps, not seconds
