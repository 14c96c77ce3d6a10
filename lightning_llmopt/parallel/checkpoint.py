"""Atomic, sharded checkpoints on top of ``torch.distributed.checkpoint`` (DCP).

Layout under a root folder::

    root/
      step-00000100/          a complete checkpoint: DCP shard files, DCP's .metadata, and our COMPLETE marker
      step-00000200.partial/  a save in progress, or one interrupted by a crash: never loaded

Saving (every rank calls :func:`save_checkpoint`):

1. every rank writes its shards into ``step-N.partial/`` through ``dcp.save`` (DCP gathers the write results on the
   coordinator and writes ``.metadata`` only once every rank has written its files);
2. the coordinator lists the files with their sizes into ``COMPLETE`` (written to a temporary name, fsynced, then
   renamed), then renames the folder to ``step-N`` (an atomic rename on POSIX file systems);
3. all ranks meet at a barrier, so nobody starts the next step before the checkpoint exists.

A rank killed at any point before step 2 leaves only a ``.partial`` folder; the previous checkpoint stays the newest
complete one. Loading checks the marker and every listed file's size first, so a truncated or half-copied checkpoint is
refused with a message that names what is missing and the newest complete checkpoint to fall back to. DCP reshards on
load: the state dict passed to :func:`load_checkpoint` describes the *new* layout (world size, sharding), and DCP reads
the saved pieces into it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint folder without a valid completion marker, or with files missing or truncated."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _is_coordinator(group: Any) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group: Any) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _broadcast_error(message: str | None, group: Any) -> str | None:
    """Rank 0's error message (or None) on every rank, so all ranks raise together instead of hanging."""
    if not dist.is_initialized():
        return message
    box = [message]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _write_marker(folder: Path, step: int, extra: dict[str, Any]) -> None:
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    if ".metadata" not in files:
        raise IncompleteCheckpointError(f"{folder}: DCP wrote no .metadata; the save did not finish")
    body = {"step": step, "time": time.time(), "files": files, **extra}
    tmp = folder / f".{MARKER}.tmp"
    with open(tmp, "w") as fh:
        json.dump(body, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MARKER)


def save_checkpoint(state: dict[str, Any], root: str | Path, step: int, *, extra: dict[str, Any] | None = None,
                    process_group: Any = None, keep_last: int | None = None) -> Path:
    """Write ``state`` (a DCP state dict: tensors, DTensors, nested dicts, plain values) as ``root/step-N``.

    Arguments:
        state: what to save; every rank passes its own shards.
        root: folder holding all checkpoints of a run.
        step: the training step, used in the folder name.
        extra: JSON-serialisable facts stored in the marker (world size, stage, ...).
        process_group: the group that saves together (default: the whole world).
        keep_last: if set, the coordinator deletes complete checkpoints beyond the newest ``keep_last``.

    Returns: the complete checkpoint folder.
    """
    if step < 0:
        raise ValueError(f"step ({step}) must be >= 0")
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if _is_coordinator(process_group):
        if final.exists():
            shutil.rmtree(final)  # re-saving a step replaces it; the marker goes first with the folder
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    _barrier(process_group)
    dcp.save(state, checkpoint_id=str(partial), process_group=process_group)
    error = None
    if _is_coordinator(process_group):
        try:
            world = dist.get_world_size(process_group) if dist.is_initialized() else 1
            _write_marker(partial, step, {"world_size": world, **(extra or {})})
            os.replace(partial, final)
            if keep_last is not None:
                for old in complete_checkpoints(root)[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    error = _broadcast_error(error, process_group)
    if error is not None:
        raise RuntimeError(f"saving checkpoint {final} failed on the coordinator: {error}")
    return final


def verify_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The marker of a complete checkpoint; raises :class:`IncompleteCheckpointError` naming what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder} does not exist")
    marker = folder / MARKER
    if not marker.is_file():
        raise IncompleteCheckpointError(
            f"checkpoint {folder} is incomplete: it has no {MARKER} marker (the save was interrupted)"
            + _fallback_hint(folder)
        )
    try:
        body = json.loads(marker.read_text())
    except json.JSONDecodeError as exc:
        raise IncompleteCheckpointError(f"checkpoint {folder}: unreadable {MARKER} marker ({exc})") from exc
    problems = []
    for name, size in body.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, {size} were written")
    if problems:
        raise IncompleteCheckpointError(
            f"checkpoint {folder} is damaged: {'; '.join(problems[:5])}" + _fallback_hint(folder)
        )
    return body


def _fallback_hint(folder: Path) -> str:
    others = [p for p in complete_checkpoints(folder.parent) if p != folder]
    return f"; the newest complete checkpoint is {others[-1]}" if others else "; no complete checkpoint exists"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root`` (marker present), oldest step first; files are not re-checked."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / MARKER).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under ``root`` that passes :func:`verify_checkpoint`, skipping damaged ones."""
    for folder in reversed(complete_checkpoints(root)):
        try:
            verify_checkpoint(folder)
        except IncompleteCheckpointError:
            continue
        return folder
    return None


def _resolve(path: Path) -> tuple[str, dict[str, Any], str | None]:
    """Coordinator side of loading: the checkpoint folder to read, its marker, or an error message."""
    if not _STEP_DIR.match(path.name):
        newest = latest_checkpoint(path)
        if newest is None:
            return str(path), {}, f"no complete checkpoint under {path}"
        path = newest
    try:
        return str(path), verify_checkpoint(path), None
    except (IncompleteCheckpointError, FileNotFoundError) as exc:
        return str(path), {}, str(exc)


def load_checkpoint(state: dict[str, Any], path: str | Path, *, process_group: Any = None) -> dict[str, Any]:
    """Load in place into ``state`` (which describes the current layout; DCP reshards) and return the marker.

    ``path`` is a checkpoint folder, or a root folder, in which case the newest complete checkpoint is used. The
    coordinator checks the marker and file sizes and tells the other ranks, so all ranks fail alike and before any
    shard is read.
    """
    box: list[Any] = list(_resolve(Path(path))) if _is_coordinator(process_group) else [None, None, None]
    if dist.is_initialized():
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=process_group)
    folder, body, error = box
    if error is not None:
        raise IncompleteCheckpointError(error)
    dcp.load(state, checkpoint_id=folder, process_group=process_group)
    return body
