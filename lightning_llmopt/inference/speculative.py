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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AdaptiveDraftLength",
    "SpecResult",
    "SpeculativeConfig",
    "expected_tokens",
    "predicted_speedup",
    "sample_from_probs",
    "speculative_verify",
]

METHODS = ("draft", "prompt_lookup", "self_quantized")
SPIKE = 8.0  # a cost sample this many times the last of its size is a suspected one-time cost (autotuning, capture)
SPIKE_REPEATS = 3  # ... until this many in a row: then it is a lasting change and is taken


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


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted per target pass with acceptance rate ``alpha`` and ``k`` drafts:
    ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, cost: float) -> float:
    """Wall-time gain over plain decoding: ``expected_tokens(alpha, k) / (k * cost + 1)``, ``cost`` being the cost
    of one draft token (plus its verification) relative to one plain decode step."""
    return expected_tokens(alpha, k) / (k * cost + 1.0)


# ---------------------------------------------------------------------- adaptive draft length
@dataclass
class _SeqAcceptance:
    accepted: float = 0.0
    trials: float = 0.0
    off_steps: int = 0


@dataclass
class AdaptiveDraftLength:
    """Per-sequence draft length from running acceptance rates and a measured cost model.

    Cost model: a target pass over ``N`` tokens takes ``a + b N`` (fitted online by least squares with forgetting);
    a plain decode step of ``B`` sequences costs each ``(a + b B) / B``, and every extra verified token ``b``, so
    one draft token costs ``draft_cost + b / ((a + b B) / B)`` plain steps. A sequence with acceptance rate
    ``alpha`` gets the ``k`` in ``0 .. max_k`` maximising :func:`predicted_speedup`; ``k = 0`` when the best gain is
    below ``min_gain`` (then every ``probe_every`` steps ``k = 1`` keeps ``alpha`` current). When the cost alone rules
    speculation out (not even ``alpha = 1`` would reach ``min_gain``), all sequences probe together, every
    ``probe_every`` steps at first and then at doubling intervals up to ``16 * probe_every`` while that lasts: such a
    probe only re-measures the costs, and at batch 32 each one cost several plain steps.

    Arguments:
        max_k: longest draft.
        adaptive: ``False`` always returns ``max_k``.
        draft_cost: fixed draft cost per token (relative to a plain decode step per sequence); ``None``: measured
            by :meth:`observe_draft`.
        prior: acceptance rate of a sequence without history (blended with the engine-wide rate).
        min_gain, probe_every, ema: see :class:`SpeculativeConfig`.
    """

    max_k: int
    adaptive: bool = True
    draft_cost: float | None = None
    prior: float = 0.6
    min_gain: float = 1.02
    probe_every: int = 16
    ema: float = 0.9
    seqs: dict[int, _SeqAcceptance] = field(default_factory=dict)
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # weighted sums: w, N, N^2, T, N T
    _draft_cost_est: float | None = None
    _global: _SeqAcceptance = field(default_factory=_SeqAcceptance)
    _hopeless_idle: int = 0  # steps since the last probe while the cost rules speculation out
    _hopeless_gap: int = 0  # steps between such probes now (0: probe_every)
    _last: dict[tuple[int, int], float] = field(default_factory=dict)  # (target 0 / draft 1, size): last sample
    _spikes: dict[tuple[int, int], int] = field(default_factory=dict)  # the same key: outliers in a row
    probing: bool = False  # the last plan includes a probe (a k = 1 step kept only to re-measure)

    # ---------------------------------------------------------------- estimates
    def alpha(self, seq_id: int) -> float:
        g = self._global
        base = (g.accepted + 4 * self.prior) / (g.trials + 4)  # engine-wide rate, pulled toward the prior
        s = self.seqs.get(seq_id)
        if s is None:
            return base
        return (s.accepted + 2 * base) / (s.trials + 2)

    def update(self, seq_id: int, proposed: int, accepted: int) -> None:
        """Record a verification: ``accepted`` of ``proposed`` drafts (a rejection counts as a failed trial)."""
        if proposed <= 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        for s in (self.seqs.setdefault(seq_id, _SeqAcceptance()), self._global):
            s.accepted = self.ema * s.accepted + accepted
            s.trials = self.ema * s.trials + trials

    def forget(self, live: set[int]) -> None:
        for sid in [s for s in self.seqs if s not in live]:
            del self.seqs[sid]

    def _spike(self, which: int, size: int, value: float) -> bool:
        """Whether a cost sample is to be skipped as a one-time cost (autotuning, a graph capture, a first
        allocation): the first sample of its size, or more than :data:`SPIKE` times the last sample of that size
        taken, until the :data:`SPIKE_REPEATS`-th such sample in a row (a lasting change is then taken). Samples are
        compared with their own size only, never with an extrapolation. Measured: a first draft step that autotuned
        took 6.4 s against 1.5 ms for a steady one at batch 32; folded into the estimates, it ruled drafting out for
        the rest of the run."""
        key = (which, size)
        last = self._last.get(key)
        if last is not None and value > SPIKE * last:
            n = self._spikes.get(key, 0) + 1
            if n < SPIKE_REPEATS:
                self._spikes[key] = n
                return True
        self._spikes[key] = 0
        self._last[key] = value
        return last is None

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        """One target pass over ``num_tokens`` tokens took ``seconds`` (one-time costs skipped, :meth:`_spike`)."""
        if self._spike(0, num_tokens, seconds):
            return
        f = self._fit
        for i, v in enumerate((1.0, num_tokens, num_tokens * num_tokens, seconds, num_tokens * seconds)):
            f[i] = 0.98 * f[i] + v

    def observe_draft(self, num_seqs: int, draft_tokens: int, seconds: float) -> None:
        """Drafting ``draft_tokens`` tokens for ``num_seqs`` sequences took ``seconds``."""
        if draft_tokens <= 0:
            return
        per_token = seconds / (draft_tokens / max(num_seqs, 1))  # one draft token of every sequence
        if self._spike(1, num_seqs, per_token):
            return
        plain = self.step_cost(num_seqs)
        if plain is None or plain <= 0:
            return
        c = per_token / plain
        prev = self._draft_cost_est
        self._draft_cost_est = c if prev is None else self.ema * prev + (1 - self.ema) * c

    def fitted(self) -> tuple[float, float] | None:
        """``(a, b)`` of the target cost ``a + b N``, or ``None`` before enough distinct batch sizes were seen."""
        w, sn, snn, st, snt = self._fit
        if w < 3:
            return None
        var = snn / w - (sn / w) ** 2
        mean_t = st / w
        if var <= 1e-9 * max(1.0, (sn / w) ** 2):
            return mean_t, 0.0  # one size only: no slope yet (bandwidth-bound assumption)
        b = (snt / w - (sn / w) * mean_t) / var
        b = max(b, 0.0)
        a = max(mean_t - b * sn / w, 1e-12)
        return a, b

    def step_cost(self, batch: int) -> float | None:
        """Seconds a plain decode step of ``batch`` sequences costs, or ``None`` before any measurement."""
        fit = self.fitted()
        return None if fit is None else fit[0] + fit[1] * batch

    def token_cost(self, batch: int) -> float:
        """Cost of one draft token (draft + its verification) in plain decode steps of one sequence."""
        draft = self.draft_cost if self.draft_cost is not None else (self._draft_cost_est or 0.0)
        fit = self.fitted()
        verify = 0.0
        if fit is not None:
            a, b = fit
            verify = b / ((a + b * batch) / batch)
        return draft + verify

    # ---------------------------------------------------------------- decisions
    def best_k(self, alpha: float, cost: float) -> tuple[int, float]:
        best, gain = 0, 1.0
        for k in range(1, self.max_k + 1):
            g = predicted_speedup(alpha, k, cost)
            if g > gain:
                best, gain = k, g
        return best, gain

    def choose(self, seq_id: int, batch: int) -> int:
        """Draft length of sequence ``seq_id`` in a decode batch of ``batch`` sequences (:meth:`plan` of a step with
        only this sequence deciding)."""
        return self.plan([seq_id], batch)[0]

    def plan(self, seq_ids: Sequence[int], batch: int) -> list[int]:
        """Draft lengths of ``seq_ids`` for one decode step of ``batch`` sequences (rule: class docstring).

        The draft token's cost is computed once for the step. When even perfect acceptance would not reach
        ``min_gain``, no sequence's best ``k`` is searched and the whole batch probes together at backed-off
        intervals (class docstring); such a step costs the host a counter, where the per-sequence search cost
        about 6 us a sequence (CPU, under cProfile)."""
        if self.idle(batch):
            return [0] * len(seq_ids)
        return self.plan_active(seq_ids, batch)

    def plan_active(self, seq_ids: Sequence[int], batch: int) -> list[int]:
        """:meth:`plan` for a step :meth:`idle` has already counted and found not idle (the engine asks :meth:`idle`
        first, so an idle step costs it no per-sequence work)."""
        self.probing = False
        if not self.adaptive:
            return [self.max_k] * len(seq_ids)
        cost = self.token_cost(batch)
        if self.best_k(1.0 - 1e-9, cost)[1] < self.min_gain:  # a probe step (idle() just reset its counter)
            self.probing = True
            return [1] * len(seq_ids)
        self._hopeless_idle = self._hopeless_gap = 0
        out = []
        for seq_id in seq_ids:
            k, gain = self.best_k(self.alpha(seq_id), cost)
            s = self.seqs.get(seq_id) or self.seqs.setdefault(seq_id, _SeqAcceptance())
            if k == 0 or gain < self.min_gain:
                s.off_steps += 1
                probe = s.off_steps % self.probe_every == 0
                self.probing |= probe
                out.append(1 if probe else 0)
            else:
                s.off_steps = 0
                out.append(k)
        return out

    def idle(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` sequences drafts nothing at all because the cost alone rules speculation
        out and no probe is due (class docstring); counts the step. The caller may then skip :meth:`plan` and its
        per-sequence work. When a probe is due, resets the interval (doubled, up to ``16 * probe_every``) and returns
        False: :meth:`plan` then gives every sequence ``k = 1``."""
        if not self.adaptive:
            return False
        if self.best_k(1.0 - 1e-9, self.token_cost(batch))[1] >= self.min_gain:
            return False
        self._hopeless_idle += 1
        gap = self._hopeless_gap or self.probe_every
        if self._hopeless_idle < gap:
            return True
        self._hopeless_idle, self._hopeless_gap = 0, min(2 * gap, 16 * self.probe_every)
        return False

    def summary(self) -> dict[str, float]:
        fit = self.fitted()
        g = self._global
        return {
            "acceptance_ema": g.accepted / g.trials if g.trials else math.nan,
            "draft_cost": self.draft_cost if self.draft_cost is not None else (self._draft_cost_est or math.nan),
            "target_fixed_s": fit[0] if fit else math.nan,
            "target_per_token_s": fit[1] if fit else math.nan,
        }
