"""ZeroStrategy on one CUDA GPU: parameter offload keeps parameters on the CPU and computes the same as stage 3.

Skipped without CUDA (``gpu`` marker). On the CPU the offload path never moves anything between devices, so only a
GPU run can catch a tensor left on the wrong side (the RoPE table, the batch, optimizer state).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from lightning_llmopt import CausalLMModule
from lightning_llmopt.strategies import ZeroStrategy
from lightning_llmopt.testing.data import RandomTokens

pytestmark = pytest.mark.gpu


class _Module(CausalLMModule):
    def __init__(self, init: dict[str, torch.Tensor]) -> None:
        super().__init__("tiny", warmup_steps=1, max_steps=10)
        self.init = init

    def on_fit_start(self) -> None:
        set_model_state_dict(self, self.init, options=StateDictOptions(full_state_dict=True))


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.param_devices: set[str] = set()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.param_devices |= {p.device.type for p in pl_module.parameters()}


def _fit(init: dict[str, torch.Tensor], **strategy_kwargs: Any) -> _Losses:
    L.seed_everything(0, verbose=False)
    record = _Losses()
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=ZeroStrategy(stage=3, **strategy_kwargs),
                        precision="32-true", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[record])
    data = RandomTokens(256, 64, 16, seed=0)
    trainer.fit(_Module(init), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    return record


def test_zero3_offload_matches_zero3_on_gpu() -> None:
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny")
    module.configure_model()
    init = {k: v.clone() for k, v in module.state_dict().items()}
    plain = _fit(init)
    offload = _fit(init, offload_optimizer=True, offload_parameters=True)
    assert plain.param_devices == {"cuda"}
    assert offload.param_devices == {"cpu"}  # sharded parameters live on the host between steps
    assert len(offload.losses) == len(plain.losses) == 4
    # fp32 on both sides; the optimizer step runs on the CPU instead of the GPU (different kernels, same math).
    torch.testing.assert_close(torch.tensor(offload.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
