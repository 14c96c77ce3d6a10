"""The sampler: one batched pass over the ``(N, V)`` logits of a step, on their device.

Per row, in order (every step is one tensor operation over the whole batch; rows that do not use an option get
its neutral value):

1. penalties (only when some row has one), on the fp32 logits ``x`` of tokens already seen: repetition
   (Keskar et al. 2019: ``x / r`` where ``x > 0``, else ``x * r``, over prompt and output tokens), then frequency
   and presence (OpenAI: ``x -= f * count + p * (count > 0)`` over output tokens);
2. temperature: ``x / T`` (greedy rows take ``argmax`` of the penalised logits: no randomness);
3. top-k: tokens below the k-th largest logit get ``-inf`` (ties with it are kept);
4. top-p: over the top-k survivors sorted by probability, tokens whose more likely predecessors already hold
   ``p`` of the mass get ``-inf`` (the most likely token always stays);
5. min-p: tokens with probability below ``min_p`` times the largest get ``-inf``;
6. the draw, as an exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per token picks token ``i``
   with probability ``probs[i]`` (the Gumbel-max trick in exponential form). Each row's noise comes from its own
   ``torch.Generator`` (one call per distinct generator: rows of unseeded requests share the engine's), so a seeded
   request draws the same tokens whatever else is in the batch.

Log-probabilities (``logprobs``) are those of the model's raw distribution (``log_softmax`` of the logits before
any of the steps above), of the sampled token and of the ``logprobs`` most likely ones. The whole pass reads the
results back to the host once, with no per-row synchronisation. Greedy batches without penalties or logprobs are
one ``argmax`` as before: greedy output is unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_llmopt.inference.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "Sampled", "SamplingParams", "TokenLogprobs", "sample", "sample_batch"]

History = tuple[Sequence[int], int]  # (prompt + output tokens, prompt length)


@dataclass
class TokenLogprobs:
    """A sampled ``token``, its log-probability and the ``k`` most likely tokens' ``(token, logprob)``, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sampled:
    """One step's draws: a token per row and, for rows that asked, their :class:`TokenLogprobs`."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


def _filter(logits: Tensor, top_k: int | None, top_p: float) -> Tensor:
    """``(V,)`` fp32 logits with the tokens outside top-k / top-p set to -inf (one row; the drafters' reference)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = before >= top_p  # the first token has before == 0 < top_p: always kept
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _upload(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without waiting for the device (pinned memory on CUDA: a copy from pageable
    memory may drain the stream first)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


# columns of the per-row parameter table (one upload a step)
TEMP, KTH, TOP_P, MIN_P, REP, FREQ, PRES, GREEDY = range(8)


def param_table(params: Sequence[SamplingParams], vocab: int, device: torch.device) -> Tensor:
    """``(N, 8)`` fp32 per-row parameters (columns above; each option's neutral value where it is off)."""
    rows = [
        [
            1.0 if p.greedy else p.temperature,
            (p.top_k if p.top_k and p.top_k < vocab else vocab) - 1,  # index of the k-th largest logit
            p.top_p if p.top_p < 1 else 2.0,  # 2: a mass never reached
            p.min_p,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
            float(p.greedy),
        ]
        for p in params
    ]
    return _upload(torch.tensor(rows, dtype=torch.float32), device)


def token_counts(histories: Sequence[History], rows: list[int], n: int, vocab: int, device: torch.device) -> Tensor:
    """``(2, N, V)`` fp32: per row of ``rows``, the counts of its prompt and output tokens, then of its output tokens
    only (other rows zero). The histories go up in one copy: ``(3, T)`` int64 of token, row and is-output."""
    lengths = np.array([len(histories[r][0]) for r in rows], dtype=np.int64)
    total = int(lengths.sum())
    flat = np.empty((3, total), dtype=np.int64)
    flat[0] = np.fromiter(itertools.chain.from_iterable(histories[r][0] for r in rows), np.int64, count=total)
    flat[1] = np.repeat(np.array(rows, dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    plens = np.repeat(np.array([histories[r][1] for r in rows], dtype=np.int64), lengths)
    flat[2] = (np.arange(total) - starts) >= plens
    ids, row_of, is_out = _upload(torch.from_numpy(flat), device)
    counts = torch.zeros(2, n, vocab, device=device)
    counts[0].index_put_((row_of, ids), torch.ones(ids.shape, device=device), accumulate=True)
    counts[1].index_put_((row_of, ids), is_out.float(), accumulate=True)
    return counts


def apply_penalties(x: Tensor, table: Tensor, params: Sequence[SamplingParams], histories: Sequence[History]) -> Tensor:
    """Repetition, frequency and presence penalties on fp32 logits ``x`` ``(N, V)`` (step 1 of the module);
    ``table`` is :func:`param_table` of ``params``."""
    n, vocab = x.shape
    counts = token_counts(histories, [i for i, p in enumerate(params) if p.penalised], n, vocab, x.device)
    if any(p.repetition_penalty != 1 for p in params):
        r = table[:, REP : REP + 1]
        x = torch.where(counts[0] > 0, torch.where(x > 0, x / r, x * r), x)
    out = counts[1]
    return x - table[:, FREQ : FREQ + 1] * out - table[:, PRES : PRES + 1] * (out > 0).to(x.dtype)


def filter_rows(x: Tensor, table: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Top-k, top-p and min-p of every row of fp32 logits ``x`` ``(N, V)`` at once (steps 3-5 of the module)."""
    vocab = x.shape[1]
    if any((p.top_k and p.top_k < vocab) or p.top_p < 1 for p in params):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        kth = sorted_x.gather(1, table[:, KTH : KTH + 1].long())
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        sorted_x = sorted_x.masked_fill(before >= table[:, TOP_P : TOP_P + 1], float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < table[:, MIN_P : MIN_P + 1] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


def _noise(shape: tuple[int, int], generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor:
    """``(N, V)`` Exp(1) noise; row ``i`` from ``generators[i]`` (rows sharing a generator in one call, in row
    order); rows without a generator (greedy) get ones."""
    q = torch.ones(shape, device=device)
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, g in enumerate(generators):
        if g is not None:
            groups.setdefault(id(g), (g, []))[1].append(i)
    for g, rows in groups.values():
        if len(rows) == shape[0]:
            q.exponential_(generator=g)
        elif len(rows) == 1:
            q[rows[0]].exponential_(generator=g)
        else:
            block = torch.empty(len(rows), shape[1], device=device).exponential_(generator=g)
            q.index_copy_(0, _upload(torch.tensor(rows), device), block)
    return q.clamp_min_(torch.finfo(q.dtype).tiny)  # an exact 0 would turn a masked token's 0 / 0 into NaN


def _logprobs(logits: Tensor, tokens: Tensor, params: Sequence[SamplingParams]) -> Sampled:
    """The tokens, and the log-probabilities of the rows that ask (one read-back of all of them)."""
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return Sampled(tokens.tolist(), [None] * len(params))
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = max(w for w in want if w is not None)
    top = lp.topk(k, dim=-1) if k > 0 else None
    toks, chosen_h = tokens.tolist(), chosen.tolist()
    values, ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    out: list[TokenLogprobs | None] = []
    for i, w in enumerate(want):
        top_i = [(ids[i][j], values[i][j]) for j in range(w)] if w else []
        out.append(None if w is None else TokenLogprobs(toks[i], chosen_h[i], top_i))
    return Sampled(toks, out)


def sample_batch(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History] | None = None,
) -> Sampled:
    """One token per row of ``logits`` ``(N, V)`` (any float dtype; computed in fp32) under ``params[i]``, drawing
    with ``generators[i]`` (ignored for greedy rows). ``histories[i]`` is ``(tokens, prompt_len)`` of row ``i``'s
    sequence, needed when a row has a penalty. See the module docstring for the steps."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params and {len(generators)} generators")
    penalised = any(p.penalised for p in params)
    if not penalised and all(p.greedy for p in params):  # the common case: one argmax
        return _logprobs(logits, logits.argmax(dim=-1), params)
    x = logits.float()
    table = param_table(params, x.shape[1], x.device)
    if penalised:
        if histories is None:
            raise ValueError("a penalised row needs histories=(tokens, prompt_len) per row")
        x = apply_penalties(x, table, params, histories)
    greedy_tokens = x.argmax(dim=-1)
    if all(p.greedy for p in params):
        return _logprobs(logits, greedy_tokens, params)
    probs = torch.softmax(filter_rows(x / table[:, TEMP : TEMP + 1], table, params), dim=-1)
    gens = [g if not p.greedy else None for p, g in zip(params, generators, strict=True)]
    drawn = (probs / _noise((x.shape[0], x.shape[1]), gens, x.device)).argmax(dim=-1)
    tokens = torch.where(table[:, GREEDY] > 0, greedy_tokens, drawn)
    return _logprobs(logits, tokens, params)


def sample(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``(N, V)`` (:func:`sample_batch` without penalties' histories)."""
    return sample_batch(logits, params, generators).tokens
