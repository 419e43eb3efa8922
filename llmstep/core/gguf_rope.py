"""Llama 3.1's RoPE scaling read back from a GGUF file's `rope_freqs` tensor (llama.cpp's converter stores the scaling
as one factor per rotary pair, not as its four parameters): the parameters that give those factors under
`rope.llama3_scale`, the roundest that fit, so that inv_freq equals transformers' from the original config.json.
`gguf_load` calls it; a ValueError says why a tensor fits no such scaling.
"""

from __future__ import annotations

import math

import numpy as np

from .config import ConfigError, RopeScaling
from .rope import inv_frequencies

__all__ = ["llama31_scaling_of"]


def llama31_scaling_of(factors: np.ndarray, head_dim: int, theta: float) -> RopeScaling | None:
    """A rope_freqs tensor (per pair, how much slower it turns) -> the Llama 3.1 scaling that gives it.

    Llama 3.1's rule (llmstep.core.rope.llama3_scale) keeps fast pairs (factor 1), slows slow ones by `factor`,
    and in between divides by 1 / ((1 - s) / factor + s) with s linear in the pair's frequency. From the factors:
    `factor` is the largest, and s at the in-between pairs fixes the two wavelength limits, original / low and
    original / high: multiplying all three by one number changes nothing, so low_freq_factor is 1 (Llama 3.1's)
    where that makes original_max_position_embeddings a whole number, else the least whole factor up to 8 that
    does. Checked by recomputing."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.size != head_dim // 2 or not np.isfinite(f).all() or (f <= 0).any():
        raise ValueError(f"rope_freqs must hold {head_dim // 2} positive finite factors, one per pair")
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    plain = inv_frequencies(head_dim, theta).double().numpy()
    factor = float(f.max())
    mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    wavelen = 2 * math.pi / plain
    slowed = wavelen[f >= factor * (1 - 1e-4)]
    s = (factor / f[mid] - 1) / (factor - 1)  # s = (orig / wavelen - 1) / (high - 1) at each in-between pair

    def limits():  # (orig, low, high) that put each pair in its region, the likeliest first
        if mid.sum() >= 2:  # s is a line in 1 / wavelen: it fixes both, orig / low an integer near the fit's
            slope, intercept = np.polyfit(1 / wavelen[mid], s, 1)
            # at low 1: high - 1 = -1 / intercept, orig = slope (high - 1)
            fitted = -slope / intercept if intercept else 0.0
            if not math.isfinite(fitted):  # an intercept that small: no limits to find
                return
            for low in range(1, 9):
                near = {max(1, round(fitted * low) + d) for d in (0, -1, 1, -2, 2)}
                for orig in sorted(near, key=lambda o: abs(o - fitted * low)):
                    yield orig, low, low * (1 + float(np.median((orig / low / wavelen[mid] - 1) / s)))
            return
        # one pair or none in between: many limits give the same frequencies; orig an integer between the
        # in-between (or kept) pairs' wavelengths and the slowed ones', the roundest first (Llama 3.1's 8192)
        below = wavelen[mid] if mid.any() else wavelen[f <= 1 + 1e-4]
        lower = float(below.max()) if below.size else 0.0
        upper = float(slowed.min()) if slowed.size else max(2.0, 4 * lower)
        origs = _roundest(lower, upper)
        if math.floor(lower) + 1 < upper:  # the integer nearest above: always in range, if least round
            origs.append(math.floor(lower) + 1)
        for orig in origs:
            if mid.any():
                yield orig, 1, 1 + (orig / lower - 1) / float(s[0])
            else:  # the kept pairs must turn faster than orig / high: round highs, then one that always fits
                fits = (math.sqrt(orig / lower),) if lower else ()  # no kept pair: any high fits
                yield from ((orig, 1, high) for high in (4.0, 2.0, 8.0, 1.5, 16.0, *fits) if orig / high > lower)

    def error(got) -> float:  # how far the factors a candidate gives are from the file's, relative
        return float(np.abs(plain / inv_frequencies(head_dim, theta, got).double().numpy() / f - 1).max())

    def scaling(digits: int | None, orig: int, low: int, high: float) -> RopeScaling | None:
        try:
            r = (lambda x: float(x)) if digits is None else (lambda x: round(float(x), digits))
            return RopeScaling(factor=r(factor), low_freq_factor=float(low), high_freq_factor=r(high),
                               original_max_position_embeddings=orig)
        except ConfigError:
            return None  # rounded too far (high_freq_factor down to 1, say)

    # The float32 factors give the parameters to ~1e-7, and the published ones are round numbers: of the limits
    # that fit, the one whose high_freq_factor needs the fewest decimals, then the roundest orig (listed first).
    best, off = None, math.inf
    for n, (orig, low, high) in enumerate(limits()):  # at most ~400 candidates
        raw = scaling(None, orig, low, high)
        if raw is None:
            continue
        e = error(raw)
        if e > 1e-5:  # these limits do not give the file's factors: the nearest miss goes in the message
            off = min(off, e)
            continue
        digits, fit = next(((d, c) for d in range(7) if (c := scaling(d, orig, low, high)) is not None
                            and error(c) <= max(1e-6, 2 * e)), (7, raw))
        if best is None or (low, digits, n) < best[0]:  # low 1 wherever it fits
            best = (low, digits, n), fit
        if digits == 0:  # a whole high_freq_factor at the roundest orig: nothing rounder to find
            break
    if best is None:
        shown = "" if off == math.inf else f" (off by up to {off:.1e})"
        raise ValueError(f"rope_freqs does not follow Llama 3.1's scaling rule{shown}")
    return best[1]


def _roundest(lower: float, upper: float, most: int = 64) -> list[int]:
    """Up to `most` integers strictly between lower and upper, those with more factors of two first."""
    first, last = math.floor(lower) + 1, math.ceil(upper) - 1
    found: dict[int, None] = {}
    for k in range(max(0, last).bit_length(), -1, -1):
        step = 1 << k
        for m in range(-(-first // step) * step, last + 1, step):
            found.setdefault(m, None)
            if len(found) >= most:
                return list(found)
    return list(found)
