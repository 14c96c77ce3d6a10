import random
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.sequence_packing import SequencePacking
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.data.packing import padding_waste


def _corpus(root: Path) -> Path:
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(40):
        n = rng.choice([rng.randint(1, 6), rng.randint(6, 30)])
        (root / f"d{i:02d}.txt").write_text(" ".join(rng.choice(["ab", "cde", "\n"]) for _ in range(n)))
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _corpus(tmp_path_factory.mktemp("seqpack"))


def _trainer(root: Path, callbacks: list, max_steps: int, **kwargs: Any) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        val_check_interval=max_steps,
        **kwargs,
    )


def test_callback_packs_and_logs_waste_in_a_short_run(corpus: Path, tmp_path: Path) -> None:
    dm = TextDataModule(str(corpus), seq_len=64, batch_size=2, val_fraction=0.1, seed=3)
    seen: list[dict[str, torch.Tensor]] = []
    module = CausalLMModule("tiny", warmup_steps=1)
    original = module.training_step

    def record(batch, batch_idx):  # type: ignore[no-untyped-def]
        seen.append(batch)
        return original(batch, batch_idx)

    module.training_step = record  # type: ignore[method-assign]
    callback = SequencePacking("best_fit", buffer_size=8)
    trainer = _trainer(tmp_path, [callback], max_steps=3, logger=False, enable_checkpointing=False)
    trainer.fit(module, datamodule=dm)
    assert dm.packing == "best_fit" and len(seen) == 3
    assert {"positions", "doc_ids"} <= set(seen[0])
    train = dm.train_dataset
    expected = padding_waste(train.docs.lengths.tolist(), 64, len(train))  # type: ignore[union-attr]
    metrics = trainer.callback_metrics
    assert float(metrics["packing/padding_waste_before"]) == pytest.approx(expected.before)
    assert float(metrics["packing/padding_waste_after"]) == pytest.approx(expected.after)
    assert expected.after < expected.before
    assert torch.isfinite(metrics["train/loss"])


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_callback_state_survives_checkpoint_and_resume(corpus: Path, tmp_path: Path) -> None:
    dm = TextDataModule(str(corpus), seq_len=64, batch_size=2, val_fraction=0.1, seed=3)
    callback = SequencePacking("ffd", buffer_size=16)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path, [callback, ckpt], max_steps=2, logger=False).fit(CausalLMModule("tiny"), datamodule=dm)
    (path,) = tmp_path.glob("*step=2.ckpt")
    saved = torch.load(path, weights_only=False)["callbacks"]["SequencePacking"]
    assert saved == callback.state_dict() and saved["algorithm"] == "ffd" and saved["buffer_size"] == 16
    assert saved["padding_stats"]["waste_after"] < saved["padding_stats"]["waste_before"]

    resumed = SequencePacking("ffd", buffer_size=16)
    dm2 = TextDataModule(str(corpus), seq_len=64, batch_size=2, val_fraction=0.1, seed=3)
    trainer = _trainer(tmp_path / "r", [resumed], max_steps=3, logger=False, enable_checkpointing=False)
    trainer.fit(CausalLMModule("tiny"), datamodule=dm2, ckpt_path=str(path))
    assert resumed.state_dict() == saved and dm2.packing == "ffd"
    assert trainer.global_step == 3

    changed = SequencePacking("best_fit", buffer_size=16)
    with pytest.warns(UserWarning, match=r"\('ffd', 16\) -> \('best_fit', 16\)"):
        changed.load_state_dict(saved)


class _Plain(LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 8, dtype=torch.long)))


def test_unsupported_datamodule_and_bad_arguments_are_named(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [SequencePacking()], max_steps=1, logger=False)
    with pytest.raises(TypeError, match="_Plain.*enable_packing"):
        trainer.fit(CausalLMModule("tiny"), datamodule=_Plain())
    with pytest.raises(ValueError, match=r"algorithm \('first_fit'\)"):
        SequencePacking("first_fit")
    with pytest.raises(ValueError, match=r"buffer_size \(0\)"):
        SequencePacking(buffer_size=0)
