"""``CurriculumSampler``: a resumable, sharded train order that follows a competence schedule.

Algorithm (Platanios et al. 2019, "Competence-based curriculum learning", Algorithm 1, made exactly resumable):

1. Sort the samples by difficulty, easiest first (ties broken by dataset index): ``order``.
2. The global order of epoch ``e`` is a tensor of ``N = len(dataset)`` positions. Position ``g`` belongs to the
   optimizer step ``t = e * steps_per_epoch + g // global_batch_size``.
3. For each step ``t`` with ``k(t) = floor(c(t) * (N - 1)) + 1 < N`` (the samples whose rank
   ``index_in_order / (N - 1)`` is at most ``c(t)``), the step's positions are filled with a uniform draw of the
   easiest ``k(t)`` samples, without replacement within the step (with replacement when ``k(t)`` is smaller than the
   step), from a generator seeded by ``(seed, epoch)`` and consumed in step order.
4. Steps with full competence (``k(t) = N``) keep the positions of the plain
   :class:`~lightning_llmopt.data.sampler.ResumableShardedSampler` permutation of that epoch: once the curriculum
   is over, the order is exactly the one training without a curriculum would see.

The order is therefore a pure function of ``(seed, epoch, difficulty, pacing, global_batch_size,
steps_per_epoch)``: every rank computes the same one and takes its interleaved slice, and the
:class:`~lightning_llmopt.data.sampler.ResumableDataLoader` skips the consumed prefix on a mid-epoch resume.
Framework-free: no Lightning imports.
"""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass

import torch

from lightning_llmopt.data.curriculum_pacing import Pacing
from lightning_llmopt.data.sampler import ResumableShardedSampler

_EPOCH_STRIDE = 1_000_003  # a prime, so (seed, epoch) pairs give distinct generator seeds for small epochs


class CurriculumSampler(ResumableShardedSampler):
    """A :class:`ResumableShardedSampler` whose order draws step ``t``'s samples from the easiest ``c(t)`` fraction.

    Arguments:
        dataset: anything with ``len``.
        difficulty: float tensor of shape ``(len(dataset),)``; lower is easier (e.g. the ranks of
            :func:`~lightning_llmopt.data.curriculum.score_dataset`).
        pacing: ``pacing(step) -> competence in (0, 1]``.
        global_batch_size: samples consumed per optimizer step over all ranks (``batch_size * num_replicas *
            accumulate_grad_batches``); a multiple of ``num_replicas``.
        steps_per_epoch: optimizer steps per epoch; ``None``: ``usable // global_batch_size`` (at least 1).
        num_replicas: world size.
        rank: this process's global rank.
        seed: seeds both the draws and the full-competence permutation.
    """

    def __init__(
        self,
        dataset: Sized,
        difficulty: torch.Tensor,
        pacing: Pacing,
        global_batch_size: int,
        steps_per_epoch: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed)
        n = len(dataset)
        if difficulty.shape != (n,):
            raise ValueError(f"difficulty has shape {tuple(difficulty.shape)}, expected ({n},) = (len(dataset),)")
        if not bool(torch.isfinite(difficulty.double()).all()):
            raise ValueError("difficulty holds NaN or infinite values")
        if global_batch_size <= 0 or global_batch_size % num_replicas != 0:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of num_replicas ({num_replicas})"
            )
        if steps_per_epoch is None:
            steps_per_epoch = max(1, self.usable // global_batch_size)
        if steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch ({steps_per_epoch}) must be positive")
        self.difficulty = difficulty.detach().cpu()
        self.order = torch.sort(self.difficulty.double(), stable=True).indices  # (N,) easiest first
        self.pacing = pacing
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = steps_per_epoch
        self._cache: tuple[int, torch.Tensor] | None = None

    def pool_size(self, competence: float) -> int:
        """Number of easiest samples available at ``competence``: those of rank ``i / (N - 1) <= competence``."""
        if not 0.0 < competence <= 1.0:
            raise ValueError(f"pacing returned competence {competence!r}, outside (0, 1]")
        n = len(self.order)
        return min(n, math.floor(competence * (n - 1)) + 1)

    def step_of(self, epoch: int, position: int) -> int:
        """The optimizer step at which global position ``position`` of epoch ``epoch`` is trained on."""
        return epoch * self.steps_per_epoch + position // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The global order of epoch ``epoch``: shape ``(len(dataset),)``, int64 dataset indices (may repeat)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n = len(self.order)
        out = super().permutation(epoch).clone()  # (N,) used as is where competence is full
        generator = torch.Generator().manual_seed(self.seed * _EPOCH_STRIDE + epoch)
        gbs = self.global_batch_size
        for s in range(math.ceil(n / gbs)):
            k = self.pool_size(float(self.pacing(self.step_of(epoch, s * gbs))))
            if k >= n:
                continue
            lo, hi = s * gbs, min(n, (s + 1) * gbs)
            if k >= hi - lo:
                picks = torch.randperm(k, generator=generator)[: hi - lo]
            else:
                picks = torch.randint(0, k, (hi - lo,), generator=generator)
            out[lo:hi] = self.order[picks]
        self._cache = (epoch, out)
        return out


@dataclass(frozen=True)
class CurriculumSamplerFactory:
    """Binds the curriculum to the ``sampler_factory`` hook of
    :class:`~lightning_llmopt.data.datamodule.TextDataModule`: called like ``ResumableShardedSampler(dataset,
    num_replicas=..., rank=..., seed=...)``, it derives the global batch and the optimizer steps per epoch the way
    Lightning counts them (``drop_last`` batches per rank, then ``ceil(batches / accumulate_grad_batches)``).

    Picklable (a dataclass, not a closure), so it survives ``ddp_spawn``.

    Arguments:
        difficulty: ``(len(dataset),)`` float tensor, lower is easier.
        pacing: ``pacing(step) -> competence``.
        batch_size: samples per batch per rank.
        accumulate_grad_batches: batches per optimizer step.
    """

    difficulty: torch.Tensor
    pacing: Pacing
    batch_size: int
    accumulate_grad_batches: int = 1

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size ({self.batch_size}) must be positive")
        if self.accumulate_grad_batches <= 0:
            raise ValueError(f"accumulate_grad_batches ({self.accumulate_grad_batches}) must be positive")

    def batches_per_epoch(self, num_samples: int, num_replicas: int) -> int:
        """Full batches per rank per epoch (the loader drops the last incomplete one)."""
        return ((num_samples - num_samples % num_replicas) // num_replicas) // self.batch_size

    def __call__(self, dataset: Sized, num_replicas: int = 1, rank: int = 0, seed: int = 0) -> CurriculumSampler:
        batches = self.batches_per_epoch(len(dataset), num_replicas)
        return CurriculumSampler(
            dataset,
            self.difficulty,
            self.pacing,
            global_batch_size=self.batch_size * num_replicas * self.accumulate_grad_batches,
            steps_per_epoch=max(1, math.ceil(batches / self.accumulate_grad_batches)),
            num_replicas=num_replicas,
            rank=rank,
            seed=seed,
        )
