"""``llmopt export``: convert a quantized checkpoint folder between formats, or re-write it.

    llmopt export SRC OUT --format gptq|compressed-tensors [--checkpoint-format gptq|gptq_v2] [--arch llama]

``SRC`` is a GPTQ or compressed-tensors ``pack-quantized`` folder (e.g. written by ``llmopt quantize``); it is
loaded into our :class:`~lightning_llmopt.models.Llama` with
:func:`~lightning_llmopt.quantization.load_quantized` (codes, scales and zero points unchanged) and written in the
requested format. GPTQ v1 and v2 differ only in the stored zero point (``zero - 1`` vs ``zero``), so re-exporting
with ``--checkpoint-format`` fixes a checkpoint labelled with the wrong convention once the right one is known.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lightning_llmopt.quantization import load_quantized, save_compressed_tensors, save_gptq

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmopt export",
        description="Convert a quantized checkpoint (GPTQ or compressed-tensors) to GPTQ or compressed-tensors.",
    )
    p.add_argument("src", help="quantized checkpoint folder")
    p.add_argument("out", help="output folder")
    p.add_argument("--format", choices=("compressed-tensors", "gptq"), required=True)
    p.add_argument(
        "--checkpoint-format",
        choices=("gptq", "gptq_v2"),
        default="gptq",
        help="GPTQ zero-point convention written (v1 'gptq' stores zero - 1)",
    )
    p.add_argument("--arch", choices=("llama", "mistral", "qwen2"), default="llama")
    return p


def main(argv: Sequence[str] | None = None) -> Path:
    """Entry point of ``llmopt export``; returns the output folder."""
    args = build_parser().parse_args(argv)
    model = load_quantized(args.src)
    if args.format == "gptq":
        out = save_gptq(model, args.out, checkpoint_format=args.checkpoint_format, arch=args.arch)
    else:
        out = save_compressed_tensors(model, args.out, arch=args.arch)
    print(f"wrote {args.format} checkpoint to {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
