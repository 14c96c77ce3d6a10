"""Reading parts of a sharded DCP checkpoint in one process: model tensors by name, the config, Lightning entries.

A ``step-N`` folder written by :func:`lightning_llmopt.parallel.checkpoint.save_checkpoint` holds
``{"model": {fqn: tensor or DTensor}, ...}``; :func:`_model_keys` maps our parameter names to DCP's state-dict paths
(FQNs may carry the LightningModule's ``model.`` prefix and ``torch.compile``'s ``_orig_mod.``), and
:func:`_load` fills a nested dict of empty CPU tensors with ``dcp.load`` without a process group (DCP reads the
overlapping pieces of every rank's files).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_llmopt.models.config import LlamaConfig

__all__ = ["checkpoint_tokenizer", "config_from_checkpoint", "lightning_entry", "lightning_tokenizer"]

Path_ = tuple[str, ...]


def _our_name(saved: str, names: Collection[str]) -> str:
    """``saved`` without ``torch.compile``'s ``_orig_mod.`` and the LightningModule's ``model.`` prefixes."""
    name = saved.replace("_orig_mod.", "")
    while name not in names and name.startswith("model."):
        name = name.removeprefix("model.")
    return name


def _model_keys(metadata: Metadata, names: set[str]) -> dict[str, Path_]:
    """``{our parameter name: DCP state-dict path}`` of the saved model tensors among ``names``."""
    paths: dict[str, Any] = metadata.planner_data or {}
    found: dict[str, Path_] = {}
    for flat, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        path = tuple(str(p) for p in paths.get(flat, (flat,)))
        name = _our_name(".".join(path), names)
        if name in names:
            if name in found:
                raise ValueError(f"checkpoint holds {name!r} twice: {'.'.join(found[name])} and {'.'.join(path)}")
            found[name] = path
    return found


def _load(state: dict[str, Any], folder: Path) -> None:
    """``dcp.load`` in this process only (no process group), without DCP's warning saying so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)


def _nested(entries: dict[Path_, Any]) -> dict[str, Any]:
    """A nested state dict with ``value`` at each path (the layout DCP flattened at save time)."""
    root: dict[str, Any] = {}
    for path, value in entries.items():
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return root


def _get(tree: dict[str, Any], path: Path_) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def config_from_checkpoint(folder: Path, metadata: Metadata, marker: dict[str, Any]) -> LlamaConfig | None:
    """The :class:`LlamaConfig` saved with the checkpoint (state entry ``"config"`` or ``marker["config"]``)."""
    paths: dict[str, Any] = metadata.planner_data or {}
    entries = {
        tuple(str(p) for p in paths.get(k, (k,))): None
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, BytesStorageMetadata)
    }
    entries = {p: v for p, v in entries.items() if p[0] == "config"}
    if entries:
        state = _nested(entries)
        _load(state, folder)
        value = state["config"]
        return value if isinstance(value, LlamaConfig) else LlamaConfig.from_dict(dict(value))
    if isinstance(marker.get("config"), dict):
        return LlamaConfig.from_dict(dict(marker["config"]))
    return None


def lightning_entry(folder: Path, metadata: Metadata, key: str) -> Any:
    """An entry of the Lightning checkpoint dict that :class:`~lightning_llmopt.strategies.ZeroStrategy` saves beside
    the shards (``state["lightning"][key]``, e.g. ``"llmopt_tokenizer"``), or ``None`` when absent."""
    paths: dict[str, Any] = metadata.planner_data or {}
    for k, m in metadata.state_dict_metadata.items():
        path = tuple(str(p) for p in paths.get(k, (k,)))
        if path == ("lightning", key) and isinstance(m, BytesStorageMetadata):
            state = _nested({path: None})
            _load(state, folder)
            value = state["lightning"][key]
            if isinstance(value, (bytes, bytearray)):  # torch.save'd by the strategy
                value = torch.load(io.BytesIO(value), weights_only=False)
            return value
    return None


def lightning_tokenizer(ckpt: dict[str, Any], path: Path) -> Any:
    """The tokenizer a Lightning checkpoint dict was trained with (``llmopt_tokenizer``, else the data module's
    hyper-parameters), or ``None`` when it does not say or the tokenizer folder has moved since."""
    from lightning_llmopt.data.tokenizers import load_tokenizer

    spec = ckpt.get("llmopt_tokenizer", ...)
    if spec is ...:
        dm_hparams = ckpt.get("datamodule_hyper_parameters")
        if not isinstance(dm_hparams, dict) or "tokenizer" not in dm_hparams:
            return None
        spec = dm_hparams["tokenizer"]
    if spec is None or spec == "byte":
        return load_tokenizer("byte")
    for candidate in (Path(str(spec)).expanduser(), path.parent / str(spec)):
        if candidate.exists():
            return load_tokenizer(candidate)
    return None  # moved or deleted since training: the caller asks for --tokenizer


def checkpoint_tokenizer(folder: Path, metadata: Metadata) -> Any:
    """The tokenizer a sharded checkpoint remembers (its Lightning entries, as in :func:`lightning_tokenizer`)."""
    entries = {}
    for key in ("llmopt_tokenizer", "datamodule_hyper_parameters"):
        value = lightning_entry(folder, metadata, key)
        if value is not None:
            entries[key] = value
    return lightning_tokenizer(entries, folder / "x") if entries else None
