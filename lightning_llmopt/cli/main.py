"""The ``llmopt`` command: LightningCLI over :class:`CausalLMModule` and :class:`TextDataModule`, and subcommands.

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

This module imports only the standard library, so ``llmopt --help`` answers at once. The LightningCLI subcommands
live in :mod:`lightning_llmopt.cli.fit`, the only part of the command that imports Lightning; ``generate``, ``serve``,
``quantize``, ``consolidate``, ``export`` and ``pipeline-plan`` import their own module and never Lightning.
"""

from __future__ import annotations

import os
import sys
from typing import Any

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

# Commands whose OpenMP threads wait passively on CPU (lightning_llmopt/cli/threads.py): training measured faster
# beside a busy process; generate and serve are not among them (decoding a small model measured slower)
_PASSIVE_WAIT = ("fit", "validate", "test", "predict")

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
    # before torch loads OpenMP, which reads the variable once; a process that imported torch already keeps its policy
    passive = command in _PASSIVE_WAIT and "torch" not in sys.modules and _prefer_passive_wait()
    try:
        _run(argv, None if args is None else argv)
    except _USER_ERRORS as exc:
        if debug:
            raise
        print(f"llmopt {command}: error: {_one_line(exc)}  (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if passive:
            os.environ.pop("OMP_WAIT_POLICY", None)


def _prefer_passive_wait() -> bool:
    from lightning_llmopt.cli.threads import prefer_passive_wait

    return prefer_passive_wait()


def _run(argv: list[str], args: list[str] | None) -> None:
    if argv[0] in _SUBCOMMANDS:  # plain argparse subcommands, outside LightningCLI
        import importlib

        importlib.import_module(f"lightning_llmopt.cli.{_SUBCOMMANDS[argv[0]]}").main(argv[1:])
        return
    from lightning_llmopt.cli.fit import run

    run(args)


_FIT_NAMES = ("LLMOptCLI", "default_loggers", "wandb_api_key_configured")


def __getattr__(name: str) -> Any:  # these lived here before cli/fit.py: import them from there on first use
    if name in _FIT_NAMES:
        from lightning_llmopt.cli import fit

        return getattr(fit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
