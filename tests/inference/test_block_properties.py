"""Property tests (hypothesis) of the block manager and the radix prefix cache.

A state machine drives random sequences of request, compute (prefill chunks and decodes), sample, fork, cancel,
preempt, finish, evict, pin and unpin against a simulated KV memory: every computed token writes its own id into its
``(block, slot)``. After every step:

- every block's reference count equals the number of live block tables holding it plus one if the cache holds it,
  and the free list holds exactly the blocks with count 0, each once (no leak, no double free);
- every live sequence reads back its own tokens from every computed position (so no block it references was freed
  and reused, evicted, or written by another sequence; prefix hits return the right contents);
- no step ever writes into a block that another table or the cache also references (copy-on-write works).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lightning_llmopt.inference.block_manager import NULL_BLOCK, BlockManager, OutOfBlocks
from lightning_llmopt.inference.prefix_cache import RadixCache

BLOCK = 4
NUM_BLOCKS = 24
ALPHABET = st.integers(0, 2)  # few symbols: prompts share prefixes often


class _Seq:
    def __init__(self, tokens: list[int], prompt_len: int) -> None:
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.block_table: list[int] = []
        self.num_computed = 0


class BlockMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK)
        self.cache = RadixCache(self.bm.allocator, BLOCK)
        self.bm.prefix_cache = self.cache
        self.memory: dict[tuple[int, int], int] = {}
        self.seqs: list[_Seq] = []
        self.pinned: list[list[int]] = []

    # ------------------------------------------------------------------ helpers
    def _admit(self, seq: _Seq) -> None:
        blocks, n = self.cache.match(seq.tokens, max_tokens=len(seq.tokens) - 1)
        self.bm.adopt(seq, blocks)
        seq.num_computed = n

    def _release(self, seq: _Seq, insert: bool, partial: bool) -> None:
        if insert and seq.block_table:
            self.cache.insert(seq.tokens, seq.block_table, seq.num_computed, partial=partial)
        self.bm.free(seq)
        self.seqs.remove(seq)

    # ------------------------------------------------------------------ rules
    @rule(tokens=st.lists(ALPHABET, min_size=1, max_size=14))
    def request(self, tokens: list[int]) -> None:
        seq = _Seq(list(tokens), len(tokens))
        self._admit(seq)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        remaining = len(seq.tokens) - seq.num_computed
        if remaining == 0:
            return
        n = data.draw(st.integers(1, remaining))
        upto = seq.num_computed + n
        before = (list(seq.block_table), list(self.bm.allocator.refcount))
        try:
            copies = self.bm.ensure(seq, upto)
        except OutOfBlocks:
            assert (seq.block_table, self.bm.allocator.refcount) == before  # nothing changed
            return
        for src, dst in copies:
            for s in range(BLOCK):
                if (src, s) in self.memory:
                    self.memory[(dst, s)] = self.memory[(src, s)]
        rc = self.bm.allocator.refcount
        for p in range(seq.num_computed, upto):
            blk = seq.block_table[p // BLOCK]
            assert rc[blk] == 1, f"writing into block {blk} shared by {rc[blk]} holders"
            self.memory[(blk, p % BLOCK)] = seq.tokens[p]
        prompt_done = seq.num_computed < seq.prompt_len <= upto
        seq.num_computed = upto
        self.cache.insert(seq.tokens, seq.block_table, upto, partial=prompt_done)

    @precondition(lambda self: any(len(s.tokens) == s.num_computed for s in self.seqs))
    @rule(data=st.data(), token=ALPHABET)
    def sample(self, data: st.DataObject, token: int) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if len(s.tokens) == s.num_computed]))
        seq.tokens.append(token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.seqs))
        child = _Seq(list(parent.tokens), parent.prompt_len)
        self.bm.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self._release(data.draw(st.sampled_from(self.seqs)), insert=False, partial=False)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Recompute later: cache what was computed, free everything, re-admit with a fresh prefix match."""
        seq = data.draw(st.sampled_from(self.seqs))
        self._release(seq, insert=True, partial=False)
        again = _Seq(seq.tokens, seq.prompt_len)
        self._admit(again)
        self.seqs.append(again)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._release(data.draw(st.sampled_from(self.seqs)), insert=True, partial=True)

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n: int) -> None:
        held = Counter(b for s in self.seqs for b in s.block_table if b != NULL_BLOCK)
        pinned_before = self._pinned_blocks()
        cached_before = set(self.cache.blocks())
        free_before = self.bm.allocator.num_free
        freed = self.cache.evict(n)
        removed = cached_before - set(self.cache.blocks())
        assert not removed & set(held), "evicted a block a sequence references"
        assert freed == len(removed) == self.bm.allocator.num_free - free_before  # every eviction frees its block
        assert freed == min(n, len(cached_before) - len(self._reachable_after_full_eviction(held)))
        assert pinned_before <= set(self.cache.blocks())

    @rule(tokens=st.lists(ALPHABET, min_size=1, max_size=10))
    def pin(self, tokens: list[int]) -> None:
        if self.cache.cached_length(tokens) == len(tokens):
            self.cache.pin(tokens)
            self.pinned.append(tokens)

    @precondition(lambda self: self.pinned)
    @rule()
    def unpin(self) -> None:
        self.cache.unpin(self.pinned.pop())

    def _reachable_after_full_eviction(self, held: Counter) -> set[int]:
        """Cache blocks that can never be evicted now: referenced or pinned, or ancestors of such nodes."""
        keep: set[int] = set()
        stack = [(self.cache.root, False)]
        order = []
        while stack:
            node, _ = stack.pop()
            order.append(node)
            for kids in node.by_first.values():
                stack.extend((c, False) for c in kids)
        for node in reversed(order):  # children before parents
            if node is self.cache.root:
                continue
            pinned_or_used = node.pins > 0 or held[node.block] > 0
            child_kept = any(c.block in keep for kids in node.by_first.values() for c in kids)
            if pinned_or_used or child_kept:
                keep.add(node.block)
        return keep

    def _pinned_blocks(self) -> set[int]:
        blocks: set[int] = set()
        for tokens in self.pinned:
            blocks.update(self.cache.lookup(tokens)[0])
        return blocks

    # ------------------------------------------------------------------ invariants
    @invariant()
    def refcounts_match_holders(self) -> None:
        holders = Counter(b for s in self.seqs for b in s.block_table if b != NULL_BLOCK)
        holders.update(self.cache.blocks())
        alloc = self.bm.allocator
        free = alloc.free_blocks()
        assert len(free) == len(set(free)), "a block is on the free list twice"
        for b in range(1, NUM_BLOCKS):
            assert alloc.refcount[b] == holders[b], f"block {b}: count {alloc.refcount[b]}, holders {holders[b]}"
            assert (b in free) == (holders[b] == 0)
        assert NULL_BLOCK not in free

    @invariant()
    def sequences_read_their_tokens(self) -> None:
        for s in self.seqs:
            for p in range(s.num_computed):
                assert self.memory.get((s.block_table[p // BLOCK], p % BLOCK)) == s.tokens[p]


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_everything_returns_after_clear() -> None:
    """Deterministic end state: finish every sequence, clear the cache: all blocks free, no count left."""
    machine = BlockMachine()
    for tokens in ([0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]):
        machine.request(tokens)
    for seq in list(machine.seqs):
        machine.bm.ensure(seq, len(seq.tokens))
        seq.num_computed = len(seq.tokens)
        machine.cache.insert(seq.tokens, seq.block_table, seq.num_computed, partial=True)
    for seq in list(machine.seqs):
        machine._release(seq, insert=True, partial=True)
    assert len(machine.cache) > 0
    machine.cache.clear()
    assert machine.bm.allocator.num_free == NUM_BLOCKS - 1
    assert sum(machine.bm.allocator.refcount) == 0
