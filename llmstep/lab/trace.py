"""The one-token trace: where one decode step spends its time, its bytes and its FLOPs.

`trace_step` fills a KV cache to `context` tokens, then runs ordinary decode steps (the model's own
forward, then `sampling.sample`) and times each stage as it happens. Nothing of the forward is
rewritten: forward hooks on the model's modules and thin timing wrappers around the functions it calls
(`rope_cos_sin`, `apply_rope`, `scaled_dot_product_attention`, the cache's `write`) mark the moment a
stage starts and ends; whatever runs between two marks (residual adds, reshapes, the mask, Python)
is booked as "other". The stage times therefore add up to the traced step exactly.

Bytes and FLOPs per stage follow llmstep.core.cost's accounting (weights streamed once as the model holds
them, float or quantized, one embedding row gathered, the KV cache read by attention, 2 FLOPs per
multiply-add of the matmuls and of attention), so they sum to `model_step_cost` - checked every time.

Timing a stage means waiting for it (a GPU sync at every mark), which slows a GPU step down; the
untraced step time is measured too (`Trace.step_seconds`) so the two can be compared.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..core import attention as attention_module
from ..core import attention_backend
from ..core import model as model_module
from ..core.checks import check_int, check_step_context
from ..core.cost import StepCost, model_step_cost
from ..core.device import synchronize
from ..core.model import LAST, Llama
from ..core.sampling import check_params, sample
from ..engines.decoding import check_prompt_ids
from .runinfo import median, time_repeats

__all__ = ["STAGES", "StageRow", "Trace", "stage_costs", "expected_calls", "trace_step", "plot_trace"]

# The stages in the order a token meets them.
STAGES = ("embedding", "rope tables", "attention norm", "qkv projection", "rope", "kv-cache write",
          "attention", "o projection", "mlp norm", "mlp (SwiGLU)", "final norm", "lm head", "sampling",
          "other")


def _stored_bytes(*modules: nn.Module) -> float:
    """Bytes the modules' weights take as stored: a float linear's or a norm's weight, a quantized linear's
    codes, scales and zeros (its `.nbytes`, llmstep.core.quantize)."""
    return float(sum(m.nbytes if hasattr(m, "nbytes") else m.weight.nbytes for m in modules))


def stage_costs(model: Llama, context: int) -> dict[str, tuple[float, float]]:
    """Stage -> (bytes, FLOPs) of one decode step of `model`, split the way llmstep.core.cost counts the whole:
    each stage's weight bytes as its modules hold them (float or quantized), FLOPs from the config."""
    c, L = model.config, model.config.n_layers
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    cost = model_step_cost(model, context=context)
    blocks = list(model.layers)
    emb = model.tok_embeddings.weight
    head_weight = getattr(model.output, "weight", None)
    tied = head_weight is emb  # a tied float head streams the whole table; otherwise one row is gathered
    costs = dict.fromkeys(STAGES, (0.0, 0.0))  # norms' and sampling's few FLOPs are not counted by cost
    costs |= {
        "embedding": (0.0 if tied else float(emb.shape[1] * emb.element_size()), 0.0),
        "attention norm": (_stored_bytes(*(b.attention_norm for b in blocks)), 0.0),
        "qkv projection": (_stored_bytes(*(m for b in blocks for m in _projections(b.attention))),
                           2.0 * L * c.dim * (q_dim + 2 * kv_dim)),
        "attention": (cost.kv_bytes, 4.0 * L * c.n_heads * c.head_dim * (context + 1)),  # q.k and p.v
        "o projection": (_stored_bytes(*(b.attention.wo for b in blocks)), 2.0 * L * q_dim * c.dim),
        "mlp norm": (_stored_bytes(*(b.ffn_norm for b in blocks)), 0.0),
        "mlp (SwiGLU)": (_stored_bytes(*(m for b in blocks for m in _projections(b.feed_forward))),
                         2.0 * L * 3 * c.dim * c.hidden_dim),
        "final norm": (_stored_bytes(model.norm), 0.0),
        "lm head": (_stored_bytes(model.output), 2.0 * c.vocab_size * c.dim),
    }
    total_bytes, total_flops = (sum(v[i] for v in costs.values()) for i in (0, 1))
    if abs(total_bytes - cost.bytes) > 1e-6 * cost.bytes or abs(total_flops - cost.flops) > 1e-6 * cost.flops:
        raise AssertionError("trace.stage_costs no longer matches llmstep.core.cost.model_step_cost; update it")
    return costs


@dataclass(frozen=True)
class StageRow:
    stage: str
    calls: int  # how many times the stage ran in one step (n_layers for per-layer stages)
    seconds: float  # median over the traced steps
    bytes: float  # read from memory (llmstep.core.cost accounting)
    flops: float
    share: float  # of the traced step's time, 0..1

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12


@dataclass(frozen=True)
class Trace:
    rows: list[StageRow]
    context: int  # tokens in the cache before the traced step
    step_seconds: float  # an ordinary, untraced step (forward + sampling), median
    cost: StepCost  # the whole step's bytes and FLOPs (llmstep.core.cost.model_step_cost)
    device: str
    dtype: str
    repeats: int
    attention: dict = field(default_factory=dict)  # the attention backend asked for (attention_backend.describe)

    @property
    def traced_seconds(self) -> float:
        """The traced step: the sum of the stages (slower than step_seconds by the marks' cost)."""
        return sum(r.seconds for r in self.rows)

    def row(self, stage: str) -> StageRow:
        for r in self.rows:
            if r.stage == stage:
                return r
        raise KeyError(f"no stage {stage!r}; stages: {', '.join(r.stage for r in self.rows)}")

    def busy_fraction(self, peak_tflops: float) -> float:
        """The share of the step the math units are busy: FLOPs done / (step time x peak FLOP/s)."""
        if not peak_tflops > 0:
            raise ValueError(f"peak_tflops must be positive, got {peak_tflops}")
        return self.cost.flops / (self.step_seconds * peak_tflops * 1e12)

    def achieved_gb_per_s(self) -> float:
        """Bytes the step had to read over the (untraced) time it took."""
        return self.cost.bytes / self.step_seconds / 1e9

    def as_dicts(self) -> list[dict[str, float | str | int]]:
        return [{"stage": r.stage, "calls": r.calls, "ms": r.seconds * 1e3, "share %": 100 * r.share,
                 "MB read": r.bytes / 1e6, "MFLOP": r.flops / 1e6, "GB/s": r.gb_per_s, "TFLOP/s": r.tflops}
                for r in self.rows]

    def table(self, peak_tflops: float | None = None) -> str:
        """The trace as text; with peak_tflops, each stage's math-unit busy share too."""
        head = f"{'stage':<16}{'calls':>6}{'ms':>9}{'share':>8}{'MB read':>10}{'MFLOP':>10}{'GB/s':>8}"
        head += f"{'busy':>8}" if peak_tflops else ""
        lines = [head]
        for r in self.rows:
            line = (f"{r.stage:<16}{r.calls:>6}{r.seconds * 1e3:>9.3f}{100 * r.share:>7.1f}%"
                    f"{r.bytes / 1e6:>10.2f}{r.flops / 1e6:>10.2f}{r.gb_per_s:>8.2f}")
            if peak_tflops:
                line += f"{100 * r.tflops / peak_tflops:>7.2f}%"
            lines.append(line)
        lines.append(f"{'traced step':<16}{'':>6}{self.traced_seconds * 1e3:>9.3f}{100.0:>7.1f}%"
                     f"{self.cost.bytes / 1e6:>10.2f}{self.cost.flops / 1e6:>10.2f}"
                     f"{self.cost.bytes / self.traced_seconds / 1e9:>8.2f}")
        lines.append(f"{'untraced step':<16}{'':>6}{self.step_seconds * 1e3:>9.3f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class _Clock:
    """Marks: the time since the previous mark goes to 'other' at a stage's start, to the stage at its end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.last = 0.0
        self.depth = 0  # a stage called from inside another is part of the outer one

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def start(self):
        self.last = self._now()

    def enter(self):
        self.depth += 1
        if self.depth == 1:
            now = self._now()
            self.seconds["other"] += now - self.last
            self.last = now

    def exit(self, stage: str):
        self.depth -= 1
        if self.depth == 0:
            now = self._now()
            self.seconds[stage] += now - self.last
            self.calls[stage] += 1
            self.last = now

    def wrap(self, fn, stage: str):
        def timed(*args, **kwargs):
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit(stage)
        return timed


class _Functional:
    """torch.nn.functional as llmstep.core.attention sees it, with scaled_dot_product_attention timed."""

    def __init__(self, sdpa):
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name):
        return getattr(F, name)


def _projections(block: nn.Module) -> list[nn.Module]:
    """An attention's q, k, v projections or an MLP's gate, up and down, as the model holds them: separate, or
    joined by `core.fuse.fused` (wqkv; w13 beside w2)."""
    names = ("wq", "wk", "wv", "wqkv") if hasattr(block, "wqkv") else ("w1", "w3", "w2", "w13")
    return [m for m in (getattr(block, name, None) for name in names) if m is not None]


@contextmanager
def _instrument(model: Llama, cache, clock: _Clock):
    """Hooks and wrappers on, for the duration; everything restored afterwards."""
    with ExitStack() as stack:
        def hook(module, stage):
            pre = module.register_forward_pre_hook(lambda m, a: clock.enter())
            post = module.register_forward_hook(lambda m, a, o: clock.exit(stage))
            stack.callback(pre.remove)
            stack.callback(post.remove)

        hook(model.tok_embeddings, "embedding")
        for layer in model.layers:
            hook(layer.attention_norm, "attention norm")
            for proj in _projections(layer.attention):  # wq, wk, wv, or a fused model's wqkv
                hook(proj, "qkv projection")
            hook(layer.attention.wo, "o projection")
            hook(layer.ffn_norm, "mlp norm")
            hook(layer.feed_forward, "mlp (SwiGLU)")
        hook(model.norm, "final norm")
        hook(model.output, "lm head")

        patches = [(model_module, "rope_cos_sin", clock.wrap(model_module.rope_cos_sin, "rope tables")),
                   (attention_module, "apply_rope", clock.wrap(attention_module.apply_rope, "rope")),
                   (attention_module, "F", _Functional(clock.wrap(F.scaled_dot_product_attention, "attention")))]
        for namespace, name, replacement in patches:
            original = getattr(namespace, name)
            setattr(namespace, name, replacement)
            stack.callback(setattr, namespace, name, original)
        cache.write = clock.wrap(cache.write, "kv-cache write")  # an instance attribute shadows the method
        stack.callback(delattr, cache, "write")
        yield


def expected_calls(model: Llama) -> dict[str, int]:
    """How many times each stage runs in one decode step of `model` (per block stages: once per layer)."""
    L = model.config.n_layers
    qkv = sum(len(_projections(b.attention)) for b in model.layers)  # 3 a layer, or 1 fused
    return {"embedding": 1, "rope tables": 1, "attention norm": L, "qkv projection": qkv, "rope": 2 * L,
            "kv-cache write": L, "attention": L, "o projection": L, "mlp norm": L, "mlp (SwiGLU)": L,
            "final norm": 1, "lm head": 1, "sampling": 1}


@torch.inference_mode()
def trace_step(model: Llama, context: int = 256, repeats: int = 5, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, prompt_ids: list[int] | None = None) -> Trace:
    """Trace one decode step of `model` after `context` tokens (random ids, or the first `context` of
    prompt_ids), at batch 1. Each of `repeats` steps rewinds the cache to `context` and decodes the same
    token again; the median time of each stage is reported, and the median of as many untraced steps (after one
    untraced warm-up step).
    """
    check_step_context(context, model.config.max_seq_len)
    check_int(repeats, "repeats", low=1)
    check_params(temperature, top_k, top_p)
    device, config = model.device, model.config
    g = torch.Generator(device=device).manual_seed(seed)
    if prompt_ids is None:
        ids = torch.randint(0, config.vocab_size, (1, context + 1), device=device, generator=g)
    else:
        if len(prompt_ids) < context + 1:
            raise ValueError(f"prompt_ids has {len(prompt_ids)} tokens; tracing after {context} needs {context + 1}")
        ids = torch.tensor([check_prompt_ids(list(prompt_ids[:context + 1]), config.vocab_size, math.inf)],
                           device=device)
    cache = model.new_cache(batch_size=1, max_len=context + 1)
    if context:
        model(ids[:, :context], cache=cache, keep=LAST)  # prefill: the cache now holds `context` tokens
    token = ids[:, context:]  # [1, 1]: the token whose step is traced

    def step():
        cache.rollback(context)
        logits = model(token, cache=cache, keep=LAST)[:, -1]  # [1, vocab]
        return sample(logits, temperature, top_k, top_p, g)

    untraced = time_repeats(step, device, repeats, warmup=1)  # the ordinary step, no marks

    per_stage: dict[str, list[float]] = {s: [] for s in STAGES}
    clock = _Clock(device)
    expected = expected_calls(model)
    with _instrument(model, cache, clock):
        sample_timed = clock.wrap(sample, "sampling")
        for _ in range(repeats):
            clock.seconds = dict.fromkeys(STAGES, 0.0)
            clock.calls = dict.fromkeys(STAGES, 0)
            cache.rollback(context)
            clock.start()
            logits = model(token, cache=cache, keep=LAST)[:, -1]
            sample_timed(logits, temperature, top_k, top_p, g)
            missing = {s: (clock.calls[s], n) for s, n in expected.items() if clock.calls[s] != n}
            if missing:
                raise RuntimeError(f"the trace saw an unexpected number of calls (seen, expected): {missing}; "
                                   "the model's forward has changed, update llmstep.lab.trace")
            for s in STAGES:
                per_stage[s].append(clock.seconds[s])

    costs = stage_costs(model, context)
    seconds = {s: median(v) for s, v in per_stage.items()}
    total = sum(seconds.values())
    calls = dict(expected, other=0)
    rows = [StageRow(s, calls[s], seconds[s], costs[s][0], costs[s][1], seconds[s] / total) for s in STAGES]
    return Trace(rows, context, median(untraced), model_step_cost(model, context),
                 str(device), str(model.dtype).removeprefix("torch."), repeats, attention_backend.describe(device))


def plot_trace(trace: Trace, ax=None, peak_tflops: float | None = None):
    """Horizontal bars: each stage's share of the step's time next to its share of the bytes read.
    Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    rows = trace.rows[::-1]  # first stage on top
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [100 * r.share for r in rows], height=0.4, label="time")
    ax.barh([i - 0.2 for i in y], [100 * r.bytes / trace.cost.bytes for r in rows], height=0.4, label="bytes read")
    ax.set_yticks(list(y), [r.stage for r in rows])
    ax.set_xlabel("% of the decode step")
    title = f"One decode step after {trace.context} tokens ({trace.device}, {trace.dtype})"
    if peak_tflops:
        title += f"\nmath units busy {100 * trace.busy_fraction(peak_tflops):.2f}% of the step"
    ax.set_title(title)
    ax.legend(loc="lower right")
    return ax
