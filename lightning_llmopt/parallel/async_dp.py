"""Data parallelism that does not synchronise every step: local SGD / DiLoCo and bounded staleness (SSP).

Framework-free: both classes work on a list of replicated parameters (plain tensors) and a process group, and are
driven by two calls around each inner optimizer step. :class:`~lightning_llmopt.strategies.AsyncDataParallelStrategy`
is the Lightning adapter; docs/async_data_parallel.md states the semantics.

- :class:`LocalSGD` (Stich 2019, "Local SGD converges fast and communicates little"; DiLoCo, Douillard et al.
  2023, arXiv 2311.08455). Every rank runs its own inner optimizer on its own data; after every ``sync_every`` inner
  steps the parameters are averaged over the group (one all-reduce). With an outer optimizer the average is not
  taken as is: the outer pseudo-gradient ``anchor - mean_r(theta_r)`` is fed to SGD with Nesterov momentum, whose
  step from the anchor (the parameters after the previous synchronisation) gives the new parameters of every rank.
- :class:`StaleSync` (stale synchronous parallel, Ho et al. 2013, with the update rule below). Each rank applies its
  own update at once and pushes it with a non-blocking all-reduce; before step ``t`` it waits for the sums of steps
  ``<= t - s - 1`` and replaces its own contribution of those steps by the mean. A rank may therefore be at most
  ``s`` steps ahead of the slowest one, and what it reads at step ``t`` is exactly

      x_r(t) = x(0) + sum_{tau < t-s} mean_q u_q(tau) + sum_{t-s <= tau < t} u_r(tau)

  (``u_q(tau)``: rank ``q``'s parameter change from its optimizer step ``tau``). The values do not depend on timing
  (only when a rank waits does), so a run can be reproduced by a single-process simulation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SYNC_MODES", "AsyncDPConfig", "LocalSGD", "StaleSync", "flatten", "unflatten_into"]

SYNC_MODES = ("bsp", "local_sgd", "ssp")
OUTER_OPTIMIZERS = ("none", "nesterov")


@dataclass
class AsyncDPConfig:
    """How data-parallel replicas synchronise.

    Arguments:
        mode: ``"bsp"`` (gradients averaged every step), ``"local_sgd"`` (parameters averaged every ``sync_every``
            steps) or ``"ssp"`` (updates pushed asynchronously, at most ``staleness`` steps behind).
        sync_every: ``local_sgd``: inner steps between synchronisations (``H``; ``None``: 1).
        staleness: ``ssp``: steps a rank may run ahead of the slowest (``s``; ``None``: 1).
        outer_optimizer: ``local_sgd``: ``"none"`` (plain averaging) or ``"nesterov"`` (DiLoCo's outer step).
        outer_lr, outer_momentum: the outer Nesterov SGD's rate and momentum (DiLoCo: 0.7 and 0.9).
    """

    mode: str = "bsp"
    sync_every: int | None = None
    staleness: int | None = None
    outer_optimizer: str = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ValueError(f"data_parallel_sync ({self.mode!r}) must be one of {', '.join(map(repr, SYNC_MODES))}")
        if self.sync_every is not None and (isinstance(self.sync_every, bool) or self.sync_every < 1):
            raise ValueError(f"sync_every ({self.sync_every}) must be >= 1")
        if self.staleness is not None and (isinstance(self.staleness, bool) or self.staleness < 0):
            raise ValueError(f"staleness ({self.staleness}) must be >= 0")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer_optimizer ({self.outer_optimizer!r}) must be 'none' or 'nesterov'")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr ({self.outer_lr}) must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum ({self.outer_momentum}) must be in [0, 1)")
        if self.mode != "local_sgd" and (self.sync_every is not None or self.outer_optimizer != "none"):
            raise ValueError(
                f"sync_every ({self.sync_every}) and outer_optimizer ({self.outer_optimizer!r}) need "
                f"data_parallel_sync='local_sgd' (got {self.mode!r})"
            )
        if self.mode != "ssp" and self.staleness is not None:
            raise ValueError(f"staleness ({self.staleness}) needs data_parallel_sync='ssp' (got {self.mode!r})")
        if self.mode == "local_sgd" and self.sync_every is None:
            self.sync_every = 1
        if self.mode == "ssp" and self.staleness is None:
            self.staleness = 1


def flatten(params: list[Tensor]) -> Tensor:
    """One new 1-D tensor holding ``params`` (all of one dtype and device) back to back."""
    dtypes = {(p.dtype, p.device) for p in params}
    if len(dtypes) > 1:
        raise TypeError(f"parameters must share one dtype and device, got {sorted(map(str, dtypes))}")
    return torch.cat([p.detach().reshape(-1) for p in params])


@torch.no_grad()
def unflatten_into(flat: Tensor, params: list[Tensor]) -> None:
    """Copy the 1-D ``flat`` (as made by :func:`flatten`) into ``params`` in place."""
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def _plain(params: list[Tensor]) -> list[Tensor]:
    from torch.distributed.tensor import DTensor

    bad = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
    if bad:
        raise TypeError(f"asynchronous data parallelism needs replicated plain tensors; parameters {bad} are DTensors")
    if not params:
        raise ValueError("no parameters to synchronise")
    return params


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class LocalSGD:
    """Periodic parameter averaging, optionally followed by an outer Nesterov step (DiLoCo).

    Call :meth:`step` after every inner optimizer step; every ``sync_every``-th call synchronises:

    1. ``avg = mean_r theta_r`` (one all-reduce of the flattened parameters, then a division);
    2. without an outer optimizer: ``theta_r = avg``;
    3. with ``"nesterov"``: ``delta = anchor - avg``; ``m = mu m + delta``; ``anchor = anchor - lr (delta + mu m)``
       (torch's SGD with ``nesterov=True`` on the gradient ``delta``); ``theta_r = anchor``.

    Arguments:
        params: the replicated parameters (equal on every rank when this object is made).
        group: the data-parallel process group (``None``: the default group).
        sync_every: ``H``.
        outer_optimizer, outer_lr, outer_momentum: see :class:`AsyncDPConfig`.

    State (:meth:`state_dict`): ``steps`` (inner steps taken), ``syncs``, and with an outer optimizer the anchor and
    the momentum buffer. The anchor and momentum are equal on every rank; the parameters are not between syncs.
    """

    def __init__(
        self,
        params: list[Tensor],
        group: Any = None,
        sync_every: int = 1,
        outer_optimizer: str = "none",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
    ) -> None:
        AsyncDPConfig("local_sgd", sync_every, None, outer_optimizer, outer_lr, outer_momentum)  # validates
        self.params = _plain(list(params))
        self.group, self.sync_every = group, sync_every
        self.steps = 0
        self.syncs = 0
        self.anchor: Tensor | None = None
        self.outer: torch.optim.SGD | None = None
        if outer_optimizer == "nesterov":
            self.anchor = flatten(self.params).clone().requires_grad_(False)
            self.outer = torch.optim.SGD([self.anchor], lr=outer_lr, momentum=outer_momentum, nesterov=True)

    def step(self) -> bool:
        """Count one inner step; synchronise if it completes a period. Returns whether it synchronised."""
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        self.sync()
        return True

    @property
    def pending(self) -> int:
        """Inner steps since the last synchronisation."""
        return self.steps % self.sync_every

    @torch.no_grad()
    def average(self) -> Tensor:
        """``mean_r theta_r`` as one flat tensor (collective over ``group``)."""
        flat = flatten(self.params)
        world = _world(self.group)
        if world > 1:
            dist.all_reduce(flat, group=self.group)
            flat.div_(world)
        return flat

    @torch.no_grad()
    def sync(self, outer_step: bool = True) -> None:
        """Average now (and, with an outer optimizer and ``outer_step``, take the outer step from the anchor)."""
        avg = self.average()
        if self.outer is not None and self.anchor is not None and outer_step:
            self.anchor.grad = self.anchor - avg  # the outer pseudo-gradient
            self.outer.step()
            self.anchor.grad = None
            avg = self.anchor
        elif self.anchor is not None:  # a plain average (end of training) also moves the anchor
            self.anchor.copy_(avg)
        unflatten_into(avg, self.params)
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"steps": self.steps, "syncs": self.syncs}
        if self.outer is not None and self.anchor is not None:
            state["anchor"] = self.anchor.detach().clone()
            state["outer"] = self.outer.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if ("anchor" in state) != (self.outer is not None):
            raise ValueError(
                "the checkpoint's local SGD state "
                + ("has" if "anchor" in state else "has no")
                + " outer optimizer state, but outer_optimizer is "
                + ("'nesterov'" if self.outer else "'none'")
            )
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        if self.outer is not None and self.anchor is not None:
            self.anchor.copy_(state["anchor"])
            self.outer.load_state_dict(state["outer"])


class StaleSync:
    """Stale synchronous data parallelism with staleness bound ``s`` (module docstring for the rule).

    Around each inner optimizer step call :meth:`before_step` (waits for the sums of steps ``<= t - s - 1`` and
    applies them, then snapshots the parameters) and :meth:`after_step` (the step's change ``u = theta - snapshot``
    is pushed with a non-blocking all-reduce). :meth:`flush` waits for and applies everything in flight (after it
    every rank holds the same parameters).

    With ``trace=True`` each rank writes its clock (steps pushed) to the process group's store before it pushes, and
    at each read records ``(own clock, clock of the slowest rank)`` in :attr:`reads`; a completed all-reduce of step
    ``k`` implies every rank has written a clock ``>= k + 1``, hence ``own - slowest <= s`` at every read.

    The shared part ``x(0) + sum of applied mean changes`` is kept as one flat tensor (:attr:`base`), identical on
    every rank, and the parameters are rebuilt as ``base + own changes in flight`` after each application, so
    replicas do not drift apart through rounding.

    Memory: up to ``s + 1`` steps in flight, each holding this rank's change and the sum being reduced (two
    parameter-sized buffers), plus the snapshot and :attr:`base`.
    """

    def __init__(
        self, params: list[Tensor], group: Any = None, staleness: int = 1, trace: bool = False, store: Any = None
    ) -> None:
        AsyncDPConfig("ssp", staleness=staleness)  # validates
        self.params = _plain(list(params))
        self.group, self.staleness = group, staleness
        self.clock = 0  # steps taken and pushed by this rank
        self.base = flatten(self.params).clone()  # x(0) + the mean changes applied so far (equal on every rank)
        self.pending: deque[tuple[int, Any, Tensor, Tensor]] = deque()  # (step, work or None, sum, own change)
        self._snapshot: Tensor | None = None
        self.trace = trace
        self.reads: list[tuple[int, int]] = []
        self._store = store
        if trace and store is None:
            from torch.distributed import distributed_c10d

            self._store = distributed_c10d._get_default_store()
        self._ranks = dist.get_process_group_ranks(group) if dist.is_initialized() and group is not None else None

    def _apply_oldest(self) -> None:
        step, work, total, own = self.pending.popleft()
        if work is not None:
            work.wait()
        self.base.add_(total.div_(_world(self.group)))  # the mean change of that step

    @torch.no_grad()
    def _refresh(self) -> None:
        """``theta = base + (this rank's changes still in flight)``: the shared part is the same tensor on every
        rank, so rounding cannot make replicas drift apart (they are equal bit for bit after :meth:`flush`)."""
        local = self.base.clone()
        for _, _, _, own in self.pending:
            local.add_(own)
        unflatten_into(local, self.params)

    def before_step(self) -> None:
        """Wait for the steps the bound requires, apply them, snapshot the parameters (and record the read)."""
        applied = False
        while self.pending and self.pending[0][0] <= self.clock - self.staleness - 1:
            self._apply_oldest()
            applied = True
        if applied:
            self._refresh()
        if self.trace:
            self.reads.append((self.clock, self._slowest_clock()))
        self._snapshot = flatten(self.params).clone()

    def after_step(self) -> None:
        """Push this step's parameter change (non-blocking all-reduce)."""
        if self._snapshot is None:
            raise RuntimeError("StaleSync.after_step() without before_step()")
        own = flatten(self.params).sub_(self._snapshot)
        self._snapshot = None
        step = self.clock
        self.clock += 1
        if self.trace:  # before the push: a finished reduction of this step proves the clock was written
            self._store.set(self._key(dist.get_rank() if dist.is_initialized() else 0), str(self.clock))
        total = own.clone()
        work = dist.all_reduce(total, group=self.group, async_op=True) if _world(self.group) > 1 else None
        self.pending.append((step, work, total, own))

    def flush(self) -> None:
        """Wait for and apply every step in flight."""
        if self.pending:
            while self.pending:
                self._apply_oldest()
            self._refresh()

    def _key(self, rank: int) -> str:
        return f"llmopt_ssp_clock/{rank}"

    def _slowest_clock(self) -> int:
        ranks = self._ranks or list(range(_world(self.group)))
        clocks = []
        for r in ranks:
            key = self._key(r)
            clocks.append(int(self._store.get(key)) if self._store.check([key]) else 0)
        return min(clocks)

    def reset_trace(self) -> None:
        """Forget the recorded reads and write clock 0 (call on every rank before a traced run, then barrier)."""
        self.reads = []
        if self.trace:
            self._store.set(self._key(dist.get_rank() if dist.is_initialized() else 0), str(self.clock))

    def state_dict(self) -> dict[str, Any]:
        """Clock and the steps in flight (waited for: their sums are complete), to resume the same trajectory."""
        done = []
        for step, work, total, own in self.pending:
            if work is not None:
                work.wait()
            done.append((step, total.clone(), own.clone()))
        self.pending = deque((s, None, t, o) for s, t, o in done)
        return {"clock": self.clock, "base": self.base.clone(), "pending": done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state["clock"])
        self.base.copy_(state["base"])
        self.pending = deque((int(s), None, t.clone(), o.clone()) for s, t, o in state["pending"])
