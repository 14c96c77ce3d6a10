"""Fused linear + cross-entropy loss module, on
:func:`~lightning_llmopt.kernels.fused_linear_ce.fused_linear_cross_entropy`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.kernels.fused_linear_ce import fused_linear_cross_entropy
from lightning_llmopt.layers.shards import vocab_operands

__all__ = ["FusedLinearCrossEntropy"]


class FusedLinearCrossEntropy(nn.Module):
    """``cross_entropy(hidden @ weight.T, labels)`` without the full logits; holds no parameters (the head's weight
    is passed in, so tied embeddings and sharded heads keep working).

    Arguments:
        ignore_index: label ignored in the loss and the mean.
        reduction: ``"mean"`` (over non-ignored tokens) or ``"sum"``.
        chunk_size: rows per chunk (default: 2^29 logits, at most half of the rows).
        process_group: group over which the vocabulary (``weight``'s rows) is sharded, for vocab-parallel TP.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Shapes: ``hidden`` ``(..., H)``, ``weight`` ``(V_local, H)``, ``labels`` ``hidden.shape[:-1]`` -> fp32 scalar.

    Under tensor parallelism (:func:`~lightning_llmopt.layers.shards.vocab_operands`) the head's weight is a DTensor
    sharded on the vocabulary: the loss runs on the local slice with that mesh's group (vocab-parallel: per chunk the
    max and the sum of exponentials are all-reduced, the full logits never exist); hidden states that are sequence
    shards (sequence parallelism) are gathered first. ``labels`` are the full rows on every rank.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        chunk_size: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.chunk_size = ignore_index, reduction, chunk_size
        self.process_group, self.backend = process_group, backend

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int | None = None) -> Tensor:
        hidden, weight, group = vocab_operands(hidden, weight)
        return fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            ignore_index=self.ignore_index if ignore_index is None else ignore_index,
            reduction=self.reduction,
            chunk_size=self.chunk_size,
            process_group=group if group is not None else self.process_group,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, chunk_size={self.chunk_size}, "
            f"vocab_parallel={self.process_group is not None}, backend={self.backend or 'auto'}"
        )
