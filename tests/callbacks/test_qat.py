"""``QuantizationAwareTraining`` inside a Trainer: fake quantization from ``start_step`` on (validation included),
the optimizer keeps updating the same Parameters, and the layers are real quantized ones after fit."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.qat import QuantizationAwareTraining
from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.quantization import FakeQuantLinear
from lightning_llmopt.testing import RandomTokens


class Probe(L.Callback):
    """Records the type of one layer at every training and validation batch, and whether the optimizer owns it."""

    def __init__(self) -> None:
        self.train_types: list[type] = []
        self.val_types: list[type] = []
        self.in_optimizer: list[bool] = []
        self.weights: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        layer = pl_module.model.layers["0"].attention.wq
        self.train_types.append(type(layer))
        owned = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        self.in_optimizer.append(id(layer.weight) in owned)
        self.weights.append(layer.weight.detach().clone())

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.val_types.append(type(pl_module.model.layers["0"].attention.wq))


def test_qat_callback_in_a_trainer() -> None:
    torch.manual_seed(0)
    module = CausalLMModule("tiny", learning_rate=1e-3, warmup_steps=0)
    data = DataLoader(RandomTokens(320, 32, 16), batch_size=4)
    qat = QuantizationAwareTraining(bits=4, group_size=32, start_step=2)
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[qat, probe],
    )
    trainer.fit(module, data, DataLoader(RandomTokens(320, 32, 4, seed=99), batch_size=4))
    assert probe.train_types == [nn.Linear, nn.Linear, FakeQuantLinear, FakeQuantLinear]
    assert probe.val_types and set(probe.val_types) == {FakeQuantLinear}  # validation saw the quantized model
    assert all(probe.in_optimizer)
    assert not torch.equal(probe.weights[2], probe.weights[3])  # still trained while fake-quantized
    model = module.model
    assert isinstance(model.layers["1"].feed_forward.w2, QuantizedLinear) and qat.converted
    assert type(model.output) is nn.Linear and len(qat.layers) == 14
    tokens = torch.randint(0, 320, (1, 8))
    with torch.no_grad():
        assert torch.isfinite(model(tokens)).all()


def test_state_dict_round_trip() -> None:
    qat = QuantizationAwareTraining(bits=4, group_size=32, start_step=5)
    qat.enabled, qat.layers = True, ["layers.0.attention.wq"]
    state = qat.state_dict()
    assert state["enabled"] and state["bits"] == 4 and state["group_size"] == 32
    resumed = QuantizationAwareTraining(bits=4, group_size=32, start_step=8)
    resumed.load_state_dict(state)
    assert resumed.start_step == 5 and resumed.layers == ["layers.0.attention.wq"]
    with pytest.warns(UserWarning, match="QAT settings"):
        QuantizationAwareTraining(bits=8, group_size=32).load_state_dict(state)
    with pytest.raises(ValueError, match="start_step"):
        QuantizationAwareTraining(start_step=-1)
