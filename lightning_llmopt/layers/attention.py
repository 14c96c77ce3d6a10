"""Attention modules built on :func:`lightning_llmopt.kernels.flash_attention`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_llmopt.kernels.flash_attention import flash_attention


class FlashAttention(nn.Module):
    """``softmax(q k^T * scale + mask) v`` through the Triton kernels on CUDA, the PyTorch reference elsewhere.

    Arguments:
        causal: causal masking (bottom-right aligned when there are more keys than queries).
        window: sliding window in keys, the query's own key included (needs ``causal``).
        softmax_scale: default ``1 / sqrt(head_dim)``.
        backend: ``"auto"`` (default), ``"triton"`` or ``"reference"``; see :func:`flash_attention`.

    Shapes: q ``(B, S_q, H, D)``, k/v ``(B, S_k, H_kv, D)`` -> ``(B, S_q, H, D)``; or packed ``(total, H, D)`` with
    ``cu_seqlens`` passed to :meth:`forward`.
    """

    def __init__(self, causal: bool = True, window: int | None = None, softmax_scale: float | None = None,
                 backend: str | None = None) -> None:
        super().__init__()
        if window is not None and (window < 1 or not causal):
            raise ValueError(f"window ({window}) must be >= 1 and needs causal=True")
        self.causal, self.window, self.softmax_scale, self.backend = causal, window, softmax_scale, backend

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None) -> Tensor:
        out = flash_attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, window=self.window,
                              cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend=self.backend)
        assert isinstance(out, torch.Tensor)
        return out

    def extra_repr(self) -> str:
        return f"causal={self.causal}, window={self.window}, backend={self.backend or 'auto'}"
