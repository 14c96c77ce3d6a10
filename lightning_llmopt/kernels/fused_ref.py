"""Pure-PyTorch references of the fused training kernels: the CPU fallback and the test oracle.

Each function computes in fp32 (``upcast=True``, the default, or fp64 when given fp64 inputs) and returns the
kernel's output dtype; ``upcast=False`` computes in the inputs' own dtype, which is the "plain PyTorch in the same
dtype" of the tolerance rule (docs/fused_kernels.md). All are differentiable through autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["fused_linear_cross_entropy_ref", "rms_norm_ref", "rotary_ref", "swiglu_ref"]


def _compute_dtype(*ts: Tensor, upcast: bool) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if upcast and dtype != torch.float64:
        return torch.float32
    return dtype


def rms_norm_ref(
    x: Tensor, weight: Tensor, eps: float = 1e-5, *, out_dtype: torch.dtype | None = None, upcast: bool = True
) -> Tensor:
    """``(x / sqrt(mean(x^2) + eps))`` rounded to x's dtype, times ``weight`` (Llama's and Hugging Face's order).

    Shapes: ``x`` ``(..., D)``, ``weight`` ``(D,)``; returns ``(..., D)`` in ``out_dtype`` (default: the promotion of
    x's and weight's dtypes, as ``normed.to(x.dtype) * weight`` gives).
    """
    out_dtype = out_dtype or torch.promote_types(x.dtype, weight.dtype)
    cdt = _compute_dtype(x, upcast=upcast)
    xf = x.to(cdt)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    wdt = _compute_dtype(normed, weight, upcast=upcast)
    return (normed.to(wdt) * weight.to(wdt)).to(out_dtype)


def rotary_ref(x: Tensor, cos: Tensor, sin: Tensor, *, upcast: bool = True) -> Tensor:
    """Rotate-half RoPE (Su et al., arXiv 2104.09864, Hugging Face layout), out of place.

    Shapes: ``x`` ``(B, T, H, D)``; ``cos``/``sin`` ``(B, T, D/2)`` (or broadcastable, e.g. ``(1, T, D/2)``).
    Channel ``c < D/2`` pairs with ``c + D/2``: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``. Returns x's dtype.
    """
    cdt = _compute_dtype(x, upcast=upcast)
    x1, x2 = x.to(cdt).chunk(2, dim=-1)
    c = cos.to(cdt)[:, :, None, :]  # (B, T, 1, D/2)
    s = sin.to(cdt)[:, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def swiglu_ref(gate: Tensor, up: Tensor, *, upcast: bool = True) -> Tensor:
    """``silu(gate) * up`` (Shazeer, arXiv 2002.05202); same shapes in and out, returns gate's dtype."""
    cdt = _compute_dtype(gate, up, upcast=upcast)
    return (F.silu(gate.to(cdt)) * up.to(cdt)).to(gate.dtype)


def fused_linear_cross_entropy_ref(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    process_group: torch.distributed.ProcessGroup | None = None,
    compute_dtype: torch.dtype | None = None,
    upcast: bool = True,
) -> Tensor:
    """Unfused ``cross_entropy(hidden @ weight.T, labels)``: materializes the ``(N, V)`` logits.

    Shapes: ``hidden`` ``(N, H)``, ``weight`` ``(V_local, H)``, ``labels`` ``(N,)`` int64 global vocabulary ids.
    The matmul runs in ``compute_dtype`` (default: hidden's dtype), the softmax in fp32 (``upcast``) or in the
    logits' dtype. With ``process_group``, the vocabulary is sharded over its ranks in rank order (rank ``r`` holds
    ids ``[r * V_local, (r + 1) * V_local)``); the reference all-gathers the other slices and computes the full
    softmax, so ``hidden`` gets the full gradient and ``weight`` its slice's. ``reduction``: ``"mean"`` over labels
    != ignore_index or ``"sum"``.
    """
    cdt = compute_dtype or hidden.dtype
    if process_group is not None:  # gather the other ranks' slices (constants): the local one keeps its autograd
        world, rank = torch.distributed.get_world_size(process_group), torch.distributed.get_rank(process_group)
        shards = [torch.empty_like(weight) for _ in range(world)]
        torch.distributed.all_gather(shards, weight.detach().contiguous(), group=process_group)
        shards[rank] = weight
        weight = torch.cat(shards)  # (V, H)
    logits = hidden.to(cdt) @ weight.to(cdt).t()  # (N, V)
    if upcast:
        logits = logits.to(torch.float64 if cdt == torch.float64 else torch.float32)
    valid = labels != ignore_index
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    if reduction == "mean":
        loss = loss / valid.sum()
    elif reduction != "sum":
        raise ValueError(f"reduction ({reduction!r}) must be 'mean' or 'sum'")
    return loss
