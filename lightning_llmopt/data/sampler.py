"""A seeded, sharded, resumable sampler and the DataLoader that counts what it hands out.

Exact mid-epoch resume needs the position of the *consumer* (the training loop), not of the sampler: DataLoader
workers pull indices ahead of time (``prefetch_factor``), so a sampler-side counter runs ahead. The position is
therefore counted in :class:`ResumableDataLoader`, one batch per item it yields, and saved through the
``state_dict``/``load_state_dict`` pair that Lightning collects from stateful dataloaders into the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class ResumableShardedSampler(DistributedSampler):
    """Shuffles ``range(len(dataset))`` with a permutation seeded by ``seed + epoch`` and shards it over ranks.

    Every rank computes the same permutation and takes the interleaved slice ``perm[rank::num_replicas]``; the tail
    that does not divide evenly is dropped so all ranks see the same number of samples. It subclasses
    ``DistributedSampler`` so Lightning leaves it in place instead of wrapping it with its own distributed sampler.

    A pending resume position (``consumed`` samples, counted over all ranks) set by :meth:`resume_from` makes the next
    iteration over that epoch skip the samples already consumed; it applies once.

    Arguments:
        dataset: anything with ``len``.
        num_replicas: world size.
        rank: this process's global rank.
        seed: shuffling seed; the order depends only on ``(seed, epoch)``.
    """

    def __init__(self, dataset: Sized, num_replicas: int = 1, rank: int = 0, seed: int = 0) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas ({num_replicas}) must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank ({rank}) must be in [0, num_replicas={num_replicas})")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)  # type: ignore[arg-type]
        self.usable = len(dataset) - len(dataset) % num_replicas  # samples per epoch over all ranks
        self._resume: tuple[int, int] | None = None  # (epoch, consumed samples over all ranks)

    def __len__(self) -> int:
        # Always the full epoch: Lightning adds the restored batch count to what it fetches after a resume.
        return self.usable // self.num_replicas

    def permutation(self, epoch: int) -> torch.Tensor:
        """The global order of epoch ``epoch``: shape ``(len(dataset),)``."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator)  # type: ignore[arg-type]

    def resume_from(self, epoch: int, consumed: int) -> None:
        """Makes the next iteration continue epoch ``epoch`` after ``consumed`` samples (over all ranks)."""
        if consumed >= self.usable:  # the saved epoch was finished: start the next one
            epoch, consumed = epoch + 1, 0
        self.epoch = epoch
        self._resume = (epoch, consumed) if consumed > 0 else None

    def start_offset(self) -> int:
        """Samples (over all ranks) the next iteration skips: the pending resume position if it is for this epoch."""
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1]
        return 0

    def __iter__(self) -> Iterator[int]:
        start = self.start_offset()
        self._resume = None
        remaining = self.permutation(self.epoch)[start : self.usable]
        return iter(remaining[self.rank :: self.num_replicas].tolist())


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableShardedSampler` whose ``state_dict`` records the epoch and how many
    samples (over all ranks) the training loop has taken from it.

    Lightning stores this state in ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`` and calls
    :meth:`load_state_dict` before creating the iterator when resuming. The loader must use ``drop_last=True`` so
    that every batch holds exactly ``batch_size`` samples per rank.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableShardedSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableShardedSampler, got {type(self.sampler).__name__}")
        if not self.drop_last or self.batch_size is None:
            raise ValueError("ResumableDataLoader needs batch_size set and drop_last=True")
        self._epoch = 0
        self._consumed = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: the body (and so the sampler's epoch and offset) is read at the first `next`, after
        # Lightning's `set_epoch`.
        sampler = self.sampler
        assert isinstance(sampler, ResumableShardedSampler) and self.batch_size is not None
        self._epoch = sampler.epoch
        self._consumed = sampler.start_offset()
        step = self.batch_size * sampler.num_replicas
        for batch in super().__iter__():
            self._consumed += step
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "consumed", "world_size", "batch_size"}``: ``consumed`` counts samples over all ranks."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableShardedSampler) and self.batch_size is not None
        return {
            "epoch": self._epoch,
            "consumed": self._consumed,
            "world_size": sampler.num_replicas,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Positions the sampler so the next iteration continues where the saved run stopped."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableShardedSampler)
        sampler.resume_from(int(state_dict["epoch"]), int(state_dict["consumed"]))
        self._epoch = sampler.epoch
        self._consumed = sampler.start_offset()
