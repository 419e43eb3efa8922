"""RMSNorm: rescale each vector to unit root-mean-square, then by a learned gain (Zhang & Sennrich 2019).

LLaMA applies it before attention, before the MLP and once after the last block. The mean square is
computed in float32 whatever the model's dtype, as the reference implementation does.
"""

import torch
from torch import nn

__all__ = ["RMSNorm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim] -> [..., dim]: x / sqrt(mean(x^2) + eps) * weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
