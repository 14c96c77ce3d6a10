"""Reading and writing Hugging Face checkpoint folders with safetensors and json only (no transformers).

Layout read: ``config.json`` plus one of ``model.safetensors``; ``model-0000k-of-0000N.safetensors`` shards with
``model.safetensors.index.json``; ``pytorch_model.bin``; or ``pytorch_model-*.bin`` shards with
``pytorch_model.bin.index.json``. Layout written: ``config.json`` plus ``model.safetensors``, or shards and an index
when the weights exceed the shard size; :func:`write_tokenizer_files` adds the tokenizer files and
``generation_config.json`` that make a folder drop-in for transformers, vLLM and our own engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
GENERATION_CONFIG = "generation_config.json"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"2GB"`` (10^9), ``"500MiB"`` (2^20), ``"10KB"``."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size ({size!r}) must be an int or a string like '2GB', '500MB', '10KiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size ({size!r}) must be positive")
    return value


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder as a dict."""
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a directory (expected a Hugging Face checkpoint folder)")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {str(path)!r}; found {sorted(p.name for p in path.iterdir())}")
    with config_file.open() as f:
        return json.load(f)


def _weight_files(path: Path) -> tuple[list[Path], bool]:
    """The weight files of a checkpoint folder and whether they are safetensors."""
    for index_name, single, is_st in ((SAFETENSORS_INDEX, SAFETENSORS_NAME, True), (BIN_INDEX, BIN_NAME, False)):
        if (path / index_name).is_file():
            with (path / index_name).open() as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
            absent = [p.name for p in files if not p.is_file()]
            if absent:
                raise FileNotFoundError(f"{index_name} in {str(path)!r} names missing shard file(s) {absent}")
            return files, is_st
        if (path / single).is_file():
            return [path / single], is_st
    raise FileNotFoundError(
        f"no weights in {str(path)!r}: expected {SAFETENSORS_NAME}, {SAFETENSORS_INDEX}, {BIN_NAME} or {BIN_INDEX}"
    )


def iter_tensors(path: Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, Tensor]]:
    """Yield ``(HF name, tensor)`` for every weight of a checkpoint folder, one file at a time, on ``device``."""
    files, is_safetensors = _weight_files(path)
    for file in files:
        if is_safetensors:
            from safetensors import safe_open

            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(file, map_location=device, weights_only=True, mmap=True).items()


def _plain(name: str, tensor: Tensor, dtype: torch.dtype | None, seen: set[int]) -> Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses shared or partial storage)."""
    if tensor.is_meta or type(tensor.data) is not Tensor:
        raise TypeError(
            f"{name} is a {type(tensor.data).__name__} on {tensor.device}; gather it into a plain "
            "tensor (e.g. DTensor.full_tensor()) before exporting"
        )
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    out = tensor.detach().to(device="cpu", dtype=cast).contiguous()
    storage = out.untyped_storage()
    if storage.data_ptr() in seen or storage.nbytes() != out.numel() * out.element_size():
        out = out.clone()
    seen.add(out.untyped_storage().data_ptr())
    return out


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy split of ``{name: bytes}`` in key order; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(
    path: Path,
    tensors: dict[str, Tensor],
    config: dict[str, Any],
    max_shard_size: int | str,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write ``config.json`` and the safetensors weights (sharded with an index above ``max_shard_size``).

    Returns the weight files written.
    """
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    sizes = {
        n: t.numel() * (dtype if dtype and t.is_floating_point() else t.dtype).itemsize for n, t in tensors.items()
    }
    shards = _plan_shards(sizes, parse_size(max_shard_size))
    for stale in [*path.glob("model-*-of-*.safetensors"), path / SAFETENSORS_INDEX, path / SAFETENSORS_NAME]:
        stale.unlink(missing_ok=True)  # a previous export with another shard count would confuse loaders
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards, start=1):
        file = SAFETENSORS_NAME if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        seen: set[int] = set()  # converted one shard at a time: a dtype change holds one shard's copy at most
        save_file({n: _plain(n, tensors[n], dtype, seen) for n in names}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        written.append(path / file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return written


def write_tokenizer_files(path: Path, tokenizer: Any = None) -> list[Path]:
    """Write ``tokenizer``'s files and a ``generation_config.json`` into the checkpoint folder ``path``.

    Arguments:
        tokenizer: ``None`` (nothing is written) or an object with ``save_pretrained(folder)`` and ``bos_id`` /
            ``eos_id`` / ``stop_ids`` (:class:`~lightning_llmopt.data.HFTokenizer`,
            :class:`~lightning_llmopt.data.ByteTokenizer`).

    The generation config is the tokenizer folder's own ``generation_config.json`` when it has one (an
    :class:`HFTokenizer` read from a Hugging Face model folder), else ``bos_token_id``, ``eos_token_id`` (every stop
    id: a list when there are several) and ``pad_token_id`` from the tokenizer. Returns the files written.
    """
    if tokenizer is None:
        return []
    path.mkdir(parents=True, exist_ok=True)
    written = list(tokenizer.save_pretrained(path))
    source = getattr(tokenizer, "folder", None)
    target = path / GENERATION_CONFIG
    if source is not None and (Path(source) / GENERATION_CONFIG).is_file():
        if (Path(source) / GENERATION_CONFIG).resolve() != target.resolve():
            target.write_text((Path(source) / GENERATION_CONFIG).read_text())
    else:
        stops = [int(i) for i in getattr(tokenizer, "stop_ids", ()) or ()]
        if not stops and tokenizer.eos_id is not None:
            stops = [int(tokenizer.eos_id)]
        config: dict[str, Any] = {"_from_model_config": False, "bos_token_id": tokenizer.bos_id}
        config["eos_token_id"] = stops[0] if len(stops) == 1 else (stops or None)
        if getattr(tokenizer, "pad_id", None) is not None:
            config["pad_token_id"] = tokenizer.pad_id
        target.write_text(json.dumps(config, indent=2) + "\n")
    return [*written, target]
