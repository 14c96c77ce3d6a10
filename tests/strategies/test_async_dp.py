"""AsyncDataParallelStrategy on CPU/gloo: local SGD against BSP and against a one-process simulation of the rule
(plain averaging and DiLoCo), SSP under injected delays against the simulation, resume, and early errors.

Tolerances: 1e-6 relative (losses: max over steps; parameters: norm of the difference over the norm), the suite's
parity bound for fp32. Nothing here is bitwise by construction: the strategy averages with a gloo all-reduce of the
flattened parameters (sum, then divide) while the oracle adds replicas in Python; BSP averages gradients before
the step where local SGD with H=1 averages parameters after it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt.strategies import AsyncDataParallelStrategy, ZeroPrecision

_spec = importlib.util.spec_from_file_location("_async_dp_jobs", Path(__file__).with_name("_async_dp_jobs.py"))
assert _spec is not None and _spec.loader is not None
A = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_async_dp_jobs", A)
_spec.loader.exec_module(A)

TOL = 1e-6
STEPS = 6


@pytest.fixture(scope="module")
def init_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    L.seed_everything(0, verbose=False)
    module = A.Module()
    module.configure_model()
    path = str(tmp_path_factory.mktemp("async_dp") / "init.pt")
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, path)
    return path


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return float((_flat(a) - _flat(b)).norm() / _flat(b).norm())


def _loss_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((ta - tb).abs() / tb.abs()).max())


def _assert_close(result: dict[str, Any], ref: dict[str, Any], tol: float = TOL) -> tuple[float, float]:
    errs = _loss_err(result["losses"], ref["losses"]), _rel(result["params"], ref["params"])
    assert errs[0] <= tol and errs[1] <= tol, errs
    return errs


# ------------------------------------------------------------------ errors before any collective
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 0}, r"sync_every \(0\) must be >= 1"),
        ({"data_parallel_sync": "ssp", "staleness": -1}, r"staleness \(-1\) must be >= 0"),
        ({"data_parallel_sync": "asp"}, r"data_parallel_sync \('asp'\) must be one of 'bsp', 'local_sgd', 'ssp'"),
        ({"outer_optimizer": "adam"}, r"outer_optimizer \('adam'\) must be 'none' or 'nesterov'"),
        ({"outer_lr": 0.0, "outer_optimizer": "nesterov"}, r"outer_lr \(0.0\) must be > 0"),
        ({"outer_momentum": 1.0, "outer_optimizer": "nesterov"}, r"outer_momentum \(1.0\) must be in \[0, 1\)"),
        ({"data_parallel_sync": "ssp", "sync_every": 4}, r"sync_every \(4\) .* need data_parallel_sync='local_sgd'"),
        ({"staleness": 2}, r"staleness \(2\) needs data_parallel_sync='ssp'"),
        ({"zero_stage": 3}, r"data_parallel_sync='local_sgd' does not compose with zero_stage \(3\)"),
        ({"data_parallel_sync": "ssp", "zero_stage": 2}, r"'ssp' does not compose with zero_stage \(2\)"),
        ({"tensor_parallel": 2}, r"does not compose with tensor_parallel \(2\)"),
        ({"pipeline_parallel": 2}, r"does not compose with pipeline_parallel \(2\)"),
        ({"context_parallel": 2}, r"does not compose with context_parallel \(2\)"),
    ],
)
def test_bad_values_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncDataParallelStrategy(**kwargs)


def test_registered_names() -> None:
    for name, mode in (("local_sgd", "local_sgd"), ("diloco", "local_sgd"), ("ssp", "ssp")):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        assert isinstance(trainer.strategy, AsyncDataParallelStrategy) and trainer.strategy.mode == mode
    assert trainer.strategy.async_config.staleness == 1  # type: ignore[attr-defined]


def test_fp16_loss_scaling_refused() -> None:
    """16-mixed's loss scaler all-reduces its overflow check every step: refused when the Trainer is built."""
    with pytest.raises(ValueError, match=r"precision '16-mixed' does not compose with data_parallel_sync='ssp'"):
        L.Trainer(
            strategy=AsyncDataParallelStrategy("ssp"),
            accelerator="cpu",
            devices=1,
            plugins=[ZeroPrecision("16-mixed", device="cpu")],
        )  # on CPU Lightning turns "16-mixed" into bf16


def test_bsp_composes_with_zero3() -> None:
    strategy = AsyncDataParallelStrategy("bsp", zero_stage=3, tensor_parallel=2)
    assert strategy.stage == 3


# ------------------------------------------------------------------ local SGD
def test_local_sgd_h1_equals_bsp(dist_pool: Any, init_path: str) -> None:
    """H=1 without an outer step is BSP when the inner optimizer is linear in the gradient (SGD with momentum):
    averaging parameters after the step equals averaging gradients before it."""
    runs = [
        {"strategy": {"data_parallel_sync": "bsp", "zero_stage": 0}, "steps": STEPS, "opt": "sgd"},
        {"strategy": {"data_parallel_sync": "local_sgd", "sync_every": 1}, "steps": STEPS, "opt": "sgd"},
    ]
    per_rank = dist_pool(2).run(A.runs_job, init_path, runs)
    for bsp, local in per_rank:
        _assert_close(local, bsp)
    assert _rel(per_rank[0][1]["params"], per_rank[1][1]["params"]) == 0.0  # replicas equal


@pytest.mark.parametrize("world", [2, 4])
def test_local_sgd_matches_simulation(dist_pool: Any, init_path: str, world: int) -> None:
    """H=3 (plain averaging) and H=4 with DiLoCo's outer Nesterov step (6 steps: the last period is unfinished and
    ends with a plain average), inner AdamW, against K replicas in one process."""
    runs = [
        {"strategy": {"data_parallel_sync": "local_sgd", "sync_every": 3}, "steps": STEPS},
        {
            "strategy": {"data_parallel_sync": "local_sgd", "sync_every": 2, "outer_optimizer": "nesterov"},
            "steps": STEPS,
        },
        {
            "strategy": {
                "data_parallel_sync": "local_sgd",
                "sync_every": 4,
                "outer_optimizer": "nesterov",
                "outer_lr": 0.5,
                "outer_momentum": 0.8,
            },
            "steps": STEPS,
        },
    ]
    sims = [
        A.simulate(init_path, world, STEPS, "local_sgd", sync_every=3),
        A.simulate(init_path, world, STEPS, "local_sgd", sync_every=2, outer=(0.7, 0.9)),
        A.simulate(init_path, world, STEPS, "local_sgd", sync_every=4, outer=(0.5, 0.8)),
    ]
    per_rank = dist_pool(world).run(A.runs_job, init_path, runs)
    for rank, results in enumerate(per_rank):
        for result, sim in zip(results, sims, strict=True):
            _assert_close(result, sim[rank])
    # not BSP in disguise: before the first average the replicas' losses differ from the simulated BSP-free ones of
    # other ranks, and the outer step changes the outcome
    assert _rel(per_rank[0][1]["params"], sims[0][0]["params"]) > 1e-4
    init = torch.load(init_path, weights_only=True)
    assert _rel(sims[1][0]["params"], {k: init[k] for k in sims[1][0]["params"]}) > 1e-3


# ------------------------------------------------------------------ SSP
def test_ssp_with_stragglers_matches_simulation(dist_pool: Any, init_path: str) -> None:
    """Rank 1 sleeps up to 200 ms before each step; s=2. Every read is within the bound, rank 0 runs ahead (Lightning's
    per-batch SIGTERM broadcast, which would hold it back, is replaced by the strategy), and the parameters (the rule
    does not depend on timing) equal the one-process simulation."""
    steps, s = 7, 2
    results = dist_pool(2).run(A.traced_ssp_job, init_path, s, steps, [1], 0.2)
    sim = A.simulate(init_path, 2, steps, "ssp", staleness=s)
    for rank, result in enumerate(results):
        assert [own for own, _ in result["reads"]] == list(range(steps))
        assert all(own - slowest <= s for own, slowest in result["reads"]), result["reads"]
        _assert_close(result, sim[rank])
    assert _rel(results[0]["params"], results[1]["params"]) == 0.0  # flushed at the end of fit
    assert max(own - slowest for own, slowest in results[0]["reads"]) >= 1, results[0]["reads"]
    bsp_like = A.simulate(init_path, 2, steps, "ssp", staleness=0)
    assert _rel(sim[0]["params"], bsp_like[0]["params"]) > 1e-5  # staleness changes the trajectory


def test_sigterm_on_one_rank_stops_all(dist_pool: Any, init_path: str) -> None:
    """The store flag that replaces Lightning's per-batch SIGTERM broadcast: a SIGTERM seen by rank 1 stops rank 0."""
    pool = dist_pool(2)
    timeout, pool.timeout = pool.timeout, 60.0  # a regression hangs (one rank waits in the final average)
    try:
        assert pool.run(A.sigterm_job, init_path) == [{"stopped": True}, {"stopped": True}]
    finally:
        pool.timeout = timeout


# ------------------------------------------------------------------ resume
@pytest.mark.parametrize(
    "strategy",
    [
        {"data_parallel_sync": "local_sgd", "sync_every": 3, "outer_optimizer": "nesterov"},
        {"data_parallel_sync": "ssp", "staleness": 2},
    ],
    ids=["diloco", "ssp"],
)
def test_resume_equals_uninterrupted(dist_pool: Any, init_path: str, tmp_path: Path, strategy: dict) -> None:
    """Saved after step 4 (inside a local-SGD period; SSP with steps in flight), resumed to 7: the per-rank
    parameters and the losses after the resume equal the uninterrupted run's, bit for bit."""
    results = dist_pool(2).run(A.resume_job, init_path, str(tmp_path / "ckpt"), strategy, 4, 7)
    for result in results:
        whole, resumed = result["whole"], result["resumed"]
        # the same arithmetic in the same order: bitwise
        assert resumed["losses"] == whole["losses"][4:]
        assert all(torch.equal(resumed["params"][k], whole["params"][k]) for k in whole["params"])


def test_resume_under_another_mode_is_refused(dist_pool: Any, init_path: str, tmp_path: Path) -> None:
    for message in dist_pool(2).run(A.wrong_resume_job, init_path, str(tmp_path / "ckpt")):
        assert "data_parallel_sync='ssp' resumes from a checkpoint of the same mode" in message, message
        assert "(mode 'local_sgd')" in message, message
