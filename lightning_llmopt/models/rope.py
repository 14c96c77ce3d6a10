"""Rotary position embedding (Su et al., arXiv 2104.09864) in the "rotate half" layout used by Hugging Face.

Channel ``c < D/2`` of a head is paired with channel ``c + D/2`` and the pair is rotated by ``pos * inv_freq[c]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_llmopt.models.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """``(head_dim / 2,)`` fp32 inverse frequencies ``theta^(-2c/D)``, with optional scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling.type == "linear":
        return (inv_freq / scaling.factor).float()
    # llama3: keep short wavelengths, scale long ones by 1/factor, interpolate smoothly between.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen < high_wavelen, inv_freq, blended)
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, out)
    return out.float()


def rope_table(max_seq_len: int, head_dim: int, theta: float, scaling: RopeScaling | None = None,
               device: torch.device | str | None = None) -> Tensor:
    """``(max_seq_len, head_dim / 2, 2)`` fp32 table of (cos, sin)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: Tensor, table: Tensor, positions: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, H, T, D)`` by the angles of ``positions`` ``(B, T)``; computed in fp32, returns x's dtype."""
    cos_sin = table[positions]  # (B, T, D/2, 2)
    cos = cos_sin[..., 0][:, None]  # (B, 1, T, D/2)
    sin = cos_sin[..., 1][:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
