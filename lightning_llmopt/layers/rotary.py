"""Rotary embedding applied to q and k (:func:`lightning_llmopt.kernels.rotary.apply_rotary`)."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_llmopt.kernels.rotary import apply_rotary

__all__ = ["FusedRotary"]


class FusedRotary(nn.Module):
    """Rotates q and k (one kernel launch each, nothing of their size saved for backward): in place without autograd
    (inference), out of place while training, where q and k are views of their projections and an in-place op would
    cost autograd copies of the projections in backward.

    The hook :class:`~lightning_llmopt.models.llama.Attention` calls when set (``attention.rotary``); the default
    there is the out-of-place fp32 :func:`~lightning_llmopt.models.rope.apply_rope`, which this reproduces.

    Arguments:
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see :mod:`lightning_llmopt.kernels.fused_common`).

    Shapes: ``q`` ``(B, H, T, D)``, ``k`` ``(B, H_kv, T, D)`` (the model's layout: views of ``(B, T, H, D)``
    projections), ``table`` ``(max_seq_len, D/2, 2)`` fp32 (cos, sin) from
    :func:`~lightning_llmopt.models.rope.rope_table`, ``positions`` ``(B, T)`` int64. Returns ``(q, k)``, the same
    tensors, rotated.
    """

    def __init__(self, backend: str | None = None) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, q: Tensor, k: Tensor, table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotate(q, table, positions), self.rotate(k, table, positions)

    def rotate(self, x: Tensor, table: Tensor, positions: Tensor) -> Tensor:
        """One tensor ``x`` ``(B, H, T, D)`` rotated (a layer that reads another layer's keys rotates only its
        queries; MLA rotates its query and shared-key RoPE channels separately)."""
        cos, sin = table[..., 0], table[..., 1]  # (P, D/2) strided views, no copy
        return apply_rotary(x.transpose(1, 2), cos, sin, positions, backend=self.backend).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"backend={self.backend or 'auto'}"
