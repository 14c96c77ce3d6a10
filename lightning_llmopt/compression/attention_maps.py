"""Capture per-block hidden states and attention probabilities of a :class:`~lightning_llmopt.models.Llama`.

The model's attention runs through SDPA (or a flash kernel), which never materialises the probabilities. For the
blocks whose maps are asked for, a forward pre-hook on ``layers.<i>.attention`` keeps its inputs (normed hidden
states, RoPE table, positions, mask); :meth:`LayerCapture.attention_probs` then recomputes ``q`` and ``k`` with
the block's own weights and runs the eager softmax in fp32. Gradients flow into the student's ``wq``/``wk`` and
everything below them.

Cost per captured block: two extra projections (``wq``, ``wk``: ``2 B T dim (H + H_kv) D`` FLOPs), the
``(B, H, T, T)`` fp32 scores and probabilities (``4 B H T^2`` bytes each, kept for backward on the student side):
at ``B = 8, H = 32, T = 2048`` that is 4 GiB per block, so capture a few blocks and short sequences only. Blocks
whose maps are not asked for keep the fast kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.models.rope import apply_rope


class LayerCapture:
    """Context manager recording block outputs and attention inputs during forward passes of ``model``.

    Arguments:
        model: a :class:`~lightning_llmopt.models.Llama` (blocks in ``model.layers``, a ``ModuleDict``).
        hidden_layers: block indices whose outputs ``(B, T, dim)`` are kept in :attr:`hidden`.
        attention_layers: block indices whose attention inputs are kept for :meth:`attention_probs`.

    The captures of the last forward pass overwrite earlier ones. Not for use with a KV cache.
    """

    def __init__(self, model: nn.Module, hidden_layers: Sequence[int] = (), attention_layers: Sequence[int] = ()):
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            raise TypeError("LayerCapture needs a model with its blocks in a ModuleDict `layers` (our Llama)")
        for i in [*hidden_layers, *attention_layers]:
            if str(i) not in layers:
                raise ValueError(f"block {i} is not in the model (blocks: {list(layers)})")
        self.layers = layers
        self.hidden_layers, self.attention_layers = list(hidden_layers), list(attention_layers)
        self.hidden: dict[int, Tensor] = {}
        self._attn_inputs: dict[int, tuple[Any, ...]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> LayerCapture:
        for i in self.hidden_layers:
            self._handles.append(self.layers[str(i)].register_forward_hook(self._keep_hidden(i)))
        for i in self.attention_layers:
            attn = self.layers[str(i)].attention
            self._handles.append(attn.register_forward_pre_hook(self._keep_attn(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        self.hidden.clear()
        self._attn_inputs.clear()

    def _keep_hidden(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            self.hidden[i] = output

        return hook

    def _keep_attn(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if len(args) > 4 and args[4] is not None:
                raise ValueError("attention maps cannot be captured with a KV cache")
            self._attn_inputs[i] = args[:4]

        return hook

    def attention_probs(self, i: int) -> Tensor:
        """Attention probabilities ``(B, H, T, T)`` fp32 of block ``i`` in the last forward pass (eager softmax)."""
        if i not in self._attn_inputs:
            raise KeyError(f"block {i}'s attention was not captured (attention_layers={self.attention_layers})")
        x, rope, positions, mask = self._attn_inputs[i]
        return eager_attention_probs(self.layers[str(i)].attention, x, rope, positions, mask)


def eager_attention_probs(attn: nn.Module, x: Tensor, rope: Tensor, positions: Tensor, mask: Any) -> Tensor:
    """``softmax(q k^T / sqrt(D) + mask)`` ``(B, H, T, S)`` fp32 of an :class:`~lightning_llmopt.models.llama.Attention`
    on its input ``x`` ``(B, T, dim)``; key/value heads are repeated for GQA."""
    B, T, _ = x.shape
    d = attn.head_dim
    q = attn.wq(x).view(B, T, -1, d).transpose(1, 2)  # (B, H, T, D)
    k = attn.wk(x).view(B, T, -1, d).transpose(1, 2)  # (B, H_kv, T, D)
    if attn.rotary is not None:
        q, k = attn.rotary(q, k, rope, positions)
    else:
        q, k = apply_rope(q, rope, positions), apply_rope(k, rope, positions)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, T, D)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(d)  # (B, H, T, T)
    scores = scores.masked_fill(~mask.dense(), float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)


__all__ = ["LayerCapture", "eager_attention_probs"]
