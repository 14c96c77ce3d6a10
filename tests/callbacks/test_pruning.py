"""``Pruning`` inside a Trainer: the cubic schedule, masks kept through optimizer steps (fine-tuning), 2:4, and
the state round trip."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.pruning import Pruning
from lightning_llmopt.compression import is_nm_sparse, sparsity_of
from lightning_llmopt.testing import RandomTokens


class Probe(L.Callback):
    """Sparsity of the model's pruned layers after every training batch, and a weight snapshot."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.sparsity: list[float] = []
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.sparsity.append(sparsity_of(pl_module.model, self.names))
        self.weights.append(pl_module.model.layers["0"].attention.wq.weight.detach().clone())


def _fit(callback: Pruning, steps: int) -> tuple[CausalLMModule, Probe]:
    torch.manual_seed(0)
    module = CausalLMModule("tiny", learning_rate=1e-3, warmup_steps=0)
    module.configure_model()
    names = [n for n, m in module.model.named_modules() if isinstance(m, torch.nn.Linear) and n != "output"]
    probe = Probe(names)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, probe],
    )
    trainer.fit(module, DataLoader(RandomTokens(320, 16, 32), batch_size=4))
    return module, probe


def test_gradual_schedule_then_fine_tuning() -> None:
    cb = Pruning(sparsity=0.6, start_step=1, end_step=5, frequency=2)
    module, probe = _fit(cb, steps=8)
    expected = [0.0] + [cb.target_sparsity(s) for s in (1, 1, 3, 3, 5, 5, 5)]  # updates at 1, 3, 5
    assert probe.sparsity == pytest.approx(expected, abs=2e-4)
    assert expected[1] == 0.0 and 0 < expected[3] < 0.6 and expected[5] == 0.6
    # fine-tuning: the mask is fixed, the kept weights keep changing, the dropped stay zero
    mask = probe.weights[5] != 0
    for w in probe.weights[6:]:
        assert torch.equal(w != 0, mask)
    assert not torch.equal(probe.weights[6], probe.weights[7])


def test_two_four_and_state_round_trip() -> None:
    cb = Pruning(pattern="2:4", start_step=0)
    module, probe = _fit(cb, steps=3)
    assert probe.sparsity == pytest.approx([0.5] * 3)
    assert all(is_nm_sparse(module.model.get_submodule(n).weight != 0) for n in cb.masks)
    state = cb.state_dict()
    resumed = Pruning(pattern="2:4", start_step=0)
    resumed.load_state_dict(state)
    assert resumed.last_update == 0 and resumed.masks.keys() == cb.masks.keys()
    assert all(torch.equal(resumed.masks[k], cb.masks[k].cpu()) for k in cb.masks)
    assert not resumed._due(5)  # resumed after the one-shot update: no new masks
    with pytest.raises(ValueError, match="initial_sparsity"):
        Pruning(sparsity=0.3, initial_sparsity=0.5)
