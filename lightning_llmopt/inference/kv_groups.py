"""KV groups: a pool and block tables per attention window, so local layers keep only their window.

A model whose K/V-producing layers mix global and local (sliding-window) attention cannot release blocks out of one
table: the global layers need every position (and local layers of several windows would all keep the widest). Its
cache is split into *groups* (after vLLM's hybrid KV-cache manager): group 0 holds the global producers (all local:
those of the widest window, released by the scheduler past it), each further group the local producers of one
window. Every group has its own :class:`~lightning_llmopt.inference.kv_pool.KVPool` and block allocator, and a
sequence one block table per group: ``seq.block_table`` (group 0, which the scheduler, the prefix cache and the rest
of the engine see as before) and ``seq.group_tables[g - 1]``, aligned with it (logical block ``j`` of every table
covers the same positions).

A local group's entries are released once every position in the block is older than the window of the next token
to compute (at the start of each :meth:`GroupedBlockManager.ensure`), so a sequence holds at most
``ceil((w - 1 + n) / block_size) + 1`` blocks of a group of window ``w`` while it computes ``n`` tokens.

Prefix cache: the cache keeps group-0 blocks; each group-0 block has a *companion* block in every local group
(allocated with it), and the cache holds a reference on the companions of the blocks it caches (through
:class:`_CacheAllocator`), so a hit brings back the local layers' keys too. A hit is used only as far as every
local group still has the companions of the positions its window needs; a shorter hit is taken otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from lightning_llmopt.inference.block_manager import NULL_BLOCK, BlockAllocator, BlockManager, HasBlockTable
from lightning_llmopt.inference.kv_group_sizing import KVGroup, group_blocks, group_pool_sizes, kv_groups
from lightning_llmopt.inference.kv_pool import KVPool
from lightning_llmopt.inference.prefix_cache import RadixCache
from lightning_llmopt.inference.step_inputs import StepInputs

__all__ = ["GroupedBlockManager", "GroupedPool", "KVGroup", "group_blocks", "group_inputs", "kv_groups"]


class GroupedPool(KVPool):
    """The KV pools of every group behind the :class:`KVPool` calls the runner makes, indexed by producer slot
    (the producer's rank among all producers, as with one pool). It owns no storage of its own (no ``data``); int8
    scales (one row per producer slot) are handed to the groups' pools row by row.

    Arguments:
        groups: the groups (:func:`kv_groups`).
        pools: one :class:`KVPool` per group, its layers in the group's order.
        manager: the block manager, whose pending copy-on-write copies of local groups :meth:`copy_blocks` runs.
    """

    def __init__(self, groups: list[KVGroup], pools: list[KVPool], manager: GroupedBlockManager) -> None:
        # KVPool.__init__ is not called: the storage is the groups' pools
        self.groups, self.pools, self.manager = groups, pools, manager
        order = sorted(i for g in groups for i in g.layers)
        self.where = [
            (gi, g.layers.index(layer)) for layer in order for gi, g in enumerate(groups) if layer in g.layers
        ]
        head = pools[0]
        self.n_layers, self.block_size, self.device, self.dtype = len(order), head.block_size, head.device, head.dtype
        self.num_blocks, self.n_kv_heads, self.head_dim = head.num_blocks, head.n_kv_heads, head.head_dim
        self.scales = None

    def group_of(self, slot: int) -> int:
        return self.where[slot][0]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def check_ready(self) -> None:
        for pool in self.pools:
            pool.check_ready()

    def set_scales(self, scales: Any) -> None:
        """int8 scales ``(producers, n_kv_heads)`` in producer-slot order: each group's pool gets its layers' rows."""
        if tuple(scales.k.shape) != (self.n_layers, self.n_kv_heads):
            raise ValueError(f"scales are {tuple(scales.k.shape)}, the pool needs ({self.n_layers}, {self.n_kv_heads})")
        for g, pool in enumerate(self.pools):
            rows = [slot for _, slot in sorted((i, slot) for slot, (gi, i) in enumerate(self.where) if gi == g)]
            pool.set_scales(type(scales)(scales.k[rows], scales.v[rows]))
        self.scales = scales

    def layer(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, i = self.where[slot]
        return self.pools[g].layer(i)

    def layer_scales(self, slot: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g, i = self.where[slot]
        return self.pools[g].layer_scales(i)

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        g, i = self.where[slot]
        self.pools[g].write(i, k, v, blocks, slots)

    def read(
        self, slot: int, blocks: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g, i = self.where[slot]
        return self.pools[g].read(i, blocks, slots, dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies: ``pairs`` of group 0, then every local group's pending ones."""
        self.pools[0].copy_blocks(pairs)
        for g, pending in enumerate(self.manager.pending_copies, start=1):
            self.pools[g].copy_blocks(pending)
            pending.clear()


class GroupedRadixCache(RadixCache):
    """The prefix cache over group 0's blocks that also holds a reference on each cached block's local companions
    (so a hit brings the local layers' keys back); a local group short of blocks drops the cache's companions,
    oldest first, before it evicts cache entries (later hits are then cut by
    :meth:`GroupedBlockManager.usable_hit`).

    Arguments:
        manager: the grouped block manager.
    """

    def __init__(self, manager: GroupedBlockManager) -> None:
        super().__init__(manager.allocator, manager.block_size)
        self.manager = manager

    def _link(self, parent: Any, node: Any, full: bool) -> None:
        super()._link(parent, node, full)
        self.manager.cache_take(node.block)

    def _remove(self, node: Any) -> None:
        self.manager.cache_drop(node.block)
        super()._remove(node)


class GroupedBlockManager(BlockManager):
    """A :class:`BlockManager` for group 0 (``seq.block_table``) that keeps every local group's table in step.

    Arguments:
        num_blocks: blocks of group 0, the null block included.
        block_size: token slots per block.
        windows: the local groups' windows.
        local_blocks: blocks of each local group, the null block included.
    """

    def __init__(self, num_blocks: int, block_size: int, windows: list[int], local_blocks: list[int]) -> None:
        super().__init__(num_blocks, block_size)
        self.windows = windows
        self.locals = [BlockAllocator(n) for n in local_blocks]
        self.companion: list[dict[int, int]] = [{} for _ in windows]  # group-0 block -> local block
        self.owner: list[dict[int, int]] = [{} for _ in windows]  # local block -> group-0 block
        self.pending_copies: list[list[tuple[int, int]]] = [[] for _ in windows]
        self.cache_held: list[dict[int, int]] = [{} for _ in windows]  # group-0 block -> local block the cache holds

    def new_prefix_cache(self) -> GroupedRadixCache:
        cache = GroupedRadixCache(self)
        self.prefix_cache = cache
        return cache

    def cache_take(self, block: int) -> None:
        """The prefix cache now holds ``block``: it takes a reference on its companions."""
        for g, comp in enumerate(self.companion):
            if block in comp:
                self.locals[g].incref(comp[block])
                self.cache_held[g][block] = comp[block]

    def cache_drop(self, block: int) -> None:
        """The prefix cache let ``block`` go: so go its references on the companions."""
        for g, held in enumerate(self.cache_held):
            if block in held:
                self.release_local(g, held.pop(block))

    # ------------------------------------------------------------------ reference counting
    def release_local(self, g: int, block: int) -> None:
        if block != NULL_BLOCK and self.locals[g].decref(block):
            primary = self.owner[g].pop(block, None)
            if primary is not None and self.companion[g].get(primary) == block:
                del self.companion[g][primary]

    def _release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        if self.allocator.decref(block):
            for comp in self.companion:
                comp.pop(block, None)
        if self.prefix_cache is not None:
            self.prefix_cache.on_release(block)

    @staticmethod
    def tables(seq: HasBlockTable) -> list[list[int]]:
        return seq.group_tables  # type: ignore[attr-defined, no-any-return]

    def _release_tables(self, seq: HasBlockTable, start: int) -> None:
        for g, table in enumerate(self.tables(seq)):
            for b in table[start:]:
                self.release_local(g, b)
            del table[start:]

    # ------------------------------------------------------------------ the window
    def release_window(self, seq: HasBlockTable) -> None:
        """Release local entries whose every position is older than the window of position ``num_computed``."""
        for g, (w, table) in enumerate(zip(self.windows, self.tables(seq), strict=True)):
            last = min(max(0, seq.num_computed - w + 1) // self.block_size, len(table))
            for j in range(last):
                if table[j] != NULL_BLOCK:
                    self.release_local(g, table[j])
                    table[j] = NULL_BLOCK

    def _local_need(self, seq: HasBlockTable, upto: int) -> list[list[int]]:
        """Per local group, the logical blocks the step writes that need a fresh or copied local block."""
        first, last = seq.num_computed // self.block_size, (upto - 1) // self.block_size
        out = []
        for g, table in enumerate(self.tables(seq)):
            rc = self.locals[g].refcount
            out.append(
                [j for j in range(first, last + 1) if j >= len(table) or table[j] == NULL_BLOCK or rc[table[j]] > 1]
            )
        return out

    def _reserve_local(self, g: int, n: int) -> None:
        alloc, held = self.locals[g], self.cache_held[g]
        while alloc.num_free < n and held:  # the cache's companions first, oldest first
            self.release_local(g, held.pop(next(iter(held))))
        while alloc.num_free < n and self.prefix_cache is not None and self.prefix_cache.num_evictable() > 0:
            self.prefix_cache.evict(n - alloc.num_free)
        if alloc.num_free < n:
            from lightning_llmopt.inference.block_manager import OutOfBlocks

            raise OutOfBlocks(f"need {n} blocks of the window-{self.windows[g]} KV group, {alloc.num_free} free")

    # ------------------------------------------------------------------ the BlockManager interface
    def ensure(self, seq: HasBlockTable, upto: int) -> list[tuple[int, int]]:
        if not hasattr(seq, "group_tables") or len(self.tables(seq)) != len(self.windows):
            seq.group_tables = [[] for _ in self.windows]  # type: ignore[attr-defined]
        self.release_window(seq)
        if upto <= seq.num_computed:
            return super().ensure(seq, upto)
        need = self._local_need(seq, upto)
        for g, js in enumerate(need):
            self._reserve_local(g, len(js))
        copies = super().ensure(seq, upto)  # group 0 (may still raise OutOfBlocks, having changed nothing)
        for g, js in enumerate(need):
            table, alloc = self.tables(seq)[g], self.locals[g]
            table.extend([NULL_BLOCK] * (len(seq.block_table) - len(table)))
            for j in js:
                old, new = table[j], alloc.allocate()
                if old != NULL_BLOCK:  # shared: copy-on-write
                    self.pending_copies[g].append((old, new))
                    self.release_local(g, old)
                table[j] = new
            first = seq.num_computed // self.block_size
            for j in range(first, (upto - 1) // self.block_size + 1):  # written group-0 blocks are private now
                self.companion[g][seq.block_table[j]] = table[j]
                self.owner[g][table[j]] = seq.block_table[j]
        return copies

    def fork(self, parent: HasBlockTable, child: HasBlockTable) -> None:
        super().fork(parent, child)
        child.group_tables = [list(t) for t in self.tables(parent)]  # type: ignore[attr-defined]
        for g, table in enumerate(self.tables(child)):
            for b in table:
                if b != NULL_BLOCK:
                    self.locals[g].incref(b)

    def adopt(self, seq: HasBlockTable, blocks: list[int]) -> None:
        """A prefix hit (the cache's ``match`` took references on ``blocks``): the sequence takes references on the
        companions still present; :meth:`usable_hit` then cuts the hit where a window lacks its keys."""
        super().adopt(seq, blocks)
        seq.group_tables = [[comp.get(b, NULL_BLOCK) for b in blocks] for comp in self.companion]  # type: ignore[attr-defined]
        for g, table in enumerate(self.tables(seq)):
            for b in table:
                if b != NULL_BLOCK:
                    self.locals[g].incref(b)
            held = self.cache_held[g]
            for b in blocks:  # a hit refreshes the cache's companions: the oldest dropped first are the least used
                if b in held:
                    held[b] = held.pop(b)

    def usable_hit(self, seq: HasBlockTable, n: int) -> int:
        """Tokens of a hit of ``n`` tokens (just adopted) whose local keys are all present; releases the rest."""
        bs = self.block_size
        while n > 0:
            ok = all(
                all(t[j] != NULL_BLOCK for j in range(max(0, n - w + 1) // bs, (n - 1) // bs + 1))
                for w, t in zip(self.windows, self.tables(seq), strict=True)
            )
            if ok:
                break
            n = ((n - 1) // bs) * bs  # drop the last (possibly partial) block
        keep = -(-n // bs)
        for b in seq.block_table[keep:]:
            self._release(b)
        del seq.block_table[keep:]
        self._release_tables(seq, keep)
        return n

    def free(self, seq: HasBlockTable) -> None:
        super().free(seq)
        if hasattr(seq, "group_tables"):
            self._release_tables(seq, 0)

    def truncate(self, seq: HasBlockTable, num_tokens: int) -> None:
        super().truncate(seq, num_tokens)
        if hasattr(seq, "group_tables"):
            self._release_tables(seq, self.blocks_for(num_tokens))

    def num_local_held(self, g: int) -> int:
        """Blocks of local group ``g`` handed out (running sequences and the prefix cache)."""
        return self.locals[g].capacity - self.locals[g].num_free


def group_inputs(runner: Any, work: list[Any], inp: StepInputs, g: int) -> StepInputs:
    """``inp`` with the block fields of local group ``g`` (``seq.group_tables[g - 1]``); the same rows."""
    nd = inp.num_decode
    dev = runner.device

    def table(w: Any) -> list[int]:
        return w.seq.group_tables[g - 1]  # type: ignore[no-any-return]

    blk, slot = zip(*(runner._slots(table(w), w.start, w.start + w.num_tokens) for w in work), strict=True)
    width = max((len(table(w)) for w in work[:nd]), default=1)
    tabs = np.zeros((nd, max(width, 1)), dtype=np.int32)
    for r, w in enumerate(work[:nd]):
        tabs[r, : len(table(w))] = table(w)
    fields: dict[str, Any] = dict(
        blocks=torch.from_numpy(np.concatenate(blk)).to(dev),
        slots=torch.from_numpy(np.concatenate(slot)).to(dev),
        dec_tables=torch.from_numpy(tabs).to(dev),
    )
    if inp.ctx_blocks is not None:
        cb, cs = [], []
        for w in work[nd:]:
            lo = max(0, w.start - runner.window + 1) if runner.window is not None else 0
            if w.start > lo:
                b, o = runner._slots(table(w), lo, w.start)
                cb.append(b)
                cs.append(o)
        fields.update(
            ctx_blocks=torch.from_numpy(np.concatenate(cb)).to(dev),
            ctx_slots=torch.from_numpy(np.concatenate(cs)).to(dev),
        )
    return dataclasses.replace(inp, **fields)


def make_kv(
    model_cfg: Any, config: Any, max_model_len: int, device: torch.device, kv_dtype: torch.dtype
) -> tuple[KVPool | GroupedPool, BlockManager]:
    """The engine's pool and block manager: one :class:`KVPool` over the producing layers, or, when they mix global
    and local layers, a :class:`GroupedPool` with a :class:`GroupedBlockManager`."""
    from lightning_llmopt.inference.kv_pool import pool_blocks

    groups = kv_groups(model_cfg)
    shape = (model_cfg.n_kv_heads, model_cfg.head_dim)
    if len(groups) == 1:
        num_blocks = pool_blocks(model_cfg, config, max_model_len, device, kv_dtype)
        pool = KVPool(len(groups[0].layers), *shape, num_blocks, config.block_size, kv_dtype, device)
        return pool, BlockManager(num_blocks, config.block_size)
    from lightning_llmopt.inference.kv_pool import kv_budget_bytes, useful_blocks

    windows = [g.window for g in groups[1:] if g.window is not None]
    budget = None
    if config.num_blocks is None and device.type == "cuda":  # the local groups' savings become global blocks
        budget = kv_budget_bytes(device, config.gpu_memory_fraction, int(config.reserve_gib * 2**30))
        num_blocks = useful_blocks(config, max_model_len)
    else:  # num_blocks, or the CPU default, for group 0; the local groups their need
        num_blocks = pool_blocks(model_cfg, config, max_model_len, device, kv_dtype)
    num_blocks, *sizes = group_pool_sizes(groups, model_cfg, config, kv_dtype, num_blocks, budget)
    manager = GroupedBlockManager(num_blocks, config.block_size, windows, sizes)  # type: ignore[arg-type]
    pools = [
        KVPool(len(g.layers), *shape, n, config.block_size, kv_dtype, device)
        for g, n in zip(groups, [num_blocks, *sizes], strict=True)
    ]
    return GroupedPool(groups, pools, manager), manager
