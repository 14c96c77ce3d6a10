"""The paged KV cache behind the models' :class:`~lightning_llmopt.models.kv_cache.KVCache` protocol.

:class:`PagedKVCache` lets the unmodified reference model (``model(tokens, positions=..., kv_cache=cache)``) decode
over paged storage: each batch row is a sequence with its own block table in a :class:`BlockManager` over a
:class:`KVPool`. ``update`` writes the new keys/values into their slots (allocating blocks at layer 0) and returns
the row's pages gathered into contiguous ``(B, H_kv, S, D)`` tensors with ``-1`` positions for empty slots, exactly
what :class:`~lightning_llmopt.models.kv_cache.StaticKVCache` returns. The engine itself does not gather: its
runner reads pages inside the decode kernel; this adapter is the protocol-level reference (and works with any
attention backend of the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_llmopt.inference.block_manager import BlockManager
from lightning_llmopt.inference.kv_pool import KVPool
from lightning_llmopt.kernels.paged_attention_ref import gather_pages

__all__ = ["PagedKVCache"]


@dataclass
class _Row:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedKVCache:
    """:class:`~lightning_llmopt.models.kv_cache.KVCache` over paged storage, one sequence per batch row.

    Arguments:
        pool: the KV storage.
        blocks: block accounting over the same number of blocks.
        batch_size: rows.
    """

    def __init__(self, pool: KVPool, blocks: BlockManager, batch_size: int) -> None:
        self.pool = pool
        self.blocks = blocks
        self.rows = [_Row() for _ in range(batch_size)]

    def update(self, layer_id: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, H, T, D = k.shape
        bs = self.pool.block_size
        pos = positions.cpu()
        if layer_id == 0:  # one allocation per forward pass
            for r, row in enumerate(self.rows):
                self.blocks.ensure(row, int(pos[r].max()) + 1)
        blk = torch.tensor([[row.block_table[p // bs] for p in pos[r].tolist()] for r, row in enumerate(self.rows)])
        flat_pos = pos.reshape(-1)
        self.pool.write(
            layer_id,
            k.transpose(1, 2).reshape(B * T, H, D),
            v.transpose(1, 2).reshape(B * T, H, D),
            blk.reshape(-1).to(k.device),
            (flat_pos % bs).to(k.device),
        )
        if layer_id == self.pool.n_layers - 1:
            for r, row in enumerate(self.rows):
                row.num_computed = max(row.num_computed, int(pos[r].max()) + 1)
        width = max(len(row.block_table) for row in self.rows)
        tables = torch.zeros(B, width, dtype=torch.int32)
        for r, row in enumerate(self.rows):
            tables[r, : len(row.block_table)] = torch.tensor(row.block_table, dtype=torch.int32)
        tables = tables.to(k.device)
        kc, vc = self.pool.layer(layer_id)
        ks, vs = self.pool.layer_scales(layer_id)
        k_all = gather_pages(kc, tables, ks, k.dtype)  # (B, H_kv, width * bs, D)
        v_all = gather_pages(vc, tables, vs, v.dtype)
        top = torch.tensor([max(row.num_computed, int(pos[r].max()) + 1) for r, row in enumerate(self.rows)])
        slot_pos = torch.arange(width * bs)
        k_pos = torch.where(slot_pos[None] < top[:, None], slot_pos[None], torch.full_like(slot_pos[None], -1))
        return k_all, v_all, k_pos.to(k.device)

    def free(self) -> None:
        """Return every row's blocks to the pool."""
        for row in self.rows:
            self.blocks.free(row)
