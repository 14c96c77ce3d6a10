"""MicroBatchSizeFinder: finds the OOM threshold by bisection, keeps the global batch, leaves no trace."""

from __future__ import annotations

import math
import types

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.batch_size_finder import (
    MicroBatchSizeFinder,
    is_oom_error,
    largest_divisor_at_most,
    search_largest_fit,
)

THRESHOLD = 12


class RandomTokens(Dataset):
    def __init__(self, n: int = 128, seq_len: int = 16, vocab: int = 320) -> None:
        self.rows = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i, :-1], "labels": self.rows[i, 1:]}


class TokensDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(), batch_size=self.batch_size, shuffle=False)


class OOMAbove(CausalLMModule):
    """Runs out of memory (raises ``torch.OutOfMemoryError`` in the backward) when a batch has more than 12 rows."""

    def __init__(self) -> None:
        super().__init__("tiny", warmup_steps=1)
        self.calls: list[int] = []
        self.loop_batches: list[int] = []

    def training_step(self, batch, batch_idx):
        rows = batch["input_ids"].shape[0]
        self.calls.append(rows)
        loss = super().training_step(batch, batch_idx)
        if rows > THRESHOLD:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a batch of {rows}")
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.loop_batches.append(batch["input_ids"].shape[0])


class Snapshot(L.Callback):
    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer_state = -1

    def on_fit_start(self, trainer, pl_module):
        self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.optimizer_state = len(trainer.optimizers[0].state)
        self.tokens_seen = pl_module.tokens_seen


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 12, 13, 31, 64, 100, 1024, 5000])
def test_search_finds_threshold_in_few_trials(threshold):
    found, trials = search_largest_fit(lambda n: n <= threshold, init=1, max_val=1024)
    assert found == min(threshold, 1024)
    assert len(trials) <= 2 * math.ceil(math.log2(min(threshold, 1024) + 1)) + 1
    assert len(set(trials)) == len(trials)  # never the same size twice


def test_search_from_a_large_init_and_divisors():
    assert search_largest_fit(lambda n: n <= 5, init=64, max_val=1024)[0] == 5
    assert [largest_divisor_at_most(48, k) for k in (12, 11, 7, 100)] == [12, 8, 6, 48]
    assert largest_divisor_at_most(40, 12) == 10


def _fit(tmp_path, callbacks, module, datamodule, max_steps, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks,
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def test_finder_in_trainer_then_resume_without_search(tmp_path):
    before, after = Snapshot(), Snapshot()
    finder = MicroBatchSizeFinder(global_batch_size=48, steps_per_trial=1)
    module, data = OOMAbove(), TokensDataModule(batch_size=4)
    trainer = _fit(tmp_path, [before, finder, after], module, data, max_steps=1)
    assert finder.found == THRESHOLD
    assert len(finder.trials) <= 2 * math.ceil(math.log2(THRESHOLD + 1))
    assert (finder.micro_batch_size, finder.accumulate_grad_batches) == (12, 4)
    assert trainer.accumulate_grad_batches == 4 and data.batch_size == 12
    assert module.loop_batches == [12, 12, 12, 12]  # one optimizer step = 4 micro-batches of 12 = 48 rows
    # The search left weights, optimizer state and the module's counters as they were.
    assert after.weights.keys() == before.weights.keys()
    for name, value in before.weights.items():
        assert torch.equal(after.weights[name], value), name
    assert before.optimizer_state == after.optimizer_state == 0
    assert before.tokens_seen == after.tokens_seen == 0

    path = tmp_path / "finder.ckpt"
    trainer.save_checkpoint(path)
    resumed, module2 = MicroBatchSizeFinder(), OOMAbove()
    data2 = TokensDataModule(batch_size=4)
    trainer2 = _fit(tmp_path, [resumed], module2, data2, max_steps=2, ckpt_path=path)
    assert resumed.found == THRESHOLD and resumed.global_batch_size == 48
    assert module2.calls == module2.loop_batches  # no trials: only the loop's batches
    assert set(module2.loop_batches) == {12}
    assert trainer2.accumulate_grad_batches == 4 and trainer2.global_step == 2


def test_default_global_batch_is_the_runs_own(tmp_path):
    finder = MicroBatchSizeFinder(init=4, steps_per_trial=1)
    module, data = OOMAbove(), TokensDataModule(batch_size=5)
    trainer = L.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[finder],
                        accumulate_grad_batches=4, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    # Global 20: the search is capped at 20, finds 12, and 10 is the largest divisor of 20 not above 12.
    assert finder.global_batch_size == 20 and finder.found == THRESHOLD
    assert (data.batch_size, trainer.accumulate_grad_batches) == (10, 2)


def test_errors_name_the_values():
    finder = MicroBatchSizeFinder(global_batch_size=30)
    fake_trainer = types.SimpleNamespace(world_size=4, accumulate_grad_batches=1, datamodule=TokensDataModule())
    with pytest.raises(ValueError, match=r"global_batch_size \(30\) must be divisible by world_size \(4\)"):
        finder.on_fit_start(fake_trainer, OOMAbove())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"init \(8\) must not exceed max_val \(4\)"):
        MicroBatchSizeFinder(init=8, max_val=4)
    with pytest.raises(ValueError, match=r"global_batch_size \(0\)"):
        MicroBatchSizeFinder(global_batch_size=0)
    with pytest.raises(ValueError, match="'bs'"):
        MicroBatchSizeFinder(batch_arg_name="bs")._holder(fake_trainer, OOMAbove())  # type: ignore[arg-type]


def test_is_oom_error():
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert not is_oom_error(RuntimeError("size mismatch"))
    assert not is_oom_error(ValueError("CUDA out of memory"))
