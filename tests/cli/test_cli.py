"""The ``llmopt`` command: fit on the example config (shortened), W&B offline run, checkpoint, validate, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "tiny_cpu.yaml"
SHORT = ["--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
         "--data.max_bytes=200000", "--data.batch_size=4", "--data.seq_len=64", "--model.warmup_steps=2"]


def _llmopt(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["WANDB_SILENT"] = "true"
    return subprocess.run([sys.executable, "-m", "lightning_llmopt.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_fit_writes_wandb_offline_run_and_checkpoint_then_validates(tmp_path):
    pytest.importorskip("wandb")
    fit = _llmopt(["fit", "--config", str(CONFIG), *SHORT], tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "final validation loss:" in fit.stdout
    assert "unigram baseline:" in fit.stdout
    runs = list((tmp_path / "runs" / "tiny_cpu" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "exactly one offline W&B run per job"
    ckpt = tmp_path / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    assert list((tmp_path / "runs" / "tiny_cpu" / "csv").glob("version_*/metrics.csv"))

    val = _llmopt(["validate", "--config", str(CONFIG), *SHORT, "--wandb=false", f"--ckpt_path={ckpt}"], tmp_path)
    assert val.returncode == 0, val.stderr[-3000:]
    assert "final validation loss:" in val.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        ("--model.model=gpt9", "unknown preset 'gpt9'"),
        ("--data.data_path=/no/such/corpus", "/no/such/corpus"),
        ("--model.model_overrides={n_heads: 4, n_kv_heads: 3}", "n_heads (4) must be divisible by n_kv_heads (3)"),
        ("--model.model_overrides={vocab_size: 100}", "vocabulary (258) is larger than the model's vocab_size (100)"),
    ],
)
def test_bad_input_fails_before_training_naming_the_value(tmp_path, override, message):
    result = _llmopt(["fit", "--config", str(CONFIG), *SHORT, "--wandb=false", override], tmp_path)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "runs" / "tiny_cpu" / "checkpoints").exists()
