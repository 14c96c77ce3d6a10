"""The framework-free pieces of asynchronous data parallelism (parallel/async_dp.py) on gloo ranks.

- SSP property (hypothesis over world sizes, staleness bounds and per-rank, per-step delays): at every read each
  rank's step minus the slowest rank's step (read from the store, where every rank writes its clock before it pushes)
  is at most ``s``, and every rank's parameters at every read equal the rule evaluated in float64 in this process
  (``x_r(t) = x(0) + sum_{tau < t-s} mean_q u_q(tau) + sum_{t-s <= tau < t} u_r(tau)``), whatever the delays.
- A fast rank does run ahead of a slow one up to the bound (not BSP in disguise).
- LocalSGD's DiLoCo step against the formula written out by hand, and its state round trip.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_llmopt.parallel.async_dp import AsyncDPConfig, LocalSGD, StaleSync

DIM = 3


def _inner_step(x: torch.Tensor, rank: int, t: int) -> None:
    """A rank's inner update: depends on what it reads (so staleness changes the result) and on the rank."""
    x.mul_(0.9).add_(torch.arange(DIM, dtype=x.dtype) * 0.01 + (rank + 1) + 0.1 * t)


def _ssp_job(staleness: int, delays: list[list[float]]) -> dict[str, Any]:
    rank = dist.get_rank()
    x = torch.zeros(DIM, dtype=torch.float64)
    sync = StaleSync([x], None, staleness, trace=True)
    sync.reset_trace()
    dist.barrier()  # every clock is 0 before anyone reads
    seen = []
    for t, delay in enumerate(delays[rank]):
        time.sleep(delay)
        sync.before_step()
        seen.append(x.clone())
        _inner_step(x, rank, t)
        sync.after_step()
    sync.flush()
    return {"reads": sync.reads, "seen": seen, "final": x.clone()}


def _rule(world: int, steps: int, s: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """What each rank reads at each step, and the final parameters, by the SSP rule in float64."""
    changes: list[list[torch.Tensor]] = []  # [step][rank]
    seen: list[list[torch.Tensor]] = [[] for _ in range(world)]
    x0 = torch.zeros(DIM, dtype=torch.float64)
    for t in range(steps):
        step_changes = []
        for r in range(world):
            x = x0 + sum((sum(c) / world for c in changes[: max(t - s, 0)]), torch.zeros(DIM, dtype=torch.float64))
            x = x + sum((c[r] for c in changes[max(t - s, 0) :]), torch.zeros(DIM, dtype=torch.float64))
            seen[r].append(x)
            after = x.clone()
            _inner_step(after, r, t)
            step_changes.append(after - x)
        changes.append(step_changes)
    final = x0 + sum(sum(c) / world for c in changes)
    return seen, final


@st.composite
def _schedules(draw: Any) -> tuple[int, int, list[list[float]]]:
    world = draw(st.sampled_from([2, 4]))
    staleness = draw(st.integers(0, 3))
    steps = draw(st.integers(1, 7))
    slow = draw(st.sets(st.integers(0, world - 1), max_size=world - 1))  # at least one rank stays fast
    delay = st.sampled_from([0.0, 0.0, 0.002, 0.01, 0.025])
    delays = [[draw(delay) if r in slow else 0.0 for _ in range(steps)] for r in range(world)]
    return world, staleness, delays


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_schedules())
def test_ssp_bound_never_exceeded(dist_pool: Any, case: tuple[int, int, list[list[float]]]) -> None:
    world, s, delays = case
    steps = len(delays[0])
    results = dist_pool(world).run(_ssp_job, s, delays)
    seen, final = _rule(world, steps, s)
    for rank, result in enumerate(results):
        assert [own for own, _ in result["reads"]] == list(range(steps))
        for own, slowest in result["reads"]:
            assert 0 <= own - slowest <= s, (rank, own, slowest, s)
        for t in range(steps):
            torch.testing.assert_close(result["seen"][t], seen[rank][t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["final"], final, rtol=1e-12, atol=1e-12)
        assert torch.equal(result["final"], results[0]["final"])  # replicas equal bit for bit after flush


def test_fast_rank_runs_ahead_to_the_bound(dist_pool: Any) -> None:
    """Rank 1 sleeps 0.1 s before each step; rank 0 reaches exactly ``s`` steps ahead and no further."""
    s, steps = 2, 6
    delays = [[0.0] * steps, [0.1] * steps]
    reads = dist_pool(2).run(_ssp_job, s, delays)[0]["reads"]
    lags = [own - slowest for own, slowest in reads]
    assert max(lags) == s, reads


# ------------------------------------------------------------------ local SGD
def _diloco_job(sync_every: int, steps: int, lr: float, mu: float) -> dict[str, Any]:
    rank = dist.get_rank()
    x = torch.zeros(DIM, dtype=torch.float64)
    local = LocalSGD([x], None, sync_every, "nesterov", lr, mu)
    synced = []
    for t in range(steps):
        _inner_step(x, rank, t)
        synced.append(local.step())
    return {"x": x.clone(), "synced": synced, "state": local.state_dict()}


def test_diloco_outer_step_against_formula(dist_pool: Any) -> None:
    world, H, steps, lr, mu = 2, 2, 6, 0.7, 0.9
    results = dist_pool(world).run(_diloco_job, H, steps, lr, mu)
    xs = [torch.zeros(DIM, dtype=torch.float64) for _ in range(world)]
    anchor, m = torch.zeros(DIM, dtype=torch.float64), torch.zeros(DIM, dtype=torch.float64)
    for t in range(steps):
        for r in range(world):
            _inner_step(xs[r], r, t)
        if (t + 1) % H == 0:
            delta = anchor - sum(xs) / world
            m = mu * m + delta
            anchor = anchor - lr * (delta + mu * m)
            xs = [anchor.clone() for _ in range(world)]
    for result in results:
        assert result["synced"] == [(t + 1) % H == 0 for t in range(steps)]
        torch.testing.assert_close(result["x"], anchor, rtol=1e-12, atol=1e-12)
        assert result["state"]["steps"] == steps and result["state"]["syncs"] == steps // H
    fresh = LocalSGD([torch.zeros(DIM, dtype=torch.float64)], None, H, "nesterov", lr, mu)
    fresh.load_state_dict(results[0]["state"])
    torch.testing.assert_close(fresh.anchor, anchor, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="has outer optimizer state, but outer_optimizer is 'none'"):
        LocalSGD([torch.zeros(DIM)], None, H).load_state_dict(results[0]["state"])


def test_config_defaults() -> None:
    assert AsyncDPConfig("local_sgd").sync_every == 1 and AsyncDPConfig("ssp").staleness == 1
    with pytest.raises(TypeError, match="one dtype and device"):
        StaleSync([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
