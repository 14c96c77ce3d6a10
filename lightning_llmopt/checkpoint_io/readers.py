"""Readers of the model in a training checkpoint: :class:`DCPReader` (a ``step-N`` folder) and
:class:`LightningReader` (a ``.ckpt`` file), with one interface: the saved config, the names, shapes and dtypes of
the model tensors (no data), the tensors of a chosen subset, and the tokenizer the training run remembered."""

from __future__ import annotations

import pickle
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_llmopt.checkpoint_io.dcp_state import (
    Path_,
    _get,
    _load,
    _model_keys,
    _nested,
    _our_name,
    checkpoint_tokenizer,
    config_from_checkpoint,
    lightning_tokenizer,
)
from lightning_llmopt.checkpoint_io.find import EXPECTED, FoundCheckpoint, find_checkpoint
from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.parallel.checkpoint import verify_checkpoint

__all__ = ["DCPReader", "LightningReader", "TensorInfo", "config_from_hparams", "open_checkpoint"]


@dataclass(frozen=True)
class TensorInfo:
    """A saved tensor's global shape and dtype (no data)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class DCPReader:
    """The model of a verified ``step-N`` folder; every read is one ``dcp.load`` of just the tensors asked for."""

    kind = "dcp"
    config_source = "no 'config' state entry or marker field"

    def __init__(self, folder: Path, marker: dict[str, Any] | None = None) -> None:
        self.path = folder
        self.marker = verify_checkpoint(folder) if marker is None else marker
        self.metadata = FileSystemReader(str(folder)).read_metadata()
        self._found: dict[str, Path_] = {}

    def saved_config(self) -> LlamaConfig | None:
        return config_from_checkpoint(self.path, self.metadata, self.marker)

    def saved_names(self) -> list[str]:
        return sorted(self.metadata.state_dict_metadata)

    def model_tensors(self, names: Collection[str]) -> dict[str, TensorInfo]:
        """``{name: TensorInfo}`` of the saved model tensors among ``names`` (our parameter names)."""
        found = _model_keys(self.metadata, set(names))
        self._found.update(found)
        paths = self.metadata.planner_data or {}
        flat_of = {tuple(str(p) for p in paths.get(k, (k,))): k for k in self.metadata.state_dict_metadata}
        infos = {}
        for name, path in found.items():
            meta = self.metadata.state_dict_metadata[flat_of[path]]
            assert isinstance(meta, TensorStorageMetadata)
            infos[name] = TensorInfo(tuple(meta.size), meta.properties.dtype)
        return infos

    def read(self, names: Sequence[str]) -> dict[str, Tensor]:
        """The full (unsharded) tensors ``names`` in their saved dtype: DCP reads the overlapping pieces of every
        rank's files into them."""
        infos = self.model_tensors(names)
        missing = [n for n in names if n not in infos]
        if missing:
            raise KeyError(f"checkpoint {self.path} lacks {len(missing)} model tensor(s), e.g. {missing[:5]}")
        state = _nested({self._found[n]: torch.empty(infos[n].shape, dtype=infos[n].dtype) for n in names})
        _load(state, self.path)
        return {n: _get(state, self._found[n]) for n in names}

    def tokenizer(self) -> Any:
        return checkpoint_tokenizer(self.path, self.metadata)


def config_from_hparams(hp: dict[str, Any]) -> LlamaConfig | None:
    """The config :class:`~lightning_llmopt.CausalLMModule` records in ``hyper_parameters["model"]`` (the resolved
    config dict; older checkpoints: a preset name plus ``model_overrides``, or a ``LlamaConfig``)."""
    model_cfg = hp.get("model")
    if isinstance(model_cfg, str):
        return LlamaConfig.from_preset(model_cfg, **(hp.get("model_overrides") or {}))
    if isinstance(model_cfg, dict):
        return LlamaConfig.from_dict(dict(model_cfg))
    return model_cfg if isinstance(model_cfg, LlamaConfig) else None


class LightningReader:
    """The model of a Lightning ``.ckpt`` file, memory-mapped: tensors are read from disk when used."""

    kind = "lightning"
    config_source = "no hyper_parameters['model']: a CausalLMModule checkpoint?"

    def __init__(self, path: Path, trust_pickle: bool = False) -> None:
        self.path = path
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=not trust_pickle, mmap=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"{path} holds objects a weights-only load refuses ({str(exc).splitlines()[0]}); if you trust the "
                "file, pass trust_pickle=True (--trust-pickle)"
            ) from exc
        except RuntimeError as exc:  # not a zip archive written by torch.save
            raise ValueError(f"{path} is not a PyTorch checkpoint ({str(exc).splitlines()[0]}); {EXPECTED}") from exc
        if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
            keys = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
            raise ValueError(f"{path}: no 'state_dict' (it holds {keys}); expected a Lightning .ckpt")
        self.ckpt: dict[str, Any] = ckpt
        self.state: dict[str, Any] = ckpt["state_dict"]
        self._found: dict[str, str] = {}

    def saved_config(self) -> LlamaConfig | None:
        return config_from_hparams(dict(self.ckpt.get("hyper_parameters") or {}))

    def saved_names(self) -> list[str]:
        return sorted(self.state)

    def model_tensors(self, names: Collection[str]) -> dict[str, TensorInfo]:
        """``{name: TensorInfo}`` of the ``state_dict`` tensors among ``names`` (our parameter names)."""
        wanted = set(names)
        infos: dict[str, TensorInfo] = {}
        for key, value in self.state.items():
            name = _our_name(key, wanted)
            if name in wanted and isinstance(value, Tensor):
                if name in infos:
                    raise ValueError(f"checkpoint holds {name!r} twice: {self._found[name]} and {key}")
                self._found[name] = key
                infos[name] = TensorInfo(tuple(value.shape), value.dtype)
        return infos

    def read(self, names: Sequence[str]) -> dict[str, Tensor]:
        """The tensors ``names`` as stored (memory-mapped views of the file, not copies)."""
        if any(n not in self._found for n in names):
            self.model_tensors(names)
        return {n: self.state[self._found[n]] for n in names}

    def tokenizer(self) -> Any:
        return lightning_tokenizer(self.ckpt, self.path)


def open_checkpoint(source: str | Path | FoundCheckpoint, trust_pickle: bool = False) -> DCPReader | LightningReader:
    """A reader of the checkpoint at or under ``source`` (see :func:`find_checkpoint`)."""
    found = source if isinstance(source, FoundCheckpoint) else find_checkpoint(source)
    if found.kind == "lightning":
        return LightningReader(found.path, trust_pickle=trust_pickle)
    return DCPReader(found.path, found.marker or None)
