"""Adaptive draft length for speculative decoding: the expected gain of ``k`` drafts and a per-sequence controller.

Expected tokens per target pass with per-token acceptance rate ``a``: ``(1 - a^(k+1)) / (1 - a)``; with a draft
costing ``c`` target passes per token, the wall-time gain is that over ``k c + 1`` (Leviathan et al. 2023, eq. 1
and Theorem 3.8). :class:`AdaptiveDraftLength` picks each sequence's ``k`` by maximising this gain with the measured
costs, and turns speculation off (``k = 0``) when no ``k`` pays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["SPIKE", "SPIKE_REPEATS", "AdaptiveDraftLength", "expected_tokens", "predicted_speedup"]

SPIKE = 8.0  # a cost sample this many times the last of its size is a suspected one-time cost (autotuning, capture)
SPIKE_REPEATS = 3  # ... until this many in a row: then it is a lasting change and is taken


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
    probe only re-measures the costs, and at batch 32 each one cost several plain steps. The same happens when the
    measured throughput of speculating steps at a batch size falls below that of plain steps (:meth:`ruled_out`).
    Probe intervals are kept per batch size.

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
    _idle_count: dict[int, int] = field(default_factory=dict)  # per batch size: steps since the last probe while
    _idle_gap: dict[int, int] = field(default_factory=dict)  # speculation is ruled out, and the probe interval now
    _rates: dict[tuple[int, bool], list[float]] = field(default_factory=dict)  # (batch, speculative): [s, tokens]
    _since_plain: dict[int, int] = field(default_factory=dict)  # per batch size: speculating plans since a plain one
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
        if not self.ruled_out(batch, cost):  # else a probe of measured throughput: the plan below, as it would run
            self._idle_count.pop(batch, None)
            self._idle_gap.pop(batch, None)
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
        if any(out) and self._plain_due(batch):  # the plain throughput this batch size is compared against
            return [0] * len(out)
        return out

    def ruled_out(self, batch: int, cost: float) -> bool:
        """Whether speculation at ``batch`` is ruled out for every sequence: the cost model says even ``alpha = 1``
        would not reach ``min_gain``, or the measured decode throughput of speculating steps at this batch size is
        below that of plain steps (:meth:`observe_outcome`; it sees costs the model does not, such as a host-path
        step's synchronisations: prompt lookup at batch 32 ran 0.74x plain while the model predicted a gain). A probe
        of the second kind runs the ordinary plan, so it measures speculation as it would run."""
        if self.best_k(1.0 - 1e-9, cost)[1] < self.min_gain:
            return True
        spec, plain = self._rates.get((batch, True)), self._rates.get((batch, False))
        return spec is not None and plain is not None and spec[1] * plain[0] < spec[0] * plain[1]

    def _plain_due(self, batch: int) -> bool:
        """Whether this speculating step of ``batch`` sequences should run plain instead, to measure the throughput
        :meth:`ruled_out` compares against: every ``probe_every`` steps while no plain step of this size has been
        measured (the first sample of a size is skipped as a one-time cost), every ``16 * probe_every`` after. A
        batch that always speculates (prompt lookup costs nothing to draft) would otherwise never be measured plain."""
        n = self._since_plain[batch] = self._since_plain.get(batch, 0) + 1
        if n < (self.probe_every if (batch, False) not in self._rates else 16 * self.probe_every):
            return False
        self._since_plain[batch] = 0
        return True

    def observe_outcome(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A decode-only step (or a run of them) of ``batch`` sequences emitted ``tokens`` in ``seconds`` of wall
        time, speculating or not (running averages per batch size and kind)."""
        if tokens <= 0 or seconds <= 0 or self._spike(3 if speculative else 2, batch, seconds / tokens):
            return  # one-time costs (a graph captured inside a run) are skipped as for the cost samples
        r = self._rates.get((batch, speculative))
        if r is None:
            self._rates[(batch, speculative)] = [seconds, float(tokens)]
        else:
            r[0] = self.ema * r[0] + (1 - self.ema) * seconds
            r[1] = self.ema * r[1] + (1 - self.ema) * tokens

    def idle(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` sequences drafts nothing at all because the cost alone rules speculation
        out and no probe is due (class docstring); counts the step. The caller may then skip :meth:`plan` and its
        per-sequence work. When a probe is due, resets the interval (doubled, up to ``16 * probe_every``) and returns
        False: :meth:`plan` then gives every sequence ``k = 1``."""
        if not self.adaptive:
            return False
        if not self.ruled_out(batch, self.token_cost(batch)):
            return False
        idle = self._idle_count[batch] = self._idle_count.get(batch, 0) + 1
        gap = self._idle_gap.get(batch, self.probe_every)
        if idle < gap:
            return True
        self._idle_count[batch], self._idle_gap[batch] = 0, min(2 * gap, 16 * self.probe_every)
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
