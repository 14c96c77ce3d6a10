"""Drafters for speculative decoding: a separate small model, prompt lookup, and the target's quantized copy.

A drafter proposes up to ``k`` tokens for each sequence of a decode batch (:meth:`Drafter.propose`), returning the
tokens and, for drafters that sample, the distributions ``q`` they were drawn from (:mod:`.speculative`).

- :class:`PromptLookupDrafter` (prompt lookup decoding): find the most recent earlier occurrence of the sequence's
  last ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) and propose the tokens that followed it.
  Deterministic: ``q`` is one-hot.
- :class:`ModelDrafter`: a small :class:`~lightning_llmopt.models.Llama` run by the engine's own machinery (a
  :class:`~lightning_llmopt.inference.kv_pool.KVPool`, a :class:`BlockManager` and a
  :class:`~lightning_llmopt.inference.runner.ModelRunner`) over its own paged cache. Per sequence it keeps the
  tokens whose keys/values its cache holds; before drafting it keeps the longest prefix that still agrees with the
  sequence (drafts the target rejected are rolled back, their blocks freed), computes the rest in one chunk, then
  decodes ``k - 1`` more steps, all sequences batched.
- :func:`quantized_drafter`: a :class:`ModelDrafter` over a copy of the target whose linear layers are RTN int8/int4
  :class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear` (Triton kernel on CUDA, reference
  dequantization elsewhere).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from lightning_llmopt.inference.block_manager import BlockManager, OutOfBlocks
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs, step_logits
from lightning_llmopt.inference.kv_pool import KVPool
from lightning_llmopt.inference.request import Sequence as Seq
from lightning_llmopt.inference.runner import ModelRunner, decode_rows, to_device
from lightning_llmopt.inference.sampling import SamplingParams, _filter
from lightning_llmopt.inference.scheduler import Work
from lightning_llmopt.models.layer_pattern import kv_producers
from lightning_llmopt.models.llama import Llama

__all__ = [
    "Drafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "draft_distribution",
    "draft_distributions",
    "quantized_drafter",
]


@dataclass
class Proposal:
    """Draft tokens of ``B`` sequences: ``tokens[b]`` (at most the ``k`` asked for, possibly none) and ``probs``
    ``(B, K, V)`` fp32, the distribution each was drawn from (``None``: deterministic drafts, one-hot ``q``)."""

    tokens: list[list[int]]
    probs: Tensor | None = None


class Drafter(Protocol):
    def propose(
        self, seqs: Sequence[Seq], ks: Sequence[int], generators: Sequence[torch.Generator | None]
    ) -> Proposal: ...

    def release(self, live: set[int]) -> None:
        """Drop the state (and free the blocks) of every sequence id not in ``live``."""
        ...


def draft_distribution(logits: Tensor, params: SamplingParams) -> Tensor:
    """``(V,)`` fp32 distribution a draft token is drawn from: the request's own temperature / top-k / top-p (any
    ``q`` keeps speculative sampling exact; the closer to the target's, the more is accepted). Greedy: one-hot."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(0, logits.argmax()[None], 1.0)
    return torch.softmax(_filter(logits.float() / params.temperature, params.top_k, params.top_p), dim=-1)


def draft_distributions(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """``(n, V)`` fp32: row ``i`` is :func:`draft_distribution` of ``logits[i]`` under ``params[i]``. When every row is
    greedy, the one-hot rows come from one ``argmax`` and one ``scatter_`` over the whole batch (per row, three
    small ops each made a 32-sequence draft round host-bound)."""
    if all(p.greedy for p in params):
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return out.scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.stack([draft_distribution(r, p) for r, p in zip(logits, params, strict=True)])


@dataclass
class _NgramIndex:
    """The n-grams of one sequence that end before its last token: n-gram -> latest start, built incrementally."""

    last: dict[tuple[int, ...], int] = field(default_factory=dict)
    upto: int = 0  # n-grams ending at indices < upto are in ``last``
    anchor: int = -1  # the token at index upto - 1 when indexed: a cheap check that the prefix did not change
    # (committed tokens only grow and the engine never reuses a sequence id; a shorter sequence also rebuilds)


class PromptLookupDrafter:
    """Prompt lookup decoding: propose the continuation of the latest earlier match of the sequence's suffix.

    Each sequence keeps an index of its n-grams (``ngram_min`` to ``ngram_max`` tokens, latest start of each),
    extended by the tokens committed since the last step, so a lookup costs the same at any length; searching the
    whole sequence per step took about 40 us a sequence, as long as a batch-32 decode step for 32 of them.
    :meth:`lookup` is that search, kept as the stateless reference.

    Arguments:
        ngram_max, ngram_min: suffix lengths tried, longest first.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.index: dict[int, _NgramIndex] = {}

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        L = len(tokens)
        if k <= 0 or L < 2:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = arr[L - n :]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0 .. L-1-n
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in arr[start : start + k]]
        return []

    def lookup_indexed(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]:
        """:meth:`lookup` through sequence ``seq_id``'s index (extended to ``tokens`` first)."""
        L = len(tokens)
        if k <= 0 or L < 2:
            return []
        ix = self.index.get(seq_id)
        if ix is None or ix.upto > L - 1 or (ix.upto and tokens[ix.upto - 1] != ix.anchor):
            ix = self.index[seq_id] = _NgramIndex()
        last, lo, hi = ix.last, self.ngram_min, self.ngram_max
        for end in range(ix.upto, L - 1):  # n-grams ending at end <= L - 2: a token follows each
            for n in range(lo, min(hi, end + 1) + 1):
                last[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        ix.upto, ix.anchor = L - 1, tokens[L - 2]
        for n in range(min(hi, L - 1), lo - 1, -1):
            start = last.get(tuple(tokens[L - n :]))
            if start is not None:
                return list(tokens[start + n : start + n + k])
        return []

    def propose(self, seqs: Sequence[Seq], ks: Sequence[int], generators: Sequence[torch.Generator | None]) -> Proposal:
        return Proposal([self.lookup_indexed(s.seq_id, s.tokens, k) for s, k in zip(seqs, ks, strict=True)])

    def release(self, live: set[int]) -> None:
        for sid in [s for s in self.index if s not in live]:
            del self.index[sid]


@dataclass
class _DraftSeq:
    """A sequence as the drafter's cache sees it (duck-types what :class:`ModelRunner` and the blocks need)."""

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0


class ModelDrafter:
    """Draft with a small model over its own paged KV cache (module docstring).

    Arguments:
        model: the draft model (same vocabulary as the target; on the target's device).
        num_blocks: KV blocks of the drafter's pool (null block included).
        block_size: tokens per block.
        backend: attention backend of its runner (``"auto"``, ``"triton"``, ``"reference"``).
        graph_sizes, max_model_len: on CUDA, replay the draft steps (single-token rounds and short catch-ups on
            accepted tokens) from CUDA graphs of these row counts, sized for ``max_model_len`` (``None``: eager).
    """

    def __init__(
        self,
        model: Llama,
        num_blocks: int,
        block_size: int,
        backend: str = "auto",
        graph_sizes: tuple[int, ...] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        cfg = model.config
        assert cfg.n_kv_heads is not None and cfg.head_dim is not None
        self.model = model.eval()
        device = model.tok_embeddings.weight.device if model.tok_embeddings is not None else torch.device("cpu")
        dtype = model.tok_embeddings.weight.dtype if model.tok_embeddings is not None else torch.float32
        n_cached = len(kv_producers(cfg))  # cross-layer KV sharing: producers only
        self.pool = KVPool(n_cached, cfg.n_kv_heads, cfg.head_dim, num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(model, self.pool, backend, fused=None)
        self.state: dict[int, _DraftSeq] = {}
        # with graphs, rounds of equal k run back to back on the device and read their tokens once (:meth:`_chain`)
        self.chain_rounds = True
        self.graphs = None
        if graph_sizes and max_model_len and device.type == "cuda":  # draft steps replayed like the target's
            self.graphs = DecodeGraphs(self.runner, graph_sizes, self.blocks.blocks_for(max_model_len), max_model_len)

    def _sync(self, seq: Seq) -> _DraftSeq:
        """Keep the cached prefix that agrees with ``seq.tokens`` (roll back rejected drafts), then copy the rest."""
        ds = self.state.setdefault(seq.seq_id, _DraftSeq())
        n, top = 0, min(len(ds.tokens), len(seq.tokens), ds.num_computed)
        if top and ds.tokens[:top] == seq.tokens[:top]:
            n = top
        else:
            while n < top and ds.tokens[n] == seq.tokens[n]:
                n += 1
        n = min(n, len(seq.tokens) - 1)  # at least one token to feed
        del ds.tokens[n:]
        ds.tokens.extend(seq.tokens[n:])
        ds.num_computed = n
        self._truncate(ds, n)
        return ds

    def _truncate(self, ds: _DraftSeq, num_tokens: int) -> None:
        keep = self.blocks.blocks_for(num_tokens)
        for b in ds.block_table[keep:]:
            self.blocks.allocator.decref(b)
        del ds.block_table[keep:]

    def _forward(self, items: list[tuple[int, _DraftSeq]]) -> dict[int, Tensor]:
        """One draft forward over every ``(row, seq)``'s uncomputed tokens: ``{row: logits (V,)}``."""
        work = [Work(ds, ds.num_computed, len(ds.tokens) - ds.num_computed) for _, ds in items]  # type: ignore[arg-type]
        by_id = {id(w): r for w, (r, _) in zip(work, items, strict=True)}
        # a prompt's catch-up runs eagerly beside the others' graphed rows (as before mixed_steps; not measured merged)
        ordered, logits = step_logits(self.graphs, self.runner, work, split=True)  # one row per work: its last token
        for w in ordered:
            w.seq.num_computed = w.start + w.num_tokens
        return {by_id[id(w)]: logits[i] for i, w in enumerate(ordered)}

    @torch.no_grad()
    def propose(self, seqs: Sequence[Seq], ks: Sequence[int], generators: Sequence[torch.Generator | None]) -> Proposal:
        K = max(ks, default=0)
        V = self.model.config.vocab_size
        tokens: list[list[int]] = [[] for _ in seqs]
        probs = torch.zeros(len(seqs), max(K, 1), V, device=self.pool.device)
        active: list[tuple[int, _DraftSeq]] = []
        for r, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if k <= 0:
                continue
            ds = self._sync(seq)
            try:  # every position the k rounds write: up to len + k - 2
                self.blocks.ensure(ds, len(ds.tokens) + k - 1)
            except OutOfBlocks:
                continue  # no room in the draft cache: this sequence does not speculate this step
            active.append((r, ds))
        if self.chain_rounds and self.graphs is not None and K > 1 and active and all(ks[r] == K for r, _ in active):
            if self.graphs.fits(len(active)):
                self._chain(seqs, K, generators, active, tokens, probs)
                return Proposal(tokens, probs[:, :K])
        for j in range(K):
            items = [(r, ds) for r, ds in active if ks[r] > j]
            if not items:
                break
            rows = self._forward(items)
            logits = torch.stack([rows[r] for r, _ in items])
            qs = draft_distributions(logits, [seqs[r].request.params for r, _ in items])
            picks = qs.argmax(-1)
            for i, (r, _) in enumerate(items):
                if not seqs[r].request.params.greedy:
                    picks[i] = torch.multinomial(qs[i], 1, generator=generators[r])[0]
            probs[torch.tensor([r for r, _ in items], device=probs.device), j] = qs
            for (r, ds), tok in zip(items, picks.tolist(), strict=True):  # one host sync per draft round
                tokens[r].append(tok)
                ds.tokens.append(tok)
        return Proposal(tokens, probs[:, :K])

    def _chain(
        self,
        seqs: Sequence[Seq],
        K: int,
        generators: Sequence[torch.Generator | None],
        active: list[tuple[int, _DraftSeq]],
        tokens: list[list[int]],
        probs: Tensor,
    ) -> None:
        """The ``K`` draft rounds (one token each) of ``active`` (every one drafting ``K`` tokens) with one host
        synchronisation for the whole proposal.

        The first round computes each sequence's uncomputed tokens (:meth:`_forward`). Rounds ``1 .. K - 1`` feed one
        token per sequence at known positions, so their rows (positions, slots, context lengths) and block tables
        go to the device before they run; each round's token row is the previous round's picks, copied on the
        device. The tokens reach the host once, after the last round (the round-by-round loop reads them each round)."""
        assert self.graphs is not None
        rows_of = [r for r, _ in active]
        starts = [len(ds.tokens) for _, ds in active]
        first = self._forward(active)
        for _, ds in active:  # placeholders: the rows of later rounds read positions and slots, not the tokens
            ds.tokens.extend([0] * (K - 1))
        size = self.blocks.block_size
        passes = [
            decode_rows([Work(ds, s + j, 1) for (_, ds), s in zip(active, starts, strict=True)], size)[0]  # type: ignore[arg-type]
            for j in range(K - 1)
        ]
        metas = self.graphs.stage_chain(passes, [ds.block_table for _, ds in active])
        index = to_device(torch.tensor(rows_of, dtype=torch.long), probs.device)
        params = [seqs[r].request.params for r in rows_of]
        logits = torch.stack([first[r] for r in rows_of])
        picks_per_round: list[Tensor] = []
        for j in range(K):
            if j:
                logits = self.graphs.replay_rows(metas[j - 1], len(active), ids=picks_per_round[-1])
            qs = draft_distributions(logits, params)
            picks = qs.argmax(-1)
            for i, r in enumerate(rows_of):
                if not params[i].greedy:
                    picks[i] = torch.multinomial(qs[i], 1, generator=generators[r])[0]
            probs[index, j] = qs
            picks_per_round.append(picks)
        drafted = torch.stack(picks_per_round, dim=1).tolist()  # the proposal's one host synchronisation
        for (r, ds), s, toks in zip(active, starts, drafted, strict=True):
            tokens[r].extend(toks)
            ds.tokens[s:] = toks
            ds.num_computed = s + K - 1

    def prepare_rounds(self, seqs: Sequence[Seq], upto: Sequence[int]) -> None:
        """Ready ``seqs`` for device-side speculative rounds (:mod:`~lightning_llmopt.inference.spec_chain`): each
        sequence's cache holds the keys/values of every token but its last two (a round's first draft pass feeds
        those two), and its table covers positions ``< upto[i]``. Raises :class:`OutOfBlocks` when the draft pool is
        short (tables may have grown; the next :meth:`propose` or round trims them)."""
        behind: list[tuple[int, _DraftSeq]] = []
        for i, (seq, n) in enumerate(zip(seqs, upto, strict=True)):
            ds = self._sync(seq)
            self.blocks.ensure(ds, n)
            if ds.num_computed < len(seq.tokens) - 2:
                del ds.tokens[len(seq.tokens) - 2 :]
                behind.append((i, ds))
        if behind:
            self._forward(behind)
        for seq in seqs:
            self.set_computed(seq, len(seq.tokens) - 2)

    def set_computed(self, seq: Seq, n: int) -> None:
        """Record that the cache holds the keys/values of ``seq.tokens[:n]`` (after device-side rounds)."""
        ds = self.state.setdefault(seq.seq_id, _DraftSeq())
        n = max(0, min(n, len(seq.tokens)))
        ds.tokens = list(seq.tokens[:n])
        ds.num_computed = n

    def release(self, live: set[int]) -> None:
        for sid in [s for s in self.state if s not in live]:
            ds = self.state.pop(sid)
            self._truncate(ds, 0)

    @property
    def num_sequences(self) -> int:
        return len(self.state)


def quantized_drafter(
    target: Llama,
    bits: int,
    group_size: int | None,
    num_blocks: int,
    block_size: int,
    backend: str = "auto",
    graph_sizes: tuple[int, ...] | None = None,
    max_model_len: int | None = None,
) -> ModelDrafter:
    """A :class:`ModelDrafter` over a copy of ``target`` with RTN ``bits``-bit weight-only linear layers (the
    output head stays in full precision, as :class:`~lightning_llmopt.quantization.QuantConfig` skips it)."""
    from lightning_llmopt.quantization import QuantConfig, quantize_model

    draft = copy.deepcopy(target)
    quantize_model(draft, QuantConfig(bits=bits, group_size=group_size, method="rtn"))
    return ModelDrafter(draft, num_blocks, block_size, backend, graph_sizes, max_model_len)
