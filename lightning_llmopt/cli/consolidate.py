"""``llmopt consolidate``: any training checkpoint of the package to one Hugging Face safetensors folder.

    llmopt consolidate runs/tiny_cpu/checkpoints out/hf [--arch llama|mistral|qwen2] [--dtype bf16|fp16|fp32]
        [--max-shard-size 2GB] [--preset tiny | --config-json config.json] [--tokenizer PATH] [--trust-pickle]

The checkpoint (found by :func:`lightning_llmopt.checkpoint_io.find_checkpoint`, which the command names before it
reads) is a Lightning ``.ckpt`` file (single device, DDP), a sharded DCP ``step-N`` folder
(:class:`~lightning_llmopt.strategies.ZeroStrategy`, :class:`~lightning_llmopt.strategies.NDParallelStrategy`:
ZeRO-1/2/3, TP, PP, ...), a folder of those (``last.ckpt/step-00000020``), or a run folder holding any of them
(``last`` wins, else the newest). Model tensor names may carry the LightningModule's ``model.`` prefix (and
``torch.compile``'s ``_orig_mod.``) or not; other entries (optimizer, RNG, data position) are ignored.

The full model is never in memory at once:

1. the checkpoint is verified (a DCP folder: marker and file sizes) and its tensor names, shapes and dtypes read;
2. the weights are cut into output shards of at most ``--max-shard-size`` bytes, in Hugging Face order;
3. per output shard just those tensors are read (a DCP folder: one ``dcp.load`` without a process group, which
   reads the overlapping pieces of every rank's files; a ``.ckpt``: memory-mapped), renamed, cast and written with
   safetensors, and dropped before the next shard is read.

The model's :class:`~lightning_llmopt.models.config.LlamaConfig` comes from ``--preset``/``--config-json`` when
given, else from the checkpoint: a DCP folder's ``"config"`` state entry or marker ``extra["config"]``, a
``.ckpt``'s ``hyper_parameters["model"]``.

Bad input (no checkpoint there, an incomplete one, a config that does not match) ends with one line naming what
was found and what was expected; ``LLMOPT_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp  # noqa: F401  (kept: callers patch ``consolidate.dcp.load``)

from lightning_llmopt.checkpoint_io import (  # noqa: F401  (re-exported: the import paths of earlier versions)
    CheckpointNotFoundError,
    DCPReader,
    FoundCheckpoint,
    LightningReader,
    TensorInfo,
    _get,
    _load,
    _model_keys,
    _nested,
    checkpoint_tokenizer,
    config_from_checkpoint,
    find_checkpoint,
    lightning_entry,
    open_checkpoint,
    resolve_checkpoint,
)
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
from lightning_llmopt.parallel.checkpoint import IncompleteCheckpointError

__all__ = ["checkpoint_tokenizer", "consolidate", "lightning_entry", "main", "resolve_checkpoint"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
Reader = DCPReader | LightningReader


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


def _check_shapes(reader: Reader, infos: dict[str, TensorInfo], config: LlamaConfig, required: list[str]) -> None:
    missing = [n for n in required if n not in infos]
    if missing:
        raise KeyError(
            f"checkpoint {reader.path} lacks {len(missing)} model tensor(s) of the config, e.g. {missing[:5]}; "
            f"saved tensors include {reader.saved_names()[:5]}"
        )
    shapes = expected_shapes(config)
    bad = [f"{n}: {infos[n].shape} (expected {shapes[n]})" for n in required if infos[n].shape != shapes[n]]
    if bad:
        raise ValueError(f"{len(bad)} checkpoint tensor(s) do not match the config: " + "; ".join(bad[:5]))


def consolidate(
    checkpoint: str | Path | FoundCheckpoint,
    out_dir: str | Path,
    *,
    arch: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "2GB",
    config: LlamaConfig | None = None,
    tokenizer: Any = None,
    trust_pickle: bool = False,
) -> list[Path]:
    """Write the model of a training checkpoint as a Hugging Face safetensors folder, one shard at a time.

    Arguments:
        checkpoint: a Lightning ``.ckpt``, a ``step-N`` folder, a folder of them, or a run folder holding any of
            them (see :func:`~lightning_llmopt.checkpoint_io.find_checkpoint`), or what ``find_checkpoint`` found.
        out_dir: output folder; stale ``model*.safetensors`` files and index there are removed.
        arch: ``"llama"``, ``"mistral"`` or ``"qwen2"``; ``None`` picks ``qwen2`` with q/k/v biases, ``mistral``
            with a sliding window, else ``llama``.
        dtype: cast floating-point weights; ``None`` keeps the saved dtype.
        max_shard_size: bytes per safetensors file (int or e.g. ``"2GB"``); at most this many bytes (of the
            saved dtype, or of ``dtype`` if larger) are loaded at once, or one tensor if it is larger.
        config: the model config; default: the one saved with the checkpoint.
        tokenizer: written beside the weights with a ``generation_config.json``; default: the tokenizer the
            checkpoint remembers (``CausalLMModule`` records its data module's), if any.
        trust_pickle: unpickle a ``.ckpt`` fully (it is loaded weights-only otherwise).

    Returns: the weight files written. Raises ``CheckpointNotFoundError`` when there is no checkpoint and
    ``IncompleteCheckpointError`` for an incomplete one, before anything is written.
    """
    if dtype is not None and dtype not in DTYPES.values():
        raise ValueError(f"dtype ({dtype}) must be one of {list(DTYPES.values())}")
    max_bytes = parse_size(max_shard_size)
    reader = open_checkpoint(checkpoint, trust_pickle=trust_pickle)
    if config is None:
        config = reader.saved_config()
    if config is None:
        raise ValueError(
            f"checkpoint {reader.path} stores no model config ({reader.config_source}); "
            "pass --preset NAME or --config-json PATH"
        )
    if arch is None:
        arch = "qwen2" if config.qkv_bias else "mistral" if config.sliding_window is not None else "llama"
    config_to_hf(config, arch)  # checks arch against the config before anything is read
    hf_names = key_map(config)
    required = [n for n in hf_names if not (config.tie_embeddings and n == "output.weight")]
    infos = reader.model_tensors(hf_names)
    _check_shapes(reader, infos, config, required)
    # Planned in the larger of the saved and written dtypes: neither the load nor the file exceeds max_bytes.
    nbytes = {
        n: math.prod(infos[n].shape) * max(infos[n].dtype.itemsize, (dtype or infos[n].dtype).itemsize)
        for n in required
    }
    shards = _plan(required, nbytes, max_bytes)
    hf_config = config_to_hf(config, arch, dtype=dtype or infos[required[0]].dtype)
    written = _write(reader, Path(out_dir), shards, hf_names, dtype, hf_config)
    if tokenizer is None:
        tokenizer = reader.tokenizer()
    write_tokenizer_files(Path(out_dir), tokenizer)
    return written


def _write(
    reader: Reader,
    out: Path,
    shards: list[list[str]],
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
        state = reader.read(names)
        tensors = {}
        for n in names:
            t = state[n].to(dtype) if dtype is not None and state[n].is_floating_point() else state[n]
            tensors[hf_names[n]] = t.contiguous()
            total += t.numel() * t.element_size()
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
        "Write a training checkpoint's model as one Hugging Face safetensors folder, one output shard in memory at a "
        "time, with the tokenizer's files beside the weights.",
    )
    parser.add_argument(
        "checkpoint",
        help="a Lightning .ckpt file, a step-N folder, a folder of them (last.ckpt), or a run folder holding any of "
        "them (runs/NAME/checkpoints or runs/NAME: 'last' wins, else the newest)",
    )
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
    parser.add_argument("--trust-pickle", action="store_true", help="unpickle a .ckpt fully (only for files you trust)")
    return parser


# Bad input rather than a bug: one line on stderr, exit status 2 (as the other ``llmopt`` commands).
_INPUT_ERRORS = (IncompleteCheckpointError, ValueError, OSError, KeyError, NotImplementedError, ImportError)


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Entry point of ``llmopt consolidate``; returns the weight files written.

    Prints the checkpoint it reads (and, when it picked one of several, which rule chose it) before reading it.
    Bad input ends in ``SystemExit(2)`` after one line on stderr, ``llmopt consolidate: error: ...``, unless
    ``LLMOPT_DEBUG`` is set (then the exception propagates with its traceback).
    """
    from lightning_llmopt.data.tokenizers import load_tokenizer

    args = build_parser().parse_args(argv)
    try:
        config = _config_from_args(args)
        found = find_checkpoint(args.checkpoint)
        print(f"reading {found.describe()}", flush=True)
        written = consolidate(
            found,
            args.out_dir,
            arch=args.arch,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            max_shard_size=args.max_shard_size,
            config=config,
            tokenizer=load_tokenizer(args.tokenizer) if args.tokenizer is not None else None,
            trust_pickle=args.trust_pickle,
        )
    except _INPUT_ERRORS as exc:
        if os.environ.get("LLMOPT_DEBUG", "") not in ("", "0"):
            raise
        print(f"llmopt consolidate: error: {_one_line(exc)}  (LLMOPT_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    extras = sorted(p.name for p in Path(args.out_dir).iterdir() if p.suffix == ".json" and p.name != CONFIG_NAME)
    print(
        f"wrote {len(written)} safetensors file(s), {CONFIG_NAME} and {extras or 'no tokenizer files'} to "
        f"{args.out_dir}",
        flush=True,
    )
    return written


if __name__ == "__main__":
    main()
