"""``llmopt fit|validate|test|predict``: LightningCLI over :class:`CausalLMModule` and :class:`TextDataModule`.

The only part of the ``llmopt`` command that imports Lightning and the training stack (the module, our strategies,
callbacks and data module); :mod:`lightning_llmopt.cli.main` imports this module only for these subcommands.

Unless the configuration names loggers, the run logs to CSV and to Weights & Biases, offline when no API key is
configured (``WANDB_API_KEY`` or a netrc entry), online otherwise; ``--wandb false`` turns W&B off.

One run, one folder: the run folder is ``trainer.default_root_dir`` (``<default_root_dir>/<run_name>`` with
``--run_name``). Its checkpoints (a ``ModelCheckpoint`` without ``dirpath``), CSV logs and W&B run all go under it.
A new ``fit`` whose folder already holds checkpoints moves to the next free ``<folder>-2``, ``-3``, ... and says so;
``--ckpt_path`` (resuming on purpose) keeps the folder. Every ``fit`` ends with a summary: steps, last train loss,
validation loss (or that none ran), throughput and the checkpoint written.

On the CPU accelerator the intra-op threads and data-loader workers are sized to the cores and to the processes on
the node, and the choice printed once (:mod:`lightning_llmopt.cli.threads`); ``--num_threads N`` or
``LLMOPT_NUM_THREADS=N`` override it.

``--model`` takes any ``LightningModule`` by import path (LightningCLI's subclass mode), e.g.
``llmopt fit --config tiny_cpu.yaml --model my_pkg.MyModule --model.init_args.lr 1e-3``: our strategies, callbacks,
loggers and data module stay. Without it the model is :class:`CausalLMModule`, configured by ``--model.<arg>``.
"""

from __future__ import annotations

import netrc
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

import lightning_llmopt.strategies  # noqa: F401  (registers zero*, nd_parallel, ... for --trainer.strategy)
from lightning_llmopt.callbacks.monitor import TrainingMonitor
from lightning_llmopt.cli import threads
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


_RUN_DIR_ENV = "LLMOPT_RUN_DIR"  # rank 0's choice, inherited by the ranks Lightning's launcher starts


def _holds_checkpoints(folder: Path) -> bool:
    ckpts = folder / "checkpoints"
    return ckpts.is_dir() and any(ckpts.iterdir())


def resolve_run_dir(root: str | os.PathLike[str], run_name: str | None, resuming: bool) -> Path:
    """The folder a run writes to: ``root`` (or ``root/run_name``); for a new run (not ``resuming``) whose folder
    already holds checkpoints, the first free ``<folder>-2``, ``<folder>-3``, ... instead.

    Ranks other than 0 that a launcher started from rank 0's process take rank 0's choice (``LLMOPT_RUN_DIR``), so
    that every rank writes to one folder even after rank 0 created it."""
    chosen = os.environ.get(_RUN_DIR_ENV)
    if chosen and any(os.environ.get(k, "0") != "0" for k in ("LOCAL_RANK", "RANK", "NODE_RANK")):
        return Path(chosen)
    base = Path(root) / run_name if run_name else Path(root)
    folder = base
    if not resuming:
        n = 2
        while _holds_checkpoints(folder):
            folder = base.with_name(f"{base.name}-{n}")
            n += 1
    os.environ[_RUN_DIR_ENV] = str(folder)
    return folder


class LLMOptCLI(LightningCLI):
    """LightningCLI with our defaults: one folder per run, W&B + CSV logging and a summary at the end."""

    run_dir: Path | None = None

    @override
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--wandb", type=bool, default=True, help="log to Weights & Biases (offline without key)")
        parser.add_argument("--wandb_project", type=str, default="lightning_llmopt", help="W&B project name")
        parser.add_argument(
            "--run_name",
            type=str,
            default=None,
            help="run name: the W&B run's name and the run folder <default_root_dir>/<run_name> "
            "(default: the config file's stem, and the folder default_root_dir itself)",
        )
        parser.add_argument(
            "--num_threads",
            type=int | None,
            default=None,
            help="on CPU: intra-op threads per process (default: the cores available / the processes on this node; "
            "LLMOPT_NUM_THREADS=N does the same, 0 keeps torch's defaults)",
        )
        # subclass mode (--model my_pkg.MyModule) with CausalLMModule as the default class: --model.<arg> and a
        # config's plain ``model:`` keys configure it as before
        parser.set_defaults({"model": {"class_path": f"{CausalLMModule.__module__}.{CausalLMModule.__name__}"}})

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
        section = self._section()
        run_name = section.get("run_name")
        root = trainer_cfg.get("default_root_dir") or os.getcwd()
        resuming = self.subcommand != "fit" or bool(section.get("ckpt_path"))
        run_dir = resolve_run_dir(root, run_name, resuming)
        asked = Path(root) / run_name if run_name else Path(root)
        if run_dir != asked and _is_rank_zero():
            print(f"run folder: {run_dir} ({asked} holds an earlier run's checkpoints; --ckpt_path resumes that run)",
                  file=sys.stderr, flush=True)
        self.run_dir = run_dir
        kwargs["default_root_dir"] = str(run_dir)
        for callback in trainer_cfg.get("callbacks") or []:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = os.path.realpath(run_dir / "checkpoints")
        if trainer_cfg.get("logger") in (None, True) and "logger" not in kwargs:
            configs = section.get("config") or []
            name = run_name or (Path(str(configs[-1])).stem if configs else "run")
            kwargs["logger"] = default_loggers(str(run_dir), name, section.get("wandb_project"), section.get("wandb"))
        trainer = super().instantiate_trainer(**kwargs)
        self._size_cpu_threads(trainer, section.get("num_threads"))
        return trainer

    def _size_cpu_threads(self, trainer: Trainer, num_threads: int | None) -> None:
        """On the CPU accelerator: intra-op threads and data-loader workers for the processes this node runs
        (:mod:`lightning_llmopt.cli.threads`), one line on rank zero. Ranks that a launcher starts without running
        this command again (``ddp_spawn``) take the thread count from ``OMP_NUM_THREADS``."""
        if not isinstance(trainer.accelerator, CPUAccelerator):
            return
        processes = int(os.environ.get("LOCAL_WORLD_SIZE") or trainer.num_devices)
        workers = getattr(self.datamodule, "num_workers", 0)
        plan = threads.configure(processes, workers, num_threads)
        if _is_rank_zero():
            print(plan.describe(), file=sys.stderr, flush=True)
        if plan.workers != workers:
            self.datamodule.num_workers = plan.workers
        if plan.threads is not None and not os.environ.get("OMP_NUM_THREADS"):
            os.environ["OMP_NUM_THREADS"] = str(plan.threads)

    def after_fit(self) -> None:
        self._report(fit=True)

    def after_validate(self) -> None:
        self._report(fit=False)

    def _report(self, fit: bool) -> None:
        """The run's summary on rank zero: steps and last train loss (fit), the validation loss or that none ran,
        throughput, and the checkpoint written (or that none was)."""
        if not self.trainer.is_global_zero:
            return
        metrics = self.trainer.callback_metrics
        lines = []
        if fit:
            train = metrics.get("train/loss")
            lines.append(f"steps: {self.trainer.global_step}"
                         + (f", last train loss: {float(train):.4f} nats/token" if train is not None else ""))
        if "val/loss" in metrics:
            lines.append(f"final validation loss: {float(metrics['val/loss']):.4f} nats/token")
            if "val/ppl" in metrics:
                lines.append(f"validation perplexity: {float(metrics['val/ppl']):.3f}")
            baseline = getattr(self.datamodule, "unigram_entropy", None)
            if callable(baseline):
                lines.append(f"unigram baseline: {baseline():.4f} nats/token")
        elif fit:
            lines.append("validation: none ran (the run ended before trainer.val_check_interval)")
        monitors = [c for c in getattr(self.trainer, "callbacks", []) if isinstance(c, TrainingMonitor)]
        perf = monitors[0].summary_line() if monitors else ""
        if perf:
            lines.append(perf)
        if fit:
            ckpt = self.trainer.checkpoint_callback
            path = (getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")) if ckpt else ""
            lines.append(f"checkpoint: {path}" if path else "checkpoint: none written")
        print("\n".join(lines), flush=True)


def _is_rank_zero() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("LOCAL_RANK", "RANK", "NODE_RANK"))


def run(args: list[str] | None) -> None:
    """Run LightningCLI on ``args`` (``None``: ``sys.argv``), e.g. ``["fit", "--config", "tiny_cpu.yaml"]``."""
    if not RequirementCache("jsonargparse[signatures]>=4.32"):
        raise SystemExit("llmopt needs the command-line extra: pip install 'lightning_llmopt[cli]'")
    if os.getcwd() not in sys.path:  # --model my_pkg.MyModule finds a package in the working folder, as python -m
        sys.path.append(os.getcwd())
    inherited = os.environ.get(_RUN_DIR_ENV)
    omp_threads, torch_threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    try:
        LLMOptCLI(
            LightningModule,
            TextDataModule,
            subclass_mode_model=True,
            args=args,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"parser_mode": "omegaconf"} if RequirementCache("omegaconf") else None,
        )
    finally:  # the choices outlive the run only in the processes started during it (a second run in-process chooses)
        for name, value in ((_RUN_DIR_ENV, inherited), ("OMP_NUM_THREADS", omp_threads)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
