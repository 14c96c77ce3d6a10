"""``NDParallelStrategy(expert_parallel=...)``: MoE Llama training through Lightning against one process.

EP=2 on 2 ranks and EP=2 x DP=2 on 4 ranks (zero_stage 0), dropless and with capacity: fp32, 5 AdamW steps, losses
and all parameters (expert shards gathered) within 1e-6 relative. Capacity groups and the balance loss are per
sequence and the load counts are summed over ranks, so the routing is the single process's routing.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt import CausalLMModule

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

TOL = 1e-6
DROPLESS = {"num_experts": 4, "top_k": 2, "z_loss_coef": 1e-3}
CAPACITY = {
    "num_experts": 4,
    "top_k": 2,
    "capacity_factor": 1.0,
    "balance": "aux_free",
    "bias_update_rate": 0.01,
    "num_shared_experts": 1,
}
SHARED = {"num_experts": 4, "top_k": 2, "balance": "aux_free", "bias_update_rate": 0.01, "num_shared_experts": 1}


def _kwargs(moe: dict[str, Any]) -> dict[str, Any]:
    return {"model_overrides": {"moe": moe}}


@pytest.fixture(scope="module")
def init_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("nd_ep")
    paths = {}
    for name, moe in (("dropless", DROPLESS), ("capacity", CAPACITY), ("shared", SHARED)):
        L.seed_everything(0, verbose=False)
        module = CausalLMModule("tiny", **_kwargs(moe))
        module.configure_model()
        paths[name] = str(root / f"{name}.pt")
        torch.save({k: v.clone() for k, v in module.state_dict().items()}, paths[name])
    return paths


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def ep_job(paths: dict[str, str], nd: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, moe in (("dropless", DROPLESS), ("capacity", CAPACITY)):
        recorder, trainer = J.fit(nd, init_path=paths[name], module_kwargs=_kwargs(moe))
        layer = trainer.lightning_module.model.layers["0"].feed_forward
        result = J.summary(recorder, trainer)
        w1 = layer.experts.w1
        result["local_experts"] = w1.to_local().shape[0]  # 2 of the 4 experts here (dim 0 over 'ep')
        result["placements"] = [str(pl) for pl in w1.placements]
        result["dispatcher"] = type(layer.dispatcher).__name__
        out.append(result)
    return out


@pytest.mark.parametrize(("world", "zero_stage"), [(2, 0), (4, 0), (2, 3), (4, 3)])
def test_expert_parallel_matches_one_process(
    dist_pool: Any, init_paths: dict[str, str], world: int, zero_stage: int
) -> None:
    """zero_stage 0: gradients all-reduced; 3: FSDP2 with the experts sharded over 'dp_rep' x 'ep' (2-D)."""
    per_rank = dist_pool(world).run(ep_job, init_paths, {"expert_parallel": 2, "zero_stage": zero_stage})
    assert all(r["local_experts"] == 2 and r["dispatcher"] == "AllToAllDispatcher" for rs in per_rank for r in rs)
    if zero_stage == 3:  # 2-D: experts over 'ep' (dim 0) and FSDP2 over 'dp_rep' (dim 1)
        assert all(r["placements"] == ["S(1)", "S(0)"] for rs in per_rank for r in rs), per_rank[0][0]["placements"]
    results = per_rank[0]
    for (name, moe), result in zip((("dropless", DROPLESS), ("capacity", CAPACITY)), results, strict=True):
        ref = J.summary(*J.fit(None, init_path=init_paths[name], module_kwargs=_kwargs(moe)))
        losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
        assert len(losses) == J.STEPS
        assert float(((losses - ref_losses).abs() / ref_losses.abs()).max()) <= TOL, name
        assert sorted(result["params"]) == sorted(ref["params"])
        assert result["params"]["model.layers.0.feed_forward.experts.w1"].shape[0] == 4  # gathered: all experts
        err = float((_flat(result["params"]) - _flat(ref["params"])).norm() / _flat(ref["params"]).norm())
        worst = sorted(
            (
                (float((result["params"][k].double() - v.double()).norm() / v.double().norm()), k)
                for k, v in ref["params"].items()
            ),
            reverse=True,
        )[:3]
        assert err <= TOL, (name, err, worst)


def _monitor() -> Any:
    from lightning_llmopt import TrainingMonitor

    return TrainingMonitor(log_every_n_steps=1, skip_first_steps=0)


def tp_job(paths: dict[str, str], nd: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, moe in (("dropless", DROPLESS), ("shared", SHARED)):
        recorder, trainer = J.fit(nd, init_path=paths[name], module_kwargs=_kwargs(moe), callbacks=[_monitor()])
        layer = trainer.lightning_module.model.layers["0"].feed_forward
        result = J.summary(recorder, trainer)
        result["grad_norm"] = float(trainer.callback_metrics["train/grad_norm"])
        result["tp_group"] = layer.tp_group is not None
        result["router"] = type(layer.router.weight).__name__
        result["aux"] = float(layer.aux_loss.detach()) if layer.aux_loss is not None else None
        out.append(result)
    return out


@pytest.mark.parametrize(
    ("world", "nd"),
    [
        (2, {"tensor_parallel": 2, "zero_stage": 0}),
        (2, {"tensor_parallel": 2, "zero_stage": 0, "sequence_parallel": False}),
        (4, {"tensor_parallel": 2, "zero_stage": 0}),
        (4, {"tensor_parallel": 2, "zero_stage": 3}),
        (4, {"tensor_parallel": 2, "expert_parallel": 2, "zero_stage": 0}),
        (4, {"tensor_parallel": 2, "expert_parallel": 2, "zero_stage": 3}),
    ],
)
def test_moe_with_tensor_parallel_matches_one_process(
    dist_pool: Any, init_paths: dict[str, str], world: int, nd: dict[str, Any]
) -> None:
    """TP (+ EP) on MoE models: each tensor-parallel rank routes its slice of the sequence (router, shared and
    expert gradients summed over TP; balance and z-loss statistics summed per sequence), so losses, parameters and
    the balance loss equal one process's to 1e-6 (dropless with the aux balance loss and z-loss; shared expert with
    aux-free bias balancing)."""
    per_rank = dist_pool(world).run(tp_job, init_paths, nd)
    assert all(r["tp_group"] and r["router"] == "DTensor" for rs in per_rank for r in rs)
    for i, ((name, moe), result) in enumerate(
        zip((("dropless", DROPLESS), ("shared", SHARED)), per_rank[0], strict=True)
    ):
        recorder, trainer = J.fit(None, init_path=init_paths[name], module_kwargs=_kwargs(moe), callbacks=[_monitor()])
        ref = J.summary(recorder, trainer)
        losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
        assert float(((losses - ref_losses).abs() / ref_losses.abs()).max()) <= TOL, (name, losses, ref_losses)
        # TrainingMonitor's gradient norm over TP, expert and FSDP shards (several meshes) is the single process's
        ref_norm = float(trainer.callback_metrics["train/grad_norm"])
        assert abs(result["grad_norm"] - ref_norm) <= 1e-5 * ref_norm, (name, result["grad_norm"], ref_norm)
        assert sorted(result["params"]) == sorted(ref["params"])
        err = float((_flat(result["params"]) - _flat(ref["params"])).norm() / _flat(ref["params"]).norm())
        assert err <= TOL, (name, err)
        tp = nd["tensor_parallel"]
        for g in range(world // tp):  # the ranks of one tensor-parallel group computed the same balance loss
            assert len({rs[i]["aux"] for rs in per_rank[g * tp : (g + 1) * tp]}) == 1, name


def _fit_error(nd: dict[str, Any], moe: dict[str, Any]) -> str:
    try:
        J.fit(nd, steps=1, module_kwargs=_kwargs(moe))
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_expert_parallel_layout_errors(dist_pool: Any) -> None:
    cases = [
        ({"expert_parallel": 2, "zero_stage": 2}, DROPLESS, r"expert_parallel \(2\) runs with zero_stage 0"),
        ({"expert_parallel": 2, "zero_stage": 0}, {**DROPLESS, "num_experts": 3}, r"num_experts \(3\) must be"),
        (
            {"tensor_parallel": 2, "zero_stage": 0},
            CAPACITY,
            r"tensor_parallel \(2\) with a Mixture-of-Experts capacity",
        ),
    ]
    for nd, moe, message in cases:
        for text in dist_pool(2).run(_fit_error, nd, moe):
            assert re.search(message, text), (message, text)


def test_checkpoint_ep2_loads_as_ep1(dist_pool: Any, init_paths: dict[str, str], tmp_path: Path) -> None:
    """Saved with EP=2 (experts as DTensor shards); resumed with every expert on every rank (dp=2): the weights are
    the saved ones exactly and the continued run follows the straight one."""
    out = dist_pool(2).run(
        J.reshard_job,
        init_paths["capacity"],
        str(tmp_path / "ckpt"),
        {"expert_parallel": 2, "zero_stage": 0},
        {"data_parallel": 2, "zero_stage": 0},
        3,
        6,
        _kwargs(CAPACITY),
    )[0]
    assert out["folders"] == ["step-00000003"]
    assert float((_flat(out["resumed"]["start_params"]) - _flat(out["saved"])).abs().max()) == 0.0
    straight, resumed = out["straight"]["losses"][3:], out["resumed"]["losses"]
    assert len(resumed) == len(straight) == 3
    assert max(abs(a - b) / b for a, b in zip(resumed, straight, strict=True)) <= TOL
