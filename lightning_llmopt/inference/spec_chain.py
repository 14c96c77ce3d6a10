"""Greedy speculative rounds run back to back on the device, with one host round trip for all of them.

A speculative step on the host path (:mod:`~lightning_llmopt.inference.spec_decode`) waits for the device twice:
once for the draft tokens (the target's verify rows are built from them on the host) and once for the acceptance
outcome (the next step's positions depend on it), and launches the glue between the graph replays one small op at
a time. At batch 1 (the speculative benchmark's 200M target and 4-layer draft, H100, 2026-11-26) a host-path step
took about 2.1 ms, 0.95-0.98x the plain engine where 1.6-1.7x was predicted; the same round captured as one CUDA
graph replays in 1.34 ms (a 5-row verify pass 0.81 ms, four draft passes 0.32 ms).

When every running sequence decodes greedily with the same draft length ``k`` from a :class:`ModelDrafter` with
CUDA graphs, and nothing waiting can be admitted (the condition of :mod:`~lightning_llmopt.inference.multi_step`),
:func:`speculative_rounds` runs ``R`` whole rounds without the host. Every input of a round is a function of each
sequence's length ``L`` (tokens), its last token and the one before, all kept on the device:

1. draft pass 0 feeds the two last tokens (positions ``L - 2`` and ``L - 1``; the first re-computes a key/value the
   draft cache may already hold, which is what lets a round start whether the previous one accepted every draft or
   not), passes ``1 .. k - 1`` feed the previous pass's ``argmax`` at ``L - 1 + j``;
2. the verify pass feeds the last token and the ``k`` drafts (``1 + k`` rows a sequence, the row layout of
   :func:`~lightning_llmopt.inference.runner.decode_rows`) and takes the target's ``argmax`` ``g_0 .. g_k``;
3. ``m`` leading drafts equal to ``g_0 .. g_{m-1}`` are accepted, ``g_m`` follows them, ``L`` grows by ``m + 1``.

Positions, KV slots (from the block tables, grown up front to hold every position ``R`` rounds can write) and
context lengths are computed on the device from ``L``; tables go up once per run. The whole round (both models'
passes, the acceptance rule and the state update) is one CUDA graph (:class:`RoundGraph`) per ``k`` and padded batch
size, captured with the engine's other graphs (:func:`capture_rounds`; else on first use, which stalls that step
while it warms up); the round graphs share one memory pool. ``R`` rounds are ``R`` replays and one read of their
tokens. Probe steps of the adaptive controller (``k = 1`` kept only to re-measure) stay on the host path.
Keys/values written for rejected drafts lie past the new length: never read, overwritten later. After one read of
the ``R`` rounds' tokens, each round is committed as the host path commits a step (scheduler bookkeeping, stop
checks, events, acceptance statistics). Greedy output is what the host path gives: the same forward passes run over
the same rows.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lightning_llmopt.inference.block_manager import OutOfBlocks
from lightning_llmopt.inference.drafters import ModelDrafter
from lightning_llmopt.inference.multi_step import _admissible
from lightning_llmopt.inference.request import Sequence as Seq
from lightning_llmopt.inference.request import StreamEvent, now
from lightning_llmopt.inference.runner import StepInputs, to_device
from lightning_llmopt.inference.scheduler import Schedule, Work
from lightning_llmopt.inference.speculative import expected_tokens

if TYPE_CHECKING:
    from lightning_llmopt.inference.engine_core import EngineCore

__all__ = ["capture_rounds", "rounds_for", "speculative_rounds"]


def rounds_for(engine: EngineCore, sched: Schedule, wanted: list[tuple[Work, int]]) -> tuple[int, int]:
    """``(k, R)``: the draft length and rounds :func:`speculative_rounds` can run for this step, ``R = 0`` when it
    must take the host path. ``R`` is at most ``decode_steps``, and no more than the rounds the sequence closest to
    its ``max_tokens`` is expected to need at its acceptance rate (tokens past the limit are dropped, so only the last
    run of a sequence may compute a round it does not use); every position a run can write (``k + 1`` tokens a
    round) stays within the model length."""
    spec = engine.spec
    if spec is None or not spec.device_rounds or engine.graphs is None or spec.controller.probing:
        return 0, 0  # a probe is one re-measuring step on the host path
    if _admissible(engine):
        return 0, 0
    drafter = spec.drafter
    if not isinstance(drafter, ModelDrafter) or drafter.graphs is None or len(wanted) != len(sched.work):
        return 0, 0
    k = wanted[0][1]
    if any(want != k for _, want in wanted) or _padded(engine, len(wanted), k) == 0:
        return 0, 0
    rounds = engine.config.decode_steps
    for w, _ in wanted:
        seq, p = w.seq, w.seq.request.params
        if w.num_tokens != 1 or not w.samples or w.start != seq.num_computed or not p.greedy or p.n != 1:
            return 0, 0
        if not p.plain:  # penalties, min-p or logprobs need the full sampler
            return 0, 0
        expected = expected_tokens(min(spec.controller.alpha(seq.seq_id), 1.0 - 1e-6), k)
        rounds = min(rounds, math.ceil((p.max_tokens - seq.num_output) / expected))
        rounds = min(rounds, (engine.max_model_len - len(seq.tokens)) // (k + 1))
    return (k, rounds) if rounds >= 1 else (0, 0)


def _padded(engine: EngineCore, B: int, k: int) -> int:
    """Sequences a round graph for ``B`` sequences holds: the next of ``graph_batch_sizes`` (padding sequences
    write only into the null block), so a few graphs serve every batch size; ``B`` itself if that one's rows do not
    fit the captured decode sizes (whose kernels are tuned), 0 if neither does."""
    assert engine.spec is not None and engine.graphs is not None
    drafter = engine.spec.drafter
    assert isinstance(drafter, ModelDrafter) and drafter.graphs is not None
    for b in (next((s for s in engine.config.graph_batch_sizes if s >= B), B), B):
        if engine.graphs.fits((k + 1) * b) and drafter.graphs.fits(2 * b):
            return b
    return 0


class RoundGraph:
    """One speculative round of ``B`` sequences with ``k`` drafts (module docstring) over static buffers, captured
    as one CUDA graph (on CUDA; elsewhere, or if capture fails, run eagerly): replaying it advances the state
    ``(lengths, last token, token before)`` on the device and leaves the round's drafts, ``m`` and next token in
    :attr:`out` ``(k + 2, B)``.

    The rows of all ``k + 1`` passes share one ``(5, R)`` buffer (token, position, block, slot, context; the
    :class:`DecodeGraphs` layout) and one table buffer, so a round rebuilds every pass's rows with a handful of
    kernels: the draft's first pass (``2B`` rows: the last two tokens), its later passes (``B`` rows each) and the
    verify pass (``(k + 1) B`` rows, token-major). Each ``argmax`` writes its tokens straight into the verify rows,
    which the next draft pass reads as its tokens. Column ``c`` is sequence ``seq[c]`` at position
    ``L[seq[c]] + offset[c]``. A target with KV groups gets the verify rows' key blocks of each local group
    (:attr:`local_blocks`) from that group's tables (:attr:`local_tables`) the same way."""

    def __init__(self, engine: EngineCore, B: int, k: int) -> None:
        assert engine.spec is not None and engine.graphs is not None
        drafter = engine.spec.drafter
        assert isinstance(drafter, ModelDrafter) and drafter.graphs is not None
        dev, self.B, self.k, self.spec = engine.device, B, k, engine.spec
        self.block_size = engine.runner.block_size
        ar = torch.arange(B, device=dev)
        steps = torch.arange(k + 1, device=dev).repeat_interleave(B)  # 0 .. k, B of each
        self.v0 = 2 * B + (k - 1) * B  # first column of the verify pass
        self.seq = torch.cat([ar.repeat(2), ar.repeat(k - 1), ar.repeat(k + 1)])
        self.off = torch.cat([steps[: 2 * B] - 2, steps[B : k * B] - 1, steps - 1])
        R = self.seq.numel()
        width = max(drafter.graphs.max_blocks, engine.graphs.max_blocks)
        self.meta = torch.zeros(5, R, dtype=torch.long, device=dev)
        self.tables = torch.zeros(R, width, dtype=torch.int32, device=dev)
        self.cols = torch.arange(R, device=dev)
        n_local, V = engine.graphs.n_local, R - self.v0  # KV groups of the target: its verify rows' local blocks
        self.local_tables = torch.zeros(n_local, V, engine.graphs.max_blocks, dtype=torch.int32, device=dev)
        self.local_blocks = torch.zeros(n_local, V, dtype=torch.long, device=dev)
        ctx = engine.graphs.max_context

        def inputs(lo: int, hi: int, ids: Tensor) -> StepInputs:
            _, pos, blocks, slots, context = (row[lo:hi] for row in self.meta.unbind(0))
            return StepInputs(ids, pos, blocks, slots, hi - lo, self.tables[lo:hi], context, ctx, self.cols[: hi - lo])

        ids = self.meta[0]
        self.passes = [(drafter.runner, inputs(0, 2 * B, ids[: 2 * B]))]
        for j in range(1, k):  # pass j feeds d_j, the verify pass's token row j
            lo = 2 * B + (j - 1) * B
            self.passes.append((drafter.runner, inputs(lo, lo + B, ids[self.v0 + j * B : self.v0 + (j + 1) * B])))
        verify = inputs(self.v0, R, ids[self.v0 :])
        if n_local:
            local = [
                dataclasses.replace(verify, blocks=self.local_blocks[g], dec_tables=self.local_tables[g])
                for g in range(n_local)
            ]
            verify.groups = [verify, *local]
        self.passes.append((engine.runner, verify))
        self.state = torch.zeros(3, B, dtype=torch.long, device=dev)
        self.out = torch.zeros(k + 2, B, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        if dev.type == "cuda":
            self._capture()

    def _forward(self, p: int) -> Tensor:
        runner, inp = self.passes[p]
        return runner.forward(inp, max_context=inp.dec_max_ctx)

    def _round(self) -> None:
        B, k, bs, v0 = self.B, self.k, self.block_size, self.v0
        lengths, last, prev = self.state.unbind(0)
        pos = lengths[self.seq] + self.off
        blk = self.tables[self.cols, (pos // bs).clamp_max(self.tables.shape[1] - 1)].long()  # clamp: padding rows
        self.meta[1:].copy_(torch.stack([pos, blk, pos % bs, pos + 1]))
        if self.local_tables.shape[0]:  # each local group's block of every verify row
            width = self.local_tables.shape[2]
            col = (pos[v0:] // bs).clamp_max(width - 1).expand(self.local_tables.shape[0], -1)
            self.local_blocks.copy_(self.local_tables.gather(2, col[..., None])[..., 0])
        ids = self.meta[0]
        torch.cat([prev, last], out=ids[: 2 * B])
        ids[v0 : v0 + B].copy_(last)
        torch.argmax(self._forward(0)[B:], -1, out=ids[v0 + B : v0 + 2 * B])
        for j in range(1, k):
            torch.argmax(self._forward(j), -1, out=ids[v0 + (j + 1) * B : v0 + (j + 2) * B])
        drafts = ids[v0 + B :].view(k, B)
        target = self._forward(k).argmax(-1).view(k + 1, B)
        m = (drafts == target[:k]).long().cumprod(0).sum(0)
        nxt = target.gather(0, m[None])[0]
        before = torch.where(m == 0, last, drafts.gather(0, (m - 1).clamp_min(0)[None])[0])
        self.out.copy_(torch.cat([drafts, m[None], nxt[None]]))
        self.state.copy_(torch.stack([lengths + m + 1, nxt, before]))

    def _capture(self) -> None:
        """Warm up (Triton compilation and autotuning) and capture, with zero tables and lengths 2: the warm-up
        writes only into the null block."""
        self.tables.zero_()
        self.local_tables.zero_()
        self.state.copy_(torch.tensor([[2], [0], [0]], device=self.state.device).expand(3, self.B))
        stream = torch.cuda.Stream(self.state.device)
        stream.wait_stream(torch.cuda.current_stream(self.state.device))
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._round()
            torch.cuda.current_stream(self.state.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.spec.round_pool):
                self._round()
            self.graph = graph
            self.spec.round_pool = graph.pool()
        except RuntimeError as exc:  # e.g. a layer that syncs with the host: run the rounds eagerly
            warnings.warn(f"CUDA graph capture of a speculative round failed ({exc}); rounds run eagerly", stacklevel=2)
            torch.cuda.synchronize(self.state.device)

    def load(self, seqs: list[Seq], draft_tables: list[list[int]]) -> None:
        """Stage ``seqs`` (lengths, last two tokens, block tables of target and draft) into the static buffers;
        padding sequences get length 2 and empty tables (every write lands in the null block)."""
        host = torch.zeros(3, self.B, dtype=torch.long)
        host[0] = 2
        host[:, : len(seqs)] = torch.tensor([[len(s.tokens), s.tokens[-1], s.tokens[-2]] for s in seqs]).T
        self.state.copy_(to_device(host, self.state.device))
        self.load_tables(seqs, draft_tables)

    def load_tables(self, seqs: list[Seq], draft_tables: list[list[int]]) -> None:
        """Stage the block tables only (a run that continues the state the previous run left on the device)."""
        pad: list[list[int]] = [[]] * (self.B - len(seqs))
        draft_tables = draft_tables + pad
        target_tables = [s.block_table for s in seqs] + pad
        rows = draft_tables * 2 + draft_tables * (self.k - 1) + target_tables * (self.k + 1)
        tab = np.zeros(tuple(self.tables.shape), dtype=np.int32)
        for r, t in enumerate(rows):
            tab[r, : len(t)] = t
        self.tables.copy_(to_device(torch.from_numpy(tab), self.tables.device))
        if self.local_tables.shape[0]:  # KV groups: the verify rows' tables of each local group, token-major
            local = np.zeros(tuple(self.local_tables.shape), dtype=np.int32)
            for g in range(local.shape[0]):
                per_seq = [s.group_tables[g] for s in seqs] + pad  # type: ignore[attr-defined]
                for r, t in enumerate(per_seq * (self.k + 1)):
                    local[g, r, : len(t)] = t
            self.local_tables.copy_(to_device(torch.from_numpy(local), self.local_tables.device))

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._round()


@dataclass
class _Run:
    """Rounds launched on the device and not yet read: ``host`` receives their tokens (``(R, k + 2, B)``: per round
    the ``k`` drafts, ``m`` and the token after the accepted drafts) by a copy queued right behind them, so reading
    them does not wait for work queued later (the next run)."""

    graph: RoundGraph
    seqs: list[Seq]
    k: int
    starts: list[int]  # each sequence's token count when the run starts
    host: Tensor
    events: tuple[Any, Any, Any] | None  # CUDA: begin, end of the rounds, and the copy's completion


def capture_rounds(engine: EngineCore) -> None:
    """Capture the round graph of every draft length the controller can choose and every captured batch size up to
    ``max_num_seqs`` (those whose rows fit the decode graphs), as the engine captures its decode graphs at start: a
    graph captured on first use stalls that step (warm-up rounds, kernel tuning for new row counts)."""
    spec = engine.spec
    if spec is None or engine.graphs is None or not isinstance(spec.drafter, ModelDrafter):
        return
    if spec.drafter.graphs is None:
        return
    for k in range(1, spec.controller.max_k + 1):
        for b in engine.config.graph_batch_sizes:
            if b <= engine.config.max_num_seqs and _padded(engine, b, k) == b:
                _graph_for(engine, b, k)


def _graph_for(engine: EngineCore, B: int, k: int) -> RoundGraph:
    """The :class:`RoundGraph` of ``B`` sequences (padded) and ``k`` drafts, captured on first use."""
    spec = engine.spec
    assert spec is not None
    key = (_padded(engine, B, k), k)
    if key not in spec.round_graphs:
        spec.round_graphs[key] = RoundGraph(engine, *key)
    return spec.round_graphs[key]


def _launch(engine: EngineCore, graph: RoundGraph, seqs: list[Seq], k: int, rounds: int, starts: list[int]) -> _Run:
    """Queue ``rounds`` replays of ``graph`` (its state and tables already staged) and the copy of their tokens."""
    assert engine.spec is not None
    engine.spec.device_runs += 1
    dev = engine.device
    out = torch.empty(rounds, k + 2, len(seqs), dtype=torch.long, device=dev)
    cuda = dev.type == "cuda"
    events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) if cuda else None
    if events is not None:
        events[0].record()
    for r in range(rounds):
        graph.replay()
        out[r].copy_(graph.out[:, : len(seqs)])
    host = torch.empty(out.shape, dtype=torch.long, pin_memory=cuda)
    if events is not None:
        events[1].record()
        host.copy_(out, non_blocking=True)
        events[2].record()
    else:
        host.copy_(out)
    return _Run(graph, seqs, k, starts, host, events)


def _read(run: _Run) -> tuple[list, float]:
    """``(tokens, device seconds of the rounds)``: waits for this run only."""
    if run.events is None:
        return run.host.tolist(), 0.0
    run.events[2].synchronize()
    return run.host.tolist(), run.events[0].elapsed_time(run.events[1]) / 1e3


def _grow(engine: EngineCore, seqs: list[Seq], upto: list[int], extra: list[tuple[int, int]]) -> bool:
    """Give every sequence target and draft blocks for positions ``< upto[i]`` and run the block copies (``extra``
    first); False when a pool is short (the copies found so far still run; tables may have grown)."""
    spec = engine.spec
    assert spec is not None and isinstance(spec.drafter, ModelDrafter)
    copies: list[tuple[int, int]] = []
    try:
        for seq, n in zip(seqs, upto, strict=True):
            copies += engine.blocks.ensure(seq, n)
            spec.drafter.blocks.ensure(spec.drafter.state[seq.seq_id], n)
    except OutOfBlocks:
        engine.pool.copy_blocks(copies)
        return False
    engine.pool.copy_blocks(extra + copies)
    return True


def _follow(engine: EngineCore, run: _Run, tokens: list) -> _Run | None:
    """Launch the run after ``run`` before ``run``'s tokens are committed, so the device computes it while the host
    commits them and schedules the next step: only when every sequence goes on (no stop token, tokens left) and
    nothing waiting could be admitted. The next step takes it if its batch and ``k`` are the same (else its work is
    dropped: its writes lie past every sequence's committed length)."""
    spec, k = engine.spec, run.k
    assert spec is not None and isinstance(spec.drafter, ModelDrafter)
    if not spec.follow_runs or _admissible(engine):
        return None
    eos = getattr(engine.tokenizer, "eos_id", None)
    rounds = engine.config.decode_steps
    lengths = []
    for b, seq in enumerate(run.seqs):
        p = seq.request.params
        emitted = [t for rnd in tokens for t in (*(rnd[j][b] for j in range(rnd[k][b])), rnd[k + 1][b])]
        if any(t in p.stop_token_ids or (not p.ignore_eos and t == eos) for t in emitted):
            return None
        length = len(seq.tokens) + len(emitted)
        left = p.max_tokens - (seq.num_output + len(emitted))
        expected = expected_tokens(min(spec.controller.alpha(seq.seq_id), 1.0 - 1e-6), k)
        rounds = min(rounds, math.ceil(left / expected) if left > 0 else 0, (engine.max_model_len - length) // (k + 1))
        lengths.append(length)
    if rounds < 1 or not _grow(engine, run.seqs, [n + rounds * (k + 1) for n in lengths], []):
        return None
    run.graph.load_tables(run.seqs, [spec.drafter.state[s.seq_id].block_table for s in run.seqs])
    return _launch(engine, run.graph, run.seqs, k, rounds, lengths)


def speculative_rounds(engine: EngineCore, sched: Schedule, wanted: list[tuple[Work, int]]) -> list[StreamEvent] | None:
    """Run this decode step as device-side speculative rounds (module docstring); ``None`` (nothing run, tables
    possibly grown) when :func:`rounds_for` rules it out or a pool is short of blocks. A run launched behind the
    previous one (:func:`_follow`) is taken when it matches this step."""
    spec = engine.spec
    assert spec is not None
    run, spec.pending = spec.pending, None
    k, rounds = rounds_for(engine, sched, wanted)
    if rounds == 0:
        return None
    assert isinstance(spec.drafter, ModelDrafter)
    seqs = [w.seq for w, _ in wanted]
    started = now()
    fresh = (
        run is None
        or run.k != k
        or len(run.seqs) != len(seqs)
        or any(a is not b for a, b in zip(run.seqs, seqs, strict=True))
        or run.starts != [len(s.tokens) for s in seqs]
    )
    if fresh:
        upto = [len(s.tokens) + rounds * (k + 1) for s in seqs]
        try:
            spec.drafter.prepare_rounds(seqs, upto)
        except OutOfBlocks:
            return None
        if not _grow(engine, seqs, upto, sched.copies):
            return None
        graph = _graph_for(engine, len(seqs), k)
        graph.load(seqs, [spec.drafter.state[s.seq_id].block_table for s in seqs])
        run = _launch(engine, graph, seqs, k, rounds, [len(s.tokens) for s in seqs])
    else:
        assert run is not None
        engine.pool.copy_blocks(sched.copies)
    tokens, device_s = _read(run)
    since = spec.last_read if not fresh and spec.last_read is not None else started
    spec.pending = _follow(engine, run, tokens)
    n = len(tokens)
    verify = spec.controller.step_cost(len(seqs) * (k + 1))  # a target pass over the verify rows (fitted)
    if device_s and verify is not None:  # the rest of a round is drafting
        spec.controller.observe_draft(len(seqs), len(seqs) * k * n, max(0.0, device_s - n * verify))
    events = _commit(engine, seqs, tokens, k, (now() - since) / n, trim=spec.pending is None)
    spec.last_read = now()
    spec.observe_outcome(len(seqs), events, spec.last_read - since, True)
    return events


def _commit(engine: EngineCore, seqs: list[Seq], tokens: list, k: int, seconds: float, trim: bool) -> list[StreamEvent]:
    """Commit each round as the host path commits a speculative step; then record the draft states and, unless a
    run is in flight behind this one (its writes lie in those blocks), release the blocks past each sequence."""
    spec = engine.spec
    assert spec is not None and isinstance(spec.drafter, ModelDrafter)
    events: list[StreamEvent] = []
    for rnd in tokens:
        live = [b for b, seq in enumerate(seqs) if not seq.finished]
        if not live:
            break
        accepted = {b: rnd[k][b] for b in live}
        work = []
        for b in live:
            seq = seqs[b]
            seq.tokens.extend(rnd[j][b] for j in range(accepted[b]))  # scheduler bookkeeping sees them
            work.append(Work(seq, seq.num_computed, 1 + accepted[b]))
        engine.scheduler.complete(Schedule(work=work))
        round_events = []
        for b in live:
            seq, m = seqs[b], accepted[b]
            del seq.tokens[len(seq.tokens) - m :]
            round_events.append(engine._append_tokens(seq, [*(rnd[j][b] for j in range(m)), rnd[k + 1][b]]))
            spec.controller.update(seq.seq_id, k, m)
            engine.stats.spec_draft_tokens += k
            engine.stats.spec_accepted += m
            engine.stats.spec_verifications += 1
        engine.stats.record_decode(len(live), round_events, seconds, True)
        engine.stats.steps += 1
        events += round_events
    for seq in seqs:
        if not seq.finished:
            if trim:
                engine.blocks.truncate(seq, len(seq.tokens))
            spec.drafter.set_computed(seq, len(seq.tokens) - 2)
    spec.release({s.seq_id for s in engine.scheduler.running})
    return events
