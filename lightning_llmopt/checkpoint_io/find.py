"""Which checkpoint a path means: a ``.ckpt`` file, a ``step-N`` folder, a folder of them, or a run folder.

- a file is a Lightning ``.ckpt`` (Lightning's single-device and DDP strategies);
- a ``step-N`` folder (or one holding DCP's ``.metadata`` or our ``COMPLETE`` marker) is a sharded DCP checkpoint
  (:class:`~lightning_llmopt.strategies.ZeroStrategy` at any stage,
  :class:`~lightning_llmopt.strategies.NDParallelStrategy` with TP, PP, CP or EP), verified through its marker;
- a folder holding ``step-N`` folders (``ModelCheckpoint`` under these strategies writes ``last.ckpt/step-00000020``)
  means its newest complete one;
- any other folder is a run folder (``runs/tiny_cpu``, ``runs/tiny_cpu/checkpoints``, ``lightning_logs/version_0``):
  the checkpoints above found up to :data:`SEARCH_DEPTH` levels below it, of which ``last`` (``last.ckpt``, or
  ``last-vN.ckpt`` after a name clash) wins, else the newest by modification time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_llmopt.parallel.checkpoint import MARKER, IncompleteCheckpointError, latest_checkpoint, verify_checkpoint

__all__ = [
    "EXPECTED",
    "SEARCH_DEPTH",
    "CheckpointNotFoundError",
    "FoundCheckpoint",
    "find_checkpoint",
    "resolve_checkpoint",
]

SEARCH_DEPTH = 4  # levels below a run folder: lightning_logs/version_0/checkpoints/last.ckpt
_STEP = re.compile(r"^step-(\d+)(\.partial)?$")
_LAST = re.compile(r"^last(-v\d+)?(\.ckpt)?$")  # ModelCheckpoint.CHECKPOINT_NAME_LAST, versioned on a name clash
EXPECTED = (
    "expected a Lightning .ckpt file, a step-N checkpoint folder, a folder of step-N folders "
    "(e.g. last.ckpt/step-00000020) or a run folder holding them"
)


class CheckpointNotFoundError(FileNotFoundError):
    """No checkpoint at or under the given path; the message names what is there and what was expected."""


@dataclass(frozen=True)
class FoundCheckpoint:
    """What :func:`find_checkpoint` chose: a ``.ckpt`` file (``kind="lightning"``) or a ``step-N`` folder
    (``kind="dcp"``, with its verified ``marker``), and, when it was picked among several, from where."""

    path: Path
    kind: str
    marker: dict[str, Any] = field(default_factory=dict)
    given: Path | None = None
    candidates: tuple[Path, ...] = ()
    rule: str = ""

    def describe(self) -> str:
        """``PATH (kind, step N)``, plus how it was picked when it was chosen among several."""
        what = "Lightning checkpoint" if self.kind == "lightning" else "sharded DCP checkpoint"
        step = self.marker.get("step")
        text = f"{self.path} ({what}{'' if step is None else f', step {step}'})"
        if self.given is not None and len(self.candidates) > 1:
            text += f": {self.rule} of {len(self.candidates)} checkpoints under {self.given}"
        return text


def _listing(folder: Path, limit: int = 8) -> str:
    """``a, b/, c`` (folders end in ``/``), or ``nothing``."""
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "nothing"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _is_dcp_folder(path: Path) -> bool:
    return bool(_STEP.match(path.name)) or (path / MARKER).exists() or (path / ".metadata").exists()


def _step_children(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and _STEP.match(p.name))


def resolve_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The ``step-N`` folder to read and its marker: ``path`` itself if it is a DCP checkpoint (verified, so an
    incomplete one raises :class:`IncompleteCheckpointError`), else the newest complete checkpoint directly in it."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
    if _is_dcp_folder(path):
        return path, verify_checkpoint(path)
    newest = latest_checkpoint(path)
    if newest is None:
        steps = [p.name for p in _step_children(path)]
        found = f"found {', '.join(steps)}" if steps else f"it holds {_listing(path)}"
        raise IncompleteCheckpointError(
            f"no complete checkpoint under {path}: {found}; expected a step-N folder with a {MARKER} marker"
        )
    return newest, verify_checkpoint(newest)


def _candidates(root: Path) -> tuple[list[Path], list[Path]]:
    """``(complete, incomplete)`` checkpoints under ``root`` (breadth-first, :data:`SEARCH_DEPTH` levels): ``.ckpt``
    files and folders holding ``step-N`` folders; nothing below a checkpoint is searched."""
    complete: list[Path] = []
    incomplete: list[Path] = []
    level = [root]
    for _ in range(SEARCH_DEPTH):
        below: list[Path] = []
        for folder in level:
            try:
                entries = sorted(folder.iterdir())
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_file() and entry.suffix == ".ckpt":
                    complete.append(entry)
                elif entry.is_dir() and _STEP.match(entry.name) is None:
                    steps = _step_children(entry)
                    if steps:
                        (complete if latest_checkpoint(entry) is not None else incomplete).append(entry)
                    else:
                        below.append(entry)
        level = below
    return complete, incomplete


def _mtime(path: Path) -> float:
    """A ``.ckpt`` file's modification time; for a folder of ``step-N`` folders, its newest complete one's."""
    if path.is_file():
        return path.stat().st_mtime
    newest = latest_checkpoint(path)
    return (newest / MARKER).stat().st_mtime if newest is not None else 0.0


def find_checkpoint(path: str | Path) -> FoundCheckpoint:
    """The checkpoint to read for ``path`` (the layouts in the module docstring).

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or no checkpoint under it (the message lists what is there).
        IncompleteCheckpointError: the checkpoint named, or every one found, is incomplete or damaged.
    """
    path = Path(path).expanduser()
    if not path.exists():
        parent = path.parent
        where = f"{parent} holds {_listing(parent)}" if parent.is_dir() else f"{parent} does not exist either"
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist ({where}); {EXPECTED}")
    if path.is_file():
        return FoundCheckpoint(path, "lightning")
    if _is_dcp_folder(path) or _step_children(path):
        folder, marker = resolve_checkpoint(path)
        return FoundCheckpoint(folder, "dcp", marker)
    complete, incomplete = _candidates(path)
    if not complete:
        if incomplete:
            resolve_checkpoint(incomplete[0])  # raises, naming what that folder holds
        raise CheckpointNotFoundError(
            f"no checkpoint under {path} (searched {SEARCH_DEPTH} levels down; it holds {_listing(path)}); {EXPECTED}"
        )
    last = [p for p in complete if _LAST.match(p.name)]
    chosen = max(last or complete, key=_mtime)
    rule = f"'{chosen.name}'" if last else "the newest"
    found = find_checkpoint(chosen)
    return FoundCheckpoint(found.path, found.kind, found.marker, path, tuple(complete), rule)
