"""SparseGPT (Frantar & Alistarh, arXiv 2301.00774): one-shot pruning of a linear layer from calibration data.

For ``y = x W^T`` with calibration inputs ``X`` the layer-wise objective is ``||X W^T - X W'^T||^2`` with ``W'``
sparse. SparseGPT shares GPTQ's machinery (:mod:`lightning_llmopt.quantization.gptq`: the Hessian
``H = 2 X^T X / n``, dampening, the upper Cholesky factor ``U`` of ``H^-1``, lazy blocks) and replaces rounding by
pruning:

1. dead inputs (``H[i, i] = 0``) get ``H[i, i] = 1`` and their weights are zeroed;
2. ``U = cholesky((H + damp * mean(diag H) I)^-1)^T``;
3. columns are processed in blocks of ``block_size``; at the start of a block (unstructured) the mask is chosen
   from the OBS saliency ``w^2 / U[i, i]^2`` of the *current* (already updated) weights: the ``sparsity``
   fraction of the block with the smallest saliency is dropped (adaptive mask selection); for N:M, at every
   ``M``-th column the ``N`` most salient of the next ``M`` columns of each row are kept;
4. inside a block, column ``i`` is set to ``q = w * mask`` and its error ``e = (w - q) / U[i, i]`` updates the
   block's later columns (``W[:, i:] -= e U[i, i:]``, the row-wise OBS update); after the block the remaining
   columns receive ``E U[block, end:]`` in one matmul.

The result is exactly zero on the dropped weights; the summed ``e^2 / 2`` is returned as the objective proxy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_llmopt.quantization.gptq import inverse_cholesky


@dataclass
class SparseGPTResult:
    """One layer's SparseGPT output: ``weight`` ``(N, K)`` fp32 with zeros where ``mask`` ``(N, K)`` is False."""

    weight: Tensor
    mask: Tensor
    loss: float
    damp: float


def _block_mask(W1: Tensor, d: Tensor, sparsity: float) -> Tensor:
    """Keep-mask of a block: drop the ``round(sparsity * numel)`` smallest ``w^2 / d^2`` (d = diag U)."""
    saliency = (W1 / d[None, :]).pow(2).flatten()
    n_drop = int(round(sparsity * saliency.numel()))
    keep = torch.ones_like(saliency, dtype=torch.bool)
    if n_drop:
        keep[torch.argsort(saliency, stable=True)[:n_drop]] = False
    return keep.view_as(W1)


@torch.no_grad()
def sparsegpt_prune(
    weight: Tensor,
    H: Tensor,
    sparsity: float = 0.5,
    n: int = 0,
    m: int = 0,
    block_size: int = 128,
    damp: float = 0.01,
) -> SparseGPTResult:
    """Prune an ``(N, K)`` weight with SparseGPT given its input Hessian ``H`` ``(K, K)`` (steps in the module doc).

    Arguments:
        weight: ``(N, K)`` float weight (not modified).
        H: ``(K, K)`` Hessian ``2 X^T X / n`` (:class:`~lightning_llmopt.quantization.gptq.HessianAccumulator`).
        sparsity: fraction dropped (unstructured; ignored when ``n, m`` are set).
        n, m: N:M semi-structured pattern (``2, 4``); ``0, 0`` for unstructured.
        block_size: columns per lazy-update block (a multiple of ``m`` for N:M).
        damp: dampening as a fraction of the mean Hessian diagonal.
    """
    if weight.ndim != 2 or H.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"weight {tuple(weight.shape)} and Hessian {tuple(H.shape)} do not match")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity ({sparsity}) must be in [0, 1)")
    if m:
        if not 0 < n < m or weight.shape[1] % m or block_size % m:
            raise ValueError(f"N:M ({n}:{m}) needs 0 < n < m, m dividing K ({weight.shape[1]}) and block_size")
    W = weight.detach().float().clone()
    H = H.detach().float().to(W.device).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    U, used_damp = inverse_cholesky(H, damp)
    del H
    k = W.shape[1]
    mask = torch.ones_like(W, dtype=torch.bool)
    loss = torch.zeros((), device=W.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        d = torch.diagonal(U1)
        M1 = _block_mask(W1, d, sparsity) if not m else torch.ones_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            if m and i % m == 0:  # choose this group of m columns from the current weights
                sal = (W1[:, i : i + m] / d[None, i : i + m]).pow(2)
                drop = torch.topk(sal, m - n, dim=1, largest=False).indices
                M1[:, i : i + m].scatter_(1, drop, False)
            w = W1[:, i]
            q = w * M1[:, i]
            err = (w - q) / U1[i, i]
            loss += (err * err).sum() / 2
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            W1[:, i] = q  # exact zeros (the update above leaves q up to rounding)
            E1[:, i] = err
        W[:, i1:i2] = W1
        mask[:, i1:i2] = M1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    mask &= ~dead[None, :]
    return SparseGPTResult(W * mask, mask, float(loss), used_damp)


__all__ = ["SparseGPTResult", "sparsegpt_prune"]
