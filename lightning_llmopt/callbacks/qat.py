"""``QuantizationAwareTraining``: fake quantization during fit, real quantized layers at the end.

A thin adapter over :mod:`lightning_llmopt.quantization.qat`. At ``on_fit_start`` (or at the first training batch
once ``trainer.global_step >= start_step``) every selected ``nn.Linear`` of the module's model becomes a
:class:`~lightning_llmopt.quantization.qat.FakeQuantLinear` sharing the same Parameters, so the optimizer built by
the strategy keeps updating them, state-dict keys do not change and checkpoints stay loadable with or without the
callback. Validation during fit therefore measures the quantized model. At ``on_fit_end`` the fake-quantized
layers are converted to :class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear` (``convert_on_fit_end``),
after the last checkpoint was written.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_llmopt.quantization.config import DEFAULT_SKIP, QuantConfig
from lightning_llmopt.quantization.qat import convert_qat, prepare_qat

_SETTINGS = ("bits", "group_size", "symmetric", "observer")


class QuantizationAwareTraining(L.Callback):
    """Trains with fake-quantized linear weights (straight-through estimator) and converts them at the end.

    Arguments:
        bits: code width trained for (4 for int4).
        group_size: input columns per scale; ``None``: per output channel.
        symmetric: symmetric grid (GPTQ ``sym=True``).
        observer: range selection at every step (``"minmax"``, ``"mse"``, ``"percentile"``).
        skip: ``fnmatch`` patterns of layer names (inside the model) left in full precision.
        start_step: global step at which fake quantization starts (0: from the first step).
        convert_on_fit_end: replace the layers by real quantized ones when fit ends.
        convert_dtype: dtype of scales and biases after conversion (default: the weights' dtype).
    """

    def __init__(
        self,
        bits: int = 4,
        group_size: int | None = 128,
        symmetric: bool = True,
        observer: str = "minmax",
        skip: tuple[str, ...] = DEFAULT_SKIP,
        start_step: int = 0,
        convert_on_fit_end: bool = True,
        convert_dtype: torch.dtype | None = None,
    ) -> None:
        if start_step < 0:
            raise ValueError(f"start_step ({start_step}) must be >= 0")
        self.config = QuantConfig(
            bits=bits, group_size=group_size, symmetric=symmetric, observer=observer, skip=tuple(skip)
        )
        self.start_step = start_step
        self.convert_on_fit_end = convert_on_fit_end
        self.convert_dtype = convert_dtype
        self.enabled = False
        self.converted = False
        self.layers: list[str] = []

    @staticmethod
    def _target(pl_module: L.LightningModule) -> nn.Module:
        model = getattr(pl_module, "model", None)
        return model if isinstance(model, nn.Module) else pl_module

    def _maybe_enable(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled or self.converted or trainer.global_step < self.start_step:
            return
        self.layers = prepare_qat(self._target(pl_module), self.config)
        if not self.layers:
            rank_zero_warn("QuantizationAwareTraining found no nn.Linear layer to fake-quantize")
        self.enabled = True
        spec = self.config.spec_for("")
        rank_zero_info(
            f"QAT: fake-quantizing {len(self.layers)} linear layers to "
            f"{spec.describe() if spec else 'float'} from step {trainer.global_step}"
        )

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        float8 = getattr(pl_module, "hparams", {}).get("float8")
        if float8:  # FP8 layers are not plain nn.Linear: QAT would skip every one of them without a word
            raise ValueError(
                f"QuantizationAwareTraining fake-quantizes plain nn.Linear layers, and the module trains FP8 linear "
                f"layers (float8={float8!r}). Train QAT in bf16 (float8=None), or quantize the FP8-trained checkpoint "
                f"afterwards (llmopt quantize)"
            )
        self.enabled = False  # the layers of a new fit are plain nn.Linear again unless prepared here
        self._maybe_enable(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._maybe_enable(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.convert_on_fit_end and self.enabled:
            convert_qat(self._target(pl_module), dtype=self.convert_dtype)
            self.converted = True
            self.enabled = False

    @override
    def state_dict(self) -> dict[str, Any]:
        settings = {k: getattr(self.config, k) for k in _SETTINGS}
        return {**settings, "start_step": self.start_step, "enabled": self.enabled, "layers": list(self.layers)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict.get(k) for k in _SETTINGS}
        current = {k: getattr(self.config, k) for k in _SETTINGS}
        if saved != current:
            rank_zero_warn(f"the checkpoint was trained with QAT settings {saved}; resuming with {current}")
        if state_dict.get("enabled") and self.start_step > int(state_dict.get("start_step", 0)):
            self.start_step = int(state_dict.get("start_step", 0))  # it had started: keep fake quantization on
        self.layers = list(state_dict.get("layers", []))


__all__ = ["QuantizationAwareTraining"]
