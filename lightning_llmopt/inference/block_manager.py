"""Block accounting of the paged KV cache: reference-counted block ids, block tables, forks and copy-on-write.

The KV pool (:mod:`~lightning_llmopt.inference.kv_pool`) holds ``num_blocks`` physical blocks of ``block_size``
token slots. Block 0 is the *null block*: it is never handed out, padding rows of a CUDA graph write their keys
there, and block-table entries that point nowhere (released by a sliding window) hold 0.

A sequence's block table lists the physical block of each of its logical blocks: token ``t`` lives in
``table[t // block_size]`` at slot ``t % block_size``. A block may be shared (forked sequences for parallel
sampling, prefix-cache hits): its reference count is the number of tables (plus the prefix cache) holding it. A
sequence about to write into a shared block first gets a private copy (copy-on-write); the copy itself is done on
the device by the model runner, from the ``(src, dst)`` pairs returned here, before any key is written that step.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

__all__ = ["NULL_BLOCK", "BlockAllocator", "BlockManager", "BlockReclaimer", "HasBlockTable", "OutOfBlocks"]

NULL_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """Not enough free (or evictable) blocks for an allocation; nothing was allocated."""


class HasBlockTable(Protocol):
    block_table: list[int]
    num_computed: int


class BlockReclaimer(Protocol):
    """What the block manager asks of a cache that holds blocks no sequence uses (the prefix cache,
    :class:`~lightning_llmopt.inference.prefix_cache.RadixCache`, which sits above this module and is handed in)."""

    def num_evictable(self) -> int: ...

    def evict(self, num_blocks: int) -> object: ...

    def on_release(self, block: int) -> None: ...


class BlockAllocator:
    """Reference-counted block ids ``1 .. num_blocks - 1`` (0 is the null block).

    Arguments:
        num_blocks: physical blocks in the pool, the null block included (>= 2).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free KV block")
        block = self._free.popleft()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        if block == NULL_BLOCK or self.refcount[block] <= 0:
            raise RuntimeError(f"incref of block {block}, which is not allocated")
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns True when the block went back to the free list."""
        if block == NULL_BLOCK:
            return False
        if self.refcount[block] <= 0:
            raise RuntimeError(f"block {block} freed twice (reference count already 0)")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
            return True
        return False

    def free_blocks(self) -> list[int]:
        return list(self._free)


class BlockManager:
    """Block tables of sequences over one :class:`BlockAllocator`, with eviction from an optional prefix cache.

    Arguments:
        num_blocks: physical blocks, the null block included.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size ({block_size}) must be >= 1")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.prefix_cache: BlockReclaimer | None = None  # set by the owner of the prefix cache

    # ------------------------------------------------------------------ queries
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_available(self) -> int:
        """Free blocks plus blocks the prefix cache could give back."""
        evictable = self.prefix_cache.num_evictable() if self.prefix_cache is not None else 0
        return self.allocator.num_free + evictable

    def _writes_shared(self, seq: HasBlockTable, upto: int) -> list[int]:
        """Logical indices of already-present shared blocks that positions ``[num_computed, upto)`` write into."""
        if upto <= seq.num_computed:
            return []
        first = seq.num_computed // self.block_size
        last = min((upto - 1) // self.block_size, len(seq.block_table) - 1)
        rc = self.allocator.refcount
        return [j for j in range(first, last + 1) if seq.block_table[j] != NULL_BLOCK and rc[seq.block_table[j]] > 1]

    def blocks_needed(self, seq: HasBlockTable, upto: int) -> int:
        """New blocks (fresh ones and copy-on-write copies) to compute positions ``[num_computed, upto)``."""
        grow = max(0, self.blocks_for(upto) - len(seq.block_table))
        return grow + len(self._writes_shared(seq, upto))

    # ------------------------------------------------------------------ allocation
    def _reserve(self, n: int) -> None:
        if self.allocator.num_free < n and self.prefix_cache is not None:
            self.prefix_cache.evict(n - self.allocator.num_free)
        if self.allocator.num_free < n:
            raise OutOfBlocks(f"need {n} KV blocks, {self.allocator.num_free} free")

    def ensure(self, seq: HasBlockTable, upto: int) -> list[tuple[int, int]]:
        """Make ``seq``'s table cover positions ``< upto`` with private blocks where it will write.

        Returns the ``(src, dst)`` block copies to run before the step's writes. Raises :class:`OutOfBlocks` (having
        changed nothing) when the blocks cannot be found even after evicting unreferenced prefix-cache entries.
        """
        shared = self._writes_shared(seq, upto)
        grow = max(0, self.blocks_for(upto) - len(seq.block_table))
        self._reserve(grow + len(shared))
        copies = []
        for j in shared:
            src = seq.block_table[j]
            dst = self.allocator.allocate()
            copies.append((src, dst))
            seq.block_table[j] = dst
            self._release(src)
        for _ in range(grow):
            seq.block_table.append(self.allocator.allocate())
        return copies

    def fork(self, parent: HasBlockTable, child: HasBlockTable) -> None:
        """``child`` shares every block of ``parent`` (it must hold none yet)."""
        if child.block_table:
            raise RuntimeError("fork into a sequence that already holds blocks")
        for b in parent.block_table:
            if b != NULL_BLOCK:
                self.allocator.incref(b)
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed

    def adopt(self, seq: HasBlockTable, blocks: list[int]) -> None:
        """Give ``seq`` (holding no block) the already-referenced ``blocks`` (a prefix-cache hit)."""
        if seq.block_table:
            raise RuntimeError("adopt into a sequence that already holds blocks")
        seq.block_table = list(blocks)

    def usable_hit(self, seq: HasBlockTable, num_tokens: int) -> int:
        """Tokens of a just-adopted prefix hit the sequence may use (all of them here; KV groups may cut it)."""
        return num_tokens

    def free(self, seq: HasBlockTable) -> None:
        """Return every block of ``seq``; its table is emptied and nothing is computed any more."""
        for b in seq.block_table:
            self._release(b)
        seq.block_table = []
        seq.num_computed = 0

    def truncate(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` positions (rolled-back speculative tokens) and cap
        ``num_computed`` there."""
        keep = self.blocks_for(num_tokens)
        for b in seq.block_table[keep:]:
            self._release(b)
        del seq.block_table[keep:]
        seq.num_computed = min(seq.num_computed, num_tokens)

    def release_before(self, seq: HasBlockTable, first_needed: int) -> None:
        """Release blocks whose every position is ``< first_needed`` (sliding window); their entries become 0."""
        last = min(first_needed // self.block_size, len(seq.block_table))
        for j in range(last):
            b = seq.block_table[j]
            if b != NULL_BLOCK:
                self._release(b)
                seq.block_table[j] = NULL_BLOCK

    def _release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        self.allocator.decref(block)
        if self.prefix_cache is not None:
            self.prefix_cache.on_release(block)
