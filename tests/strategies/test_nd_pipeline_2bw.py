"""``NDParallelStrategy(schedule="pipedream_2bw")`` through ``lightning.Trainer`` on CPU/gloo against a single
process running the PipeDream-2BW rule (no pipeline, no Lightning loop), bit for bit.

The oracle (:func:`simulate`): the same ``CausalLMModule`` (its ``train_loss``, its AdamW parameter groups and
warm-up schedule), the same global batches and per-data-parallel-rank rows, the same contiguous micro-batches; at
Lightning step ``t`` the gradient of batch ``t - 1`` (computed at the weights batch ``t - 1`` saw) is applied, then
the scheduler steps (step 0 applies nothing). With data parallelism the per-rank gradients are summed and halved,
as the strategy's all-reduce does. Losses (per rank) and every parameter must be ``torch.equal``.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.parallel.pipeline_2bw import check_2bw_trainer
from lightning_llmopt.strategies import NDParallelStrategy

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

N_LAYERS = 4


def _module_kwargs() -> dict[str, Any]:
    return {"model_overrides": {"n_layers": N_LAYERS}}


@pytest.fixture(scope="module")
def init_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    L.seed_everything(0, verbose=False)
    module = J.Module(**_module_kwargs())
    module.configure_model()
    path = str(tmp_path_factory.mktemp("pp2bw") / "init.pt")
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, path)
    return path


def _batches(dp: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """The rows J.fit gives data-parallel rank ``rank`` of ``dp``, step by step."""
    data = J.Tokens(J.GLOBAL_BATCH * J.STEPS)
    sampler = ResumableShardedSampler(data, num_replicas=dp, rank=rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=J.GLOBAL_BATCH // dp, sampler=sampler, drop_last=True)
    return list(loader)


def simulate(init_path: str, dp: int, m: int, clip: float | None = None) -> dict[str, Any]:
    """Single-process PipeDream-2BW: per-rank losses, the final parameters and the parameters after each step;
    ``clip``: the applied gradient scaled by ``min(1, clip / (norm + 1e-6))`` (the strategy's clipping)."""
    L.seed_everything(0, verbose=False)
    module = J.Module(**_module_kwargs())
    module.configure_model()
    module.load_state_dict(torch.load(init_path, weights_only=True))
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    params = list(module.model.parameters())
    per_rank = [_batches(dp, r) for r in range(dp)]
    losses: list[list[float]] = [[] for _ in range(dp)]
    pending, after = None, []
    for step in range(J.STEPS):
        grads = []
        for r in range(dp):
            batch = per_rank[r][step]
            total = torch.zeros(())
            for rows in torch.arange(batch["input_ids"].shape[0]).tensor_split(m):
                loss = module.train_loss({k: v[rows] for k, v in batch.items()}) / m
                loss.backward()
                total = total + loss.detach().float()
            losses[r].append(float(total))
            grads.append([p.grad for p in params])
            for p in params:
                p.grad = None
        mean = [sum(gs[1:], gs[0]).div_(dp) if dp > 1 else gs[0] for gs in zip(*grads, strict=True)]
        if pending is not None:  # the previous batch's gradient, computed at the weights that batch saw
            for p, g in zip(params, pending, strict=True):
                p.grad = g
            if clip is not None:
                norm = torch.stack([g.pow(2).sum() for g in pending]).sum().sqrt()
                coef = (clip / (norm + 1e-6)).clamp(max=1.0)
                for g in pending:
                    g.mul_(coef)
            opt.step()
            opt.zero_grad()
        with warnings.catch_warnings():  # step 0 steps the schedule without an update, as Lightning does here
            warnings.simplefilter("ignore", UserWarning)
            sched.step()
        pending = mean
        after.append({f"model.{k}": v.detach().clone() for k, v in module.model.named_parameters()})
    params = {f"model.{k}": v.detach().clone() for k, v in module.model.named_parameters()}
    return {"losses": losses, "params": params, "after": after}


def _fit_job(init_path: str, nd: dict[str, Any], clip: float | None = None) -> dict[str, Any]:
    import torch.distributed as dist

    recorder, trainer = J.fit(nd, init_path=init_path, module_kwargs=_module_kwargs(), clip=clip)
    runner = trainer.strategy._pipeline  # type: ignore[attr-defined]
    dims = trainer.strategy.dims  # type: ignore[attr-defined]
    return {
        "losses": recorder.losses,
        "params": J.union_over_ranks(J.full_params(trainer.lightning_module)),
        "dp_rank": dims.coordinates(dist.get_rank())["dp"],
        "storages": runner.weights.storages(),
        "n_params": len(runner.weights.params),
        "max_versions": runner.max_versions,
        "in_flight_after_fit": len(runner.in_flight),
        "tokens_seen": int(trainer.lightning_module.tokens_seen),
    }


def _assert_equal(results: list[dict[str, Any]], ref: dict[str, Any], what: Any) -> None:
    for r in results:
        assert r["losses"] == ref["losses"][r["dp_rank"]], (what, r["losses"], ref["losses"])
        assert sorted(r["params"]) == sorted(ref["params"]), what
        for k, v in r["params"].items():
            assert torch.equal(v, ref["params"][k]), (what, k, float((v - ref["params"][k]).abs().max()))
        assert r["storages"] == 2 * r["n_params"]  # two weight versions per stage
        assert r["in_flight_after_fit"] == 0  # drained at the end of fit


def test_two_stages_through_lightning_bitwise(dist_pool: Any, init_path: str) -> None:
    nd = {"pipeline_parallel": 2, "schedule": "pipedream_2bw", "microbatches": 2}  # zero_stage defaults to 0
    results = dist_pool(2).run(_fit_job, init_path, nd)
    _assert_equal(results, simulate(init_path, 1, 2), nd)
    assert [r["max_versions"] for r in results] == [2, 1]  # the first stage holds the stash across steps
    assert [r["tokens_seen"] for r in results] == [J.STEPS * J.GLOBAL_BATCH * J.SEQ] * 2


def test_clipping_clips_the_delayed_gradient(dist_pool: Any, init_path: str) -> None:
    """``gradient_clip_val`` clips the gradient being applied (the previous batch's) by its norm over both stages.
    The norm is summed per stage and all-reduced, so the comparison is to 1e-6 relative, not bitwise."""
    nd = {"pipeline_parallel": 2, "schedule": "pipedream_2bw", "microbatches": 2}
    results = dist_pool(2).run(_fit_job, init_path, nd, 0.05)
    ref, unclipped = simulate(init_path, 1, 2, clip=0.05), simulate(init_path, 1, 2)
    flat = torch.cat([ref["params"][k].flatten() for k in sorted(ref["params"])])
    for r in results:
        loss_err = max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"][0], strict=True))
        got = torch.cat([r["params"][k].flatten() for k in sorted(ref["params"])])
        param_err = float((got - flat).norm() / flat.norm())
        print(f"2bw clip 0.05: losses {loss_err:.1e}, parameters {param_err:.1e}")  # shown with -s
        assert loss_err <= 1e-6 and param_err <= 1e-6
    other = torch.cat([unclipped["params"][k].flatten() for k in sorted(ref["params"])])
    assert float((other - flat).norm() / flat.norm()) > 1e-4  # the clip was active


def test_four_ranks_pipeline_and_data_parallel_bitwise(dist_pool: Any, init_path: str) -> None:
    pool = dist_pool(4)
    for nd, dp, m in (
        ({"pipeline_parallel": 2, "data_parallel": 2, "schedule": "pipedream_2bw", "microbatches": 2}, 2, 2),
        ({"pipeline_parallel": 4, "schedule": "pipedream_2bw", "microbatches": 4}, 1, 4),
    ):
        _assert_equal(pool.run(_fit_job, init_path, nd), simulate(init_path, dp, m), nd)


def test_differs_from_synchronous_training(init_path: str) -> None:
    """The same oracle with the gradient applied at once would be synchronous training: the rules differ."""
    delayed = simulate(init_path, 1, 2)
    ref = J.summary(*J.fit(None, init_path=init_path, module_kwargs=_module_kwargs()))  # Lightning, one process
    assert delayed["losses"][0][0] == pytest.approx(ref["losses"][0], rel=1e-6)  # batch 0 sees W(0) in both
    assert abs(delayed["losses"][0][2] - ref["losses"][2]) > 1e-5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 2}, r"zero_stage \(2\) is not supported"),
        ({"zero_stage": 3}, r"zero_stage \(3\) is not supported"),
        ({"tensor_parallel": 2}, r"tensor_parallel \(2\)"),
        ({"microbatches": 1}, r"microbatches \(1\) must be >= pipeline_parallel \(2\) for pipedream_2bw"),
        ({"virtual_stages": 2}, r"virtual_stages \(2\) must be 1"),
        ({"context_parallel": 2}, r"context_parallel \(2\)"),
        ({"activation_checkpointing": "full"}, r"activation_checkpointing \('full'\) is not supported"),
    ],
)
def test_unsupported_combinations_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, NotImplementedError), match=message):
        NDParallelStrategy(pipeline_parallel=2, schedule="pipedream_2bw", **kwargs)


def _fit_error_job(init_path: str, trainer_kwargs: dict[str, Any]) -> str:
    from lightning_llmopt.testing.lightning_env import PoolEnvironment

    strategy = NDParallelStrategy(
        pipeline_parallel=2, schedule="pipedream_2bw", microbatches=2, cluster_environment=PoolEnvironment()
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(J.Tokens(8), batch_size=4)
    try:
        trainer.fit(J.Module(init_path=init_path, **_module_kwargs()), loader)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_trainer_settings_are_refused_before_training(dist_pool: Any, init_path: str) -> None:
    for text in dist_pool(2).run(_fit_error_job, init_path, {"accumulate_grad_batches": 2}):
        assert "accumulate_grad_batches (2) is not supported" in text, text
    # fp16 needs CUDA (Lightning turns 16-mixed into bf16-mixed on CPU): the check on the trainer's settings alone
    trainer = SimpleNamespace(accumulate_grad_batches=1, precision_plugin=SimpleNamespace(precision="16-mixed"))
    with pytest.raises(NotImplementedError, match=r"precision \('16-mixed'\) is not supported"):
        check_2bw_trainer(trainer)
    check_2bw_trainer(
        SimpleNamespace(accumulate_grad_batches=1, precision_plugin=SimpleNamespace(precision="bf16-mixed"))
    )


def _fit_with_validation_job(init_path: str) -> dict[str, Any]:
    """J.fit's run with a validation pass every 2 steps: the forward-only pass's untagged sends cross the stages
    while 2BW's gradient sends are still in flight."""
    import torch.distributed as dist

    from lightning_llmopt.testing.lightning_env import PoolEnvironment

    L.seed_everything(0, verbose=False)
    recorder = J.Recorder()
    strategy = NDParallelStrategy(
        pipeline_parallel=2, schedule="pipedream_2bw", microbatches=2, cluster_environment=PoolEnvironment()
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=J.STEPS, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[recorder], num_sanity_val_steps=0,
        use_distributed_sampler=False, val_check_interval=2, limit_val_batches=1,
    )  # fmt: skip
    data = J.Tokens(J.GLOBAL_BATCH * J.STEPS)
    sampler = ResumableShardedSampler(data, num_replicas=1, rank=0, seed=0)
    loader = ResumableDataLoader(data, batch_size=J.GLOBAL_BATCH, sampler=sampler, drop_last=True)
    val = torch.utils.data.DataLoader(J.Tokens(8, packed=True), batch_size=8)  # J.validate's rows
    module = J.Module(init_path=init_path, **_module_kwargs())
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val)
    (after,) = trainer.validate(module, val, verbose=False)  # after the drain: the final live weights
    return {
        "losses": recorder.losses,
        "params": J.union_over_ranks(J.full_params(module)),
        "dp_rank": 0,
        "storages": trainer.strategy._pipeline.weights.storages(),  # type: ignore[attr-defined]
        "n_params": len(trainer.strategy._pipeline.weights.params),  # type: ignore[attr-defined]
        "in_flight_after_fit": len(trainer.strategy._pipeline.in_flight),  # type: ignore[attr-defined]
        "val_loss": float(after["val/loss"]),
        "rank": dist.get_rank(),
    }


def test_validation_during_fit_leaves_training_unchanged(dist_pool: Any, init_path: str) -> None:
    """Training is bit-for-bit the rule's with validation passes in between (their untagged sends cross the stages
    while 2BW's gradient sends are in flight); ``Trainer.validate`` after ``fit`` runs on both stages alike."""
    results = dist_pool(2).run(_fit_with_validation_job, init_path)
    _assert_equal(results, simulate(init_path, 1, 2), "validation every 2 steps")
    assert results[0]["val_loss"] == results[1]["val_loss"] > 0


def test_checkpoint_mid_run_holds_the_live_weights(dist_pool: Any, init_path: str, tmp_path: Path) -> None:
    """A checkpoint saved after step 2 of a 2BW run (gradient sends still in flight) holds the live weights, i.e.
    the rule's after 2 steps, and the training is unchanged by the save; it resumes under PP=1 x DP=2 with those
    weights exactly. (PP -> PP resumes are tested in test_nd_pipeline.py.)"""
    nd = {"pipeline_parallel": 2, "schedule": "pipedream_2bw", "microbatches": 2}
    load = {"data_parallel": 2, "zero_stage": 0}
    out = dist_pool(2).run(J.reshard_job, init_path, str(tmp_path / "ckpt"), nd, load, 2, J.STEPS, _module_kwargs())
    ref = simulate(init_path, 1, 2)
    for r in out:
        assert r["folders"] == ["step-00000002"]
        assert r["straight"]["losses"] == ref["losses"][0]
        assert all(torch.equal(v, ref["params"][k]) for k, v in r["straight"]["params"].items())
        assert sorted(r["saved"]) == sorted(ref["after"][1])
        assert all(torch.equal(v, ref["after"][1][k]) for k, v in r["saved"].items())
        assert all(torch.equal(v, r["saved"][k]) for k, v in r["resumed"]["start_params"].items())
