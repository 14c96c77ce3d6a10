"""Jobs for tests/strategies/test_clipping.py: gradient clipping with the default (fused) AdamW under every precision
and strategy, against one process that clips by the norm it computes itself.

Built on ``_nd_jobs.py`` (same data, module, learning rate and initial weights). The runs under test use
``CausalLMModule(fused_optimizer=True)`` -- what the module picks on CUDA, forced here because the tests run on CPU
(torch has a fused AdamW there too) -- and ``Trainer(gradient_clip_val=CLIP)``. The reference runs Lightning's
default strategy with the unfused AdamW, no ``gradient_clip_val``, and :class:`ManualClip`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_llmopt.strategies import NDParallelStrategy, ZeroStrategy

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
if "_nd_jobs" not in sys.modules:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["_nd_jobs"] = _module
    _spec.loader.exec_module(_module)
J: Any = sys.modules["_nd_jobs"]

CLIP = 1e-3  # far below the gradient norm of the tiny model (~1-10): every step is clipped
# AdamW normalises each element by its own running magnitude, so a clipping coefficient the same for every element
# hardly changes its first steps (only through eps). With eps above the clipped elements' size (~CLIP/sqrt(1.4e5
# parameters) ~ 3e-6) the update is nearly proportional to the clipped gradient: a wrong norm shows in the weights.
EPS = 1e-5
STEPS = 3
STRATEGIES = {"nd": NDParallelStrategy, "zero": ZeroStrategy}


class ManualClip(L.Callback):
    """The reference's clipping, written out: ``norm = sqrt(sum of the squared full gradients)`` (fp64), then every
    gradient times ``min(1, clip / (norm + 1e-6))``; runs before the optimizer step (after AMP's unscaling)."""

    def __init__(self, clip: float) -> None:
        self.clip = clip
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = float(torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt())
        coef = min(1.0, self.clip / (norm + 1e-6))  # a non-finite norm leaves the gradients as they are
        for g in grads:
            g.mul_(coef)
        self.norms.append(norm)


class PoisonGrad(L.Callback):
    """An inf in one gradient element after the backward of step ``step`` (fp16 overflow, on purpose)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")


def trainer_kwargs(precision: str) -> dict[str, Any]:
    """``16-mixed`` on the CPU needs the plugin itself (the Trainer's flag turns it into bf16 there)."""
    if precision == "16-mixed":
        from lightning.pytorch.plugins.precision import MixedPrecision

        return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    return {"precision": precision}


def _fused(trainer: L.Trainer) -> bool:
    opt: Any = trainer.optimizers[0]
    inner = getattr(opt, "optimizer", opt)  # the ZeRO-1/2 engine's inner optimizer over the shards
    return all(bool(group.get("fused")) for group in inner.param_groups)


def _scale(trainer: L.Trainer) -> float | None:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return None if scaler is None else float(scaler.get_scale())


def run(
    init_path: str,
    nd: dict[str, Any] | None = None,
    strategy: str = "nd",
    clip: float | None = CLIP,
    manual: bool = False,
    precision: str = "32-true",
    poison_step: int | None = None,
) -> dict[str, Any]:
    """One training: ``nd=None`` on one process, else ``STRATEGIES[strategy](**nd)`` on the pool's ranks.
    ``manual``: the reference (unfused AdamW, :class:`ManualClip` instead of ``gradient_clip_val``)."""
    callbacks: list[L.Callback] = [PoisonGrad(poison_step)] if poison_step is not None else []
    manual_clip = ManualClip(clip) if manual and clip is not None else None
    callbacks += [manual_clip] if manual_clip is not None else []
    recorder, trainer = J.fit(
        nd,
        steps=STEPS,
        init_path=init_path,
        callbacks=callbacks,
        clip=None if manual else clip,
        module_kwargs={"fused_optimizer": not manual, "eps": EPS},
        strategy_cls=STRATEGIES[strategy],
        trainer_kwargs=trainer_kwargs(precision),
    )
    out = J.summary(recorder, trainer)
    out.update(
        fused=_fused(trainer),
        plugin=type(trainer.precision_plugin).__name__,
        scale=_scale(trainer),
        norms=manual_clip.norms if manual_clip is not None else [],
    )
    return out


def strategy_job(init_path: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several trainings one after another on the pool's ranks; each config holds :func:`run` arguments."""
    return [run(init_path, **config) for config in configs]
