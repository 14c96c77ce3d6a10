"""``llmopt <command> --help`` of every argparse subcommand: each option has help, shows its default, carries no
Sphinx markup, and ``--tokenizer`` reads the same in every command."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

from lightning_llmopt.cli.main import _SUBCOMMANDS

MARKUP = ("``", ":func:", ":class:", ":mod:", ":meth:", ":attr:", ":data:")


def _parser(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"lightning_llmopt.cli.{_SUBCOMMANDS[command]}")
    return module.build_parser()


def _entries(text: str) -> dict[str, str]:
    """``{invocation: help}`` of a rendered help (wide enough that nothing wraps)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if re.match(r"  \S", line):
            current, *help_text = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            entries[current] = help_text[0] if help_text else ""
        elif current is not None and re.match(r"\s{3,}\S", line):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def _entry(entries: dict[str, str], action: argparse.Action) -> str:
    names = action.option_strings or [action.metavar or action.dest]
    found = [help_text for inv, help_text in entries.items() if names[0] in re.split(r"[ ,]+", inv)]
    assert len(found) == 1, f"{names[0]}: {found} in {list(entries)}"
    return found[0]


def _has_default(action: argparse.Action) -> bool:
    """A default the user could pass (not None, not a flag's False, not a repeatable option's empty list)."""
    if action.default in (None, argparse.SUPPRESS) or action.default == []:
        return False
    return not (isinstance(action.default, bool) and action.nargs == 0)


@pytest.mark.parametrize("command", sorted(_SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: a default is never split across lines
    parser = _parser(command)
    text = parser.format_help()
    assert not [m for m in MARKUP if m in text], text
    assert parser.description and len(parser.description) > 20
    entries = _entries(text)
    for action in parser._actions:
        help_text = _entry(entries, action)
        name = action.option_strings[0] if action.option_strings else action.dest
        assert help_text, f"llmopt {command} {name} has no help"
        if _has_default(action):
            assert f"(default: {action.default})" in help_text, f"llmopt {command} {name}: {help_text!r}"


def test_tokenizer_is_described_once():
    from lightning_llmopt.cli.options import TOKENIZER_HELP

    helps = {}
    for command in _SUBCOMMANDS:
        for action in _parser(command)._actions:
            if "--tokenizer" in action.option_strings:
                helps[command] = action.help
    assert {"generate", "quantize", "serve", "consolidate"} <= set(helps)
    assert set(helps.values()) == {TOKENIZER_HELP}, helps
