"""One run, one folder (``llmopt fit``): checkpoints and logs under the run folder, a second run of one config in
its own folder, resuming in place, the end-of-run summary, and a user's own LightningModule (``--model``)."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "tiny_cpu.yaml"
# shorter than the config's validation interval (100): the summary must still say what happened
SHORT = [
    "--trainer.max_steps=3",
    "--data.max_bytes=100000",
    "--data.batch_size=2",
    "--data.seq_len=32",
    "--model.warmup_steps=1",
    "--wandb=false",
]


def _fit(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    from lightning_llmopt.cli.main import main

    capsys.readouterr()
    main(["fit", "--config", str(CONFIG), *SHORT, *args])
    captured = capsys.readouterr()
    return captured.out, captured.err


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMOPT_RUN_DIR", raising=False)
    return tmp_path


def test_second_run_of_a_config_gets_its_own_folder_and_a_summary(in_tmp: Path, capsys) -> None:
    out, _ = _fit([], capsys)
    first = in_tmp / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt"
    assert first.is_file() and (in_tmp / "runs" / "tiny_cpu" / "csv").is_dir()
    # the summary of a run that ended before its first validation
    assert "steps: 3, last train loss: " in out
    assert "validation: none ran" in out
    assert f"checkpoint: {first.resolve()}" in out
    before = _digest(first)

    out, err = _fit([], capsys)  # the same config again, e.g. a fine-tune: must not touch the first run
    second = in_tmp / "runs" / "tiny_cpu-2" / "checkpoints" / "last.ckpt"
    assert "run folder: runs/tiny_cpu-2 (runs/tiny_cpu holds an earlier run's checkpoints" in err
    assert second.is_file() and (in_tmp / "runs" / "tiny_cpu-2" / "csv").is_dir()
    assert f"checkpoint: {second.resolve()}" in out
    assert _digest(first) == before
    assert sorted(p.name for p in first.parent.iterdir()) == ["last.ckpt"]  # no last-v1.ckpt beside it


def test_default_root_dir_and_run_name_move_checkpoints_and_logs(in_tmp: Path, capsys) -> None:
    _fit(["--trainer.default_root_dir=elsewhere"], capsys)
    assert (in_tmp / "elsewhere" / "checkpoints" / "last.ckpt").is_file()
    assert (in_tmp / "elsewhere" / "csv").is_dir()
    _fit(["--run_name=ablation"], capsys)
    assert (in_tmp / "runs" / "tiny_cpu" / "ablation" / "checkpoints" / "last.ckpt").is_file()
    assert not (in_tmp / "runs" / "tiny_cpu" / "checkpoints").exists()


def test_resuming_keeps_the_folder(in_tmp: Path, capsys) -> None:
    _fit([], capsys)
    last = in_tmp / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt"
    out, err = _fit([f"--ckpt_path={last}", "--trainer.max_steps=5"], capsys)
    assert "run folder:" not in err and not (in_tmp / "runs" / "tiny_cpu-2").exists()
    assert "steps: 5," in out


_OWN_MODULE = '''
import torch
from lightning.pytorch import LightningModule


class TinyLM(LightningModule):
    """A user's own module: a bigram model over the data module's batches."""

    def __init__(self, lr: float = 1e-2, vocab_size: int = 320) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab_size, 16)
        self.head = torch.nn.Linear(16, vocab_size)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.head(self.embed(ids[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
'''


def test_own_lightning_module_by_import_path(in_tmp: Path, capsys) -> None:
    package = in_tmp / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(_OWN_MODULE))
    out, _ = _fit(["--model", "my_pkg.TinyLM", "--model.init_args.lr=0.02"], capsys)
    assert "steps: 3, last train loss: " in out
    ckpt = in_tmp / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt"
    import torch

    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["hyper_parameters"]["lr"] == 0.02
    assert any(key.startswith("embed.") for key in state["state_dict"])
    # the configured callbacks ran with the foreign module: the training monitor's throughput line
    assert "tokens/s per device" in out
