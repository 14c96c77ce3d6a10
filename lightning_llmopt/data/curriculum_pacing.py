"""Pacing functions (competence schedules) and the sequence-length warm-up schedule.

A pacing function maps the optimizer step ``t`` to a competence ``c(t)`` in ``(0, 1]``: the fraction of the training
set, easiest first, that may be drawn at step ``t``.

* Bengio et al. 2009, "Curriculum learning" (ICML): train on easy examples first and widen the set in stages
  (:func:`staged`, the "baby steps" schedule).
* Platanios et al. 2019, "Competence-based curriculum learning for neural machine translation" (NAACL): a continuous
  competence ``c(t)`` starting at ``c0`` and reaching 1 at ``T`` steps; linear (:func:`linear`) or the root-``p``
  schedule (:func:`root`) that grows fast early, so each new sample gets about the same number of updates.
* Li et al. 2022, "The stability-efficiency dilemma: investigating sequence length warmup for training GPT models"
  (NeurIPS): train on truncated sequences whose length grows linearly to the full context (:func:`seq_len_schedule`).

Every schedule is a small frozen dataclass: callable on a step, comparable, and described by :meth:`params` (saved in
checkpoints so that a resumed run can tell when its schedule changed). Framework-free: no Lightning imports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Pacing(Protocol):
    """Anything callable as ``pacing(step) -> competence in (0, 1]``; non-decreasing in ``step`` by convention."""

    def __call__(self, step: int) -> float: ...


def _check_c0(c0: float) -> None:
    if not 0.0 < c0 <= 1.0:
        raise ValueError(f"c0 ({c0!r}) must be in (0, 1]")


def _check_total(total_steps: int) -> None:
    if not isinstance(total_steps, int) or total_steps <= 0:
        raise ValueError(f"total_steps ({total_steps!r}) must be a positive integer")


@dataclass(frozen=True)
class LinearPacing:
    """``c(t) = min(1, c0 + (1 - c0) * t / T)`` (Platanios et al. 2019, eq. 3)."""

    c0: float
    total_steps: int

    def __post_init__(self) -> None:
        _check_c0(self.c0)
        _check_total(self.total_steps)

    def __call__(self, step: int) -> float:
        return min(1.0, self.c0 + (1.0 - self.c0) * max(step, 0) / self.total_steps)

    def params(self) -> dict[str, Any]:
        return {"kind": "linear", **asdict(self)}


@dataclass(frozen=True)
class RootPacing:
    """``c(t) = min(1, (c0^p + (1 - c0^p) * t / T)^(1/p))`` (Platanios et al. 2019, eq. 6; ``p = 2``: "sqrt")."""

    c0: float
    total_steps: int
    p: float = 2.0

    def __post_init__(self) -> None:
        _check_c0(self.c0)
        _check_total(self.total_steps)
        if not self.p > 0:
            raise ValueError(f"p ({self.p!r}) must be positive")

    def __call__(self, step: int) -> float:
        c0p = self.c0**self.p
        return min(1.0, (c0p + (1.0 - c0p) * max(step, 0) / self.total_steps) ** (1.0 / self.p))

    def params(self) -> dict[str, Any]:
        return {"kind": "root", **asdict(self)}


@dataclass(frozen=True)
class StagedPacing:
    """Piecewise-constant competence: ``c(t)`` is the fraction of the last stage whose start step is ``<= t``.

    ``stages`` is a sequence of ``(start_step, fraction)`` with strictly increasing start steps, the first at step 0,
    and non-decreasing fractions in ``(0, 1]`` (Bengio et al. 2009).
    """

    stages: tuple[tuple[int, float], ...] = field(default=((0, 1.0),))

    def __post_init__(self) -> None:
        stages = tuple((int(s), float(f)) for s, f in self.stages)
        object.__setattr__(self, "stages", stages)
        if not stages or stages[0][0] != 0:
            raise ValueError(f"stages ({list(self.stages)!r}) must be non-empty and start at step 0")
        for (s0, f0), (s1, f1) in zip(stages, stages[1:], strict=False):
            if s1 <= s0:
                raise ValueError(f"stage steps must increase strictly, got {s0} then {s1}")
            if f1 < f0:
                raise ValueError(f"stage fractions must not decrease, got {f0} then {f1}")
        for _, f in stages:
            if not 0.0 < f <= 1.0:
                raise ValueError(f"stage fraction ({f!r}) must be in (0, 1]")

    def __call__(self, step: int) -> float:
        fraction = self.stages[0][1]
        for start, value in self.stages:
            if step < start:
                break
            fraction = value
        return fraction

    def params(self) -> dict[str, Any]:
        return {"kind": "staged", "stages": [list(s) for s in self.stages]}


def linear(c0: float = 0.1, total_steps: int = 1000) -> LinearPacing:
    """Linear competence from ``c0`` at step 0 to 1 at ``total_steps``."""
    return LinearPacing(c0=c0, total_steps=total_steps)


def root(c0: float = 0.1, total_steps: int = 1000, p: float = 2.0) -> RootPacing:
    """Root-``p`` competence from ``c0`` at step 0 to 1 at ``total_steps`` (grows fastest at the start)."""
    return RootPacing(c0=c0, total_steps=total_steps, p=p)


def staged(stages: Sequence[tuple[int, float]]) -> StagedPacing:
    """Staged competence, e.g. ``staged([(0, 0.25), (100, 0.5), (200, 1.0)])``."""
    return StagedPacing(stages=tuple((int(s), float(f)) for s, f in stages))


def pacing_params(pacing: Pacing) -> dict[str, Any]:
    """A JSON-friendly description of ``pacing``: its ``params()`` when it has them, else its qualified name."""
    params = getattr(pacing, "params", None)
    if callable(params):
        return dict(params())
    name = getattr(pacing, "__qualname__", type(pacing).__qualname__)
    return {"kind": "callable", "name": f"{getattr(pacing, '__module__', '?')}.{name}"}


@dataclass(frozen=True)
class SeqLenSchedule:
    """Sequence length at step ``t`` (Li et al. 2022): linear from ``start`` to ``end`` over ``warmup_steps``.

    ``L(t) = end`` for ``t >= warmup_steps``; before that ``L(t) = floor(v / m) * m`` with
    ``v = start + (end - start) * t / warmup_steps`` and ``m = multiple_of``, raised to at least ``min(m, end)`` and
    capped at ``end``. Rounding down to a multiple of 8 keeps matmul shapes friendly to tensor cores, as in the paper.
    """

    start: int
    end: int
    warmup_steps: int
    multiple_of: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or self.start <= 0:
            raise ValueError(f"start ({self.start!r}) must be a positive integer")
        if not isinstance(self.end, int) or self.end < self.start:
            raise ValueError(f"end ({self.end!r}) must be an integer >= start ({self.start})")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps!r}) must be a non-negative integer")
        if not isinstance(self.multiple_of, int) or self.multiple_of <= 0:
            raise ValueError(f"multiple_of ({self.multiple_of!r}) must be a positive integer")

    def __call__(self, step: int) -> int:
        if step >= self.warmup_steps:
            return self.end
        value = self.start + (self.end - self.start) * max(step, 0) / self.warmup_steps
        rounded = math.floor(value / self.multiple_of) * self.multiple_of
        return min(self.end, max(rounded, min(self.multiple_of, self.end)))

    def params(self) -> dict[str, Any]:
        return asdict(self)


def seq_len_schedule(start: int, end: int, warmup_steps: int, multiple_of: int = 8) -> SeqLenSchedule:
    """The sequence-length warm-up of Li et al. 2022; call the result with a step to get the length."""
    return SeqLenSchedule(start=start, end=end, warmup_steps=warmup_steps, multiple_of=multiple_of)
