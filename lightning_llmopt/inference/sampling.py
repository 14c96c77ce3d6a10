"""Sampling parameters and the sampler.

Per row of logits the sampler applies, in order: temperature (0 means greedy: ``argmax``, no randomness), top-k
(keep the ``k`` largest logits), top-p (keep the smallest set of most likely tokens whose probability reaches ``p``;
the most likely token is always kept), then draws one token with the row's own ``torch.Generator`` (seeded per
request, so a seeded request samples the same tokens whatever else is in the batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt.

    Arguments:
        max_tokens: number of tokens to generate at most (>= 1).
        temperature: 0 for greedy decoding; otherwise logits are divided by it before sampling (> 0).
        top_k: keep only the ``top_k`` most likely tokens (``None`` or 0: all).
        top_p: nucleus sampling: keep the most likely tokens whose cumulative probability reaches ``top_p``
            (in ``(0, 1]``; 1 keeps all).
        seed: seeds the request's own generator; ``None`` draws from the engine's generator.
        stop_token_ids: tokens that end the sequence (not included in the output).
        ignore_eos: do not stop at the tokenizer's end-of-sequence token.
        n: number of sequences sampled from the prompt (parallel sampling; they share the prompt's KV blocks,
            copied on write). ``n > 1`` needs ``temperature > 0``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens ({self.max_tokens!r}) must be an integer >= 1")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature ({self.temperature!r}) must be a finite number >= 0 (0 is greedy)")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0
        ):
            raise ValueError(f"top_k ({self.top_k!r}) must be None or an integer >= 0 (0 keeps every token)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p ({self.top_p!r}) must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed ({self.seed!r}) must be None or an integer >= 0")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids ({list(stops)!r}) must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", stops)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n ({self.n!r}) must be an integer >= 1")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n ({self.n}) > 1 needs temperature > 0: greedy samples would all be identical")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a stop token lies outside the vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")


def _filter(logits: Tensor, top_k: int | None, top_p: float) -> Tensor:
    """``(V,)`` fp32 logits with the tokens outside top-k / top-p set to -inf."""
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


def sample(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``(N, V)`` (any float dtype; computed in fp32)."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params and {len(generators)} generators")
    out: list[int] = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):  # the common case: one argmax, one device sync
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for i, tok in zip(greedy, logits.index_select(0, idx).argmax(dim=-1).tolist(), strict=True):
            out[i] = int(tok)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter(logits[i].float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
