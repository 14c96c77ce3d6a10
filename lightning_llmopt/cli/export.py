"""``llmopt export``: convert a quantized checkpoint folder between formats, or re-write it.

    llmopt export SRC OUT --format gptq|compressed-tensors [--checkpoint-format gptq|gptq_v2] [--arch qwen2]

``SRC`` is a GPTQ or compressed-tensors ``pack-quantized`` folder (e.g. written by ``llmopt quantize``); it is
loaded into our :class:`~lightning_llmopt.models.Llama` with
:func:`~lightning_llmopt.quantization.load_quantized` (codes, scales and zero points unchanged) and written in the
requested format. GPTQ v1 and v2 differ only in the stored zero point (``zero - 1`` vs ``zero``), so re-exporting
with ``--checkpoint-format`` fixes a checkpoint labelled with the wrong convention once the right one is known.
The architecture written is ``SRC``'s ``model_type`` unless ``--arch`` says otherwise; ``SRC``'s tokenizer files and
``generation_config.json`` are copied. Progress (read, write) goes to stderr.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lightning_llmopt.cli.progress import Progress
from lightning_llmopt.models.hf_config import arch_of
from lightning_llmopt.models.hf_files import read_config, write_tokenizer_files
from lightning_llmopt.quantization import load_quantized, save_compressed_tensors, save_gptq

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from lightning_llmopt.cli import options

    p = options.parser(
        "llmopt export",
        "Convert a quantized checkpoint (GPTQ or compressed-tensors) to GPTQ or compressed-tensors.",
    )
    p.add_argument("src", help="quantized checkpoint folder")
    p.add_argument("out", help="output folder")
    p.add_argument("--format", choices=("compressed-tensors", "gptq"), required=True, help="checkpoint format written")
    p.add_argument(
        "--checkpoint-format",
        choices=("gptq", "gptq_v2"),
        default="gptq",
        help="GPTQ zero-point convention written (v1 'gptq' stores zero - 1)",
    )
    p.add_argument(
        "--arch", choices=("llama", "mistral", "qwen2"), default=None, help="model_type written (default: SRC's)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> Path:
    """Entry point of ``llmopt export``; returns the output folder."""
    from lightning_llmopt.data.tokenizers import load_tokenizer

    args = build_parser().parse_args(argv)
    src = Path(args.src)
    with Progress("export", 2, "stages") as bar:
        model = load_quantized(src)
        arch = args.arch or arch_of(model.config, read_config(src).get("model_type"))
        bar.update(1, f"read {src}")
        if args.format == "gptq":
            out = save_gptq(model, args.out, checkpoint_format=args.checkpoint_format, arch=arch)
        else:
            out = save_compressed_tensors(model, args.out, arch=arch)
        write_tokenizer_files(out, load_tokenizer(src) if (src / "tokenizer.json").is_file() else None)
        bar.update(1, f"wrote {out}")
    print(f"wrote {args.format} checkpoint ({arch}) to {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
