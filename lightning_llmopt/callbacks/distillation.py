"""``Distillation``: train the module's model against a frozen teacher (response KL, features, attention maps).

A thin adapter over :mod:`lightning_llmopt.compression.distill`. At ``setup`` the callback prepares the teacher
(``eval``, no gradients, optionally cast to ``teacher_dtype`` or quantized with our
:func:`~lightning_llmopt.quantization.quantize_model`, placed on ``teacher_device`` or the module's device) and
replaces the training loss of a :class:`~lightning_llmopt.CausalLMModule` (its ``train_loss(batch)``, shadowed on
the instance and restored at ``teardown``) by::

    alpha * T^2 KL(teacher_T || student_T) + (1 - alpha) * CE
        + feature_weight * MSE(proj(h_student), h_teacher) + attention_weight * KL(A_teacher || A_student)

Validation still measures the plain cross-entropy of the student. The fused linear + cross-entropy path is not
used while distilling (the KL term needs the student's logits).

The teacher is held by the callback, not by the LightningModule: no strategy sees it, so under
:class:`~lightning_llmopt.strategies.ZeroStrategy` it is neither sharded, broadcast nor optimized; each rank keeps a
full copy (use ``teacher_dtype=torch.bfloat16`` or int8 quantization to halve or quarter it, or ``teacher_device=
"cpu"`` to keep it off the accelerator at the cost of a host-device copy of the logits). When hidden widths differ
the learned projection (:class:`~lightning_llmopt.compression.FeatureProjector`) is registered on the module as
``distill_projector`` (so strategies broadcast and checkpoint it) and added to the first optimizer as its own
parameter group (the first group's learning-rate schedule, no weight decay) by wrapping ``configure_optimizers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_llmopt.compression.attention_maps import LayerCapture
from lightning_llmopt.compression.distill import (
    FeatureProjector,
    attention_map_loss,
    default_layer_map,
    distillation_loss,
    feature_loss,
)

IGNORE_INDEX = -100


class Distillation(L.Callback):
    """Knowledge distillation from a frozen teacher into the module's ``model``.

    Arguments:
        teacher: the teacher model (``model(tokens, positions=, doc_ids=)`` -> logits; our ``Llama`` for feature
            or attention losses), with the student's vocabulary.
        temperature: softmax temperature ``T`` of the KL term.
        alpha: weight of the KL term against the hard-label cross-entropy.
        feature_weight: weight of the hidden-state loss (0: off).
        attention_weight: weight of the attention-map loss (0: off).
        layer_map: ``(student block, teacher block)`` pairs for the feature and attention losses (default
            :func:`~lightning_llmopt.compression.default_layer_map`).
        attention_layers: student blocks (from ``layer_map``) whose attention maps are compared (default: the
            last pair only; each costs an eager ``(B, H, T, T)`` softmax, see
            :mod:`lightning_llmopt.compression.attention_maps`).
        teacher_dtype: cast the teacher's parameters to this dtype (e.g. ``torch.bfloat16``).
        teacher_quantization: a :class:`~lightning_llmopt.quantization.QuantConfig` (round to nearest) applied to
            the teacher at setup, e.g. ``QuantConfig(bits=8, group_size=None)``.
        teacher_device: where the teacher runs (default: the module's device).
    """

    def __init__(
        self,
        teacher: nn.Module,
        temperature: float = 2.0,
        alpha: float = 0.5,
        feature_weight: float = 0.0,
        attention_weight: float = 0.0,
        layer_map: Sequence[tuple[int, int]] | None = None,
        attention_layers: Sequence[int] | None = None,
        teacher_dtype: torch.dtype | None = None,
        teacher_quantization: Any = None,
        teacher_device: torch.device | str | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature ({temperature}) must be > 0")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha ({alpha}) must be in [0, 1]")
        if feature_weight < 0 or attention_weight < 0:
            raise ValueError(
                f"feature_weight ({feature_weight}) and attention_weight ({attention_weight}) must be >= 0"
            )
        self.teacher = teacher
        self.temperature, self.alpha = temperature, alpha
        self.feature_weight, self.attention_weight = feature_weight, attention_weight
        self.layer_map = list(layer_map) if layer_map is not None else None
        self.attention_layers = list(attention_layers) if attention_layers is not None else None
        self.teacher_dtype, self.teacher_quantization = teacher_dtype, teacher_quantization
        self.teacher_device = torch.device(teacher_device) if teacher_device is not None else None
        self._prepared = False
        self._patched: L.LightningModule | None = None

    # ------------------------------------------------------------------ setup
    def _prepare_teacher(self, device: torch.device) -> None:
        if self._prepared:
            return
        t = self.teacher.eval().requires_grad_(False)
        if self.teacher_quantization is not None:
            from lightning_llmopt.quantization import quantize_model

            quantize_model(t, self.teacher_quantization)
        if self.teacher_dtype is not None:
            for p in t.parameters():
                p.data = p.data.to(self.teacher_dtype)
        t.to(self.teacher_device or device)
        self._prepared = True

    def _pairs(self, student: nn.Module) -> list[tuple[int, int]]:
        if self.layer_map is not None:
            return self.layer_map
        return default_layer_map(len(student.layers), len(self.teacher.layers))  # type: ignore[arg-type]

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not hasattr(pl_module, "train_loss"):
            raise TypeError("Distillation needs a CausalLMModule (or a module computing its loss in train_loss)")
        self._prepare_teacher(pl_module.device)
        pl_module.train_loss = self._loss(pl_module)  # type: ignore[method-assign]
        self._patched = pl_module
        if self.feature_weight > 0:
            self._add_projector(pl_module)

    def _add_projector(self, pl_module: L.LightningModule) -> None:
        s_dim = pl_module.config.dim  # type: ignore[attr-defined]
        t_dim = self.teacher.config.dim  # type: ignore[union-attr]
        if s_dim == t_dim or hasattr(pl_module, "distill_projector"):
            return
        n_pairs = len(self.layer_map) if self.layer_map is not None else pl_module.config.n_layers  # type: ignore
        pl_module.distill_projector = FeatureProjector(s_dim, t_dim, n_pairs)
        original = pl_module.configure_optimizers

        def configure_optimizers() -> Any:
            out = original()
            opt = out["optimizer"] if isinstance(out, dict) else out[0] if isinstance(out, (list, tuple)) else out
            opt = opt[0] if isinstance(opt, (list, tuple)) else opt
            first = opt.param_groups[0]
            opt.add_param_group(
                {
                    "params": list(pl_module.distill_projector.parameters()),
                    "weight_decay": 0.0,
                    "initial_lr": first.get("initial_lr", first["lr"]),
                }
            )
            _extend_scheduler(out, opt)
            return out

        pl_module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._patched is not None:
            for name in ("train_loss", "configure_optimizers"):
                self._patched.__dict__.pop(name, None)
            self._patched = None

    # ------------------------------------------------------------------ the loss
    def _loss(self, pl_module: L.LightningModule) -> Any:
        def train_loss(batch: dict[str, Tensor]) -> Tensor:
            student = pl_module.model  # type: ignore[attr-defined]
            pairs = self._pairs(student) if (self.feature_weight or self.attention_weight) else []
            attn_pairs = (
                [p for p in pairs if p[0] in (self.attention_layers or [pairs[-1][0]])]
                if (self.attention_weight and pairs)
                else []
            )
            feat = [s for s, _ in pairs] if self.feature_weight else []
            s_cap = LayerCapture(student, feat, [s for s, _ in attn_pairs]) if pairs else None
            t_cap = (
                LayerCapture(
                    self.teacher, [t for _, t in pairs] if self.feature_weight else [], [t for _, t in attn_pairs]
                )
                if pairs
                else None
            )
            kwargs = {k: batch.get(k) for k in ("positions", "doc_ids")}
            t_dev = next(self.teacher.parameters()).device
            with torch.no_grad():
                with t_cap or nullcontext():
                    t_logits = self.teacher(
                        batch["input_ids"].to(t_dev),
                        **{k: v.to(t_dev) if v is not None else None for k, v in kwargs.items()},
                    )
                t_attn = [t_cap.attention_probs(t) for _, t in attn_pairs] if t_cap else []
            with s_cap or nullcontext():
                s_logits = student(batch["input_ids"], **kwargs)
            labels = batch["labels"]
            total, kl, ce = distillation_loss(
                s_logits, t_logits.to(s_logits.device), labels, self.temperature, self.alpha
            )
            pl_module.log("distill/kl", kl.detach())
            pl_module.log("distill/ce", ce.detach())
            if self.feature_weight and s_cap is not None and t_cap is not None:
                proj = getattr(pl_module, "distill_projector", None)
                f = feature_loss(
                    [s_cap.hidden[s] for s, _ in pairs],
                    [t_cap.hidden[t].to(s_logits.device) for _, t in pairs],
                    proj,
                    labels != IGNORE_INDEX,
                )
                pl_module.log("distill/feature", f.detach())
                total = total + self.feature_weight * f
            if attn_pairs and s_cap is not None:
                a = attention_map_loss(
                    [s_cap.attention_probs(s) for s, _ in attn_pairs], [p.to(s_logits.device) for p in t_attn]
                )
                pl_module.log("distill/attention", a.detach())
                total = total + self.attention_weight * a
            return total

        return train_loss

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "alpha": self.alpha,
            "feature_weight": self.feature_weight,
            "attention_weight": self.attention_weight,
            "layer_map": self.layer_map,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict.get(k) for k in ("temperature", "alpha", "feature_weight", "attention_weight")}
        current = {k: getattr(self, k) for k in saved}
        if saved != current:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"the checkpoint was distilled with {saved}; resuming with {current}")


def _extend_scheduler(out: Any, opt: Any) -> None:
    """Give the projector's new param group the first group's schedule (LambdaLR-style schedulers)."""
    sched = out.get("lr_scheduler") if isinstance(out, dict) else None
    sched = sched.get("scheduler") if isinstance(sched, dict) else sched
    if sched is None or getattr(sched, "optimizer", None) is not opt:
        return
    sched.base_lrs.append(sched.base_lrs[0])
    if hasattr(sched, "lr_lambdas"):
        sched.lr_lambdas.append(sched.lr_lambdas[0])


__all__ = ["Distillation"]
