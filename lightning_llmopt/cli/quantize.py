"""``llmopt quantize``: a float model to a quantized checkpoint folder (GPTQ or compressed-tensors).

    llmopt quantize SRC OUT [--method rtn|gptq] [--bits 4] [--group-size 128] [--asym] [--observer minmax]
        [--act-order] [--damp 0.01] [--format compressed-tensors|gptq] [--data PATH] [--tokenizer byte|PATH]
        [--calib-samples 128] [--seq-len 512 or max_seq_len] [--dtype fp16|bf16|fp32] [--device cpu|cuda] [--offload]

``SRC`` is a Hugging Face folder (Llama, Mistral, Qwen2; read without transformers) or a Lightning checkpoint
(``.ckpt``) of :class:`~lightning_llmopt.CausalLMModule`, e.g. the end of a run with the
:class:`~lightning_llmopt.callbacks.qat.QuantizationAwareTraining` callback (round to nearest then reproduces the
grid QAT trained for). GPTQ calibrates on ``--calib-samples`` sequences of ``--seq-len`` tokens from ``--data``
(a labelled fallback without it: the Python standard library, :class:`~lightning_llmopt.data.TextDataModule`'s
default corpus) tokenized with ``--tokenizer`` (default: ``SRC``'s own tokenizer, else bytes). GPTQ runs block by
block (:mod:`~lightning_llmopt.quantization.gptq_blocks`); ``--offload`` keeps the model on the CPU and moves one
block at a time to ``--device``. The architecture written is ``SRC``'s (``--arch`` overrides it); the output also
holds ``SRC``'s tokenizer files and a ``generation_config.json``. It loads back with
:func:`lightning_llmopt.quantization.load_quantized`, ``LLMEngine.from_pretrained``, ``llmopt generate`` and other
tools (see docs/quantization.md). Progress over the layers goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_llmopt.cli import options
from lightning_llmopt.cli.progress import Progress
from lightning_llmopt.models.hf_files import write_tokenizer_files
from lightning_llmopt.models.llama import Llama
from lightning_llmopt.quantization import QuantConfig, quantize_model, save_compressed_tensors, save_gptq
from lightning_llmopt.quantization.apply import quantizable_linears

__all__ = [
    "build_parser",
    "calibration_batches",
    "check_group_sizes",
    "load_float_model",
    "load_source",
    "main",
    "save_quantized",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = ("compressed-tensors", "gptq")


def load_float_model(src: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> Llama:
    """A :class:`Llama` from a Hugging Face folder or a ``CausalLMModule`` Lightning checkpoint."""
    return load_source(src, dtype, device)[0]


def load_source(src: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> tuple[Llama, Any, str]:
    """``(model, tokenizer or None, arch)`` of a float source: a Hugging Face folder (its ``model_type`` is the
    architecture written), a ``CausalLMModule`` ``.ckpt`` or one of our sharded checkpoint folders (the
    architecture follows the config: :func:`~lightning_llmopt.models.hf_config.arch_of`)."""
    from lightning_llmopt.inference.loading import load_model
    from lightning_llmopt.models.hf_config import arch_of
    from lightning_llmopt.models.hf_files import read_config

    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"source {str(src)!r} does not exist")
    model_type = None
    if path.is_dir() and (path / "config.json").is_file():
        hf_config = read_config(path)
        if hf_config.get("quantization_config"):
            raise ValueError(f"source {str(src)!r} is already quantized; use `llmopt export` to change its format")
        model_type = hf_config.get("model_type")
    # A Lightning checkpoint holds Python objects beside tensors (hyper-parameters, loop state): the user names
    # the file, so it is trusted as Lightning itself trusts it.
    model, tokenizer = load_model(path, dtype=dtype, device=device, trust_pickle=True)
    return model, tokenizer, arch_of(model.config, model_type)


def calibration_batches(
    data: str | None,
    tokenizer: str | None,
    samples: int,
    seq_len: int,
    vocab_size: int,
    batch_size: int = 8,
    seed: int = 1234,
) -> list[torch.Tensor]:
    """``samples`` training chunks of ``seq_len`` tokens as ``(B, T)`` int64 batches (deterministic order)."""
    from lightning_llmopt.data import TextDataModule

    max_bytes = max(2_000_000, samples * seq_len * 8)
    dm = TextDataModule(
        data_path=data, tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size, max_bytes=max_bytes, seed=seed
    )
    if dm.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer's vocabulary ({dm.vocab_size}) is larger than the model's ({vocab_size}); "
            "pass --tokenizer with the model's tokenizer"
        )
    dm.setup("fit")
    dataset = dm.train_dataset
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=g)[:samples].tolist()
    ids = torch.stack([dataset[i]["input_ids"] for i in order])  # (samples, T)
    return list(ids.split(batch_size))


def save_quantized(model: torch.nn.Module, out: str | Path, fmt: str, arch: str = "llama") -> Path:
    if fmt == "gptq":
        return save_gptq(model, out, arch=arch)
    if fmt == "compressed-tensors":
        return save_compressed_tensors(model, out, arch=arch)
    raise ValueError(f"format ({fmt!r}) must be one of {FORMATS}")


def build_parser() -> argparse.ArgumentParser:
    p = options.parser(
        "llmopt quantize",
        "Quantize a model's linear layers (weight-only, round to nearest or GPTQ) and write a GPTQ or "
        "compressed-tensors checkpoint folder that transformers and llmopt generate load.",
    )
    p.add_argument("src", help="Hugging Face folder (Llama, Mistral, Qwen2), CausalLMModule .ckpt or checkpoint folder")
    p.add_argument("out", help="output folder")
    p.add_argument(
        "--method", choices=("rtn", "gptq"), default="gptq", help="rtn: round to nearest; gptq: calibrated on --data"
    )
    p.add_argument("--bits", type=int, default=4, help="bits per weight code, 2 to 8 (Triton kernels for 4 and 8)")
    p.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="input columns per scale; 0: one scale per output channel (for layer widths it does not divide)",
    )
    p.add_argument("--asym", action="store_true", help="asymmetric grid (zero point per group)")
    p.add_argument(
        "--observer", choices=("minmax", "mse", "percentile"), default="minmax", help="how each group's range is chosen"
    )
    p.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening (fraction of the mean diagonal)")
    p.add_argument("--format", choices=FORMATS, default="compressed-tensors", help="checkpoint format written")
    p.add_argument(
        "--arch",
        choices=("llama", "mistral", "qwen2"),
        default=None,
        help="model_type written (default: the source folder's, else from the config: qwen2 with q/k/v biases, "
        "mistral with a sliding window, else llama)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="GPTQ calibration text, a file or folder (default: the Python standard library's sources)",
    )
    options.add_tokenizer(p)
    p.add_argument("--calib-samples", type=int, default=128, help="GPTQ: calibration sequences")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="GPTQ: tokens per calibration sequence (default: 512, or the model's max_seq_len where shorter)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="dtype of the model while quantizing (default: as loaded); the GPTQ format writes fp16 "
        "scales and floats whatever this is",
    )
    p.add_argument("--device", default=None, help="device that quantizes (default: cuda when available, else cpu)")
    p.add_argument(
        "--offload",
        action="store_true",
        help="GPTQ: keep the model on the CPU and move one transformer block at a time to --device (for models "
        "larger than the device's memory)",
    )
    return p


def check_group_sizes(model: torch.nn.Module, config: QuantConfig) -> None:
    """Raise one ``ValueError`` naming every layer whose input width its group size does not divide, with the way
    out: ``--group-size 0`` (per output channel) or a power-of-two group size that divides every width (if one of at
    least 32 does). Runs before any calibration, so that bad input fails in seconds."""
    layers = quantizable_linears(model, config)
    bad: dict[str, tuple[int, int]] = {}
    for name, layer in layers.items():
        spec = config.spec_for(name, layer.in_features)
        if spec is not None and spec.granularity == "group" and layer.in_features % spec.group_size:
            bad[name] = (layer.in_features, spec.group_size)
    if not bad:
        return
    groups = sorted({g for _, g in bad.values()})
    widths = math.gcd(*(layer.in_features for layer in layers.values()))
    fits = widths & -widths  # the largest power of two dividing every width
    while fits > max(groups[-1], 32):
        fits //= 2
    other = f" or --group-size {fits} (divides every layer's width)" if fits >= 32 else ""
    raise ValueError(
        f"--group-size {'/'.join(map(str, groups))} does not divide the input width of {len(bad)} of "
        f"{len(layers)} layers: {_layer_list(bad)}; pass --group-size 0 (one scale per output channel){other}"
    )


def _layer_list(bad: dict[str, tuple[int, int]]) -> str:
    """``layers.*.feed_forward.w2 (172 inputs, 2 layers), output2 (200 inputs)``: names with their block index
    replaced by ``*`` where several blocks share the problem."""
    shared: dict[tuple[str, int], list[str]] = {}
    for name, (width, _) in bad.items():
        shared.setdefault((re.sub(r"(?<![^.])\d+(?=\.)", "*", name), width), []).append(name)
    return ", ".join(
        f"{pattern} ({width} inputs, {len(names)} layers)" if len(names) > 1 else f"{names[0]} ({width} inputs)"
        for (pattern, width), names in shared.items()
    )


def _calibration_spec(tokenizer: Any) -> str | None:
    """The :class:`TextDataModule` spec of a loaded tokenizer (``None``: bytes)."""
    path = getattr(tokenizer, "path", None)
    return str(path) if path is not None else None


def _calibration_length(asked: int | None, max_seq_len: int) -> int:
    """``--seq-len``, or without it 512 tokens cut to the model's context; a longer ``--seq-len`` is refused."""
    if asked is None:
        return min(512, max_seq_len)
    if asked <= 0 or asked > max_seq_len:
        raise ValueError(f"--seq-len ({asked}) must be between 1 and the model's max_seq_len ({max_seq_len})")
    return asked


def main(argv: Sequence[str] | None = None) -> Path:
    """Entry point of ``llmopt quantize``; returns the output folder.

    Prints to stderr what it reads, where the calibration text comes from, and the progress over the layers (a bar on
    a terminal, a line every 10 s otherwise); to stdout one summary line."""
    import sys

    from lightning_llmopt.data.tokenizers import load_tokenizer

    args = build_parser().parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    print(f"[quantize] loading {args.src}", file=sys.stderr, flush=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, arch = load_source(args.src, dtype, "cpu" if args.offload else device)
    model.eval()
    arch = args.arch or arch
    config = QuantConfig(
        bits=args.bits,
        group_size=args.group_size or None,
        symmetric=not args.asym,
        method=args.method,
        observer=args.observer,
        act_order=args.act_order,
        damp=args.damp,
        scale_dtype=torch.float16 if args.format == "gptq" else None,
    )
    check_group_sizes(model, config)  # every layer, before calibration text is read
    if args.tokenizer is not None:
        tokenizer = load_tokenizer(args.tokenizer)
    calibration: Any = None
    if args.method == "gptq":
        args.seq_len = _calibration_length(args.seq_len, model.config.max_seq_len)
        source = args.data or "the Python standard library (fallback: pass --data with text like the model's use)"
        print(f"[quantize] calibration text: {source}", file=sys.stderr, flush=True)
        calibration = calibration_batches(
            args.data, _calibration_spec(tokenizer), args.calib_samples, args.seq_len, model.config.vocab_size
        )
    with Progress("quantize", len(quantizable_linears(model, config)), "layers") as bar:
        block_device = device if args.offload else None
        report = quantize_model(
            model, config, calibration, progress=lambda name: bar.update(1, name), device=block_device
        )
    out = save_quantized(model, args.out, args.format, arch)
    write_tokenizer_files(out, tokenizer)
    print(
        f"quantized {len(report.layers)} linear layers ({args.method}, {next(iter(report.layers.values()), '-')}) "
        f"in {report.seconds:.1f} s; wrote {args.format} checkpoint ({arch}) to {out}",
        flush=True,
    )
    return out


if __name__ == "__main__":
    main()
