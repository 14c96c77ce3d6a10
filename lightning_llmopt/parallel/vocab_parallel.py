"""Vocab-parallel cross-entropy: the loss over logits sharded on the vocabulary, never gathering the full logits.

With tensor parallelism the output head is column-parallel, so rank ``t`` of ``tp`` holds logits ``(N, V/tp)`` for
vocabulary ids ``[t*V/tp, (t+1)*V/tp)``. Per token (Megatron-LM, Shoeybi et al., arXiv 1909.08053, section 3):

1. ``m`` = max over the vocabulary: local max, then all-reduce MAX;
2. ``s`` = sum of ``exp(x - m)``: local sum, then all-reduce SUM;
3. ``z_t`` = the target's shifted logit ``x[target] - m``: the rank holding the target contributes it, the others 0,
   all-reduce SUM;
4. loss = ``log(s) - z_t`` (equal to ``-log_softmax(x)[target]``), averaged over tokens whose label is not
   ``ignore_index``.

Backward: ``d loss / d x = (softmax(x) - onehot(target)) / n_valid`` on the local shard, no communication. Three
all-reduces of ``N`` floats replace gathering ``N*V`` logits.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = ["is_vocab_sharded", "vocab_parallel_cross_entropy"]


def _dtensor_cls() -> Any:
    module = sys.modules.get("torch.distributed.tensor")  # nothing can be a DTensor before this is imported
    return getattr(module, "DTensor", None) if module is not None else None


def is_vocab_sharded(logits: Any) -> bool:
    """True for a DTensor sharded on its last (vocabulary) dimension over a 1-D mesh (a column-parallel head)."""
    cls = _dtensor_cls()
    if cls is None or not isinstance(logits, cls):
        return False
    placements = logits.placements
    return len(placements) == 1 and placements[0].is_shard() and placements[0].dim in (-1, logits.ndim - 1)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        vocab_start: int,
        group: Any,  # type: ignore[override]
        ignore_index: int,
    ) -> Tensor:
        # logits: (N, V_local) fp32; labels: (N,) int64 global vocabulary ids
        v_local = logits.shape[-1]
        m = logits.detach().amax(dim=-1)  # (N,)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        probs = (logits - m[:, None]).exp_()  # exp(x - m), becomes the local softmax below
        s = probs.sum(dim=-1)
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        valid = labels != ignore_index
        local = labels - vocab_start
        inside = valid & (local >= 0) & (local < v_local)
        index = local.clamp(0, v_local - 1)
        z_t = (logits.gather(1, index[:, None]).squeeze(1) - m) * inside
        dist.all_reduce(z_t, op=dist.ReduceOp.SUM, group=group)
        n_valid = valid.sum()
        loss = ((s.log() - z_t) * valid).sum() / n_valid  # 0/0 = nan when every label is ignored, as torch
        probs.div_(s[:, None])
        ctx.save_for_backward(probs, index, inside, valid, n_valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        probs, index, inside, valid, n_valid = ctx.saved_tensors
        g = probs  # reused in place: the softmax is not needed after this (backward runs once)
        # minus the one-hot target on the rank holding it (adds -0.0 elsewhere; no nonzero(): no host sync)
        g.scatter_add_(1, index[:, None], -inside[:, None].to(g.dtype))
        g.mul_((valid.to(g.dtype) * (grad / n_valid))[:, None])
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits: Any, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy in fp32 over labels != ``ignore_index``, like ``F.cross_entropy``.

    Arguments:
        logits: ``(..., V)``: a DTensor sharded on the vocabulary (the output of a column-parallel head, see
            :func:`~lightning_llmopt.parallel.tensor_parallel.apply_tp`), computed without gathering; any other
            DTensor is gathered first; a plain tensor goes to ``F.cross_entropy``.
        labels: ``(...)`` int64 vocabulary ids, the same on every tensor-parallel rank.

    Returns: a plain 0-dim fp32 tensor (the same on every tensor-parallel rank).
    """
    if not is_vocab_sharded(logits):
        cls = _dtensor_cls()
        if cls is not None and isinstance(logits, cls):
            logits = logits.full_tensor()
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=ignore_index)
    mesh = logits.device_mesh
    vocab, tp = logits.shape[-1], mesh.size()
    if vocab % tp != 0:
        raise ValueError(
            f"vocab_size ({vocab}) must be divisible by tensor_parallel ({tp}) for the vocab-parallel loss"
        )
    local = logits.to_local()  # (..., V / tp); its gradient flows back as the same Shard(-1)
    start = mesh.get_local_rank() * (vocab // tp)
    return _VocabParallelCE.apply(local.float().flatten(0, -2), labels.flatten(), start, mesh.get_group(), ignore_index)
