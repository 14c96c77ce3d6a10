"""The pieces the decoder's blocks share: :class:`RMSNorm` and the SwiGLU :class:`FeedForward`.

Used by :mod:`~lightning_llmopt.models.llama` (which re-exports both), :mod:`~lightning_llmopt.models.mla` (its
low-rank norms) and :mod:`~lightning_llmopt.models.moe` (the shared expert); they import nothing from those modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FeedForward", "RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, arXiv 1910.07467), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` (Shazeer, arXiv 2002.05202)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
