"""Structured pruning of a :class:`~lightning_llmopt.models.Llama`: attention heads and MLP channels removed, so the
linear layers and the :class:`~lightning_llmopt.models.LlamaConfig` really shrink.

The config is shared by every block, so every block keeps the same counts (``n_kv_heads``, query heads per
key/value head ``n_rep``, ``ffn_hidden_dim``) while *which* heads and channels survive is chosen per block:

1. :func:`plan_structured` ranks, per block, key/value groups (GQA: a key/value head with its ``n_rep`` query
   heads), query heads inside each kept group, and SwiGLU channels, by importance scores (default: weight norms,
   ``||W_q[h]|| * ||W_o[:, h]||`` per query head, ``(||W_1[c]|| + ||W_3[c]||) * ||W_2[:, c]||`` per channel; pass
   your own, e.g. from calibration activations) and keeps the top ones in their original order;
2. :func:`mask_structured` zeroes the output projections of the dropped heads and channels (``wo`` columns, ``w2``
   columns): the same function as the pruned model, with the original shapes;
3. :func:`prune_structured` slices ``wq``/``wk``/``wv`` rows (and biases), ``wo`` columns, ``w1``/``w3`` rows and
   ``w2`` columns, and sets ``n_heads = n_kv_heads * n_rep``, ``n_kv_heads``, ``head_dim`` (kept explicit) and
   ``ffn_hidden_dim`` in a new config. Query head ``j * n_rep' + r`` reads key/value head ``j`` as before.

MoE blocks are not supported (their channels live in stacked expert tensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from lightning_llmopt.models.llama import Attention, FeedForward, Llama, TransformerBlock


@dataclass
class StructuredPlan:
    """Per block index: kept key/value heads, kept query heads (original indices, GQA order) and kept channels."""

    kv_heads: dict[int, list[int]]
    q_heads: dict[int, list[int]]
    channels: dict[int, list[int]]
    n_kv_heads: int
    n_rep: int
    ffn_hidden_dim: int


def _blocks(model: Llama) -> dict[int, TransformerBlock]:
    return {int(k): cast(TransformerBlock, b) for k, b in model.layers.items()}


def _attention(block: TransformerBlock, i: int) -> Attention:
    """The block's GQA attention; structured pruning removes whole q/k/v heads, which MLA (a shared latent) and a
    layer reading another layer's K/V (``kv_sources``) do not have."""
    attn = block.attention
    if not isinstance(attn, Attention) or attn.wk is None:
        kind = "MLA" if not isinstance(attn, Attention) else "K/V shared from another layer (kv_sources)"
        raise ValueError(f"block {i}: structured pruning supports GQA attention with its own K/V only (found {kind})")
    return attn


def head_scores(attn: Attention) -> Tensor:
    """``(H,)`` weight-norm importance of each query head: ``||W_q[h]||_F * ||W_o[:, h]||_F``."""
    d = attn.head_dim
    q = attn.wq.weight.detach().float().view(-1, d, attn.wq.in_features).pow(2).sum((1, 2)).sqrt()
    o = attn.wo.weight.detach().float().view(attn.wo.out_features, -1, d).pow(2).sum((0, 2)).sqrt()
    return q * o


def channel_scores(ffn: FeedForward) -> Tensor:
    """``(F,)`` weight-norm importance of each SwiGLU channel: ``(||W_1[c]|| + ||W_3[c]||) * ||W_2[:, c]||``."""
    w1, w2, w3 = (w.weight.detach().float() for w in (ffn.w1, ffn.w2, ffn.w3))
    return (w1.norm(dim=1) + w3.norm(dim=1)) * w2.norm(dim=0)


def _topk_sorted(scores: Tensor, k: int) -> list[int]:
    return sorted(torch.topk(scores, k).indices.tolist())


def plan_structured(
    model: Llama,
    n_kv_heads: int | None = None,
    n_rep: int | None = None,
    ffn_hidden_dim: int | None = None,
    scores: dict[int, tuple[Tensor, Tensor]] | None = None,
) -> StructuredPlan:
    """Choose what each block keeps (``None``: keep the current count).

    Arguments:
        model: a dense :class:`Llama`.
        n_kv_heads: key/value heads kept per block (``<= config.n_kv_heads``).
        n_rep: query heads kept per kept key/value head (``<= config.n_rep``).
        ffn_hidden_dim: SwiGLU channels kept per block.
        scores: optional ``{block: (head scores (H,), channel scores (F,))}`` replacing the weight-norm defaults.
    """
    cfg = model.config
    assert cfg.n_kv_heads is not None and cfg.ffn_hidden_dim is not None
    n_kv = cfg.n_kv_heads if n_kv_heads is None else n_kv_heads
    rep = cfg.n_rep if n_rep is None else n_rep
    ffn = cfg.ffn_hidden_dim if ffn_hidden_dim is None else ffn_hidden_dim
    for name, value, limit in (
        ("n_kv_heads", n_kv, cfg.n_kv_heads),
        ("n_rep", rep, cfg.n_rep),
        ("ffn_hidden_dim", ffn, cfg.ffn_hidden_dim),
    ):
        if not 0 < value <= limit:
            raise ValueError(f"{name} ({value}) must be in [1, {limit}]")
    plan = StructuredPlan({}, {}, {}, n_kv, rep, ffn)
    for i, block in _blocks(model).items():
        feed = block.feed_forward
        if not isinstance(feed, FeedForward):
            raise ValueError(f"block {i}: structured pruning supports dense SwiGLU blocks only (found MoE)")
        hs, cs = scores[i] if scores is not None else (head_scores(_attention(block, i)), channel_scores(feed))
        groups = hs.view(cfg.n_kv_heads, cfg.n_rep)  # (H_kv, n_rep)
        kv = _topk_sorted(groups.sum(1), n_kv)
        plan.kv_heads[i] = kv
        plan.q_heads[i] = [g * cfg.n_rep + r for g in kv for r in _topk_sorted(groups[g], rep)]
        plan.channels[i] = _topk_sorted(cs, ffn)
    return plan


@torch.no_grad()
def mask_structured(model: Llama, plan: StructuredPlan) -> None:
    """Zero ``wo`` columns of dropped query heads and ``w2`` columns of dropped channels, in place."""
    for i, block in _blocks(model).items():
        attn, ffn = _attention(block, i), cast(FeedForward, block.feed_forward)
        d = attn.head_dim
        keep = torch.zeros(attn.wo.in_features // d, dtype=torch.bool)
        keep[plan.q_heads[i]] = True
        attn.wo.weight.mul_(keep.repeat_interleave(d).to(attn.wo.weight))
        keep_c = torch.zeros(ffn.w2.in_features, dtype=torch.bool)
        keep_c[plan.channels[i]] = True
        ffn.w2.weight.mul_(keep_c.to(ffn.w2.weight))


def _sliced(linear: nn.Linear, rows: Tensor | None = None, cols: Tensor | None = None) -> nn.Linear:
    w = linear.weight.detach()
    b = linear.bias.detach() if linear.bias is not None else None
    if rows is not None:
        w = w[rows.to(w.device)]
        b = b[rows.to(w.device)] if b is not None else None
    if cols is not None:
        w = w[:, cols.to(w.device)]
    new = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    new.weight.data.copy_(w)
    if b is not None:
        new.bias.data.copy_(b)  # type: ignore[union-attr]
    new.weight.requires_grad_(linear.weight.requires_grad)
    return new


def _head_rows(heads: list[int], d: int) -> Tensor:
    return (torch.tensor(heads)[:, None] * d + torch.arange(d)[None, :]).flatten()


@torch.no_grad()
def prune_structured(model: Llama, plan: StructuredPlan) -> Llama:
    """Remove the dropped heads and channels of ``plan`` in place and give ``model`` the smaller config.

    Returns ``model``. Optimizer state built for the old parameters is invalid afterwards: prune before fit (or
    rebuild the optimizer)."""
    cfg = model.config
    assert cfg.head_dim is not None
    d = cfg.head_dim
    for i, block in _blocks(model).items():
        attn, ffn = _attention(block, i), cast(FeedForward, block.feed_forward)
        q_rows, kv_rows = _head_rows(plan.q_heads[i], d), _head_rows(plan.kv_heads[i], d)
        assert attn.wk is not None and attn.wv is not None  # _attention refuses shared K/V
        attn.wq, attn.wk, attn.wv = _sliced(attn.wq, q_rows), _sliced(attn.wk, kv_rows), _sliced(attn.wv, kv_rows)
        attn.wo = _sliced(attn.wo, cols=q_rows)
        attn.n_heads, attn.n_kv_heads = plan.n_kv_heads * plan.n_rep, plan.n_kv_heads
        ch = torch.tensor(plan.channels[i])
        ffn.w1, ffn.w3, ffn.w2 = _sliced(ffn.w1, ch), _sliced(ffn.w3, ch), _sliced(ffn.w2, cols=ch)
    model.config = dataclasses.replace(
        cfg,
        n_heads=plan.n_kv_heads * plan.n_rep,
        n_kv_heads=plan.n_kv_heads,
        head_dim=d,
        ffn_hidden_dim=plan.ffn_hidden_dim,
    )
    return model


__all__ = ["StructuredPlan", "channel_scores", "head_scores", "mask_structured", "plan_structured", "prune_structured"]
