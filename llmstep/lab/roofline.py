"""The roofline model (Williams, Waterman & Patterson, 2009): what a kernel can reach on a chip.

A kernel that does I FLOPs per byte it moves (its arithmetic intensity) can run no faster than
min(peak FLOP/s, bandwidth x I). Left of the ridge point (peak / bandwidth) the memory is the limit;
right of it, the math units. A decode step at batch 1 sits at I ~ 1 FLOP per byte (bf16), far left of
every GPU's ridge (150-300 FLOPs/byte): memory-bound.
"""

from __future__ import annotations

from collections.abc import Iterable

from .hardware import Chip

__all__ = ["attainable_tflops", "plot_roofline"]


def attainable_tflops(chip: Chip, intensity: float) -> float:
    """The roof at `intensity` FLOPs/byte, in TFLOP/s."""
    if not intensity > 0:
        raise ValueError(f"arithmetic intensity must be positive, got {intensity}")
    return min(chip.tensor_tflops, chip.memory_gb_per_s * 1e9 * intensity / 1e12)


def plot_roofline(chips: Chip | Iterable[Chip], points: Iterable[tuple[float, float, str]] = (), ax=None,
                  intensity_range: tuple[float, float] = (0.1, 1e4),
                  highlight: tuple[float, float, str] | None = None):
    """Draw each chip's roof and the measured `points` (intensity FLOPs/byte, TFLOP/s, label) on log axes, each
    its own black marker (never a square); `highlight`, a point of the same form, is the one red square.
    Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    chips = [chips] if isinstance(chips, Chip) else list(chips)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    x = np.logspace(np.log10(intensity_range[0]), np.log10(intensity_range[1]), 200)
    for i, chip in enumerate(chips):
        roof = [attainable_tflops(chip, v) for v in x]
        ax.loglog(x, roof, color=f"C{i}", lw=1.5, label=f"{chip.name}: {chip.memory_gb_per_s:,.0f} GB/s, "
                  f"{chip.tensor_tflops:,.3g} TFLOP/s")
        ax.axvline(chip.ridge_point(), color=f"C{i}", lw=0.6, ls=":")
    markers = "o^Dv<>p*hX"  # no square: that is the highlight's
    for j, (intensity, tflops, label) in enumerate(points):
        ax.loglog([intensity], [tflops], markers[j % len(markers)], color="k", ms=6, label=label)
    if highlight is not None:
        intensity, tflops, label = highlight
        ax.loglog([intensity], [tflops], "s", color="C3", ms=8, label=label)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    return ax
