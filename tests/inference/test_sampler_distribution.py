"""The batched device sampler against a float64 reference written from the definitions, option by option.

Each case draws 100,000 tokens in one batched call (identical rows, one generator) and compares the counts with the
reference distribution by a chi-square test (p > 0.01); tokens the reference gives probability 0 must never be
drawn. The reference is plain NumPy over one row, sorting and thresholding as each option is defined (OpenAI for
the presence/frequency penalties, Keskar et al. 2019 for the repetition penalty, Holtzman et al. 2019 for top-p).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lightning_llmopt.inference.sampling import SamplingParams, sample_batch

DRAWS = 100_000
V = 12
PROMPT, OUTPUT = [1, 2, 2, 7], [3, 3, 5, 1]  # a history for the penalties: token 3 twice, 5 and 1 once in the output


def _logits() -> np.ndarray:
    return np.random.default_rng(0).normal(0.0, 1.5, V)


def reference(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """float64 probabilities of one row under ``p`` (temperature > 0), from the definitions."""
    x = x.astype(np.float64).copy()
    if p.repetition_penalty != 1:
        for t in set(PROMPT + OUTPUT):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(OUTPUT):
        x[t] -= p.frequency_penalty * OUTPUT.count(t) + p.presence_penalty
    x /= p.temperature
    keep = np.ones(V, bool)
    if p.top_k:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        mass = 0.0
        for t in order:  # keep tokens until the kept mass reaches top_p
            if mass >= p.top_p:
                keep[t] = False
            mass += probs[t]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "hot": SamplingParams(temperature=1.8),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.15),
    "presence": SamplingParams(temperature=1.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=1.0, frequency_penalty=0.8),
    "repetition": SamplingParams(temperature=1.0, repetition_penalty=1.7),
    "everything": SamplingParams(
        temperature=0.9,
        top_k=8,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CASES))
def test_empirical_distribution_matches_the_reference(name):
    p = CASES[name]
    x = _logits()
    expected = reference(x, p)
    logits = torch.tensor(x, dtype=torch.float32).repeat(DRAWS, 1)
    g = torch.Generator().manual_seed(1)
    histories = [(PROMPT + OUTPUT, len(PROMPT))] * DRAWS if p.penalised else None
    out = sample_batch(logits, [p] * DRAWS, [g] * DRAWS, histories)
    counts = np.bincount(np.array(out.tokens), minlength=V)
    assert counts[expected == 0].sum() == 0, f"drew tokens outside the kept set: {counts} vs {expected}"
    support = expected > 0
    assert support.sum() >= 2, "a case must keep several tokens to test anything"
    stat = chisquare(counts[support], expected[support] * DRAWS)
    assert stat.pvalue > 0.01, f"{name}: counts {counts.tolist()} vs expected {np.round(expected * DRAWS).tolist()}"


def test_penalties_under_greedy_and_mixed_batches():
    """A greedy row takes the argmax of the penalised logits; greedy rows without options are unchanged by the
    sampled rows beside them, and a seeded row draws the same tokens alone as in any batch."""
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    logits[1, 7], logits[1, 9] = 10.0, 9.0  # token 7 leads by 1; it was generated once: penalties 2 + 2 drop it by 4
    hist = [([1, 2, 3, 7], 3)] * 4
    greedy = SamplingParams()
    pen = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    hot = SamplingParams(temperature=1.0)
    out = sample_batch(logits, [greedy, pen, hot, greedy], [None, None, torch.Generator(), None], hist)
    assert out.tokens[1] == 9
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[3] == int(logits[3].argmax())

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    others = [greedy, SamplingParams(temperature=2.0), SamplingParams(top_k=3, temperature=1.0), pen]

    def draws(batch: list[SamplingParams]) -> list[int]:
        g = torch.Generator().manual_seed(11)  # the seeded row's own generator
        shared = torch.Generator().manual_seed(99)  # the engine's, for unseeded rows
        gens = [g] + [None if q.greedy else shared for q in batch]
        rows = logits[[2] + [i % 4 for i in range(len(batch))]]
        return [sample_batch(rows, [seeded, *batch], gens, [hist[0]] * (1 + len(batch))).tokens[0] for _ in range(30)]

    alone = draws([])
    assert alone == draws(others) == draws(others[::-1] + others)
    assert len(set(alone)) > 1  # the seeded row really samples


def test_logprobs_are_the_models_log_softmax():
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=1.0, logprobs=0), SamplingParams()]
    out = sample_batch(logits, params, [None, torch.Generator().manual_seed(0), None])
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp is not None and lp.token == out.tokens[i]
        assert abs(lp.logprob - float(ref[i, lp.token])) < 1e-5  # fp32 log_softmax of O(1) logits
        top = ref[i].topk(params[i].logprobs or 1)
        assert [t for t, _ in lp.top] == top.indices.tolist()[: params[i].logprobs]
    assert out.logprobs[2] is None
