"""Speculative decoding: the exact acceptance rule, its configuration and the adaptive draft length.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318). A cheap
drafter proposes ``k`` tokens ``d_1 .. d_k`` drawn from its distributions ``q_1 .. q_k``; the target computes its
distributions ``p_1 .. p_{k+1}`` for all of them in **one** forward pass. Then, per sequence:

1. for ``j = 1 .. k``: accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))`` (draw ``u ~ U[0, 1)``,
   accept iff ``u * q_j(d_j) < p_j(d_j)``); stop at the first rejection;
2. at a rejection at ``j``: emit a token drawn from the residual ``norm(max(0, p_j - q_j))``;
3. when all ``k`` are accepted: emit a *bonus* token drawn from ``p_{k+1}``.

The emitted tokens are distributed exactly as tokens sampled from the target one at a time. Greedy requests accept
``d_j`` iff it is the target's argmax, and emit the target's argmax at the first mismatch (or as the bonus), so their
output is token-identical to plain greedy decoding. A deterministic drafter (prompt lookup) has one-hot ``q``: the
acceptance probability is ``p_j(d_j)`` and the residual is ``p_j`` without ``d_j``.

Expected tokens per target pass with per-token acceptance rate ``a``: ``(1 - a^(k+1)) / (1 - a)``; with a draft
costing ``c`` target passes per token, the wall-time gain is that over ``k c + 1`` (Leviathan et al., eq. 1 and
Theorem 3.8). :class:`AdaptiveDraftLength` picks each sequence's ``k`` by maximising this gain with the measured
costs, and turns speculation off (``k = 0``) when no ``k`` pays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.inference.draft_length import (
    SPIKE,
    SPIKE_REPEATS,
    AdaptiveDraftLength,
    expected_tokens,
    predicted_speedup,
)

__all__ = [
    "SPIKE",
    "SPIKE_REPEATS",
    "AdaptiveDraftLength",
    "SpecResult",
    "SpeculativeConfig",
    "expected_tokens",
    "predicted_speedup",
    "sample_from_probs",
    "speculative_verify",
]

METHODS = ("draft", "prompt_lookup", "self_quantized")


@dataclass
class SpeculativeConfig:
    """Speculative decoding in :class:`~lightning_llmopt.inference.LLMEngine`.

    Arguments:
        method: ``"draft"`` (a separate small model, ``draft_model``), ``"prompt_lookup"`` (n-gram matches in the
            sequence itself) or ``"self_quantized"`` (the target's own weight-only quantized copy).
        num_tokens: draft tokens proposed per step at most (``k``).
        adaptive: choose each sequence's ``k`` in ``0 .. num_tokens`` from its running acceptance rate and the
            measured costs (``False``: always ``num_tokens``).
        draft_model: the draft :class:`~lightning_llmopt.models.Llama` (``method="draft"``; same vocabulary).
        draft_num_blocks: KV blocks of the drafter's own pool (default: as many as the target's).
        quant_bits, quant_group_size: ``self_quantized``: round-to-nearest width (4 or 8) and group (``None``: one
            scale per output channel).
        ngram_max, ngram_min: ``prompt_lookup``: longest and shortest suffix n-gram searched for.
        draft_cost: cost of one draft token relative to one target decode step of a sequence; ``None`` measures it
            (prompt lookup: 0).
        prior_acceptance: acceptance rate assumed for a sequence before any of its drafts were verified.
        min_gain: predicted gain below which a sequence does not speculate (adaptive only).
        probe_every: a sequence with speculation switched off drafts one token every this many steps, so its
            acceptance rate stays current; when the measured costs alone rule speculation out, the whole batch
            probes at doubling intervals from this up to 16 times it.
        ema: weight of the past in the running acceptance and cost estimates.
    """

    method: str = "draft"
    num_tokens: int = 4
    adaptive: bool = True
    draft_model: Any = None
    draft_num_blocks: int | None = None
    quant_bits: int = 8
    quant_group_size: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    draft_cost: float | None = None
    prior_acceptance: float = 0.6
    min_gain: float = 1.02
    probe_every: int = 16
    ema: float = 0.9

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method ({self.method!r}) must be one of {METHODS}")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_tokens ({self.num_tokens!r}) must be an integer >= 1")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method 'draft' needs draft_model")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"draft_model is only used by method 'draft', not {self.method!r}")
        if self.quant_bits not in (4, 8):
            raise ValueError(f"quant_bits ({self.quant_bits}) must be 4 or 8")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({self.ngram_min}) <= ngram_max ({self.ngram_max})")
        if self.draft_cost is not None and self.draft_cost < 0:
            raise ValueError(f"draft_cost ({self.draft_cost}) must be >= 0")
        if not 0.0 < self.prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance ({self.prior_acceptance}) must be in (0, 1)")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema ({self.ema}) must be in [0, 1)")
        if self.probe_every < 1:
            raise ValueError(f"probe_every ({self.probe_every}) must be >= 1")


# ---------------------------------------------------------------------- the acceptance rule
@dataclass
class SpecResult:
    """Outcome of :func:`speculative_verify` for ``B`` sequences.

    ``num_accepted`` ``(B,)`` int64: leading draft tokens accepted (``0 .. num_drafts``); ``next_tokens`` ``(B,)``
    int64: the token emitted after them (residual sample at a rejection, bonus token when all were accepted).
    Sequence ``b`` emits ``draft_tokens[b, :num_accepted[b]]`` then ``next_tokens[b]``.
    """

    num_accepted: Tensor
    next_tokens: Tensor

    def emitted(self, draft_tokens: Tensor) -> list[list[int]]:
        drafts, acc, nxt = draft_tokens.tolist(), self.num_accepted.tolist(), self.next_tokens.tolist()
        return [d[:m] + [t] for d, m, t in zip(drafts, acc, nxt, strict=True)]


def sample_from_probs(weights: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: row ``b`` of ``weights`` ``(B, V)`` (non-negative, any scale) with ``u[b]`` in
    ``[0, 1)``. A zero-weight token is never returned."""
    c = torch.cumsum(weights.double(), dim=-1)
    target = u.double() * c[:, -1]
    idx = (c <= target[:, None]).sum(-1)
    return idx.clamp_max(weights.shape[-1] - 1)


def speculative_verify(
    target_probs: Tensor,
    draft_tokens: Tensor,
    num_drafts: Tensor,
    draft_probs: Tensor | None = None,
    greedy: Tensor | None = None,
    uniforms: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Exact speculative sampling for a batch of sequences with different draft lengths (module docstring).

    Arguments:
        target_probs: ``(B, K + 1, V)`` the target's distributions at the ``K`` draft positions and the bonus
            position (for greedy rows any scores: only their argmax is used).
        draft_tokens: ``(B, K)`` int64 proposed tokens (entries at ``j >= num_drafts[b]`` are ignored).
        num_drafts: ``(B,)`` int64 draft tokens of each sequence, ``0 .. K``.
        draft_probs: ``(B, K, V)`` the distributions the drafts were drawn from; ``None``: deterministic drafts
            (one-hot ``q``).
        greedy: ``(B,)`` bool rows decided by argmax equality (default: none).
        uniforms: ``(B, K + 1)`` uniform ``[0, 1)`` draws (``[:, :K]`` accept tests, ``[:, K]`` the emitted token);
            drawn from ``generator`` when ``None``.

    Returns a :class:`SpecResult`.
    """
    B, K1, V = target_probs.shape
    K = K1 - 1
    dev = target_probs.device
    if draft_tokens.shape != (B, K):
        raise ValueError(f"draft_tokens {tuple(draft_tokens.shape)} must be (B, K) = ({B}, {K})")
    if draft_probs is not None and draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must be (B, K, V) = ({B}, {K}, {V})")
    if uniforms is None:
        uniforms = torch.rand(B, K1, generator=generator, device=dev, dtype=torch.float64)
    greedy = torch.zeros(B, dtype=torch.bool, device=dev) if greedy is None else greedy.to(dev)
    num_drafts = num_drafts.to(dev).long()
    draft_tokens = draft_tokens.to(dev).long()
    rows = torch.arange(B, device=dev)
    if K > 0:
        idx = draft_tokens[..., None]  # (B, K, 1)
        p_tok = target_probs[:, :K].gather(-1, idx).squeeze(-1).double()  # (B, K)
        q_tok = torch.ones_like(p_tok) if draft_probs is None else draft_probs.gather(-1, idx).squeeze(-1).double()
        accept = uniforms[:, :K].double() * q_tok < p_tok
        accept = torch.where(greedy[:, None], target_probs[:, :K].argmax(-1) == draft_tokens, accept)
        accept &= torch.arange(K, device=dev)[None] < num_drafts[:, None]
        m = accept.long().cumprod(-1).sum(-1)  # (B,) leading accepted drafts
    else:
        m = torch.zeros(B, dtype=torch.long, device=dev)
    p_row = target_probs[rows, m].double()  # (B, V): target at the first unaccepted position
    weights = p_row
    if K > 0:
        rejected = m < num_drafts
        at = m.clamp_max(K - 1)
        if draft_probs is None:
            q_row = torch.zeros_like(p_row).scatter_(1, draft_tokens[rows, at][:, None], 1.0)
        else:
            q_row = draft_probs[rows, at].double()
        residual = (p_row - q_row).clamp_min(0.0)
        # p == q up to rounding makes a rejection (nearly) impossible; should one happen, fall back to p
        ok = residual.sum(-1) > 0
        weights = torch.where((rejected & ok)[:, None], residual, p_row)
    nxt = sample_from_probs(weights, uniforms[:, K])
    nxt = torch.where(greedy, p_row.argmax(-1), nxt)
    return SpecResult(m, nxt)
