"""Gradient clipping (``Trainer(gradient_clip_val=...)``) with the default optimizer, fused AdamW, under every
precision on one device and under every strategy, on CPU/gloo.

Issue 51: Lightning's ``MixedPrecision`` refuses to clip for an optimizer that unscales inside its step (fused AdamW,
the module's default on CUDA), so ``llmopt fit`` with any GPU config stopped at the first step.

Each run trains ``CausalLMModule("tiny")`` for 3 steps with ``fused_optimizer=True`` (forced: the default picks it on
CUDA only) and a max norm of 1e-3, so every step is clipped. The reference is one process with Lightning's default
strategy, the unfused AdamW and no ``gradient_clip_val``: a callback computes ``sqrt(sum of squared full gradients)``
itself and scales every gradient by ``min(1, clip / (norm + 1e-6))`` (``_clip_jobs.ManualClip``). Losses and final
parameters must agree to 1e-6 relative (fp32: the sharded reductions reorder sums, 1e-6 as in test_nd_parallel.py;
fused against unfused AdamW differ by rounding only). The clipped reference differs from an unclipped one by far
more than that (asserted), so a wrong or missing norm fails.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_llmopt import CausalLMModule
from lightning_llmopt.module import clip_with_amp_scaling_optimizer
from lightning_llmopt.strategies import ZeroPrecision

_spec = importlib.util.spec_from_file_location("_clip_jobs", Path(__file__).with_name("_clip_jobs.py"))
assert _spec is not None and _spec.loader is not None
C = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_clip_jobs", C)
_spec.loader.exec_module(C)

TOL = 1e-6


@pytest.fixture(scope="module")
def init_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny")
    module.configure_model()
    path = tmp_path_factory.mktemp("clip") / "init.pt"
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, path)
    return str(path)


_REFS: dict[tuple[str, float | None], dict[str, Any]] = {}


def _reference(init_path: str, precision: str = "32-true", clip: float | None = C.CLIP) -> dict[str, Any]:
    key = (precision, clip)
    if key not in _REFS:
        _REFS[key] = C.run(init_path, manual=True, precision=precision, clip=clip)
    return _REFS[key]


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_parity(result: dict[str, Any], ref: dict[str, Any], what: Any, tol: float = TOL) -> float:
    assert result["fused"] and not ref["fused"], what  # the fused AdamW ran, against the unfused one
    assert len(ref["norms"]) == C.STEPS and all(n > 100 * C.CLIP for n in ref["norms"]), ref["norms"]  # clipped
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses) == C.STEPS, what
    loss_err = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    assert sorted(result["params"]) == sorted(ref["params"]), what
    param_err = _rel(_flat(result["params"]), _flat(ref["params"]))
    assert loss_err <= tol and param_err <= tol, (what, loss_err, param_err)
    return param_err


def test_clipping_changes_the_weights(init_path: str) -> None:
    """The comparisons below can fail: clipped and unclipped training end far apart (AdamW with eps=1e-5)."""
    clipped, unclipped = _reference(init_path), _reference(init_path, clip=None)
    assert _rel(_flat(clipped["params"]), _flat(unclipped["params"])) > 1e3 * TOL


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_single_device_every_precision(init_path: str, precision: str) -> None:
    """Lightning's own precision plugins (``MixedPrecision`` for the mixed ones, with a ``GradScaler`` for fp16):
    the fused optimizer is clipped by norm, after unscaling under fp16."""
    result = C.run(init_path, precision=precision)
    ref = _reference(init_path, precision)
    assert result["plugin"] == ref["plugin"] == ("Precision" if precision == "32-true" else "MixedPrecision")
    assert result["scale"] == ref["scale"] == (2.0**16 if precision == "16-mixed" else None)
    _assert_parity(result, ref, precision)


def test_fp16_overflow_still_skips_the_step(init_path: str) -> None:
    """An inf gradient at step 1 under ``16-mixed``: unscaling inside the clipping records it, the fused step is
    skipped (as the reference's is) and the scale backs off once."""
    result = C.run(init_path, precision="16-mixed", poison_step=1)
    ref = C.run(init_path, precision="16-mixed", poison_step=1, manual=True)
    assert result["scale"] == ref["scale"] == 2.0**15
    assert ref["norms"][1] == float("inf")
    _assert_parity(result, ref, "16-mixed, overflow at step 1")
    unpoisoned = _reference(init_path, "16-mixed")
    assert _rel(_flat(result["params"]), _flat(unpoisoned["params"])) > 100 * TOL  # one update fewer


def test_clip_hook_leaves_other_plugins_and_optimizers_to_lightning() -> None:
    """The hook takes over only Lightning's ``MixedPrecision`` with an optimizer that unscales in its step; the
    strategies' own plugins (which unscale first and step the optimizer directly) keep their clipping."""
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 3.0)
    fused = torch.optim.AdamW([param], fused=True)
    plain = torch.optim.AdamW([param])
    assert fused._step_supports_amp_scaling and not getattr(plain, "_step_supports_amp_scaling", False)
    bf16 = MixedPrecision("bf16-mixed", "cpu")
    assert not clip_with_amp_scaling_optimizer(ZeroPrecision("bf16-mixed", device="cpu"), fused, 1.0, "norm")
    assert not clip_with_amp_scaling_optimizer(Precision(), fused, 1.0, "norm")
    assert not clip_with_amp_scaling_optimizer(bf16, plain, 1.0, "norm")
    assert not clip_with_amp_scaling_optimizer(bf16, fused, 0.0, "norm")
    assert not clip_with_amp_scaling_optimizer(bf16, fused, None, None)
    assert torch.equal(param.grad, torch.full((4,), 3.0))  # untouched so far
    assert clip_with_amp_scaling_optimizer(bf16, fused, 1.0, "value")
    assert torch.equal(param.grad, torch.ones(4))
    assert clip_with_amp_scaling_optimizer(bf16, fused, 1.0, None)  # the algorithm defaults to the norm
    torch.testing.assert_close(param.grad.norm(), torch.tensor(1.0), rtol=1e-5, atol=0)


STRATEGY_CONFIGS: list[dict[str, Any]] = [
    {"strategy": "zero", "nd": {"stage": 1}},
    {"strategy": "zero", "nd": {"stage": 2}},
    {"strategy": "zero", "nd": {"stage": 3}},
    {"nd": {"data_parallel": 2, "zero_stage": 1}},
    {"nd": {"data_parallel": 2, "zero_stage": 3}},
    {"nd": {"tensor_parallel": 2, "zero_stage": 0}},
    *({"nd": {"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": z}} for z in (0, 1, 2)),
]


def test_every_strategy_two_ranks(dist_pool: Any, init_path: str) -> None:
    """ZeroStrategy ZeRO-1/2/3 (``ZeroPrecision``), NDParallelStrategy ZeRO-1/3, TP and PP x ZeRO-0/1/2
    (``NDPrecision``): the norm is the whole model's, over every shard and every pipeline stage (under PP x ZeRO-1/2
    each stage's engine holds only its stage's shards)."""
    results = dist_pool(2).run(C.strategy_job, init_path, STRATEGY_CONFIGS)[0]
    ref = _reference(init_path)
    for config, result in zip(STRATEGY_CONFIGS, results, strict=True):
        err = _assert_parity(result, ref, config)
        print(f"clipping parity {config}: {err:.1e}")  # shown with -s


FOUR_RANK_CONFIGS: list[dict[str, Any]] = [
    *({"nd": {"data_parallel": 2, "pipeline_parallel": 2, "microbatches": 2, "zero_stage": z}} for z in (1, 2)),
    {"nd": {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": 3}},
]


def test_pipeline_zero_and_tensor_parallel_four_ranks(dist_pool: Any, init_path: str) -> None:
    """The combinations where the shards of one stage really are spread over data-parallel ranks: PP x ZeRO-1/2
    (each element's square counted on exactly one of the four ranks) and ZeRO-3 x TP."""
    results = dist_pool(4).run(C.strategy_job, init_path, FOUR_RANK_CONFIGS)[0]
    ref = _reference(init_path)
    for config, result in zip(FOUR_RANK_CONFIGS, results, strict=True):
        err = _assert_parity(result, ref, config)
        print(f"clipping parity {config}: {err:.1e}")  # shown with -s
