"""Mixture-of-Experts routing: routers, capacity with priority dropping, balancing losses and load statistics.

Pure tensor functions, no modules and no ``torch.distributed``: :mod:`lightning_llmopt.models.moe` builds the layer
on them and :mod:`lightning_llmopt.parallel.expert_parallel` dispatches their output across ranks.

Capacity groups are sequences: with ``capacity_factor=c`` each expert takes at most ``ceil(c * T * k / E)``
assignments from one sequence of ``T`` tokens (GShard's "groups"). A sequence's routing then never depends on which
other sequences share its batch, so data-parallel and expert-parallel runs drop exactly the tokens a single process
drops. Inside a sequence, assignments are served in priority order: all first choices before any second choice, and
within one choice rank by descending router probability (batch-prioritized routing, Riquelme et al. 2021).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Routing",
    "aux_balance_loss",
    "capacity",
    "capacity_keep",
    "kept_assignments",
    "load_stats",
    "route",
    "z_loss",
]


@dataclass
class Routing:
    """The router's decision for ``B`` sequences of ``T`` tokens, ``k`` experts per token.

    Attributes:
        experts: ``(B, T, k)`` int64 expert index of each assignment, first choice first.
        weights: ``(B, T, k)`` fp32 combine weights (0 for dropped assignments).
        keep: ``(B, T, k)`` bool, False where capacity dropped the assignment.
        probs: ``(B, T, E)`` fp32 router softmax (before any balancing bias).
        logits: ``(B, T, E)`` fp32 router logits.
        dropless: every assignment is kept (no capacity): dispatchers then skip selecting the kept ones, a
            data-dependent ``nonzero`` that waits for the device.
    """

    experts: Tensor
    weights: Tensor
    keep: Tensor
    probs: Tensor
    logits: Tensor
    dropless: bool = False


def capacity(tokens_per_group: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert accepts from one group: ``ceil(capacity_factor * tokens * k / E)``."""
    return max(1, math.ceil(capacity_factor * tokens_per_group * top_k / num_experts))


def capacity_keep(experts: Tensor, weights: Tensor, num_experts: int, cap: int) -> Tensor:
    """``(B, T, k)`` bool: which assignments fit the per-sequence capacity ``cap`` (priority order, see module doc).

    Vectorised over sequences: the assignments of a row are ranked by priority, then stably grouped by expert;
    an assignment is kept when fewer than ``cap`` assignments of its expert rank before it.
    """
    b, t, k = experts.shape
    n = t * k
    flat_e = experts.permute(0, 2, 1).reshape(b, n)  # choice-major: all first choices, then second choices...
    flat_w = weights.permute(0, 2, 1).reshape(b, n)
    choice = torch.arange(k, device=experts.device).repeat_interleave(t).expand(b, n)
    # Priority: choice ascending, then weight descending (weights lie in [0, 1]); ties by position (stable sort).
    key = choice.to(torch.float64) * 2.0 + (1.0 - flat_w.to(torch.float64))
    prio = torch.argsort(key, dim=1, stable=True)
    rank = torch.empty_like(prio)
    rank.scatter_(1, prio, torch.arange(n, device=experts.device).expand(b, n))
    order = torch.argsort(flat_e * n + rank, dim=1)  # by expert, then priority
    sorted_e = flat_e.gather(1, order)
    counts = F.one_hot(flat_e, num_experts).sum(1)  # (B, E)
    starts = torch.cumsum(counts, 1) - counts
    pos_sorted = torch.arange(n, device=experts.device).expand(b, n) - starts.gather(1, sorted_e)
    pos = torch.empty_like(pos_sorted)
    pos.scatter_(1, order, pos_sorted)
    return (pos < cap).reshape(b, k, t).permute(0, 2, 1)


def route(
    logits: Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    bias: Tensor | None = None,
    capacity_factor: float | None = None,
) -> Routing:
    """Route ``(B, T, E)`` logits to ``top_k`` experts per token.

    ``top_k=1`` is the Switch router (weight = the chosen expert's probability); ``top_k>1`` is GShard/Mixtral
    top-k, with the k weights renormalised to sum to 1 when ``renormalize``. ``bias`` ``(E,)`` (auxiliary-loss-free
    balancing, DeepSeek-V3) is added to the probabilities for *selection only*; weights come from the unbiased
    probabilities. ``capacity_factor=None`` is dropless.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least (fp64 stays fp64)
    probs = logits.softmax(-1)
    scores = probs if bias is None else probs + bias.to(probs.dtype)
    experts = scores.topk(top_k, dim=-1).indices  # (B, T, k), descending score
    weights = probs.gather(-1, experts)
    if top_k > 1 and renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if capacity_factor is None:
        keep = torch.ones_like(experts, dtype=torch.bool)
    else:
        cap = capacity(logits.shape[1], top_k, logits.shape[-1], capacity_factor)
        keep = capacity_keep(experts, weights.detach(), logits.shape[-1], cap)
        weights = weights * keep
    return Routing(
        experts=experts, weights=weights, keep=keep, probs=probs, logits=logits, dropless=capacity_factor is None
    )


def kept_assignments(keep: Tensor, dropless: bool) -> Tensor:
    """Indices of the kept assignments of the flattened ``keep`` ``(N,)`` bool: all of them when ``dropless``
    (no host synchronisation), else ``nonzero`` (whose size the host must read)."""
    if dropless:
        return torch.arange(keep.numel(), device=keep.device)
    return torch.nonzero(keep).squeeze(1)


def _identity(x: Tensor) -> Tensor:
    return x


def aux_balance_loss(routing: Routing, seq_sum: Callable[[Tensor], Tensor] = _identity) -> Tensor:
    """Switch Transformer balance loss ``E * sum_i f_i * P_i`` per sequence, averaged over sequences.

    ``f_i``: fraction of the sequence's assignments (all k choices, before capacity) routed to expert ``i``;
    ``P_i``: mean router probability of expert ``i`` over the sequence. Equals 1 for a uniform router. Computed per
    sequence so that its mean over a batch does not depend on how the batch is split across ranks.
    ``seq_sum``: sums per-sequence partial sums over the ranks that hold slices of each sequence (tensor
    parallelism routes sequence slices); the identity when each rank holds whole sequences.
    """
    num_experts = routing.probs.shape[-1]
    b, t, k = routing.experts.shape
    counts = seq_sum(F.one_hot(routing.experts, num_experts).sum((1, 2)).float())  # (B, E), no gradient
    tokens = seq_sum(routing.probs.new_full((b, 1), float(t)))
    f = counts / (tokens * k)
    p = seq_sum(routing.probs.sum(1)) / tokens  # (B, E)
    return num_experts * (f * p).sum(-1).mean()


def z_loss(routing: Routing, seq_sum: Callable[[Tensor], Tensor] = _identity) -> Tensor:
    """Router z-loss (ST-MoE): mean over tokens of ``logsumexp(logits)**2`` (``seq_sum`` as in
    :func:`aux_balance_loss`)."""
    z = torch.logsumexp(routing.logits, dim=-1).square()
    total = seq_sum(torch.stack([z.sum(), z.new_full((), float(z.numel()))]))  # new_full: no host copy
    return total[0] / total[1]


def load_stats(routing: Routing) -> tuple[Tensor, Tensor]:
    """``(counts, dropped)``: kept assignments per expert ``(E,)`` int64 and dropped assignments (scalar int64)."""
    num_experts = routing.probs.shape[-1]
    experts, keep = routing.experts.reshape(-1), routing.keep.reshape(-1)
    # scatter-add rather than experts[keep]: a boolean-mask index has a data-dependent size the host must read
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device).scatter_add_(0, experts, keep.long())
    dropped = (~keep).sum()
    return counts, dropped
