"""How the KV byte budget is split between KV groups (producers with different windows).

When the pool size comes from free GPU memory, the local groups get the blocks their windows need
(:func:`~lightning_llmopt.inference.kv_groups.group_blocks`, which grows with the global group's count only up to its
own bound) and the global group gets every byte left, so the bytes a local layer does not keep become more global
blocks: the global count is the largest ``n <= useful`` with ``n * bytes_0 + sum(local_g(n) * bytes_g) <= budget``.
With ``num_blocks`` set (or off the GPU) the global group has that many blocks and the local groups their need, as
before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_llmopt.inference.kv_pool import block_bytes
from lightning_llmopt.models.layer_pattern import kv_producers, layer_windows


@dataclass
class KVGroup:
    """Producing layers (model layer indices) cached together, with their window (``None``: global)."""

    window: int | None
    layers: list[int]


def kv_groups(config: Any) -> list[KVGroup]:
    """Group 0: the global producers (all local: those of the widest window, which the scheduler releases past it);
    then one group per other local window (ascending). A single group when every producer has one window (the
    engine's plain pool)."""
    windows = layer_windows(config)
    producers = kv_producers(config)
    glob = [i for i in producers if windows[i] is None]
    local: list[int] = sorted({w for i in producers if (w := windows[i]) is not None})
    if not local or (not glob and len(local) == 1):
        return [KVGroup(windows[producers[0]], producers)]
    head = KVGroup(None, glob) if glob else KVGroup(local[-1], [i for i in producers if windows[i] == local[-1]])
    rest = local if glob else local[:-1]
    return [head] + [KVGroup(w, [i for i in producers if windows[i] == w]) for w in rest]


def group_blocks(
    window: int, block_size: int, max_num_seqs: int, max_tokens: int, cap: int, prefix_caching: bool = False
) -> int:
    """Blocks of a local group: every sequence slot at its bound ``ceil((w - 1 + n) / bs) + 1`` (``n``: the step's
    token budget), plus the null block; with prefix caching, room for the last window ``ceil((w - 1) / bs) + 1`` of
    as many cached prefixes as there are sequence slots; at most ``cap`` (the global group's size)."""
    per_seq = math.ceil((window - 1 + max_tokens) / block_size) + 1
    cached = max_num_seqs * (math.ceil((window - 1) / block_size) + 1) if prefix_caching else 0
    return min(cap, max_num_seqs * per_seq + cached + 1)


__all__ = ["group_pool_sizes", "split_blocks"]


def split_blocks(
    budget_bytes: int,
    block_bytes: Sequence[int],
    local_blocks: Sequence[Callable[[int], int]],
    max_global: int,
) -> list[int]:
    """Blocks per group (group 0 first) from a byte budget.

    Arguments:
        budget_bytes: bytes the whole cache may take.
        block_bytes: bytes of one block of each group (group 0, the global producers, first).
        local_blocks: for each local group, its block count given the global group's (a local group never holds
            more blocks than the global one: :func:`~lightning_llmopt.inference.kv_groups.group_blocks` with
            ``cap`` the global count); non-decreasing in it.
        max_global: the most global blocks worth having (the engine's ``useful`` bound).

    The global group gets the largest count ``n <= max_global`` with ``n * block_bytes[0] + sum(local(n) *
    block_bytes[g])`` within the budget (bisection, as the local counts grow with ``n`` only up to their cap).
    Raises ``ValueError`` when not even two global blocks (the null block and one more) fit."""
    if len(block_bytes) != len(local_blocks) + 1:
        raise ValueError(f"block_bytes has {len(block_bytes)} groups, local_blocks {len(local_blocks)} (+1 needed)")
    if any(b <= 0 for b in block_bytes):
        raise ValueError(f"block_bytes must be positive, got {list(block_bytes)}")

    def sizes(n: int) -> list[int]:
        return [n, *(f(n) for f in local_blocks)]

    def cost(n: int) -> int:
        return sum(c * b for c, b in zip(sizes(n), block_bytes, strict=True))

    lo, hi = 2, max(2, max_global)
    if cost(lo) > budget_bytes:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no usable pool: 2 global blocks and the local groups' "
            f"{sizes(2)[1:]} blocks need {cost(2)} bytes"
        )
    while lo < hi:  # the largest n in [lo, hi] whose cost fits
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return sizes(lo)


def group_pool_sizes(
    groups: list[KVGroup],
    model_cfg: Any,
    config: Any,
    kv_dtype: torch.dtype,
    num_blocks: int,
    budget_bytes: int | None = None,
) -> list[int]:
    """Blocks of each group (group 0 first). ``budget_bytes`` ``None``: group 0 gets ``num_blocks`` (the
    ``num_blocks`` override, or the CPU default) and each local group its need capped at it; else the budget is
    split (:func:`split_blocks`) with ``num_blocks`` as the most global blocks worth having."""
    local = [
        functools.partial(
            _local_need,
            window=g.window,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_tokens=config.max_num_batched_tokens,
            prefix_caching=config.enable_prefix_caching,
        )
        for g in groups[1:]
    ]
    if budget_bytes is None:
        return [num_blocks, *(f(num_blocks) for f in local)]
    per = [
        block_bytes(len(g.layers), model_cfg.n_kv_heads, model_cfg.head_dim, config.block_size, kv_dtype)
        for g in groups
    ]
    return split_blocks(budget_bytes, per, local, num_blocks)


def _local_need(
    cap: int, *, window: int | None, block_size: int, max_num_seqs: int, max_tokens: int, prefix_caching: bool
) -> int:
    assert window is not None  # local groups have a window
    return group_blocks(window, block_size, max_num_seqs, max_tokens, cap, prefix_caching)
