"""Speculative steps of :class:`~lightning_llmopt.inference.LLMEngine`: draft, verify in one pass, roll back.

A step with speculation (after the scheduler has chosen the step's work):

1. :meth:`SpeculativeDecoder.extend`: every decode whose adaptive draft length ``k`` is positive gets up to ``k``
   draft tokens from the drafter. Its target block table is grown to hold them (copy-on-write included), the drafts
   are appended to its tokens, and its work becomes ``1 + k`` tokens returning ``1 + k`` logit rows: the target
   verifies all drafts in the same forward pass as every other sequence's decode or prefill chunk (the runner's
   variable-length path with the cached context read back from the pool).
2. :meth:`SpeculativeDecoder.verify`: the acceptance rule (:func:`~.speculative.speculative_verify`) decides how
   many drafts ``m`` each sequence keeps and the token after them. The rejected drafts are removed from its tokens
   and its work shrinks to ``1 + m`` tokens, so the scheduler's bookkeeping advances ``num_computed`` over the
   accepted tokens only; the engine then appends the emitted tokens and releases the blocks past the sequence's
   new length (:meth:`BlockManager.truncate`). Keys/values of rejected drafts left in a kept block are never read
   (attention stops at the context length) and are overwritten by the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.inference.block_manager import BlockManager, OutOfBlocks
from lightning_llmopt.inference.drafters import Drafter, ModelDrafter, PromptLookupDrafter, quantized_drafter
from lightning_llmopt.inference.request import Sequence as Seq
from lightning_llmopt.inference.runner import to_device
from lightning_llmopt.inference.sampling import SamplingParams, _filter
from lightning_llmopt.inference.scheduler import Schedule, Work
from lightning_llmopt.inference.speculative import AdaptiveDraftLength, SpeculativeConfig, speculative_verify
from lightning_llmopt.inference.stats import EngineStats
from lightning_llmopt.models.llama import Llama

__all__ = ["SpecItem", "SpeculativeDecoder", "build_drafter", "target_probs"]


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def build_drafter(
    config: SpeculativeConfig,
    target: Llama,
    num_blocks: int,
    block_size: int,
    backend: str,
    graph_sizes: tuple[int, ...] | None = None,
    max_model_len: int | None = None,
) -> Drafter:
    """The drafter of ``config``; a model drafter replays its decode steps from CUDA graphs of ``graph_sizes`` rows
    when given (CUDA)."""
    if config.method == "prompt_lookup":
        return PromptLookupDrafter(config.ngram_max, config.ngram_min)
    blocks = config.draft_num_blocks or num_blocks
    if config.method == "self_quantized":
        return quantized_drafter(
            target, config.quant_bits, config.quant_group_size, blocks, block_size, backend, graph_sizes, max_model_len
        )
    draft = config.draft_model
    if not isinstance(draft, Llama):
        raise TypeError(f"draft_model must be a lightning_llmopt Llama, got {type(draft).__name__}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft vocab_size ({draft.config.vocab_size}) != target vocab_size ({target.config.vocab_size})"
        )
    return ModelDrafter(draft, blocks, block_size, backend, graph_sizes, max_model_len)


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """``(n, V)`` rows the acceptance rule compares against: raw logits for greedy requests (argmax only), else the
    distribution the request samples from (temperature, top-k, top-p, as :func:`~.sampling.sample`)."""
    if params.greedy:
        return logits
    if (params.top_k in (None, 0) or params.top_k >= logits.shape[-1]) and params.top_p >= 1.0:
        return torch.softmax(logits.float() / params.temperature, dim=-1)
    return torch.stack(
        [torch.softmax(_filter(r.float() / params.temperature, params.top_k, params.top_p), -1) for r in logits]
    )


@dataclass
class SpecItem:
    """One speculating sequence of a step: its work, drafts, length before them, and its row in the proposal."""

    work: Work
    drafts: list[int]
    base_len: int
    row: int
    accepted: int = 0
    next_token: int = 0


class SpeculativeDecoder:
    """Drafter + adaptive draft length + verification for the engine (module docstring).

    Arguments:
        config: the :class:`SpeculativeConfig`.
        target: the served model.
        blocks: the target's block manager.
        max_model_len, budget: the engine's length limit and token budget per step.
        generator: the engine's generator (requests without a seed).
        stats: the engine's :class:`EngineStats` (speculation counters are added there).
        backend: attention backend for a draft model's runner.
        graph_sizes: row counts of the engine's CUDA graphs; a draft model replays its steps from graphs of these
            sizes too (``None``: eager).
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        target: Llama,
        blocks: BlockManager,
        max_model_len: int,
        budget: int,
        generator: torch.Generator,
        stats: EngineStats,
        backend: str = "auto",
        graph_sizes: tuple[int, ...] | None = None,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.budget = budget
        self.generator = generator
        self.stats = stats
        self.drafter = build_drafter(
            config, target, blocks.allocator.num_blocks, blocks.block_size, backend, graph_sizes, max_model_len
        )
        draft_cost = config.draft_cost
        if draft_cost is None and config.method == "prompt_lookup":
            draft_cost = 0.0
        self.controller = AdaptiveDraftLength(
            config.num_tokens,
            config.adaptive,
            draft_cost,
            config.prior_acceptance,
            config.min_gain,
            config.probe_every,
            config.ema,
        )
        if isinstance(self.drafter, ModelDrafter) and draft_cost is None:  # until measured: the bytes ratio
            self.controller._draft_cost_est = _param_bytes(self.drafter.model) / max(_param_bytes(target), 1)
        self.draft_s = 0.0
        # greedy steps of a model drafter with graphs run as device-side rounds (:mod:`.spec_chain`)
        self.device_rounds = True
        self.device_runs = 0  # runs of device-side rounds so far
        self.round_graphs: dict[tuple[int, int], Any] = {}  # (padded batch, k) -> spec_chain.RoundGraph
        self.round_pool: Any = None  # the memory pool the round graphs share (replayed one at a time)
        self.pending: Any = None  # spec_chain._Run launched behind the last one, not yet read
        self.follow_runs = True  # launch each run behind the last one (False: one run at a time, for A/B timing)
        self.last_read: float | None = None  # when the last run's tokens were read

    # ------------------------------------------------------------------ before the forward pass
    def _room(self, seq: Seq) -> int:
        p = seq.request.params
        return min(p.max_tokens - seq.num_output - 1, self.max_model_len - len(seq.tokens) - 1)

    def plan(self, sched: Schedule) -> list[tuple[Work, int]]:
        """The step's decodes that speculate and the draft length each wants (the adaptive controller's choice,
        before the room and budget caps of :meth:`extend`)."""
        decodes = [w for w in sched.work if w.num_tokens == 1 and w.samples and w.seq.num_output > 0]
        decodes = [w for w in decodes if w.seq.request.params.plain]  # penalties, min-p, logprobs: full sampler
        if not decodes or self.controller.idle(len(decodes)):
            return []
        plan = self.controller.plan_active([w.seq.seq_id for w in decodes], len(decodes))
        return [(w, k) for w, k in zip(decodes, plan, strict=True) if k > 0]

    def extend(self, sched: Schedule, wanted: list[tuple[Work, int]]) -> list[SpecItem]:
        """Draft for the step's decodes that want to (:meth:`plan`) and grow their work (see the module docstring);
        returns the speculating sequences."""
        left = self.budget - sched.num_tokens
        chosen: list[tuple[Work, int]] = []
        for w, want in wanted:
            k = min(want, self._room(w.seq), left)
            if k > 0:
                chosen.append((w, k))
                left -= k
        if not chosen:
            return []
        t0 = time.perf_counter()
        seqs = [w.seq for w, _ in chosen]
        gens = [s.generator if s.generator is not None else self.generator for s in seqs]
        proposal = self.drafter.propose(seqs, [k for _, k in chosen], gens)
        self.draft_s = time.perf_counter() - t0
        self.proposal_probs = proposal.probs
        items = []
        for row, ((w, _), drafts) in enumerate(zip(chosen, proposal.tokens, strict=True)):
            if not drafts:
                continue
            seq = w.seq
            L = len(seq.tokens)
            try:
                sched.copies += self.blocks.ensure(seq, L + len(drafts))
            except OutOfBlocks:
                continue
            seq.tokens.extend(drafts)
            w.num_tokens = w.num_logits = 1 + len(drafts)
            items.append(SpecItem(w, drafts, L, row))
        drafted = sum(len(d) for d in proposal.tokens)
        if isinstance(self.drafter, ModelDrafter):
            self.controller.observe_draft(len(seqs), drafted, self.draft_s)
        return items

    # ------------------------------------------------------------------ after the forward pass
    def _uniforms(self, items: list[SpecItem], K: int, device: torch.device) -> Tensor:
        u = torch.zeros(len(items), K + 1, dtype=torch.float64, device=device)
        for i, it in enumerate(items):
            seq = it.work.seq
            if not seq.request.params.greedy:
                g = seq.generator if seq.generator is not None else self.generator
                u[i] = torch.rand(K + 1, generator=g, device=device, dtype=torch.float64)
        return u

    def verify(self, items: list[SpecItem], rows: list[Tensor]) -> None:
        """Accept/reject each item's drafts given its ``1 + k`` target logit rows; shrink its work and tokens to the
        accepted ones (``item.accepted``, ``item.next_token`` hold the outcome)."""
        K = max(len(it.drafts) for it in items)
        B, V = len(items), rows[0].shape[-1]
        dev = rows[0].device
        lens = [len(it.drafts) for it in items]
        drafts = torch.tensor([it.drafts + [0] * (K - len(it.drafts)) for it in items], dtype=torch.long)
        num = torch.tensor(lens, dtype=torch.long)
        flags = [it.work.seq.request.params.greedy for it in items]
        greedy = torch.tensor(flags)
        if all(flags) and all(n == K for n in lens):  # the common batch: one stack, no per-row copies
            probs = torch.stack(rows).float()
        else:
            probs = torch.zeros(B, K + 1, V, device=dev)
            for i, (it, r) in enumerate(zip(items, rows, strict=True)):
                probs[i, : r.shape[0]] = target_probs(r, it.work.seq.request.params)
        q = None
        if self.proposal_probs is not None:
            sel = to_device(torch.tensor([it.row for it in items]), self.proposal_probs.device)
            q = torch.zeros(B, K, V, device=dev)
            picked = self.proposal_probs.index_select(0, sel)[:, :K]
            q[:, : picked.shape[1]] = picked
        # host tensors go over without waiting for the device (a blocking copy would first drain the verify pass);
        # the outcome comes back in one read
        drafts, num, greedy = (to_device(t, dev) for t in (drafts, num, greedy))
        res = speculative_verify(probs, drafts, num, q, greedy, self._uniforms(items, K, dev))
        accepted, nxt = torch.stack([res.num_accepted, res.next_tokens]).tolist()
        for it, m, t in zip(items, accepted, nxt, strict=True):
            it.accepted, it.next_token = m, t
            seq = it.work.seq
            del seq.tokens[it.base_len + m :]
            it.work.num_tokens = 1 + m
            self.controller.update(seq.seq_id, len(it.drafts), m)
            self.stats.spec_draft_tokens += len(it.drafts)
            self.stats.spec_accepted += m
            self.stats.spec_verifications += 1

    def observe_outcome(self, batch: int, events: list, seconds: float, speculative: bool) -> None:
        """A decode-only step (or run) of ``batch`` sequences that emitted ``events`` (:meth:`AdaptiveDraftLength.
        observe_outcome`)."""
        self.controller.observe_outcome(batch, speculative, sum(len(e.token_ids) for e in events), seconds)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.controller.observe_target(num_tokens, seconds)

    def release(self, live: set[int]) -> None:
        self.drafter.release(live)
        self.controller.forget(live)
