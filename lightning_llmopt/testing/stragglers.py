"""Slow ranks on demand: a Lightning callback that sleeps a random time before each training batch on chosen ranks.

Used to test asynchronous data parallelism (``AsyncDataParallelStrategy``) under stragglers; the delays are drawn
from a generator seeded with ``(seed, rank, step)``, so a run's delays are reproducible whatever the timing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import lightning as L

__all__ = ["Straggler", "straggler_delay"]


def straggler_delay(seed: int, rank: int, step: int, max_seconds: float) -> float:
    """The delay of ``rank`` before step ``step``: uniform in ``[0, max_seconds)``, reproducible."""
    return random.Random(f"{seed}/{rank}/{step}").random() * max_seconds


class Straggler(L.Callback):
    """Sleep before every training batch on ``ranks``.

    Arguments:
        ranks: global ranks that straggle.
        max_seconds: upper bound of the uniform random delay per batch.
        seed: seed of the delays.
    """

    def __init__(self, ranks: Sequence[int], max_seconds: float, seed: int = 0) -> None:
        if max_seconds < 0:
            raise ValueError(f"max_seconds ({max_seconds}) must be >= 0")
        self.ranks, self.max_seconds, self.seed = set(ranks), max_seconds, seed
        self.slept = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank in self.ranks:
            delay = straggler_delay(self.seed, trainer.global_rank, trainer.global_step, self.max_seconds)
            time.sleep(delay)
            self.slept += delay
