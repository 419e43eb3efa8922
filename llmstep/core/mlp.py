"""SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)).

Two thirds of an 8B model's weights live here: three [dim x hidden_dim] matrices per layer.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False)  # gate, HF: gate_proj   (hidden_dim, dim)
        self.w3 = Linear(dim, hidden_dim, bias=False)  # up,   HF: up_proj     (hidden_dim, dim)
        self.w2 = Linear(hidden_dim, dim, bias=False)  # down, HF: down_proj   (dim, hidden_dim)
        self.w13: nn.Module | None = None  # w1|w3 stacked as one matmul, set by llmstep.core.fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]."""
        if self.w13 is None:
            gate, up = self.w1(x), self.w3(x)  # [B, T, hidden_dim] each
        else:  # one matmul, split back into the two
            gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
