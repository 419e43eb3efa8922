"""The notebooks' widgets: sliders over the package's arithmetic, each redrawing a figure and a sentence.

Every explorer is made the same way (`explorer`): controls above an output area; each change of a control
calls a pure `draw_*` function (its values in, a Figure and a one-line summary out) and puts the two in the
output area. The numbers come from llmstep.lab.explore, which is tested on its own. Calling an explorer in
a notebook also displays the starting point as a plain image and text (pass fallback=False not to), so a
static copy of the notebook (nbval, GitHub, a viewer without a kernel) still shows something, as 06's
sampling explorer does.

    roofline_explorer      chip, dtype, batch, context: where a decode step sits on the roofline (00, 05)
    rope_explorer          position and frequency pair: how far RoPE turns a pair (02)
    kv_memory_explorer     model, context, batch, dtype: the KV cache next to the weights (03)
    attention_explorer     layer and head: who attends to whom in a prompt (03)
    quant_explorer         bits and group size: error against bytes per weight (07)
    speculative_explorer   acceptance, k, draft and verify costs: the expected speedup (08)
    batching_explorer      slots, arrival rate, policy: the slots and the queue over time (09)
    journey_explorer       one decode step, stage by stage: shapes, bytes and time (05)
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable, Iterable

import torch

from ..core.checks import is_int
from ..core.config import LlamaConfig, RopeScaling
from ..core.model import Llama
from ..core.tokens import Tokenizer
from . import explore, pictures
from .hardware import DATASHEETS, Chip
from .roofline import plot_roofline
from .trace import Trace

__all__ = ["explorer", "figure_png", "draw_roofline", "roofline_explorer", "draw_rope", "rope_explorer",
           "draw_kv_memory", "kv_memory_explorer", "draw_attention", "attention_explorer", "draw_quant",
           "quant_explorer", "draw_speculative", "speculative_explorer", "draw_batching", "batching_explorer",
           "draw_journey", "journey_explorer", "context_stops", "EXPLORERS"]

DTYPES = ("bfloat16", "float16", "float32")
POWERS = [2**i for i in range(18)]  # 1 .. 131072: batches and contexts on a log scale


def context_stops(config: LlamaConfig, step: bool) -> list[int]:
    """A context slider's stops for `config`: 0 (step only), then powers of two from 128 within the model's window:
    a decode step's context up to max_seq_len - 1 (its own token takes the last position), a cache's up to
    max_seq_len (at least one stop: the window itself where it is below 128)."""
    top = config.max_seq_len - 1 if step else config.max_seq_len
    powers = [c for c in POWERS[7:] if c <= top]
    return [0, *powers] if step else powers or [top]


def _nearest_below(stops: list[int], value: int) -> int:
    return max((c for c in stops if c <= value), default=stops[0])


def _follow_window(controls: dict, configs: dict[str, LlamaConfig], step: bool) -> None:
    """Keep the context slider's stops within the window of the model the model dropdown selects (context_stops): a
    context the new model cannot take moves down to its largest stop, before the figure is redrawn (this observer
    comes before `explorer`'s)."""
    context = controls["context"]

    def follow(change):
        stops = context_stops(configs[change.new], step)
        value = _nearest_below(stops, context.value)
        if tuple(stops) != tuple(context.options):
            context.options = stops  # ipywidgets then selects the first stop (one redraw, of a context it takes)
        context.value = value

    controls["model"].observe(follow, names="value")


def figure_png(fig) -> bytes:
    """The figure as PNG bytes, then closed (a widget redraws many figures: none may pile up in pyplot)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _outputs(fig, text: str) -> tuple[dict, dict]:
    """The summary and the figure as two notebook outputs (nbformat), for an Output widget or a display."""
    png = base64.b64encode(figure_png(fig)).decode("ascii")
    return ({"output_type": "stream", "name": "stdout", "text": text + "\n"},
            {"output_type": "display_data", "data": {"image/png": png, "text/plain": text}, "metadata": {}})


def explorer(draw: Callable, controls: dict, fallback: bool = True):
    """Controls above an output area; draw(**{name: control.value}) -> (Figure, summary) fills it now and after
    every change of a control. fallback: also display the starting point as a plain image and text.
    Returns the widget (an ipywidgets.VBox: a box of the controls, then the Output)."""
    import ipywidgets as widgets
    from IPython.display import display

    out = widgets.Output()

    def render(_change=None):
        out.outputs = _outputs(*draw(**{name: c.value for name, c in controls.items()}))

    for control in controls.values():
        control.observe(render, names="value")
    render()
    if fallback:
        text, image = out.outputs
        print(text["text"], end="")
        display(image["data"], raw=True)
    box = widgets.Box(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap"))
    return widgets.VBox([box, out])


def _slider(name: str, options, value):
    import ipywidgets as widgets

    return widgets.SelectionSlider(options=list(options), value=value, description=name, continuous_update=False)


def _dropdown(name: str, options, value):
    import ipywidgets as widgets

    return widgets.Dropdown(options=list(options), value=value, description=name)


# ---- the roofline (00, 05) ---------------------------------------------------------------------------

def draw_roofline(model: str, chip: Chip, dtype: str, batch: int, context: int,
                  points: Iterable[tuple[float, float, str]] = ()):
    config = explore.model_configs()[model]
    p = explore.roofline_point(config, chip, dtype, batch, context)
    ax = plot_roofline(chip, points, highlight=(p.intensity, p.attainable_tflops, f"{model}, batch {batch}"))
    ax.set_title(f"{model} ({dtype}), batch {batch}, after {context:,} tokens on {chip.name}", fontsize=10)
    return ax.figure, (f"{p.intensity:,.2f} FLOPs/byte: {p.bound}-bound on {chip.name}; at the roof a step takes "
                       f"{p.ms_per_step:,.3f} ms, {p.tokens_per_second:,.0f} tokens/s for the batch")


def roofline_explorer(points: Iterable[tuple[float, float, str]] = (), chips: Iterable[Chip] = (),
                      model: str = "llama-3.1-8b", fallback: bool = True):
    """`points`: measured (intensity, TFLOP/s, label) to show on every roof; `chips`: more chips to choose
    from (llmstep.lab.hardware.measured_chip() is this machine) besides the datasheets."""
    points = list(points)
    choices = {c.name: c for c in [*chips, *DATASHEETS.values()]}
    configs = explore.model_configs()
    controls = {"model": _dropdown("model", list(configs), model),
                "chip": _dropdown("chip", [(n, c) for n, c in choices.items()], next(iter(choices.values()))),
                "dtype": _dropdown("dtype", DTYPES, "bfloat16"),
                "batch": _slider("batch", POWERS[:11], 1),
                "context": _slider("context", context_stops(configs[model], step=True), 0)}
    _follow_window(controls, configs, step=True)
    return explorer(lambda **v: draw_roofline(**v, points=points), controls, fallback)


# ---- RoPE (02) ---------------------------------------------------------------------------------------

def draw_rope(config: LlamaConfig, position: int, pair: int, llama3_scaling: bool):
    import matplotlib.pyplot as plt

    config = config.replace(rope_scaling=(config.rope_scaling or RopeScaling()) if llama3_scaling else None)
    r = explore.rope_rotation(config, position, pair)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.add_patch(plt.Circle((0, 0), 1, fill=False, color="0.7"))
    left.plot(r.trail[:, 0], r.trail[:, 1], ".", color="C0", alpha=0.35, ms=4)
    left.annotate("", xy=tuple(r.trail[-1].tolist()), xytext=(0, 0), arrowprops={"arrowstyle": "->", "lw": 2})
    left.set(xlim=(-1.2, 1.2), ylim=(-1.2, 1.2), aspect="equal",
             title=f"pair {pair} (dims {pair}, {pair + config.head_dim // 2}) at position {position:,}")
    right.semilogy(r.wavelengths.numpy(), ".-", ms=3)
    right.plot([pair], [r.wavelength], "o", color="C3")
    if config.rope_scaling is not None:
        right.axhline(config.rope_scaling.original_max_position_embeddings, color="0.5", ls=":",
                      label="pre-training context")
        right.legend(fontsize=8)
    right.set(xlabel="pair i", ylabel="wavelength (positions per turn)", title="every pair's wavelength")
    fig.tight_layout()
    return fig, (f"pair {pair}: {r.inv_freq:.4g} rad per position, one turn every {r.wavelength:,.1f} positions; "
                 f"at position {position:,} it has turned {r.angle / math.tau:,.3f} turns")


def rope_explorer(config: LlamaConfig | None = None, fallback: bool = True):
    import ipywidgets as widgets

    config = config or LlamaConfig.preset("llama-3.1-8b")
    controls = {"position": widgets.IntSlider(value=8, min=0, max=4096, description="position",
                                              continuous_update=False),
                "pair": widgets.IntSlider(value=0, min=0, max=config.head_dim // 2 - 1, description="pair",
                                          continuous_update=False),
                "llama3_scaling": widgets.Checkbox(value=config.rope_scaling is not None,
                                                   description="Llama 3.1 scaling")}
    return explorer(lambda **v: draw_rope(config, **v), controls, fallback)


# ---- KV memory and attention (03) ---------------------------------------------------------------------

def draw_kv_memory(model: str, context: int, batch: int, dtype: str):
    import matplotlib.pyplot as plt

    m = explore.kv_memory(explore.model_configs()[model], context, batch, dtype)
    fig, ax = plt.subplots(figsize=(8, 2.6))
    ax.barh([0], [m.weights_bytes / 1e9], color="C2", label="weights")
    ax.barh([0], [m.kv_bytes / 1e9], left=[m.weights_bytes / 1e9], color="C1", label="KV cache")
    for i, chip in enumerate(DATASHEETS.values()):
        ax.axvline(chip.memory_gb, color="0.4", ls=":", lw=1)
        ax.text(chip.memory_gb, 0.45 - 0.12 * i, f" {chip.name}", fontsize=7)
    ax.set(yticks=[], xlabel="GB (1e9 bytes)", title=f"{model} in {dtype}: batch {batch} x {context:,} positions")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fits = [c.name for c in DATASHEETS.values() if c.memory_gb and m.total_bytes <= c.memory_gb * 1e9]
    return fig, (f"KV cache {batch} x {context:,} x {m.per_token_bytes / 1e3:,.1f} kB = {m.kv_bytes / 1e9:,.3f} GB, "
                 f"weights {m.weights_bytes / 1e9:,.3f} GB, together {m.total_bytes / 1e9:,.3f} GB; "
                 f"fits on {', '.join(fits) or 'none of the datasheet GPUs'}")


def kv_memory_explorer(model: str = "llama-3.1-8b", fallback: bool = True):
    configs = explore.model_configs()
    stops = context_stops(configs[model], step=False)
    controls = {"model": _dropdown("model", list(configs), model),
                "context": _slider("context", stops, _nearest_below(stops, 8192)),
                "batch": _slider("batch", POWERS[:9], 1),
                "dtype": _dropdown("dtype", DTYPES, "bfloat16")}
    _follow_window(controls, configs, step=False)
    return explorer(draw_kv_memory, controls, fallback)


def draw_attention(weights: torch.Tensor, labels: list[str], layer: int, head: int):
    """weights [n_heads, T, T] of one layer (explore.attention_weights); labels: the T tokens as text."""
    import matplotlib.pyplot as plt

    w = weights[head]  # [T, T]
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    ax.imshow(w.numpy(), cmap="Blues", vmin=0, vmax=1)
    ticks = [repr(t)[1:-1][:10] for t in labels]
    ax.set_xticks(range(len(ticks)), ticks, rotation=90, fontsize=7)
    ax.set_yticks(range(len(ticks)), ticks, fontsize=7)
    ax.set(xlabel="key (attended to)", ylabel="query", title=f"layer {layer}, head {head}")
    fig.tight_layout()
    top = int(w[-1].argmax())
    return fig, (f"layer {layer}, head {head}: the last token puts {float(w[-1, top]):.0%} of its attention on "
                 f"token {top} ({labels[top]!r}); {float(w.diagonal().mean()):.0%} on itself on average")


def attention_explorer(model: Llama, tokenizer: Tokenizer, prompt: str, fallback: bool = True):
    """The attention pattern of `model` over `prompt`, one layer and head at a time (computed per layer once)."""
    import ipywidgets as widgets

    ids = tokenizer.encode(prompt)
    labels = [tokenizer.decode([i]) for i in ids]
    per_layer: dict[int, torch.Tensor] = {}

    def draw(layer: int, head: int):
        if layer not in per_layer:
            per_layer[layer] = explore.attention_weights(model, ids, layer)
        return draw_attention(per_layer[layer], labels, layer, head)

    c = model.config
    controls = {"layer": widgets.IntSlider(value=0, min=0, max=c.n_layers - 1, description="layer"),
                "head": widgets.IntSlider(value=0, min=0, max=c.n_heads - 1, description="head")}
    return explorer(draw, controls, fallback)


# ---- quantization (07) ------------------------------------------------------------------------------

def draw_quant(w: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.bfloat16):
    import matplotlib.pyplot as plt

    if not is_int(bits) or bits not in (4, 8):
        raise ValueError(f"bits must be 8 (int8, a scale per row) or 4 (int4, groups of group_size), got {bits!r}")
    mode = "int8" if bits == 8 else "int4"
    every = [explore.quant_error(w, m, g, scale_dtype) for m, g in explore.quant_options(w.shape[1])]
    p = explore.quant_error(w, mode, group_size if mode == "int4" else None, scale_dtype)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for q in every:
        left.plot(q.bits_per_weight, q.relative_error, "o", color="C0" if q.mode == "int4" else "C2", ms=5)
        left.annotate("int8" if q.mode == "int8" else f"g{q.group_size}", (q.bits_per_weight, q.relative_error),
                      fontsize=7, xytext=(3, 3), textcoords="offset points")
    left.plot(p.bits_per_weight, p.relative_error, "o", mfc="none", mec="C3", ms=12, mew=2)
    left.set(xlabel="bits per weight (codes, scales, zeros)", ylabel="relative error ||w - w_q|| / ||w||",
             yscale="log", title="every setting; circled: this one")
    right.hist(p.error.flatten().numpy(), bins=80, color="C3")
    right.set(xlabel="w - w_q", ylabel="weights", title=f"{mode}" + (f", group {group_size}" if bits == 4 else ""))
    fig.tight_layout()
    name = "int8 (one scale per row)" if mode == "int8" else f"int4, groups of {group_size}"
    return fig, (f"{name}: {p.bits_per_weight:.3f} bits per weight, relative error {p.relative_error:.4f}, "
                 f"largest error {p.max_error:.3g}")


def quant_explorer(w: torch.Tensor | None = None, fallback: bool = True):
    """w [N, K]: the matrix to quantize (a model's weight, e.g. model.layers[0].attention.wq.weight); None: a
    random one drawn from N(0, 0.02^2) (GPT-2's init), seed 0."""
    import ipywidgets as widgets

    if w is None:
        w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * 0.02
    w = w.detach().float().cpu()
    sizes = [g for m, g in explore.quant_options(w.shape[1]) if m == "int4"]
    if not sizes:
        raise ValueError(f"int4 needs an input dimension divisible by 16 or more; this matrix has {w.shape[1]}")
    controls = {"bits": widgets.ToggleButtons(options=[8, 4], value=4, description="bits"),
                "group_size": _slider("group_size", sizes, 64 if 64 in sizes else sizes[0])}
    return explorer(lambda **v: draw_quant(w, **v), controls, fallback)


# ---- speculative decoding (08) ----------------------------------------------------------------------

def draw_speculative(acceptance: float, k: int, cost_ratio: float, k_max: int = 16, verify_cost: float = 1.0):
    import matplotlib.pyplot as plt

    curve = explore.speculative_curve(acceptance, cost_ratio, k_max, verify_cost)  # checks k_max and the costs
    if not is_int(k) or not 1 <= k <= k_max:
        raise ValueError(f"k must be an integer in 1..k_max = {k_max} (draft tokens per round), got {k!r}")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    ks = range(1, k_max + 1)
    left.plot(ks, curve.speedups, ".-")
    left.plot([k], [curve.speedups[k - 1]], "o", color="C3", ms=9, label=f"k = {k}")
    left.plot([curve.best_k], [curve.best_speedup], "*", color="C2", ms=12, label=f"best k = {curve.best_k}")
    left.axhline(1, color="0.5", lw=0.8)
    left.set(xlabel="k (draft tokens per round)", ylabel="expected speedup", title="speedup against k")
    left.legend(fontsize=8)
    rates = [i / 100 for i in range(100)]
    right.plot(rates, [explore.speculative_curve(a, cost_ratio, k, verify_cost).speedups[-1] for a in rates])
    right.plot([acceptance], [curve.speedups[k - 1]], "o", color="C3", ms=9)
    right.axhline(1, color="0.5", lw=0.8)
    right.set(xlabel="acceptance rate a", ylabel="expected speedup", title=f"speedup against a, k = {k}")
    fig.tight_layout()
    return fig, (f"a = {acceptance:.2f}, k = {k}, draft costs {cost_ratio:.2f} of a target forward, verifying "
                 f"k + 1 tokens {verify_cost:.2f}: {curve.tokens_per_forward[k - 1]:.2f} tokens per target forward, "
                 f"speedup {curve.speedups[k - 1]:.2f}x (best: k = {curve.best_k}, {curve.best_speedup:.2f}x)")


def speculative_explorer(acceptance: float = 0.7, cost_ratio: float = 0.1, fallback: bool = True, *,
                         verify_cost: float = 1.0, k: int = 4):
    """Sliders over acceptance, k, the draft's cost (in target forwards) and the cost of verifying k+1 tokens (in
    one-token forwards; 1 when decode is memory-bound), starting at the values given: pass measured ones to
    start at the measured speedup. A slider's range widens to take a starting value outside it."""
    import ipywidgets as widgets

    if not (isinstance(k, int) and 1 <= k <= 16):
        raise ValueError(f"speculative_explorer: k must be an integer in 1..16 (the slider's range), got {k!r}")

    def slider(name, value, low, high, step, cls=widgets.FloatSlider):
        return cls(value=value, min=min(low, value), max=max(high, value), step=step, description=name,
                   continuous_update=False)

    controls = {"acceptance": slider("acceptance", acceptance, 0.0, 0.99, 0.01),
                "k": slider("k", k, 1, 16, 1, widgets.IntSlider),
                "cost_ratio": slider("cost ratio", cost_ratio, 0.0, 1.0, 0.01),
                "verify_cost": slider("verify cost", verify_cost, 1.0, 4.0, 0.01)}
    return explorer(draw_speculative, controls, fallback)


# ---- batching (09) -----------------------------------------------------------------------------------

def draw_batching(n_slots: int, arrival_rate: float, policy: str, n_requests: int = 24, seed: int = 0):
    """The slots' timeline and, below it, the queue (requests waiting for a slot) over the same engine steps."""
    run = explore.simulate_batching(n_slots, arrival_rate, n_requests, policy, seed)
    s = run.summary()
    waited = [c.queued_steps for c in run.completions]
    return pictures.plot_batching_slots(run, queue=True), (
        f"{policy}, {n_slots} slots, {arrival_rate:g} requests per step: {s['engine_steps']} steps for "
        f"{s['tokens']} tokens, slots busy {s['slot_utilisation']:.0%}, latency {s['mean_latency_steps']:.1f} "
        f"steps on average (at most {s['max_latency_steps']}); queue at most {max(run.queued)} waiting, "
        f"{sum(waited) / len(waited):.1f} steps waited on average")


def batching_explorer(fallback: bool = True):
    import ipywidgets as widgets

    controls = {"n_slots": widgets.IntSlider(value=4, min=1, max=16, description="slots", continuous_update=False),
                "arrival_rate": widgets.FloatLogSlider(value=0.35, base=10, min=-1.3, max=0.7, step=0.05,
                                                       description="arrivals/step", continuous_update=False),
                "policy": widgets.ToggleButtons(options=["continuous", "static"], value="continuous",
                                                description="policy")}
    return explorer(draw_batching, controls, fallback)


# ---- the token's journey (05) -------------------------------------------------------------------------

def draw_journey(config: LlamaConfig, context: int, stage: int, name: str = "", trace: Trace | None = None,
                 dtype: str = "bfloat16"):
    rows = pictures.step_stages(config, context, dtype, trace)
    if not is_int(stage) or not 0 <= stage < len(rows):
        raise ValueError(f"stage must be an integer in 0..{len(rows) - 1} (the step's {len(rows)} stages), "
                         f"got {stage!r}")
    r = rows[stage]
    so_far = sum(x.bytes for x in rows[:stage + 1]) / sum(x.bytes for x in rows)
    text = (f"{stage + 1}/{len(rows)} {r.stage} (x{r.calls}): {r.inputs} -> {r.outputs}; reads "
            f"{pictures.si(r.bytes, 'B')}, {pictures.si(r.flops, 'FLOP')}; {so_far:.0%} of the step's bytes so far")
    if r.seconds is not None:
        text += f"; measured {r.seconds * 1e3:.3f} ms"
    return pictures.plot_decode_step(config, context, dtype, name, trace, highlight=stage), text


def journey_explorer(config: LlamaConfig | None = None, context: int = 256, trace: Trace | None = None,
                     name: str = "", dtype: str = "bfloat16", fallback: bool = True):
    """Step through one decode step of `config` (default: the shipped target) after `context` tokens; with a
    `trace` (llmstep.lab.trace.trace_step of a model of this config, at this context) each stage's time too."""
    import ipywidgets as widgets

    if config is None:  # the shipped target; a copy of the package without data/ has only the presets
        configs = explore.model_configs()
        default = "shakespeare-target" if "shakespeare-target" in configs else "llama-3.2-1b"
        name, config = name or default, configs[default]
    if trace is not None:
        dtype = trace.dtype
    n = len(pictures.step_stages(config, context, dtype))
    stage = widgets.IntSlider(value=0, min=0, max=n - 1, description="stage")
    play = widgets.Play(value=0, min=0, max=n - 1, interval=1500, description="play")
    widgets.jslink((play, "value"), (stage, "value"))
    box = explorer(lambda stage: draw_journey(config, context, stage, name, trace, dtype), {"stage": stage}, fallback)
    box.children[0].children = (play, stage)
    return box


# Every explorer with the arguments that make it without a model in memory (the browser test shows each).
EXPLORERS = {"roofline_explorer": roofline_explorer, "rope_explorer": rope_explorer,
             "kv_memory_explorer": kv_memory_explorer, "quant_explorer": quant_explorer,
             "speculative_explorer": speculative_explorer, "batching_explorer": batching_explorer,
             "journey_explorer": journey_explorer}
