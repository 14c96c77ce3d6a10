"""``llmopt consolidate``: a sharded DCP training checkpoint to one Hugging Face safetensors checkpoint.

    llmopt consolidate runs/ckpts/step-00001000 out/hf [--arch llama|mistral|qwen2] [--dtype bf16|fp16|fp32]
        [--max-shard-size 2GB] [--preset tiny | --config-json config.json]

The checkpoint is one written by :func:`lightning_llmopt.parallel.checkpoint.save_checkpoint` (a ``step-N`` folder,
or a root holding several, in which case the newest complete one is used) whose state holds
``{"model": {fqn: tensor or DTensor}, ...}``; FQNs may carry the LightningModule's ``model.`` prefix (and
``torch.compile``'s ``_orig_mod.``) or not. Other entries (optimizer, RNG, data position) are ignored.

The full model is never in memory at once:

1. the checkpoint is verified (marker and file sizes) and its DCP metadata read: names, shapes, dtypes only;
2. the weights are cut into output shards of at most ``--max-shard-size`` bytes, in Hugging Face order;
3. per output shard, a state dict of empty CPU tensors for just those keys is filled by ``dcp.load`` (no process
   group; DCP reads the overlapping pieces of every rank's files), renamed, cast and written with safetensors, and
   dropped before the next shard is read.

The model's :class:`~lightning_llmopt.models.config.LlamaConfig` comes from ``--preset``/``--config-json`` when
given, else from the checkpoint: a ``"config"`` entry of the saved state or the marker's ``extra["config"]``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_llmopt.cli.progress import Progress
from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from lightning_llmopt.models.hf_files import (
    CONFIG_NAME,
    SAFETENSORS_INDEX,
    SAFETENSORS_NAME,
    parse_size,
    write_tokenizer_files,
)
from lightning_llmopt.models.hf_weights import expected_shapes, key_map
from lightning_llmopt.parallel.checkpoint import (
    MARKER,
    IncompleteCheckpointError,
    latest_checkpoint,
    verify_checkpoint,
)

__all__ = ["checkpoint_tokenizer", "consolidate", "lightning_entry", "main", "resolve_checkpoint"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
Path_ = tuple[str, ...]


def resolve_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder to read and its marker: ``path`` itself if it is a checkpoint (verified, so an
    incomplete one raises :class:`IncompleteCheckpointError`), else the newest complete checkpoint under it."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.name.startswith("step-") or (path / MARKER).exists() or (path / ".metadata").exists():
        return path, verify_checkpoint(path)
    newest = latest_checkpoint(path)
    if newest is None:
        raise IncompleteCheckpointError(f"no complete checkpoint under {path}")
    return newest, verify_checkpoint(newest)


def _model_keys(metadata: Metadata, names: set[str]) -> dict[str, Path_]:
    """``{our parameter name: DCP state-dict path}`` of the saved model tensors among ``names``."""
    paths: dict[str, Any] = metadata.planner_data or {}
    found: dict[str, Path_] = {}
    for flat, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        path = tuple(str(p) for p in paths.get(flat, (flat,)))
        name = ".".join(path).replace("_orig_mod.", "")
        while name not in names and name.startswith("model."):
            name = name.removeprefix("model.")
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
    import io

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


def checkpoint_tokenizer(folder: Path, metadata: Metadata) -> Any:
    """The tokenizer a sharded checkpoint remembers (see :func:`lightning_llmopt.inference.loading.load_model`)."""
    from lightning_llmopt.inference.loading import _checkpoint_tokenizer

    entries = {}
    for key in ("llmopt_tokenizer", "datamodule_hyper_parameters"):
        value = lightning_entry(folder, metadata, key)
        if value is not None:
            entries[key] = value
    return _checkpoint_tokenizer(entries, folder / "x") if entries else None


def _plan(names: list[str], nbytes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy split in order; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shards[-1] and size + nbytes[name] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def _check_shapes(
    found: dict[str, Path_], metadata: Metadata, config: LlamaConfig, flat_of: dict[Path_, str], required: list[str]
) -> None:
    missing = [n for n in required if n not in found]
    if missing:
        raise KeyError(
            f"checkpoint lacks {len(missing)} model tensor(s) of the config, e.g. {missing[:5]}; "
            f"saved tensors include {sorted(metadata.state_dict_metadata)[:5]}"
        )
    shapes = expected_shapes(config)
    bad = []
    for name in required:
        meta = metadata.state_dict_metadata[flat_of[found[name]]]
        assert isinstance(meta, TensorStorageMetadata)
        if tuple(meta.size) != shapes[name]:
            bad.append(f"{name}: {tuple(meta.size)} (expected {shapes[name]})")
    if bad:
        raise ValueError(f"{len(bad)} checkpoint tensor(s) do not match the config: " + "; ".join(bad[:5]))


def consolidate(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    arch: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "2GB",
    config: LlamaConfig | None = None,
    tokenizer: Any = None,
) -> list[Path]:
    """Write the model of a sharded DCP checkpoint as a Hugging Face safetensors folder, one shard at a time.

    Arguments:
        checkpoint: a ``step-N`` folder or a root folder of checkpoints (the newest complete one is used).
        out_dir: output folder; stale ``model*.safetensors`` files and index there are removed.
        arch: ``"llama"``, ``"mistral"`` or ``"qwen2"``; ``None`` picks ``qwen2`` with q/k/v biases, ``mistral``
            with a sliding window, else ``llama``.
        dtype: cast floating-point weights; ``None`` keeps the saved dtype.
        max_shard_size: bytes per safetensors file (int or e.g. ``"2GB"``); at most this many bytes (of the
            saved dtype, or of ``dtype`` if larger) are loaded at once, or one tensor if it is larger.
        config: the model config; default: the one saved with the checkpoint.
        tokenizer: written beside the weights with a ``generation_config.json``; default: the tokenizer the
            checkpoint remembers (``CausalLMModule`` records its data module's), if any.

    Returns: the weight files written. Raises ``IncompleteCheckpointError`` for an incomplete checkpoint.
    """
    folder, marker = resolve_checkpoint(checkpoint)
    if dtype is not None and dtype not in DTYPES.values():
        raise ValueError(f"dtype ({dtype}) must be one of {list(DTYPES.values())}")
    max_bytes = parse_size(max_shard_size)
    metadata = FileSystemReader(str(folder)).read_metadata()
    if config is None:
        config = config_from_checkpoint(folder, metadata, marker)
    if config is None:
        raise ValueError(
            f"checkpoint {folder} stores no model config (no 'config' state entry or marker field); "
            "pass --preset NAME or --config-json PATH"
        )
    if arch is None:
        arch = "qwen2" if config.qkv_bias else "mistral" if config.sliding_window is not None else "llama"
    config_to_hf(config, arch)  # checks arch against the config before anything is read
    hf_names = key_map(config)
    required = [n for n in hf_names if not (config.tie_embeddings and n == "output.weight")]
    found = _model_keys(metadata, set(hf_names))
    flat_of = {
        tuple(str(p) for p in (metadata.planner_data or {}).get(k, (k,))): k for k in metadata.state_dict_metadata
    }
    _check_shapes(found, metadata, config, flat_of, required)
    metas: dict[str, TensorStorageMetadata] = {}
    for n in required:
        meta = metadata.state_dict_metadata[flat_of[found[n]]]
        assert isinstance(meta, TensorStorageMetadata)
        metas[n] = meta
    # Planned in the larger of the saved and written dtypes: neither the load nor the file exceeds max_bytes.
    nbytes = {
        n: m.size.numel() * max(m.properties.dtype.itemsize, (dtype or m.properties.dtype).itemsize)
        for n, m in metas.items()
    }
    shards = _plan(required, nbytes, max_bytes)
    hf_config = config_to_hf(config, arch, dtype=dtype or metas[required[0]].properties.dtype)
    written = _write(folder, Path(out_dir), shards, metas, found, hf_names, dtype, hf_config)
    if tokenizer is None:
        tokenizer = checkpoint_tokenizer(folder, metadata)
    write_tokenizer_files(Path(out_dir), tokenizer)
    return written


def _write(
    folder: Path,
    out: Path,
    shards: list[list[str]],
    metas: dict[str, TensorStorageMetadata],
    found: dict[str, Path_],
    hf_names: dict[str, str],
    dtype: torch.dtype | None,
    hf_config: dict[str, Any],
) -> list[Path]:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model-*-of-*.safetensors"), out / SAFETENSORS_INDEX, out / SAFETENSORS_NAME]:
        stale.unlink(missing_ok=True)
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    bar = Progress("consolidate", sum(len(names) for names in shards), "tensors")
    for k, names in enumerate(shards, start=1):
        file = SAFETENSORS_NAME if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        state = _nested({found[n]: torch.empty(tuple(metas[n].size), dtype=metas[n].properties.dtype) for n in names})
        _load(state, folder)
        tensors = {}
        for n in names:
            t = _get(state, found[n])
            tensors[hf_names[n]] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            total += tensors[hf_names[n]].numel() * tensors[hf_names[n]].element_size()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del state, tensors  # this shard's tensors are gone before the next is read
        weight_map.update({hf_names[n]: file for n in names})
        written.append(out / file)
        bar.update(len(names), file)
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    return written


def _config_from_args(args: argparse.Namespace) -> LlamaConfig | None:
    if args.preset is not None and args.config_json is not None:
        raise SystemExit("pass at most one of --preset and --config-json")
    if args.preset is not None:
        return LlamaConfig.from_preset(args.preset)
    if args.config_json is not None:
        values = json.loads(Path(args.config_json).read_text())
        if "model_type" in values:  # a Hugging Face config.json
            return config_from_hf(values)[0]
        return LlamaConfig.from_dict(values)
    return None


def build_parser() -> argparse.ArgumentParser:
    from lightning_llmopt.cli import options

    parser = options.parser(
        "llmopt consolidate",
        "Write a sharded DCP checkpoint's model as one Hugging Face safetensors checkpoint, "
        "one output shard in memory at a time, with the tokenizer's files beside the weights.",
    )
    parser.add_argument("checkpoint", help="a step-N checkpoint folder, or a root (the newest complete one is used)")
    parser.add_argument("out_dir", help="output folder")
    parser.add_argument(
        "--arch",
        choices=sorted(ARCHITECTURES),
        default=None,
        help="model_type to write (default: from the config: qwen2 with q/k/v bias, mistral with a "
        "sliding window, else llama)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: as saved)")
    parser.add_argument("--max-shard-size", default="2GB", help="bytes per safetensors file, e.g. 2GB, 500MiB")
    parser.add_argument("--preset", default=None, help="LlamaConfig preset when the checkpoint stores no config")
    options.add_tokenizer(parser)  # written beside the weights
    parser.add_argument(
        "--config-json", default=None, help="JSON of LlamaConfig fields (or a Hugging Face config.json) for the model"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Entry point of ``llmopt consolidate``; returns the weight files written."""
    from lightning_llmopt.data.tokenizers import load_tokenizer

    args = build_parser().parse_args(argv)
    written = consolidate(
        args.checkpoint,
        args.out_dir,
        arch=args.arch,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        max_shard_size=args.max_shard_size,
        config=_config_from_args(args),
        tokenizer=load_tokenizer(args.tokenizer) if args.tokenizer is not None else None,
    )
    extras = sorted(p.name for p in Path(args.out_dir).iterdir() if p.suffix == ".json" and p.name != CONFIG_NAME)
    print(
        f"wrote {len(written)} safetensors file(s), {CONFIG_NAME} and {extras or 'no tokenizer files'} to "
        f"{args.out_dir}",
        flush=True,
    )
    return written


if __name__ == "__main__":
    main()
