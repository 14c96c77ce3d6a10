"""Radix prefix cache over KV blocks ("stateful" reuse of shared prompt prefixes across requests).

Published designs this follows (the code is ours): vLLM's block hashes (a block's key hashes its parent's key with
the block's tokens, so equal keys mean equal prefixes) and SGLang's RadixAttention (a tree with token-level matching
and LRU eviction of leaves nobody uses).

- **Nodes.** A node holds one physical KV block and its tokens. Full nodes (``block_size`` tokens) are keyed in their
  parent by ``hash((parent.key, tokens))``, with the tokens compared on lookup (a hash collision is a miss, never a
  wrong hit). Partial nodes (fewer tokens: the tail of a prompt) are leaves.
- **Match** (:meth:`RadixCache.match`): follow full nodes block by block, then take the child (full or partial)
  sharing the longest token prefix with the rest: a token-level tail hit, so a shared prefix shorter than a block
  still hits. The sequence adopts the blocks (one reference each); a partially used block is copied before the
  sequence writes into it (copy-on-write in :class:`~lightning_llmopt.inference.block_manager.BlockManager`).
- **Insert** (:meth:`RadixCache.insert`): full blocks as soon as they are computed, and the partial tail of a
  prompt once the prompt is computed; the cache takes one reference per node.
- **Evict** (:meth:`RadixCache.evict`): least recently used leaves whose block nobody else references (reference
  count 1: only the cache) and that are not pinned. A leaf's time is the last time a sequence matched or released
  it. Candidates sit in a lazy min-heap: entries whose node changed since are skipped, and a node is pushed again
  whenever it may have become evictable (released by its last sequence, last child evicted, unpinned).
- **Pins** (:meth:`RadixCache.pin`): every node on a pinned path is never evicted (system prompts).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from lightning_llmopt.inference.block_manager import NULL_BLOCK, BlockAllocator

__all__ = ["RadixCache"]


class _Node:
    __slots__ = ("key", "tokens", "block", "parent", "children", "by_first", "last_access", "pins", "removed")

    def __init__(self, key: int, tokens: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key
        self.tokens = tokens
        self.block = block
        self.parent = parent
        self.children: dict[int, _Node] = {}  # full children by key
        self.by_first: dict[int, list[_Node]] = {}  # every child (full and partial) by first token
        self.last_access = 0
        self.pins = 0
        self.removed = False

    def is_leaf(self) -> bool:
        return not self.by_first


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    """Prefix tree of KV blocks with LRU eviction (design in the module docstring).

    Arguments:
        allocator: the pool's :class:`BlockAllocator` (the cache holds one reference per node).
        block_size: tokens per block.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.root = _Node(0, (), NULL_BLOCK, None)
        self._node_of_block: dict[int, _Node] = {}
        self._heap: list[tuple[int, int, _Node]] = []
        self._clock = itertools.count(1)
        self._order = itertools.count()
        self.num_evicted = 0  # blocks freed by eviction so far

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._node_of_block)

    def blocks(self) -> list[int]:
        """Blocks held by the cache."""
        return list(self._node_of_block)

    def _evictable(self, node: _Node) -> bool:
        return not node.removed and node.is_leaf() and node.pins == 0 and self.allocator.refcount[node.block] == 1

    def num_evictable(self) -> int:
        """Blocks that evicting repeatedly could free (leaves first, then their parents, ...)."""
        order: list[_Node] = []
        stack = [self.root]
        while stack:  # pre-order; reversed, every child comes before its parent
            node = stack.pop()
            order.append(node)
            for kids in node.by_first.values():
                stack.extend(kids)
        whole: dict[int, bool] = {}  # id(node) -> its whole subtree can go
        count = 0
        for node in reversed(order):
            ok = all(whole[id(c)] for kids in node.by_first.values() for c in kids)
            if node is not self.root:
                ok = ok and node.pins == 0 and self.allocator.refcount[node.block] == 1
                count += ok
            whole[id(node)] = ok
        return count

    # ------------------------------------------------------------------ lookup
    def _child_key(self, parent: _Node, chunk: tuple[int, ...]) -> int:
        return hash((parent.key, chunk))

    def _walk(self, tokens: Sequence[int], limit: int) -> tuple[list[_Node], int]:
        """Nodes of the longest cached prefix of ``tokens[:limit]`` and its length in tokens."""
        bs = self.block_size
        node, i, path = self.root, 0, []
        while i + bs <= limit:
            chunk = tuple(tokens[i : i + bs])
            child = node.children.get(self._child_key(node, chunk))
            if child is None or child.tokens != chunk:
                break
            path.append(child)
            node, i = child, i + bs
        if i < limit:
            rest = tokens[i:limit]
            best, best_len = None, 0
            for cand in node.by_first.get(rest[0], ()):
                n = _lcp(cand.tokens, rest)
                if n > best_len:
                    best, best_len = cand, n
            if best is not None:
                path.append(best)
                i += best_len
        return path, i

    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> tuple[list[int], int]:
        """Blocks holding the longest cached prefix of ``tokens`` (at most ``max_tokens`` of them) and its length.

        The caller's sequence now holds one reference to each returned block; the last block may be used only in
        part (the caller's first write into it copies it).
        """
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        path, n = self._walk(tokens, limit)
        now = next(self._clock)
        for node in path:
            node.last_access = now
            self.allocator.incref(node.block)
        return [node.block for node in path], n

    def lookup(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """What :meth:`match` would return now, without taking references or touching LRU times."""
        path, n = self._walk(tokens, len(tokens))
        return [node.block for node in path], n

    def cached_length(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` a :meth:`match` would reuse now (no side effects)."""
        return self._walk(tokens, len(tokens))[1]

    # ------------------------------------------------------------------ insertion
    def _link(self, parent: _Node, node: _Node, full: bool) -> None:
        if full:
            parent.children[node.key] = node
        parent.by_first.setdefault(node.tokens[0], []).append(node)
        self._node_of_block[node.block] = node
        self.allocator.incref(node.block)
        node.last_access = next(self._clock)
        self._push(node)

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], num_tokens: int, partial: bool = False) -> None:
        """Cache the first ``num_tokens`` tokens of a sequence whose keys/values are in ``blocks`` (its table).

        Full blocks are inserted (existing equal nodes are kept and refreshed); with ``partial``, the tokens of a
        last incomplete block become a partial leaf unless a node already covers them. Stops at the first null
        block (released by a sliding window) or a block the cache already holds under another prefix.
        """
        bs = self.block_size
        node = self.root
        full = num_tokens // bs
        now = next(self._clock)
        for j in range(full):
            chunk = tuple(tokens[j * bs : (j + 1) * bs])
            key = self._child_key(node, chunk)
            child = node.children.get(key)
            if child is not None and child.tokens != chunk:
                return  # hash collision: leave this branch alone
            if child is None:
                block = blocks[j]
                if block == NULL_BLOCK or block in self._node_of_block:
                    return
                child = _Node(key, chunk, block, node)
                self._link(node, child, full=True)
            else:
                self._touch(child, now)
            node = child
        rem = num_tokens - full * bs
        if not partial or rem == 0 or full >= len(blocks):
            return
        chunk = tuple(tokens[full * bs : num_tokens])
        block = blocks[full]
        if block == NULL_BLOCK or block in self._node_of_block:
            return
        if any(c.tokens[:rem] == chunk for c in node.by_first.get(chunk[0], ())):
            return  # already covered by an equal or longer node
        self._link(node, _Node(self._child_key(node, chunk), chunk, block, node), full=False)

    # ------------------------------------------------------------------ eviction
    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._order), node))
        if len(self._heap) > 4 * len(self._node_of_block) + 64:  # drop stale entries
            self._heap = [
                (n.last_access, next(self._order), n) for n in self._node_of_block.values() if self._evictable(n)
            ]
            heapq.heapify(self._heap)

    def _touch(self, node: _Node, now: int) -> None:
        """New LRU time; a node evictable right now needs a heap entry with that time."""
        node.last_access = now
        if self._evictable(node):
            self._push(node)

    def on_release(self, block: int) -> None:
        """A sequence dropped its reference to ``block``: if the cache holds it, it may have become evictable."""
        node = self._node_of_block.get(block)
        if node is not None and self.allocator.refcount[block] == 1:
            self._touch(node, next(self._clock))

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks, least recently used evictable leaves first; returns how many."""
        freed = 0
        while freed < num_blocks and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if stamp != node.last_access or not self._evictable(node):
                continue  # stale entry; the node is pushed again when it becomes evictable
            self._remove(node)
            freed += 1
        self.num_evicted += freed
        return freed

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        if len(node.tokens) == self.block_size and parent.children.get(node.key) is node:
            del parent.children[node.key]
        siblings = parent.by_first[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del parent.by_first[node.tokens[0]]
        node.removed = True
        del self._node_of_block[node.block]
        self.allocator.decref(node.block)
        if parent is not self.root and parent.is_leaf():
            self._push(parent)

    def clear(self) -> int:
        """Evict everything evictable (unpinned, unreferenced); returns the blocks freed."""
        total = 0
        while True:
            for node in list(self._node_of_block.values()):
                if self._evictable(node):
                    self._push(node)
            freed = self.evict(len(self._node_of_block))
            total += freed
            if freed == 0:
                return total

    # ------------------------------------------------------------------ pins
    def _exact_path(self, tokens: Sequence[int]) -> list[_Node]:
        path, n = self._walk(tokens, len(tokens))
        if n != len(tokens):
            raise KeyError(f"the prefix of {len(tokens)} tokens is not cached ({n} cached)")
        return path

    def pin(self, tokens: Sequence[int]) -> None:
        """Never evict the nodes holding ``tokens`` (which must be cached exactly, e.g. by a finished request)."""
        for node in self._exact_path(tokens):
            node.pins += 1

    def unpin(self, tokens: Sequence[int]) -> None:
        for node in self._exact_path(tokens):
            if node.pins == 0:
                raise KeyError("unpin of a prefix that is not pinned")
            node.pins -= 1
            self._push(node)
