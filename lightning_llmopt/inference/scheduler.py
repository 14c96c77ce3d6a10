"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Every step, :meth:`Scheduler.schedule`:

1. walks the running sequences in priority order (arrival order): a sequence whose only uncomputed token is its
   last sampled one gets 1 token (decode); a sequence still computing its prompt gets a chunk of at most the budget
   left after the decodes still to come (chunked prefill), so prompts never starve running decodes;
2. makes each one's block table cover the tokens it will write (new blocks, copy-on-write of shared ones). When the
   pool is out of blocks even after evicting unreferenced prefix-cache entries, the lowest-priority running
   sequence is preempted: its computed blocks are offered to the prefix cache, its blocks freed, and it goes back
   to the waiting queue to be recomputed from its tokens later (a decode preempts itself when it is the lowest);
3. admits waiting sequences first-come-first-served while the budget, ``max_num_seqs`` and the pool allow, after
   matching their prompt against the prefix cache (at least one token is always left to compute, so the step
   yields logits). Cache-aware admission (after SGLang): a request sharing at least a block more with a prompt
   admitted in the same step than the cache holds waits one step (once), and then hits the blocks that step
   computed instead of computing them a second time. ``policy="static"`` admits a whole batch only when nothing
   is running (the baseline that continuous batching is measured against); with ``admission_batch > 1``,
   continuous batching admits while others run only once that many slots are free (or all waiting fit).

:meth:`Scheduler.complete` then advances the sequences, inserts their newly filled blocks into the prefix cache, and
(sliding-window models) releases blocks that left the window.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from lightning_llmopt.inference.block_manager import BlockManager, OutOfBlocks
from lightning_llmopt.inference.prefix_cache import RadixCache
from lightning_llmopt.inference.request import SeqStatus, Sequence

__all__ = ["Schedule", "Scheduler", "Work"]


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


POLICIES = ("continuous", "static")


@dataclass
class Work:
    """Compute ``num_tokens`` tokens of ``seq`` starting at position ``start``."""

    seq: Sequence
    start: int
    num_tokens: int
    num_logits: int = 1  # logit rows returned when it samples: the last ``num_logits`` positions (speculation)

    @property
    def samples(self) -> bool:
        """Whether the step ends at the sequence's last token (its logits give the next token)."""
        return self.start + self.num_tokens == len(self.seq.tokens)


@dataclass
class Schedule:
    work: list[Work] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.work)


class Scheduler:
    """Decides what every step computes (see the module docstring).

    Arguments:
        blocks: the block manager.
        prefix_cache: the radix cache, or ``None`` without prefix caching.
        max_num_seqs: running sequences at most.
        max_num_batched_tokens: tokens computed per step at most (the budget).
        policy: ``"continuous"`` or ``"static"``.
        window: the model's sliding window (blocks left of it are released), or ``None``.
        admission_batch: ``"continuous"``: while sequences run, admit waiting ones only once this many slots are
            free, or as many as are waiting (their prefills then share a step).
    """

    def __init__(
        self,
        blocks: BlockManager,
        prefix_cache: RadixCache | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "continuous",
        window: int | None = None,
        admission_batch: int = 1,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy ({policy!r}) must be one of {POLICIES}")
        self.blocks = blocks
        self.cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.policy = policy
        self.window = window
        self.admission_batch = admission_batch
        self.waiting: list[Sequence] = []  # sorted by priority
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.priority)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence that starts running next to its parent."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq``: cache what it computed, return its blocks, drop it from the queues."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        if seq.block_table and self.cache is not None and reason != "cancelled":
            self.cache.insert(seq.tokens, seq.block_table, seq.num_computed, partial=True)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.cache is not None and seq.block_table:
            self.cache.insert(seq.tokens, seq.block_table, seq.num_computed)
        self.blocks.free(seq)
        seq.matched = False
        seq.request.metrics.preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> Schedule:
        out = Schedule()
        budget = self.budget
        order = sorted(self.running, key=lambda s: s.priority)
        pending_decodes = sum(1 for s in order if len(s.tokens) - s.num_computed == 1)
        i = 0
        while i < len(order) and budget > 0:
            seq = order[i]
            remaining = len(seq.tokens) - seq.num_computed
            decode = remaining == 1
            if decode:
                pending_decodes -= 1
            n = 1 if decode else min(remaining, budget - pending_decodes)
            if n <= 0:
                i += 1
                continue
            copies = self._ensure(seq, n, order, i, out)
            if copies is None:  # preempted itself, or a prefill that must wait
                if seq.status == SeqStatus.WAITING:
                    order.pop(i)
                else:
                    i += 1
                continue
            out.copies += copies
            out.work.append(Work(seq, seq.num_computed, n))
            budget -= n
            i += 1
        self._admit(out, budget)
        return out

    def _ensure(self, seq: Sequence, n: int, order: list[Sequence], i: int, out: Schedule) -> list | None:
        """Blocks for ``n`` tokens of ``order[i]``, preempting lower-priority sequences as needed."""
        while True:
            try:
                return self.blocks.ensure(seq, seq.num_computed + n)
            except OutOfBlocks:
                if len(order) - 1 > i:
                    victim = order.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                    continue
                if len(seq.tokens) - seq.num_computed == 1:
                    self._preempt(seq)
                    out.preempted.append(seq)
                return None

    def _shares_uncached(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        """Whether ``seq`` shares at least a block more with a prompt admitted this step than the cache holds."""
        if self.cache is None or seq.deferred:
            return False
        best = max((_lcp(seq.tokens, a.tokens) for a in admitted), default=0)
        return best - seq.num_computed >= self.blocks.block_size

    def _admit(self, out: Schedule, budget: int) -> None:
        static = self.policy == "static"
        if static and self.running:
            return
        if self.running and self.max_num_seqs - len(self.running) < min(self.admission_batch, len(self.waiting)):
            return  # wait until a group of slots is free: their prefills share one step
        admitted: list[Sequence] = []
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs and (budget > 0 or static):
            seq = self.waiting[i]
            self._match(seq)
            if self._shares_uncached(seq, admitted):
                # cache-aware admission: its prefix is being computed this step; next step it is a cache hit
                seq.deferred = True
                self.blocks.free(seq)
                seq.matched = False
                i += 1
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            copies: list[tuple[int, int]] = []
            if n > 0:
                try:
                    copies = self.blocks.ensure(seq, seq.num_computed + n)
                except OutOfBlocks:
                    self.blocks.free(seq)  # give the matched blocks back while it waits
                    seq.matched = False
                    return
            self.waiting.pop(i)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            if n > 0:
                out.copies += copies
                out.work.append(Work(seq, seq.num_computed, n))
                budget -= n

    def _match(self, seq: Sequence) -> None:
        if seq.matched:
            return
        seq.matched = True
        if self.cache is None:
            return
        blocks, n = self.cache.match(seq.tokens, max_tokens=len(seq.tokens) - 1)
        self.blocks.adopt(seq, blocks)
        seq.num_computed = n = self.blocks.usable_hit(seq, n)
        if seq.request.metrics.first_token_time is None and seq.index == 0 and not seq.request.metrics.preemptions:
            seq.cached_tokens = n
            seq.request.metrics.cached_tokens = n

    # ------------------------------------------------------------------ after the forward pass
    def complete(self, schedule: Schedule) -> None:
        """Advance every scheduled sequence by its computed tokens; cache full blocks; apply the window."""
        bs = self.blocks.block_size
        for w in schedule.work:
            seq = w.seq
            before = seq.num_computed
            seq.num_computed = w.start + w.num_tokens
            if self.cache is not None:
                prompt_done = before < seq.prompt_len <= seq.num_computed
                if seq.num_computed // bs > before // bs or prompt_done:
                    self.cache.insert(seq.tokens, seq.block_table, seq.num_computed, partial=prompt_done)
            if self.window is not None:
                self.blocks.release_before(seq, seq.num_computed + 1 - self.window)
