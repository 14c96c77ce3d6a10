"""Progress of the long commands: periodic lines off a terminal, a tqdm bar with rate and ETA on one."""

from __future__ import annotations

import io
import re

from lightning_llmopt.cli.progress import Progress


def test_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()  # not a tty
    with Progress("quantize", 3, "layers", stream=stream, interval=0.0) as bar:
        for name in ("a", "b", "c"):
            bar.update(1, name)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[quantize] started: 3 layers"
    assert re.fullmatch(
        r"\[quantize\] 1/3 layers \(33\.3%\), [\d.e+]+ layers/s, \d+ s elapsed, ETA \d+ s \[a\]", lines[1]
    )
    assert lines[-1].startswith("[quantize] 3/3 layers (100.0%)") and "ETA" not in lines[-1]
    assert "\r" not in stream.getvalue()  # no terminal redraws in a log file


def test_lines_are_periodic_but_the_last_is_always_shown() -> None:
    stream = io.StringIO()
    bar = Progress("consolidate", 100, "tensors", stream=stream, interval=3600.0)
    for _ in range(100):
        bar.update()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("[consolidate] 100/100 tensors (100.0%)")  # nothing in between


def test_bar_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with Progress("export", 4, "stages", stream=stream) as bar:
        for _ in range(4):
            bar.update()
    text = stream.getvalue()
    assert "\r" in text and "export" in text and "4/4" in text and "stages/s" in text  # tqdm: count and rate
