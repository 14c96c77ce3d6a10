"""Exactness of the speculative acceptance rule (:func:`speculative_verify`) on synthetic distributions.

Each case fixes target distributions ``p_1 .. p_{K+1}`` and draft distributions ``q_1 .. q_K`` that do not depend on
the prefix, so the token emitted at position ``j`` of a speculative step must be distributed as ``p_j``, whatever
happened before it. 10^5 independent steps run in one vectorised call; the emitted tokens must pass a chi-square
goodness-of-fit test against ``p_j`` (p > 0.01) and lie within total-variation distance 0.01 (the first position
has all 10^5 samples; later positions are reached less often and get the chi-square test).
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from lightning_llmopt.inference.sampling import SamplingParams
from lightning_llmopt.inference.speculative import (
    AdaptiveDraftLength,
    expected_tokens,
    predicted_speedup,
    sample_from_probs,
    speculative_verify,
)

N = 100_000
V = 16
K = 3


def _dirichlet(g: torch.Generator, rows: int, support: slice | None = None, conc: float = 0.7) -> torch.Tensor:
    x = torch._standard_gamma(torch.full((rows, V), conc, dtype=torch.float64), generator=g)
    if support is not None:
        mask = torch.zeros(V, dtype=torch.bool)
        mask[support] = True
        x = x * mask
    return x / x.sum(-1, keepdim=True)


def _one_hot(rows: int, token: int) -> torch.Tensor:
    x = torch.zeros(rows, V, dtype=torch.float64)
    x[:, token] = 1.0
    return x


def _case(name: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(p (K+1, V), q (K, V) or None, fixed draft tokens (K,) for one-hot drafters or None)``."""
    if name == "random":
        return _dirichlet(g, K + 1), _dirichlet(g, K), None
    if name == "disjoint":  # q never proposes a token p allows: every draft is rejected, residual = p
        return _dirichlet(g, K + 1, slice(8, 16)), _dirichlet(g, K, slice(0, 8)), None
    if name == "partial_overlap":
        return _dirichlet(g, K + 1, slice(0, 10)), _dirichlet(g, K, slice(6, 16)), None
    if name == "one_hot_target":
        return _one_hot(K + 1, 5), _dirichlet(g, K), None
    if name == "one_hot_draft":  # a draft model that is certain (q one-hot, given as a distribution)
        return _dirichlet(g, K + 1), _one_hot(K, 2), None
    if name == "equal":  # q == p: every draft accepted, the bonus token carries the last position
        p = _dirichlet(g, K + 1)
        return p, p[:K].clone(), None
    if name == "lookup":  # deterministic drafter (prompt lookup): q is implicit one-hot
        p = _dirichlet(g, K + 1)
        return p, None, torch.tensor([p[0].argmax().item(), 7, 1])
    raise AssertionError(name)


def _check(counts: torch.Tensor, p: torch.Tensor, tv_limit: float | None) -> tuple[float, float]:
    n = int(counts.sum())
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    tv = 0.5 * (counts / n - p).abs().sum().item()
    if support.sum() == 1:
        assert counts[support].item() == n
        return 1.0, tv
    expected = (p[support] * n).numpy()
    observed = counts[support].double().numpy()
    pval = float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)
    assert pval > 0.01, f"chi-square p-value {pval:.4g}"
    if tv_limit is not None:
        assert tv < tv_limit, f"total variation {tv:.4f}"
    return pval, tv


CASES = ["random", "disjoint", "partial_overlap", "one_hot_target", "one_hot_draft", "equal", "lookup"]


@pytest.mark.parametrize("name", CASES)
def test_emitted_tokens_follow_target(name):
    g = torch.Generator().manual_seed(CASES.index(name) + 11)
    p, q, fixed = _case(name, g)
    if fixed is None:
        assert q is not None
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
        draft_probs = q[None].expand(N, K, V)
    else:
        drafts = fixed[None].expand(N, K)
        draft_probs = None
    # mixed draft lengths in one batch: a quarter of the rows draft fewer tokens (0 included)
    num = torch.full((N,), K, dtype=torch.long)
    num[: N // 4] = torch.randint(0, K, (N // 4,), generator=g)
    res = speculative_verify(
        p[None].expand(N, K + 1, V), drafts, num, draft_probs, uniforms=torch.rand(N, K + 1, generator=g, dtype=p.dtype)
    )
    m, nxt = res.num_accepted, res.next_tokens
    assert ((m >= 0) & (m <= num)).all()
    # the token emitted at position j: the draft if j < m, the next token at j == m
    pos = torch.arange(K + 1)[None]
    padded = torch.cat([drafts, torch.zeros(N, 1, dtype=torch.long)], 1)
    emitted = torch.where(pos < m[:, None], padded, nxt[:, None])
    reached = pos <= m[:, None]
    first = torch.bincount(emitted[:, 0], minlength=V)
    _check(first, p[0], tv_limit=0.01)
    for j in range(1, K + 1):
        sel = reached[:, j]
        if sel.sum() >= 2000:
            _check(torch.bincount(emitted[sel, j], minlength=V), p[j], tv_limit=None)
    if name == "disjoint":
        assert (m == 0).all()
    if name == "equal":
        assert (m == num).all()


def test_acceptance_rate_matches_theory():
    """Per-token acceptance probability is sum_x min(p(x), q(x)) (Leviathan et al., Definition 3.1)."""
    g = torch.Generator().manual_seed(3)
    p, q = _dirichlet(g, 2), _dirichlet(g, 1)
    drafts = torch.multinomial(q[0], N, replacement=True, generator=g)[:, None]
    res = speculative_verify(
        p[None].expand(N, 2, V), drafts, torch.ones(N, dtype=torch.long), q[None].expand(N, 1, V), generator=g
    )
    alpha = torch.minimum(p[0], q[0]).sum().item()
    rate = res.num_accepted.double().mean().item()
    assert abs(rate - alpha) < 4 * (alpha * (1 - alpha) / N) ** 0.5 + 1e-3


def test_greedy_rows_accept_on_argmax():
    logits = torch.tensor(
        [
            [[0.1, 3.0, 0.2, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]],
            [[0.1, 3.0, 0.2, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]],
            [[0.1, 3.0, 0.2, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]],
        ]
    )
    drafts = torch.tensor([[1, 0], [1, 2], [2, 0]])
    res = speculative_verify(logits, drafts, torch.tensor([2, 2, 1]), greedy=torch.tensor([True, True, True]))
    assert res.num_accepted.tolist() == [2, 1, 0]
    assert res.next_tokens.tolist() == [3, 0, 1]  # bonus argmax; argmax at the first mismatch
    assert res.emitted(drafts) == [[1, 0, 3], [1, 0], [1]]


def test_sample_from_probs_skips_zero_weights():
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]])
    u = torch.tensor([0.0, 0.2499, 0.25, 0.999999])
    out = sample_from_probs(w.expand(4, 5), u)
    assert out.tolist() == [1, 1, 3, 3]


def test_expected_tokens_and_speedup_formulas():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx(expected_tokens(0.8, 4) / 1.2)


def test_adaptive_length_follows_acceptance_and_cost():
    ctl = AdaptiveDraftLength(max_k=6, draft_cost=0.2, prior=0.6, probe_every=4)
    for _ in range(30):
        ctl.update(1, 6, 6)  # always accepted
        ctl.update(2, 3, 0)  # always rejected
    assert ctl.choose(1, batch=1) == 6
    choices = [ctl.choose(2, batch=1) for _ in range(8)]
    assert choices == [0, 0, 0, 1, 0, 0, 0, 1]  # off, with a one-token probe every 4 steps
    # a compute-bound target (cost proportional to tokens): extra verified tokens cost as much as a decode
    busy = AdaptiveDraftLength(max_k=6, draft_cost=0.0)
    for n in (32, 64, 96, 128) * 3:
        busy.observe_target(n, 1e-3 * n)
    assert busy.token_cost(32) == pytest.approx(1.0, rel=1e-6)
    for _ in range(30):
        busy.update(7, 6, 4)
    assert busy.choose(7, batch=32) == 0  # alpha ~0.8 does not pay when every token costs a full step
    bound = AdaptiveDraftLength(max_k=6, draft_cost=0.0)
    for n in (32, 64, 96, 128) * 3:
        bound.observe_target(n, 1e-3)  # bandwidth-bound: flat cost
    for _ in range(30):
        bound.update(7, 6, 4)
    assert bound.choose(7, batch=32) == 6
    fixed = AdaptiveDraftLength(max_k=3, adaptive=False)
    assert fixed.choose(9, batch=64) == 3


def test_cost_model_skips_one_time_costs():
    """A first pass of a size that autotunes or captures (thousands of steady steps) does not enter the cost
    model; a lasting change does, after SPIKE_REPEATS samples in a row."""
    from lightning_llmopt.inference.speculative import SPIKE_REPEATS

    ctl = AdaptiveDraftLength(max_k=4)
    ctl.observe_target(32, 6.4)  # first pass of 32 tokens: autotuning
    for _ in range(5):
        ctl.observe_target(32, 1.5e-3)
    assert ctl.step_cost(32) == pytest.approx(1.5e-3)
    ctl.observe_draft(32, 32, 5.0)  # first draft step: capture
    for _ in range(3):
        ctl.observe_draft(32, 32, 3e-4)
    assert ctl.token_cost(32) == pytest.approx(3e-4 / 1.5e-3)  # flat target cost: verification is free
    ctl.observe_target(32, 1.0)  # one stray spike is skipped
    assert ctl.step_cost(32) == pytest.approx(1.5e-3)
    for _ in range(SPIKE_REPEATS):  # a lasting change is taken
        ctl.observe_target(32, 3e-2)
    assert ctl.step_cost(32) > 1e-2


def test_batched_draft_distributions_match_row_by_row() -> None:
    """One scatter for an all-greedy batch, the per-row path otherwise: the same rows as ``draft_distribution``."""
    from lightning_llmopt.inference.drafters import draft_distribution, draft_distributions

    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    greedy = [SamplingParams(temperature=0.0)] * 5
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=4), *greedy[:3]]
    for params in (greedy, mixed):
        want = torch.stack([draft_distribution(r, p) for r, p in zip(logits, params, strict=True)])
        got = draft_distributions(logits, params)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_plan_follows_the_documented_rule_in_both_paths():
    """``plan`` against the rule written out here: each sequence gets the ``k`` maximising the predicted speedup at
    its acceptance rate, ``0`` below ``min_gain`` with a one-token probe every ``probe_every``-th such step, and every
    ``probe_every``-th speculating plan runs plain while no plain throughput was measured; when not even ``alpha = 1``
    would pay, everyone probes together at doubling intervals (``probe_every``, 2x, 4x, ... 16x)."""

    def trained(draft_cost: float) -> AdaptiveDraftLength:
        ctl = AdaptiveDraftLength(max_k=4, draft_cost=draft_cost, probe_every=3)
        for _ in range(20):
            ctl.update(1, 4, 4)
            ctl.update(2, 4, 0)
        return ctl

    ctl = trained(0.05)
    off = {1: 0, 2: 0, 3: 0}
    speculating = 0  # plans that speculate: every probe_every-th runs plain (no plain throughput measured yet)
    for _ in range(7):
        want = []
        for sid in (1, 2, 3):
            gains = {k: predicted_speedup(ctl.alpha(sid), k, 0.05) for k in range(1, 5)}
            k = max(gains, key=gains.get)
            if gains[k] < ctl.min_gain:
                off[sid] += 1
                want.append(1 if off[sid] % 3 == 0 else 0)
            else:
                off[sid] = 0
                want.append(k)
        if any(want):
            speculating += 1
            if speculating % 3 == 0:
                want = [0, 0, 0]
        assert ctl.plan([1, 2, 3], batch=3) == want
    assert want[0] == 4 and want[1] in (0, 1)

    hopeless = trained(50.0)  # every k loses even at alpha = 1
    probes = [step for step in range(1, 200) if hopeless.plan([1, 2, 3], batch=3) == [1, 1, 1]]
    gaps = [b - a for a, b in zip([0, *probes], probes, strict=False)]
    assert gaps[:6] == [3, 6, 12, 24, 48, 48]  # capped at 16 * probe_every
    split = trained(50.0)  # the engine's way: idle() first, plan_active() only for steps that are not idle
    split_probes = [step for step in range(1, 200) if not split.idle(3) and split.plan_active([1, 2, 3], 3) == [1] * 3]
    assert split_probes == probes
    cheap = AdaptiveDraftLength(max_k=4, draft_cost=50.0, probe_every=3)
    cheap.plan([1], batch=1)
    cheap.draft_cost = 0.05  # costs fell: back to per-sequence decisions, backoff reset
    assert cheap.plan([1], batch=1) == [4] and 1 not in cheap._idle_gap


def test_probe_intervals_are_per_batch_size_and_measured_throughput_rules_out():
    """A batch size where speculation pays does not reset another's probe backoff; and where speculating steps were
    measured slower than plain ones at a batch size, speculation is ruled out there (probes only) even though the
    cost model predicts a gain, while other batch sizes still speculate."""
    ctl = AdaptiveDraftLength(max_k=4, draft_cost=50.0, probe_every=2)
    for _ in range(7):
        ctl.plan([1, 2], batch=2)
    gap = ctl._idle_gap[2]
    ctl.draft_cost = 0.05
    ctl.plan([1], batch=1)  # pays at batch 1
    ctl.draft_cost = 50.0
    assert ctl._idle_gap[2] == gap

    fast = AdaptiveDraftLength(max_k=4, draft_cost=0.0, probe_every=4)
    for _ in range(10):
        fast.update(1, 4, 3)
    assert fast.plan([1], batch=32)[0] > 0
    for speculative, tokens, seconds in ((True, 60, 0.2), (False, 32, 0.1)) * 2:  # the first of each is skipped
        fast.observe_outcome(32, speculative, tokens, seconds)  # 300 tokens/s speculating, 320 plain
    assert fast.ruled_out(32, fast.token_cost(32)) and not fast.ruled_out(8, fast.token_cost(8))
    plans = [fast.plan([1], batch=32)[0] for _ in range(8)]
    assert plans.count(0) >= 6 and max(plans) > 1  # idle, and probes that speculate as the plan would
    assert fast.plan([1], batch=8)[0] > 1
    fast.observe_outcome(32, True, 200, 0.2)  # speculation got faster: it comes back
    always = AdaptiveDraftLength(max_k=4, draft_cost=0.0, probe_every=4)  # never idle: plain steps are planned
    plans = [always.plan([1, 2], batch=16) for _ in range(12)]
    assert [i for i, p in enumerate(plans) if p == [0, 0]] == [3, 7, 11]  # until a plain step is measured
    for _ in range(2):
        always.observe_outcome(16, False, 16, 0.01)
    plans = [always.plan([1, 2], batch=16) for _ in range(64)]
    assert [i for i, p in enumerate(plans) if p == [0, 0]] == [63]  # then every 16 * probe_every
    fast.observe_outcome(32, True, 200, 0.2)
    assert not fast.ruled_out(32, fast.token_cost(32))
