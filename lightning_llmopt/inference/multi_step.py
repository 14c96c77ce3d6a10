"""Several greedy decode steps per host round trip (``EngineConfig.decode_steps``).

A decode step of a small batch leaves the GPU idle while the host schedules the next step, samples, and reads the
token back: about 0.2-0.3 ms a token for the llama2-7b shape at batch 1 on an H100 (a 5.45 ms captured step, 177.8
tokens/s where the step alone allows 183). When every running sequence decodes greedily and nothing waits for
admission, the next ``k`` steps need no host decision but the stop checks: positions, KV slots and context lengths
are known in advance, and each step's input token is the previous step's ``argmax``. Requests waiting for a slot do
not stop a run: a run never passes the first running sequence's ``max_tokens``, and while fewer slots are free than
continuous batching admits at once (``admission_batch``), or static batching still runs its batch, nothing can be
admitted before that sequence ends, so the run ends exactly when the one-step path would admit (a stop token
inside a run delays it by the rest of the run). :func:`greedy_steps` then

1. gives every sequence blocks for ``k`` more tokens (or gives up, changing nothing, if the pool is short);
2. uploads the rows of all ``k`` steps at once (:meth:`DecodeGraphs.stage_chain`, as a draft model's chain does);
3. replays the decode graph ``k`` times, feeding each step's ``argmax`` to the next on the device;
4. reads the ``k x n`` tokens back once, then advances and appends them step by step exactly as ``k`` engine steps
   would (prefix-cache inserts, window releases, stop checks and events in the same order).

Greedy output is unchanged: each step computes what the one-step path computes, and ``argmax`` is the sampler's
greedy rule. A sequence that stops on a stop token inside a run wastes the rest of the run (its later tokens are
dropped, their KV slots belong to a finished sequence); ``k`` never passes a sequence's ``max_tokens`` or the
model length, so length stops waste nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_llmopt.inference.block_manager import OutOfBlocks
from lightning_llmopt.inference.request import StreamEvent, now
from lightning_llmopt.inference.scheduler import Schedule, Work

if TYPE_CHECKING:
    from lightning_llmopt.inference.engine_core import EngineCore

__all__ = ["greedy_steps", "steps_for"]


def steps_for(engine: EngineCore, work: list[Work], speculating: bool = False) -> int:
    """How many greedy steps ``work`` (a decode-only step) can run in one round trip; 1 when it must take the
    ordinary path: no graphs, a sequence speculating this step, a waiting request that could be admitted now, a
    sampled (non-greedy) or parallel-sampled sequence, or fewer than two tokens left to any sequence. A speculative
    engine whose drafts were all ruled out this step (``speculating`` false: the adaptive controller found drafting
    too costly, or nothing to propose) runs like a plain one; its drafters catch up on the committed tokens when
    they next propose."""
    k = engine.config.decode_steps
    graphs = engine.graphs
    if k < 2 or graphs is None or speculating or _admissible(engine):
        return 1
    if not graphs.accepts(work):
        return 1
    for w in work:
        seq, p = w.seq, w.seq.request.params
        if w.num_tokens != 1 or not w.samples or not p.greedy or not p.plain or p.n != 1:
            return 1
        k = min(k, p.max_tokens - seq.num_output, engine.max_model_len - len(seq.tokens))
    return k if k >= 2 else 1


def _admissible(engine: EngineCore) -> bool:
    """Whether a waiting request may be admitted before a running sequence ends: enough slots are free for the
    scheduler to admit (it did not, for lack of blocks or budget, and may next step), or nothing runs."""
    sched = engine.scheduler
    if not sched.waiting or (sched.policy == "static" and sched.running):
        return False
    if not sched.running:
        return True
    free = sched.max_num_seqs - len(sched.running)
    return free >= min(sched.admission_batch, len(sched.waiting))


def greedy_steps(engine: EngineCore, work: list[Work], k: int) -> list[StreamEvent] | None:
    """Run ``k`` greedy decode steps of ``work`` (see the module docstring); ``None``, with nothing changed but
    blocks added to sequence tables, when the pool cannot hold ``k`` more tokens of every sequence."""
    graphs = engine.graphs
    assert graphs is not None
    seqs = [w.seq for w in work]
    copies = []
    try:
        for seq in seqs:  # the schedule gave each one token's blocks
            copies += engine.blocks.ensure(seq, seq.num_computed + k)
    except OutOfBlocks:
        return None
    engine.pool.copy_blocks(copies)
    started = now()
    starts = [seq.num_computed for seq in seqs]
    lengths = [len(seq.tokens) for seq in seqs]
    for seq in seqs:  # placeholders: the rows of later steps read positions and slots, not tokens
        seq.tokens.extend([0] * (k - 1))
    # rows of every step (with KV groups, each local group's key blocks too: DecodeGraphs.row_layout)
    passes = [graphs.row_layout([Work(s, p + j, 1) for s, p in zip(seqs, starts, strict=True)])[0] for j in range(k)]
    for seq, n in zip(seqs, lengths, strict=True):
        del seq.tokens[n:]
    local = [[seq.group_tables[g] for seq in seqs] for g in range(graphs.n_local)]  # type: ignore[attr-defined]
    metas = graphs.stage_chain(passes, [seq.block_table for seq in seqs], local)
    picks: list[torch.Tensor] = []
    for j in range(k):
        logits = graphs.replay_rows(metas[j], len(seqs), ids=picks[-1] if picks else None)
        picks.append(logits.argmax(dim=-1))
    tokens = torch.stack(picks).tolist()  # the one host synchronisation of the run
    per_step = (now() - started) / k
    events: list[StreamEvent] = []
    for j in range(k):
        live = [r for r, seq in enumerate(seqs) if not seq.finished]
        if not live:
            break
        engine.scheduler.complete(Schedule(work=[Work(seqs[r], seqs[r].num_computed, 1) for r in live]))
        step_events = [engine._append(seqs[r], int(tokens[j][r])) for r in live]
        engine.stats.record_decode(len(live), step_events, per_step, False)
        engine.stats.steps += 1
        events += step_events
    return events
