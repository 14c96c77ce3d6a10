"""What the argparse subcommands of ``llmopt`` share: a parser whose help shows every default, and options that mean
the same in every command (``--tokenizer``), described once."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["TOKENIZER_HELP", "DefaultsHelpFormatter", "add_num_threads", "add_tokenizer", "parser"]

TOKENIZER_HELP = (
    "'byte' or a tokenizer.json file (or the folder holding one); default: the model's own, i.e. the tokenizer "
    "files in its folder or the tokenizer its training checkpoint remembers"
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: VALUE)`` to an option's help where the default is a value the user could pass.

    Left out: ``None`` (the help says what happens instead), ``False`` of a flag, the empty list of a repeatable
    option, and help that already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is argparse.SUPPRESS or default == [] or "default:" in text:
            return text
        if isinstance(default, bool) and action.nargs == 0:  # store_true / store_false
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)"


def parser(prog: str, description: str, **kwargs: Any) -> argparse.ArgumentParser:
    """An :class:`argparse.ArgumentParser` for ``llmopt <command>`` whose help shows each option's default."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=DefaultsHelpFormatter, **kwargs)


def add_tokenizer(p: argparse.ArgumentParser) -> None:
    """``--tokenizer``, with the same meaning and help in every command."""
    p.add_argument("--tokenizer", default=None, metavar="byte|PATH", help=TOKENIZER_HELP)


def add_num_threads(p: argparse.ArgumentParser) -> None:
    """``--num-threads`` of the engine commands: torch's intra-op threads on CPU (``lightning_llmopt.cli.threads``)."""
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        metavar="N",
        help="on CPU: torch's intra-op threads (default: the cores available; LLMOPT_NUM_THREADS=N does the same, "
        "0 keeps torch's defaults)",
    )
