"""The training callbacks together under a real 2-process DDP run on CPU (gloo)."""

from __future__ import annotations

import random

import lightning as L
import pytest

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks import ActivationCheckpointing, Curriculum, SequencePacking, TrainingMonitor
from lightning_llmopt.data import TextDataModule


@pytest.mark.slow
def test_callbacks_compose_under_ddp(tmp_path):
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):  # long-tailed enough that packing removes padding
        (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(5, 120))))
    L.seed_everything(0)
    data = TextDataModule(data_path=str(corpus), seq_len=64, batch_size=2, max_bytes=None, val_fraction=0.1)
    callbacks = [ActivationCheckpointing("full"), SequencePacking("ffd"),
                 Curriculum(scorer="length", pacing="root", total_steps=6), TrainingMonitor(log_every_n_steps=2)]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=6, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, callbacks=callbacks,
                        limit_val_batches=2, val_check_interval=3, check_val_every_n_epoch=None,
                        default_root_dir=tmp_path)
    trainer.fit(CausalLMModule("tiny", warmup_steps=2), data)
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert m["train/tokens_seen"] == 6 * 2 * 2 * 64  # steps x ranks x rows x tokens
    assert m["ac/saved_activation_bytes"] < m["ac/saved_activation_bytes_no_ac"]
    assert m["packing/padding_waste_after"] < m["packing/padding_waste_before"]
    assert 0 < m["curriculum/competence"] <= 1
    assert m["val/loss"] > 0 and m["perf/tokens_per_sec"] > 0
