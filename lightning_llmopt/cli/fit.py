"""``llmopt fit|validate|test|predict``: LightningCLI over :class:`CausalLMModule` and :class:`TextDataModule`.

The only part of the ``llmopt`` command that imports Lightning and the training stack (the module, our strategies,
callbacks and data module); :mod:`lightning_llmopt.cli.main` imports this module only for these subcommands.

Unless the configuration names loggers, the run logs to CSV and to Weights & Biases, offline when no API key is
configured (``WANDB_API_KEY`` or a netrc entry), online otherwise; ``--wandb false`` turns W&B off.
"""

from __future__ import annotations

import netrc
import os
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

import lightning_llmopt.strategies  # noqa: F401  (registers zero*, nd_parallel, ... for --trainer.strategy)
from lightning_llmopt.callbacks.monitor import TrainingMonitor
from lightning_llmopt.data.datamodule import TextDataModule
from lightning_llmopt.module import CausalLMModule

_WANDB_AVAILABLE = RequirementCache("wandb")


def wandb_api_key_configured() -> bool:
    """True when W&B could log online: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def default_loggers(save_dir: str, name: str, project: str = "lightning_llmopt", wandb: bool = True) -> list[Logger]:
    """CSV plus W&B (offline without an API key). W&B creates its run on rank zero only, so one run per job."""
    loggers: list[Logger] = [CSVLogger(save_dir=save_dir, name="csv")]
    if wandb and not _WANDB_AVAILABLE:
        rank_zero_warn("wandb is not installed (pip install 'lightning_llmopt[wandb]'): logging to CSV only")
    elif wandb:
        from lightning.pytorch.loggers import WandbLogger

        offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_api_key_configured()
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        loggers.insert(0, WandbLogger(project=project, name=name, save_dir=save_dir, offline=offline))
    return loggers


class LLMOptCLI(LightningCLI):
    """LightningCLI with our defaults: W&B + CSV logging and a final report of the validation loss."""

    @override
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--wandb", type=bool, default=True, help="log to Weights & Biases (offline without key)")
        parser.add_argument("--wandb_project", type=str, default="lightning_llmopt", help="W&B project name")
        parser.add_argument("--run_name", type=str, default=None, help="run name (default: the config file's stem)")

    def _section(self) -> Any:
        return self.config[self.subcommand] if self.subcommand else self.config

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        if trainer_cfg.get("enable_progress_bar") in (None, True) and not sys.stderr.isatty():
            from lightning.pytorch.callbacks import ProgressBar

            from lightning_llmopt.cli.progress import line_progress_bar

            configured = trainer_cfg.get("callbacks") or []
            if not any(isinstance(c, ProgressBar) for c in configured):  # logs and pipes: lines, not tqdm redraws
                # replaces the trainer's "callbacks" entry: keep the configured ones
                kwargs["callbacks"] = [*configured, *kwargs.get("callbacks", []), line_progress_bar()]
        if trainer_cfg.get("logger") in (None, True) and "logger" not in kwargs:
            section = self._section()
            configs = section.get("config") or []
            name = section.get("run_name") or (Path(str(configs[-1])).stem if configs else "run")
            root = trainer_cfg.get("default_root_dir") or os.getcwd()
            kwargs["logger"] = default_loggers(str(root), name, section.get("wandb_project"), section.get("wandb"))
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        self._report()

    def after_validate(self) -> None:
        self._report()

    def _report(self) -> None:
        metrics = self.trainer.callback_metrics
        monitors = [c for c in getattr(self.trainer, "callbacks", []) if isinstance(c, TrainingMonitor)]
        perf = monitors[0].summary_line() if monitors and self.trainer.is_global_zero else ""
        if perf:
            print(perf, flush=True)
        if "val/loss" not in metrics:
            return
        lines = [f"final validation loss: {float(metrics['val/loss']):.4f} nats/token"]
        if "val/ppl" in metrics:
            lines.append(f"validation perplexity: {float(metrics['val/ppl']):.3f}")
        baseline = getattr(self.datamodule, "unigram_entropy", None)
        if callable(baseline):
            lines.append(f"unigram baseline: {baseline():.4f} nats/token")
        ckpt = self.trainer.checkpoint_callback
        path = (getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")) if ckpt else ""
        if path:
            lines.append(f"checkpoint: {path}")
        if self.trainer.is_global_zero:
            print("\n".join(lines), flush=True)


def run(args: list[str] | None) -> None:
    """Run LightningCLI on ``args`` (``None``: ``sys.argv``), e.g. ``["fit", "--config", "tiny_cpu.yaml"]``."""
    if not RequirementCache("jsonargparse[signatures]>=4.32"):
        raise SystemExit("llmopt needs the command-line extra: pip install 'lightning_llmopt[cli]'")
    LLMOptCLI(
        CausalLMModule,
        TextDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"parser_mode": "omegaconf"} if RequirementCache("omegaconf") else None,
    )
