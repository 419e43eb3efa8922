"""Rotary position embedding (RoPE, Su et al. 2021) with Llama 3.1's `llama3` frequency scaling.

Each query and key head vector of size head_dim is split into head_dim/2 pairs; pair i is rotated by
the angle position * inv_freq[i]. A rotation keeps lengths, and the dot product of two rotated vectors
depends only on the difference of their positions: attention sees relative position.

Pairing follows the Hugging Face checkpoints: element i pairs with element i + head_dim/2 ("rotate
half"), not with its neighbour as in Meta's original code; the published weights are permuted to match.
"""

import math

import torch

from .config import ConfigError, LlamaConfig, RopeScaling

__all__ = ["inv_frequencies", "llama3_scale", "rope_cos_sin", "apply_rope", "rotate_half"]


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The rotation speed of each pair, radians per position: [head_dim/2], float32.

    inv_freq[i] = theta^(-2i/head_dim): pair 0 turns once a radian per token, the last pair barely moves.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return inv_freq if scaling is None else llama3_scale(inv_freq, scaling)


def llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's context extension: slow the low frequencies by `factor`, keep the high ones.

    Wavelengths shorter than original_max/high_freq_factor are kept; longer than
    original_max/low_freq_factor are divided by `factor`; in between, a smooth interpolation.
    """
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def config_inv_frequencies(config: LlamaConfig) -> torch.Tensor:
    """The model's inv_freq buffer, refused if the config's rope_theta/rope_scaling make it non-finite."""
    inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    if inv_freq.device.type != "meta" and not torch.isfinite(inv_freq).all():  # meta: shapes only, checked later
        raise ConfigError(f"rope_theta {config.rope_theta} and rope_scaling {config.rope_scaling} give non-finite "
                          "rotation speeds (inv_freq)")
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, T, head_dim], angles computed in float32 then cast."""
    angles = positions[..., None].float() * inv_freq.float()  # [B, T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, T, head_dim]: pair i and i + head_dim/2 share it
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim], cos/sin [B, T, head_dim] -> x rotated pair by pair."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, head_dim], broadcast over heads
    return x * cos + rotate_half(x) * sin
