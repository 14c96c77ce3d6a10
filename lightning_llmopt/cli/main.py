"""The ``llmopt`` command: LightningCLI over :class:`CausalLMModule` and :class:`TextDataModule`.

    llmopt fit --config examples/configs/tiny_cpu.yaml
    llmopt validate --config examples/configs/tiny_cpu.yaml --ckpt_path runs/tiny_cpu/checkpoints/last.ckpt
    llmopt consolidate runs/zero/checkpoints hf_out/ --dtype bf16     # sharded DCP checkpoint -> HF safetensors
    llmopt quantize hf_or_ckpt out/ --method gptq --bits 4 --group-size 128 --format gptq|compressed-tensors
    llmopt export quantized/ out/ --format compressed-tensors|gptq
    llmopt generate runs/ckpts --prompt "def fib(n):" --max-tokens 64
    llmopt pipeline-plan --pp 4 --microbatches 8 --schedule interleaved_1f1b --virtual-stages 2
    llmopt --help                                                    # every subcommand

Bad input (an unknown preset or strategy, a missing path, a negative learning rate) ends with one line naming the
value, ``llmopt <command>: error: ...``; ``--debug`` (anywhere on the line) or ``LLMOPT_DEBUG=1`` shows the
traceback instead. Training shows Lightning's progress bar on a terminal and a line every 10 s otherwise.

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

from lightning_llmopt.callbacks.monitor import TrainingMonitor
from lightning_llmopt.data import TextDataModule
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


_SUBCOMMANDS = {
    "consolidate": "consolidate",
    "quantize": "quantize",
    "export": "export",
    "generate": "generate",
    "pipeline-plan": "pipeline_plan",
    "serve": "serve",
}

_SUMMARIES = {
    "fit": "train or fine-tune (LightningCLI over CausalLMModule + TextDataModule; --model.pretrained HF_FOLDER)",
    "validate": "validation loss of a checkpoint",
    "test": "test loss of a checkpoint",
    "predict": "run the model's predict step",
    "generate": "complete prompts with the inference engine",
    "quantize": "quantize a model's linear layers (RTN/GPTQ) into a GPTQ or compressed-tensors folder",
    "export": "convert a quantized folder between GPTQ and compressed-tensors",
    "consolidate": "a sharded training checkpoint to one Hugging Face folder",
    "pipeline-plan": "print a pipeline-parallel schedule and its bubble",
    "serve": "serve a model over HTTP (OpenAI-style API)",
}

# Errors that mean bad input (a value, a path, a missing extra) rather than a bug: shown as one line.
_USER_ERRORS = (ValueError, OSError, KeyError, NotImplementedError, ImportError)


def _available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"lightning_llmopt.cli.{_SUBCOMMANDS[name]}") is not None


def usage() -> str:
    """The text of ``llmopt --help``: every subcommand with one line each."""
    names = ["fit", "validate", "test", "predict", *[n for n in _SUBCOMMANDS if _available(n)]]
    width = max(map(len, names)) + 2
    lines = ["usage: llmopt <command> [options]   (llmopt <command> --help for its options)", "", "commands:"]
    lines += [f"  {n:<{width}}{_SUMMARIES.get(n, '')}" for n in names]
    lines += ["", "options:", "  --debug     show the full traceback of an error (also LLMOPT_DEBUG=1)"]
    return "\n".join(lines)


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    if "invalid strategy name" in text:
        text = _strategy_message(text)
    return " ".join(text.split()) or type(exc).__name__


def _strategy_message(text: str) -> str:
    """Lightning's unknown-strategy message names Lightning's choices only: add ours (``zero*``, ``nd_*``)."""
    import re

    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_llmopt.strategies  # noqa: F401  (registers our names)

    ours = sorted(
        n for n in StrategyRegistry if str(StrategyRegistry[n]["strategy"].__module__).startswith("lightning_llmopt")
    )
    name = re.search(r"strategy='([^']*)'", text)
    shown = f"unknown strategy {name.group(1)!r}" if name else "unknown strategy"
    return f"{shown}; lightning_llmopt's: {', '.join(ours)}; Lightning's: auto, ddp, fsdp, deepspeed, ..."


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``llmopt`` console script (see the module docstring for errors and ``--debug``)."""
    argv = sys.argv[1:] if args is None else list(args)
    debug = "--debug" in argv or os.environ.get("LLMOPT_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if args is None:  # LightningCLI reads sys.argv itself: it must not see our flag
        sys.argv[1:] = argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    command = argv[0] if argv[0] in _SUMMARIES else "fit"
    try:
        _run(argv, None if args is None else argv)
    except _USER_ERRORS as exc:
        if debug:
            raise
        print(f"llmopt {command}: error: {_one_line(exc)}  (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


def _run(argv: list[str], args: list[str] | None) -> None:
    if argv[0] in _SUBCOMMANDS:  # plain argparse subcommands, outside LightningCLI
        import importlib

        importlib.import_module(f"lightning_llmopt.cli.{_SUBCOMMANDS[argv[0]]}").main(argv[1:])
        return
    if not RequirementCache("jsonargparse[signatures]>=4.32"):
        raise SystemExit("llmopt needs the command-line extra: pip install 'lightning_llmopt[cli]'")
    LLMOptCLI(
        CausalLMModule,
        TextDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"parser_mode": "omegaconf"} if RequirementCache("omegaconf") else None,
    )


if __name__ == "__main__":
    main()
