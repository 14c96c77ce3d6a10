"""Data mixtures across sources: how many tokens to take from each under a token budget.

- :func:`fixed_mixture`: tokens proportional to given weights; a source that has fewer tokens than its share
  (times ``max_epochs``) gives what it has and the rest is spread over the others in proportion (water-filling).
- :func:`lp_mixture`: the linear program

      maximise   sum_i u_i x_i
      subject to sum_i x_i = B,   l_i <= x_i <= h_i,
                 l_i = min_share_i * B,   h_i = min(max_share_i * B, max_epochs * available_i)

  where ``u_i`` is the utility of one token of source ``i`` (e.g. a quality score, or the validation-loss gain per
  token measured on a small proxy run). With one equality and box constraints the optimum is reached by starting
  every source at its lower bound and filling the remaining budget in decreasing order of utility up to the upper
  bounds (the LP's basic solution; ties keep the given order). Infeasible constraints raise ``ValueError`` naming
  the values.
- :func:`take_tokens`: draws documents from each source's stream until its allocation is met.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = ["fixed_mixture", "lp_mixture", "take_tokens"]

T = TypeVar("T")


def _check(available: dict[str, int], budget: int) -> None:
    if budget <= 0:
        raise ValueError(f"budget ({budget}) must be positive")
    if not available:
        raise ValueError("at least one source is needed")
    for name, n in available.items():
        if n < 0:
            raise ValueError(f"available[{name!r}] ({n}) must be >= 0")


def fixed_mixture(available: dict[str, int], weights: dict[str, float], budget: int,
                  max_epochs: float = 1.0) -> dict[str, int]:
    """Tokens per source proportional to ``weights`` (see the module docstring); sums to ``budget``."""
    _check(available, budget)
    if set(weights) != set(available):
        raise ValueError(f"weights name {sorted(weights)}, sources are {sorted(available)}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"weights ({weights}) must be >= 0 with a positive sum")
    caps = {k: max_epochs * available[k] for k in available}
    if sum(caps.values()) < budget:
        raise ValueError(f"budget ({budget}) exceeds what the sources hold x max_epochs ({sum(caps.values()):.0f})")
    alloc: dict[str, float] = {}
    open_ = {k for k in available if weights[k] > 0}
    remaining = float(budget)
    while open_:
        total_w = sum(weights[k] for k in open_)
        share = {k: remaining * weights[k] / total_w for k in open_}
        capped = {k for k in open_ if share[k] >= caps[k]}
        if not capped:
            alloc.update(share)
            break
        for k in capped:
            alloc[k] = caps[k]
            remaining -= caps[k]
        open_ -= capped
    if remaining > 1e-9 and not open_ and abs(sum(alloc.values()) - budget) > 1e-6:
        raise ValueError(f"budget ({budget}) cannot be met by the sources with positive weight ({sorted(alloc)})")
    return _round(alloc, budget)


def lp_mixture(available: dict[str, int], utility: dict[str, float], budget: int,
               min_share: dict[str, float] | None = None, max_share: dict[str, float] | None = None,
               max_epochs: float = 1.0) -> dict[str, int]:
    """Solve the mixture LP of the module docstring; returns integer tokens per source summing to ``budget``."""
    _check(available, budget)
    if set(utility) != set(available):
        raise ValueError(f"utility names {sorted(utility)}, sources are {sorted(available)}")
    lo = {k: (min_share or {}).get(k, 0.0) * budget for k in available}
    hi = {k: min((max_share or {}).get(k, 1.0) * budget, max_epochs * available[k]) for k in available}
    for k in available:
        if lo[k] > hi[k] + 1e-9:
            raise ValueError(f"source {k!r}: min_share x budget ({lo[k]:.0f}) exceeds its upper bound ({hi[k]:.0f})")
    if sum(lo.values()) > budget + 1e-9:
        raise ValueError(f"the min_share lower bounds ({sum(lo.values()):.0f} tokens) exceed the budget ({budget})")
    if sum(hi.values()) < budget - 1e-9:
        raise ValueError(f"budget ({budget}) exceeds the sources' upper bounds ({sum(hi.values()):.0f} tokens)")
    x = dict(lo)
    left = budget - sum(lo.values())
    for k in sorted(available, key=lambda k: -utility[k]):  # stable: ties keep the given order
        add = min(hi[k] - x[k], left)
        x[k] += add
        left -= add
    return _round(x, budget)


def _round(alloc: dict[str, float], budget: int) -> dict[str, int]:
    """Integers summing to ``budget`` (largest remainders get the leftover tokens)."""
    out = {k: int(v) for k, v in alloc.items()}
    short = budget - sum(out.values())
    for k in sorted(alloc, key=lambda k: alloc[k] - int(alloc[k]), reverse=True)[: max(short, 0)]:
        out[k] += 1
    return out


def take_tokens(sources: dict[str, Iterable[T]], tokens: dict[str, int], count: Callable[[T], int]
                ) -> Iterator[tuple[str, T]]:
    """``(source, document)`` pairs: each source's documents in order until its token allocation is reached (the
    last document may overshoot by less than one document). ``count`` gives a document's tokens. Sources are
    interleaved round-robin so a prefix of the stream is already mixed."""
    iters = {k: iter(v) for k, v in sources.items() if tokens.get(k, 0) > 0}
    taken = dict.fromkeys(iters, 0)
    while iters:
        for name in list(iters):
            if taken[name] >= tokens[name]:
                del iters[name]
                continue
            try:
                doc = next(iters[name])
            except StopIteration:
                del iters[name]
                continue
            taken[name] += count(doc)
            yield name, doc
