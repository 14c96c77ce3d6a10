"""Mixture allocations against brute force and hand-computed cases."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_llmopt.data.mixture import fixed_mixture, lp_mixture, take_tokens


def test_fixed_weights_and_water_filling() -> None:
    assert fixed_mixture({"a": 1000, "b": 1000}, {"a": 3, "b": 1}, 400) == {"a": 300, "b": 100}
    # "a" holds only 100 tokens: it gives all of them, the rest goes to "b" and "c" in proportion 1:1.
    got = fixed_mixture({"a": 100, "b": 1000, "c": 1000}, {"a": 2, "b": 1, "c": 1}, 500)
    assert got == {"a": 100, "b": 200, "c": 200}
    assert sum(fixed_mixture({"a": 7, "b": 9}, {"a": 1, "b": 1}, 13).values()) == 13
    with pytest.raises(ValueError, match="exceeds what the sources hold"):
        fixed_mixture({"a": 10}, {"a": 1}, 11)


def test_lp_matches_brute_force_over_a_grid() -> None:
    rng = random.Random(0)
    for _ in range(30):
        names = ["a", "b", "c"]
        available = {k: rng.randint(50, 400) for k in names}
        utility = {k: rng.uniform(0, 1) for k in names}
        min_share = {k: rng.choice([0.0, 0.1]) for k in names}
        max_share = {k: rng.choice([1.0, 0.6]) for k in names}
        budget = rng.randint(100, 400)
        try:
            got = lp_mixture(available, utility, budget, min_share, max_share)
        except ValueError:
            continue
        best = -1.0
        for xa, xb in itertools.product(range(0, budget + 1, 1), repeat=2):  # exhaustive over integer points
            xc = budget - xa - xb
            x = {"a": xa, "b": xb, "c": xc}
            if xc < 0 or any(x[k] < min_share[k] * budget - 1e-9 for k in names):
                continue
            if any(x[k] > min(max_share[k] * budget, available[k]) + 1e-9 for k in names):
                continue
            best = max(best, sum(utility[k] * x[k] for k in names))
        value = sum(utility[k] * got[k] for k in names)
        assert sum(got.values()) == budget
        assert value >= best - max(utility.values()) - 1e-9  # optimal up to integer rounding of one token


def test_lp_errors_and_take_tokens() -> None:
    with pytest.raises(ValueError, match="lower bounds"):
        lp_mixture({"a": 100, "b": 100}, {"a": 1, "b": 2}, 100, min_share={"a": 0.7, "b": 0.5})
    with pytest.raises(ValueError, match="exceeds the sources' upper bounds"):
        lp_mixture({"a": 10, "b": 10}, {"a": 1, "b": 2}, 100)
    docs = {"a": ["aaaa"] * 10, "b": ["bb"] * 10}
    out = list(take_tokens(docs, {"a": 8, "b": 4}, len))
    assert [s for s, _ in out] == ["a", "b", "a", "b"]
