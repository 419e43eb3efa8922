"""The course's diagrams, drawn by code from a config or a run's record: no image files to fall out of date.

Each `plot_*` function is pure (its arguments in, a new matplotlib Figure out) and draws only numbers the
package computes: shapes from the LlamaConfig, bytes from llmstep.core.cost (split by stage as
llmstep.lab.trace splits them), a speculative run's rounds from its `Rounds` record, a batching run's slots
from its `BatchRun.timeline`. Change the config and the picture changes with it.

    plot_decode_step(config)       one decode step, stage by stage: shapes, bytes, (optionally) time
    plot_gqa(config)               which query heads share which key/value head
    plot_cache_growth(config, ...) the KV cache over one generation: prefill, then a token's worth per step
    plot_speculative_rounds(run)   each round's accepted, rejected, discarded and bonus tokens
    plot_batching_slots(run)       which request sat in which slot at every engine step (and the queue)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.checks import check_int, check_step_context
from ..core.config import LlamaConfig
from ..core.cost import as_dtype, kv_bytes_per_token, model_bytes, n_params
from ..core.model import Llama
from ..engines.decoding import cache_len
from ..engines.scheduler import BatchRun
from ..engines.speculative import Rounds
from .trace import STAGES, Trace, expected_calls, stage_costs

__all__ = ["StageInfo", "shape_model", "step_stages", "plot_decode_step", "plot_gqa", "plot_cache_growth",
           "plot_speculative_rounds", "plot_batching_slots", "round_tokens", "si"]


def shape_model(config: LlamaConfig, dtype: torch.dtype | str = torch.bfloat16) -> Llama:
    """A model of `config`'s shapes on the meta device: names, shapes and bytes, no memory (an 8B model too)."""
    dtype = as_dtype(dtype)  # a torch dtype or a float dtype's name ("bf16" too); another name is refused
    with torch.device("meta"):
        return Llama(config).to(dtype)


@dataclass(frozen=True)
class StageInfo:
    """One stage of a decode step at batch 1: what goes in and out, what it reads, what it computes."""

    stage: str
    calls: int  # per step: n_layers for a stage inside a block (rope: 2 n_layers, q and k), else 1
    inputs: str  # shapes, e.g. "x [1, 1, 4096]"
    outputs: str
    bytes: float  # read from memory (llmstep.core.cost's accounting, split as llmstep.lab.trace splits it)
    flops: float
    seconds: float | None = None  # from a Trace, where one is given


def _shapes(c: LlamaConfig, context: int) -> dict[str, tuple[str, str]]:
    """Stage -> (inputs, outputs) of one decode step after `context` tokens, batch 1, from the config."""
    H, KV, hd, S = c.n_heads, c.n_kv_heads, c.head_dim, context + 1
    x = f"x [1, 1, {c.dim}]"
    return {
        "embedding": ("token [1, 1]", x),
        "rope tables": ("position [1, 1]", f"cos, sin [1, 1, {hd}]"),
        "attention norm": (x, x),
        "qkv projection": (x, f"q [1, {H}, 1, {hd}], k, v [1, {KV}, 1, {hd}]"),
        "rope": (f"q, k + cos, sin [1, 1, {hd}]", "q, k rotated (same shapes)"),
        "kv-cache write": (f"k, v [1, {KV}, 1, {hd}] at position {context}", f"K, V [1, {KV}, {S}, {hd}]"),
        "attention": (f"q [1, {H}, 1, {hd}], K, V [1, {KV}, {S}, {hd}]", f"[1, {H}, 1, {hd}]"),
        "o projection": (f"[1, 1, {H * hd}]", x),
        "mlp norm": (x, x),
        "mlp (SwiGLU)": (x, f"[1, 1, {c.hidden_dim}] -> {x}"),
        "final norm": (x, x),
        "lm head": (x, f"logits [1, {c.vocab_size}]"),
        "sampling": (f"logits [1, {c.vocab_size}]", "token [1]"),
    }


def step_stages(config: LlamaConfig, context: int = 0, dtype: torch.dtype | str = torch.bfloat16,
                trace: Trace | None = None) -> list[StageInfo]:
    """The stages of one decode step after `context` tokens, in the order a token meets them ("other", the
    time between stages, is left out). Bytes and FLOPs from llmstep.lab.trace.stage_costs on a meta-device
    model; with a `trace` of a model of this config, each stage's measured time too. `context`: 0 .. the model's
    window less the step's own token."""
    check_step_context(context, config.max_seq_len)
    if trace is not None and trace.context != context:
        raise ValueError(f"the trace was taken after {trace.context} tokens, not {context}")
    model = shape_model(config, dtype)
    costs, calls, shapes = stage_costs(model, context), expected_calls(model), _shapes(config, context)
    return [StageInfo(s, calls[s], *shapes[s], *costs[s], None if trace is None else trace.row(s).seconds)
            for s in STAGES if s != "other"]


def si(n: float, unit: str) -> str:
    """n with an SI prefix and 3 significant digits: si(1.5e9, "B") -> "1.5 GB"; the prefix is chosen after rounding,
    so 999,500 is "1 MB", not "1e+03 kB"."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(float(f"{n / scale:.3g}")) >= 1:
            return f"{n / scale:,.3g} {prefix}{unit}"
    return f"{n:,.3g} {unit}"


def plot_decode_step(config: LlamaConfig, context: int = 0, dtype: torch.dtype | str = torch.bfloat16,
                     name: str = "", trace: Trace | None = None, highlight: int | None = None):
    """One decode step as a column of stages, each with its shapes and the bytes it reads (bars, share of the
    step); the stages inside a block are bracketed and marked with their calls per step. With a `trace`, the
    time of each stage too; with `highlight` (a stage index), that stage is marked and the ones before it
    filled: the token's journey so far."""
    import matplotlib.pyplot as plt

    rows = step_stages(config, context, dtype, trace)
    total = sum(r.bytes for r in rows)
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.3))
    ax.set_xlim(0, 1)
    ax.set_ylim(len(rows) - 0.5, -0.9)
    ax.axis("off")
    for i, r in enumerate(rows):
        done = highlight is not None and i <= highlight
        face = "#ffd27f" if i == highlight else "#dce9f5" if highlight is None or done else "#f2f2f2"
        ax.add_patch(plt.Rectangle((0.005, i - 0.4), 0.2, 0.8, facecolor=face, edgecolor="0.4"))
        layer = f"  x{r.calls}" if r.calls > 1 else ""
        ax.text(0.01, i, r.stage + layer, va="center", fontsize=8.5, weight="bold" if i == highlight else None)
        ax.text(0.215, i, f"{r.inputs}  ->  {r.outputs}", va="center", fontsize=7.5, family="monospace")
        share = r.bytes / total
        ax.add_patch(plt.Rectangle((0.75, i - 0.3), 0.16 * share, 0.6, color="C0" if done or highlight is None
                                   else "0.75"))
        label = si(r.bytes, "B") if r.bytes else "-"
        if r.seconds is not None:
            label += f", {r.seconds * 1e3:.3g} ms"
        ax.text(0.915, i, label, va="center", fontsize=7.5)
    inside = [i for i, r in enumerate(rows) if r.calls % config.n_layers == 0 and r.calls > 1]  # in every block
    if config.n_layers > 1 and inside:
        top, bottom = min(inside) - 0.45, max(inside) + 0.45
        ax.plot([0.002, 0.0, 0.0, 0.002], [top, top, bottom, bottom], color="C3", lw=1.5, clip_on=False)
        ax.text(-0.005, (top + bottom) / 2, f"each of {config.n_layers} blocks", rotation=90, va="center",
                ha="right", fontsize=8, color="C3")
    ax.text(0.215, -0.75, "shapes in -> out (batch 1, one new token)", fontsize=8, color="0.3")
    ax.text(0.75, -0.75, "bytes read (bar: share of the step)", fontsize=8, color="0.3")
    dname = str(dtype).removeprefix("torch.")
    ax.set_title(f"One decode step of {name or si(n_params(config), 'params')} ({dname}) after {context:,} tokens: "
                 f"{si(total, 'B')} read, {si(sum(r.flops for r in rows), 'FLOP')}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_gqa(config: LlamaConfig, name: str = "", dtype: torch.dtype | str = torch.bfloat16):
    """Grouped-query attention: each of the n_kv_heads key/value heads serves n_rep = n_heads / n_kv_heads query
    heads (query head h reads KV head h // n_rep, as llmstep.core.attention does), and what that saves in the
    KV cache per token compared with one KV head per query head (MHA)."""
    import matplotlib.pyplot as plt

    H, KV, rep = config.n_heads, config.n_kv_heads, config.n_rep
    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.axis("off")
    w = 1.0 / H
    for h in range(H):
        ax.add_patch(plt.Rectangle((h * w + 0.1 * w, 0.75), 0.8 * w, 0.15, color=f"C{(h // rep) % 10}"))
        kv_center = (h // rep + 0.5) / KV
        ax.plot([(h + 0.5) * w, kv_center], [0.75, 0.35], color=f"C{(h // rep) % 10}", lw=0.8, alpha=0.7)
    for g in range(KV):
        ax.add_patch(plt.Rectangle((g / KV + 0.15 / KV, 0.18), 0.7 / KV, 0.17, color=f"C{g % 10}", alpha=0.85))
        ax.text((g + 0.5) / KV, 0.265, f"K,V {g}", ha="center", va="center", fontsize=8, color="w")
    ax.text(0, 0.95, f"{H} query heads (head_dim {config.head_dim})", fontsize=9)
    ax.text(0, 0.05, f"{KV} key/value heads: each serves {rep} query heads", fontsize=9)
    gqa, mha = kv_bytes_per_token(config, dtype), kv_bytes_per_token(config.replace(n_kv_heads=H), dtype)
    ax.set_title(f"GQA in {name or si(n_params(config), 'params')}: the KV cache holds {si(gqa, 'B')} per token, "
                 f"{H // KV}x less than with one KV head per query head ({si(mha, 'B')})", fontsize=10)
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(0, 1)
    return fig


def plot_cache_growth(config: LlamaConfig, prompt_len: int, max_new_tokens: int,
                      dtype: torch.dtype | str = torch.bfloat16, batch: int = 1, name: str = ""):
    """The KV cache's bytes over one generation: the prompt's keys and values written by the prefill, then one
    token's worth per decode step, against the cache llmstep allocates up front (decoding.cache_len) and the
    weights' bytes."""
    import matplotlib.pyplot as plt

    for what, v, low in (("prompt_len", prompt_len, 1), ("max_new_tokens", max_new_tokens, 1), ("batch", batch, 1)):
        check_int(v, what, low)
    if prompt_len >= config.max_seq_len:
        raise ValueError(f"prompt_len {prompt_len} leaves no room for a new token in the context of "
                         f"{config.max_seq_len}")
    per_token = batch * kv_bytes_per_token(config, dtype)
    slots = cache_len(prompt_len, max_new_tokens, config.max_seq_len)
    # 0: after the prefill; each decode step writes the token before it: the last new token is never written
    steps = list(range(0, min(max_new_tokens - 1, slots - prompt_len) + 1))
    filled = [(prompt_len + s) * per_token for s in steps]  # the new token's own K, V are written in its step
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.step(steps, [f / 1e6 for f in filled], where="post", label="written (prompt, then one token per step)")
    ax.axhline(slots * per_token / 1e6, color="C1", ls="--", label=f"allocated: {slots:,} positions")
    ax.axhline(model_bytes(config, dtype) / 1e6, color="C2", ls=":", label="the weights")
    ax.set_xlabel("decode step (0: the prefill)")
    ax.set_ylabel("MB")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"KV cache of {name or si(n_params(config), 'params')}, batch {batch}: {si(per_token, 'B')} per "
                 f"token, {prompt_len:,} prompt + {steps[-1] + 1:,} new", fontsize=10)
    fig.tight_layout()
    return fig


def round_tokens(run: Rounds, tokens: list[str] | None = None) -> list[list[str]]:
    """The tokens each round emitted (its accepted proposals, then its own), given the run's emitted tokens as
    text (run.tokens decoded one by one; the first, the prefill's, belongs to no round)."""
    if tokens is None:
        return [[""] * p for p in run.produced]
    if len(tokens) != 1 + sum(run.produced):
        raise ValueError(f"the run emitted {1 + sum(run.produced)} tokens (1 from the prefill, then its rounds'), "
                         f"got {len(tokens)} texts")
    out, start = [], 1
    for p in run.produced:
        out.append(tokens[start:start + p])
        start += p
    return out


def plot_speculative_rounds(run: Rounds, tokens: list[str] | None = None, max_rounds: int = 12):
    """Each round of a speculative run as a row of k proposal boxes and one more: accepted (green), the first
    rejected (red), the proposals after it that were never examined (grey), and the token the target adds
    itself: a bonus draw when all k were accepted (blue), else the draw from the residual at the rejection
    (orange). `tokens`: the run's emitted tokens as text, to label the boxes (see round_tokens)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    texts = round_tokens(run, tokens)[:max_rounds]
    n_rounds = len(texts)
    if not n_rounds:
        raise ValueError("the run has no rounds to draw (it made at most one token)")
    width = max(run.proposed[:n_rounds]) + 1
    fig, ax = plt.subplots(figsize=(1.1 * width + 2.5, 0.45 * n_rounds + 1.2))
    colors = {"accepted": "#6cc46c", "rejected": "#e06060", "not examined": "#cccccc", "bonus": "#5b9bd5",
              "resampled": "#f0a040"}
    for r, (k, n, row) in enumerate(zip(run.proposed, run.accepted, texts, strict=False)):
        boxes = [(j, "accepted", row[j] if j < len(row) else "") for j in range(n)]
        if n < k:  # the first rejection ends the round; the proposals after it are never looked at
            boxes += [(n, "rejected", "")] + [(j, "not examined", "") for j in range(n + 1, k)]
        boxes.append((k + 0.15, "bonus" if n == k else "resampled", row[n] if len(row) > n else ""))
        for j, (x, kind, label) in enumerate(boxes):
            cut = j == len(boxes) - 1 and len(row) <= n  # a stop token ended the run before the round's own token
            ax.add_patch(plt.Rectangle((x, r - 0.4), 0.9, 0.8, facecolor=colors[kind], edgecolor="0.3",
                                       hatch="//" if cut else None))
            ax.text(x + 0.45, r, repr(label)[1:-1][:8], ha="center", va="center", fontsize=7)
        ax.text(-0.2, r, f"round {r + 1}: {n}/{k}", ha="right", va="center", fontsize=8)
    ax.legend(handles=[Patch(color=color, label=kind) for kind, color in colors.items()], fontsize=7, ncol=5,
              loc="upper center", bbox_to_anchor=(0.5, -0.02), frameon=False)
    ax.set_xlim(-2.6, width + 0.3)
    ax.set_ylim(n_rounds - 0.5, -0.6)
    ax.axis("off")
    ax.set_title(f"Speculative rounds (k = {run.k}): acceptance {run.acceptance_rate:.0%}, "
                 f"{run.tokens_per_target_forward:.2f} tokens per target forward", fontsize=10)
    fig.tight_layout()
    return fig


def plot_batching_slots(run: BatchRun, max_steps: int | None = None, queue: bool = False):
    """Slots (rows) over engine steps (columns), each cell coloured by the request decoding in it (white: a free
    slot); a dot marks a prompt's prefill. queue: below it, on the same step axis, the requests that have arrived
    and wait for a slot at each step (after its admissions). From the run's own record: BatchRun.timeline,
    .prefills and .queued."""
    import matplotlib.pyplot as plt
    import numpy as np

    steps = run.steps if max_steps is None else min(run.steps, max_steps)
    if not steps:
        raise ValueError("the run has no engine steps to draw")
    if queue and len(run.queued) < steps:
        raise ValueError(f"the run records the queue for {len(run.queued)} of its {steps} steps: no queue to draw")
    grid = np.array(run.timeline[:steps], dtype=float).T  # [slots, steps]: request id, -1 free
    grid[grid < 0] = np.nan
    width, height = min(14, 2 + 0.18 * steps), 0.45 * run.n_slots + 1.4
    if queue:
        fig, (ax, qax) = plt.subplots(2, 1, figsize=(width, height + 1.6), sharex=True,
                                      gridspec_kw={"height_ratios": [max(1.0, 0.45 * run.n_slots), 1.2]})
    else:
        fig, ax = plt.subplots(figsize=(width, height))
    cmap = plt.get_cmap("tab20").with_extremes(bad="white")
    ax.imshow(np.mod(grid, 20), cmap=cmap, vmin=0, vmax=19, aspect="auto", interpolation="nearest")
    for step, slot, rid in run.prefills:
        if step < steps:
            ax.plot(step, slot, "k.", ms=4)
            ax.text(step, slot, f" {rid}", fontsize=6, va="center")
    ax.set_yticks(range(run.n_slots), [f"slot {i}" for i in range(run.n_slots)])
    ax.set_xlabel("engine step (dot: a request's prompt prefilled into the slot)")
    ax.set_title(f"{run.policy} batching, {run.n_slots} slots, {len(run.completions)} requests: "
                 f"{run.steps} steps, slots busy {run.slot_utilisation:.0%}", fontsize=10)
    if queue:
        waiting = run.queued[:steps]
        qax.step(range(steps), waiting, where="mid", color="tab:red")
        qax.fill_between(range(steps), waiting, step="mid", color="tab:red", alpha=0.3)
        qax.set(xlabel="engine step", ylabel="waiting", ylim=(0, max(1, max(waiting)) * 1.15))
        qax.set_title(f"the queue: requests arrived and waiting for a slot (at most {max(waiting)})", fontsize=9)
        qax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
