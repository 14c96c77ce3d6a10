"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh, arXiv 2210.17323): second-order weight quantization of one layer.

For a linear layer ``y = x W^T`` with calibration inputs ``X``, GPTQ quantizes the columns of ``W`` (input features)
one at a time and spreads each column's rounding error over the not-yet-quantized columns so as to minimise
``||X W^T - X Q^T||^2``, using the Hessian ``H = 2 X^T X / n`` of that objective:

1. accumulate ``H`` over the calibration data (:class:`HessianAccumulator`, a running mean, fp32);
2. dead inputs (``H[i, i] = 0``: the feature was always 0) get ``H[i, i] = 1`` and their weights are zeroed;
3. optional activation order (``act_order``): process columns by decreasing ``H[i, i]``; groups are then formed in
   that order and the layer keeps the permutation (``perm``);
4. dampening: ``H += damp * mean(diag H) * I`` (raised tenfold on a failed Cholesky, up to 3 times);
5. ``U = cholesky(H^-1)^T`` (upper): row ``i`` of ``U`` holds the update coefficients after column ``i``;
6. lazy batched updates: columns are processed in blocks of ``block_size``; inside a block each column ``i`` is
   rounded (``q``, on the grid of its group, whose scale/zero are chosen by the observer from the current, already
   updated weights when the group starts), its error ``e = (w - q) / U[i, i]`` updates the block's remaining
   columns (``W[:, i:] -= e U[i, i:]``); the rest of the matrix receives the block's errors in one matmul
   (``W[:, end:] -= E U[block, end:]``), which is what makes GPTQ fast on GPUs.

Returns a :class:`~lightning_llmopt.quantization.weight.QuantizedWeight` whose codes, scales and zeros are exactly
those used in the error feedback (scales rounded to their storage dtype first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_llmopt.quantization.observers import Observer, get_observer
from lightning_llmopt.quantization.spec import QuantSpec, quantize_codes
from lightning_llmopt.quantization.weight import QuantizedWeight, round_scale


class HessianAccumulator:
    """Running ``H = 2 X^T X / n`` over the rows of every batch passed to :meth:`add` (fp32, on the input's device).

    Arguments:
        in_features: ``K``.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: Tensor) -> None:
        """``x`` ``(..., K)``: every row is one sample."""
        x = x.detach().reshape(-1, self.in_features).float()
        if self.H.device != x.device:
            self.H = self.H.to(x.device)
        rows = x.shape[0]
        if rows == 0:
            return
        self.H.mul_(self.n / (self.n + rows))
        self.n += rows
        x = x * (2.0 / self.n) ** 0.5
        self.H.addmm_(x.t(), x)


@dataclass
class GPTQResult:
    """One layer's GPTQ output: the quantized weight and the summed ``(w - q)^2 / U[i,i]^2`` objective proxy."""

    weight: QuantizedWeight
    loss: float
    damp: float


def inverse_cholesky(H: Tensor, damp: float) -> tuple[Tensor, float]:
    """Upper Cholesky factor of ``(H + d I)^-1``, raising ``d`` tenfold (up to 3 times) if ``H`` is not PD."""
    mean_diag = float(torch.diagonal(H).mean())
    for attempt in range(4):
        d = damp * (10**attempt) * mean_diag
        Hd = H.clone()
        Hd.diagonal().add_(d)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U, damp * 10**attempt
    raise RuntimeError(f"GPTQ: the Hessian is not positive definite even with dampening {damp * 1000} x mean diag")


def gptq_quantize(
    weight: Tensor,
    H: Tensor,
    spec: QuantSpec,
    observer: str | Observer = "minmax",
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> GPTQResult:
    """Quantize an ``(N, K)`` weight with GPTQ given its input Hessian ``H`` ``(K, K)`` (steps in the module doc).

    Arguments:
        weight: ``(N, K)`` float weight (not modified).
        H: ``(K, K)`` Hessian ``2 X^T X / n`` (:class:`HessianAccumulator`), not modified.
        spec: bits, granularity (``"group"`` or ``"channel"``), symmetry.
        observer: how each group's range is chosen (min/max, as in the paper, by default); a name, or an
            :class:`Observer` built for ``QuantSpec(bits, "channel", group_size, symmetric)`` (it sees one
            ``(N, group)`` slice at a time).
        block_size: columns per lazy-update block.
        damp: dampening as a fraction of the mean Hessian diagonal (the paper's 1%).
        act_order: process columns by decreasing Hessian diagonal.
        scale_dtype: dtype the scales are stored (and rounded) in.
    """
    spec.check_weight(tuple(weight.shape))
    if spec.granularity == "tensor":
        raise ValueError("GPTQ quantizes per channel or per group; granularity 'tensor' is not supported")
    n, k = weight.shape
    W = weight.detach().float().clone()
    H = H.detach().float().to(W.device).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    U, used_damp = inverse_cholesky(H, damp)
    del H
    g = spec.effective_group_size(k)
    row_spec = QuantSpec(spec.bits, "channel", spec.group_size, spec.symmetric)
    if isinstance(observer, Observer) and observer.spec != row_spec:
        raise ValueError(f"GPTQ applies the observer to one group at a time: build it for {row_spec}")
    obs = get_observer(observer, row_spec)
    codes = torch.zeros(n, k, dtype=torch.uint8, device=W.device)
    scales = torch.zeros(n, k // g, dtype=torch.float32, device=W.device)
    zeros = torch.zeros(n, k // g, dtype=torch.float32, device=W.device)
    loss = torch.zeros((), device=W.device)
    scale = zero = None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # a new group starts: its range from the current (updated) weights
                current = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :g]
                qp = obs(current)
                scale, zero = round_scale(qp.scale[:, 0], scale_dtype), qp.zero[:, 0]
                scales[:, col // g], zeros[:, col // g] = scale, zero
            assert scale is not None and zero is not None
            w = W1[:, i]
            q = quantize_codes(w, scale, zero, spec.maxq)
            codes[:, col] = q.to(torch.uint8)
            err = (w - (q - zero) * scale) / U1[i, i]
            loss += (err * err).sum() / 2
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    qw = QuantizedWeight.from_codes(
        codes, scales.to(scale_dtype), None if spec.symmetric else zeros, spec.bits, g, perm
    )
    return GPTQResult(qw, float(loss), used_damp)


__all__ = ["GPTQResult", "HessianAccumulator", "gptq_quantize", "inverse_cholesky"]
