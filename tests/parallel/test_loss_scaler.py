"""DynamicLossScaler with ZeRO shards on 2 gloo ranks and with plain gradient lists."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.llama import Llama
from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler, LossScaleError
from lightning_llmopt.parallel.zero import ZeroOptimizer


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-3)


def _step(model: nn.Module, opt: ZeroOptimizer, scaler: DynamicLossScaler, poison: bool) -> bool:
    """One scaled step; with ``poison`` rank 1 alone produces infinite gradients."""
    tokens = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    if poison and dist.get_rank() == 1:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    stepped = scaler.step(opt)
    opt.zero_grad()
    return stepped


def _scaler_worker(stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny"))
    opt = ZeroOptimizer(model, _adamw, stage=stage, bucket_size_mb=0.05)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, max_consecutive_skips=3)
    out: dict[str, Any] = {"stepped": [], "scales": [], "skips": []}
    before = [p.detach().clone() for p in model.parameters()]
    out["stepped"].append(_step(model, opt, scaler, poison=True))
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    out["scales"].append(scaler.scale_value)
    out["skips"].append((scaler.skipped_steps, scaler.consecutive_skips))
    for _ in range(2):  # two clean steps: growth_interval reached
        out["stepped"].append(_step(model, opt, scaler, poison=False))
        out["scales"].append(scaler.scale_value)
    out["changed"] = not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    out["state"] = scaler.state_dict()
    try:
        for _ in range(3):
            _step(model, opt, scaler, poison=True)
        out["error"] = None
    except LossScaleError as err:
        out["error"] = str(err)
    out["skips"].append((scaler.skipped_steps, scaler.consecutive_skips))
    opt.remove_hooks()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_non_finite_on_one_rank_skips_everywhere(dist_pool: Any, stage: int) -> None:
    results = dist_pool(2).run(_scaler_worker, stage)
    for r in results:  # both ranks agree although only rank 1 saw inf
        assert r["stepped"] == [False, True, True]
        assert r["unchanged"] and r["changed"]
        assert r["scales"] == [2.0**9, 2.0**9, 2.0**10]  # halved, then doubled after 2 clean steps
        assert r["skips"] == [(1, 1), (4, 3)]
        assert r["error"] is not None and "3 consecutive steps" in r["error"]
        assert r["state"] == {"scale": 2.0**10, "skipped_steps": 1, "consecutive_skips": 0, "clean_steps": 0}


def _list_worker() -> list[bool]:
    scaler = DynamicLossScaler(init_scale=4.0)
    g = torch.full((3,), 8.0)
    bad = torch.tensor([1.0, float("nan")]) if dist.get_rank() == 0 else torch.ones(2)
    found = [scaler.unscale_and_check([g, None])]
    found.append(scaler.unscale_and_check([torch.ones(2), bad]))
    return found + [bool(torch.equal(g, torch.full((3,), 2.0)))]


def test_gradient_list_is_checked_across_ranks(dist_pool: Any) -> None:
    assert dist_pool(2).run(_list_worker) == [[False, True, True], [False, True, True]]


def test_single_process_and_state_round_trip() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=1, max_consecutive_skips=None)
    assert scaler.scale(torch.tensor(2.0)).item() == 16.0
    assert scaler.unscale_and_check([torch.tensor([float("inf")])])
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale_value == 8.0 and scaler.skipped_steps == 1 and scaler.consecutive_skips == 0
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"backoff_factor \(1.5\)"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match=r"growth_interval \(0\)"):
        DynamicLossScaler(growth_interval=0)
