"""Load a quantized Hugging Face checkpoint folder (GPTQ or compressed-tensors ``pack-quantized``) into our
:class:`~lightning_llmopt.models.Llama`, its quantized layers as
:class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear` (the form the inference engine runs).

The format is read from ``config.json``'s ``quantization_config.quant_method`` (``"gptq"`` or
``"compressed-tensors"``); safetensors and json only, no transformers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.models.hf_config import config_from_hf
from lightning_llmopt.models.hf_files import iter_tensors, read_config
from lightning_llmopt.models.llama import Llama
from lightning_llmopt.quantization.checkpoint import build_llama
from lightning_llmopt.quantization.export_ct import FORMAT, from_ct_tensors
from lightning_llmopt.quantization.export_gptq import from_gptq_tensors
from lightning_llmopt.quantization.weight import QuantizedWeight


def _gptq_loader(qc: dict[str, Any], tensors: dict[str, Tensor], dtype: torch.dtype | None):  # type: ignore
    bits, sym = int(qc["bits"]), bool(qc.get("sym", True))
    fmt = qc.get("checkpoint_format", "gptq")

    def load(name: str) -> QuantizedWeight | None:
        if f"{name}.qweight" not in tensors:
            return None
        parts = {
            s: tensors[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{s}" in tensors
        }
        return from_gptq_tensors(parts, bits, sym, fmt, scale_dtype=dtype)

    return load


def _ct_match(target: str, name: str) -> bool:
    """compressed-tensors' target rule for a linear layer: its class name, its exact name, or ``re:<regex>``."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, "Linear")


def _ct_scheme(qc: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``weights`` args of the first config group targeting linear layer ``name`` (``None`` if ignored)."""
    if any(_ct_match(t, name) for t in qc.get("ignore") or []):
        return None
    for group in qc["config_groups"].values():
        if any(_ct_match(t, name) for t in group.get("targets", [])):
            return group["weights"]
    return None


def _ct_loader(qc: dict[str, Any], tensors: dict[str, Tensor], dtype: torch.dtype | None):  # type: ignore
    if qc.get("format") != FORMAT:
        raise ValueError(f"compressed-tensors format {qc.get('format')!r} is not supported; only {FORMAT!r}")

    def load(name: str) -> QuantizedWeight | None:
        if f"{name}.weight_packed" not in tensors:
            return None
        args = _ct_scheme(qc, name)
        if args is None:
            raise ValueError(f"{name} has packed weights but no config group targets it")
        if args.get("type", "int") != "int":
            raise ValueError(f"{name}: only integer weights are supported, got {args.get('type')!r}")
        parts = {
            s: tensors[f"{name}.{s}"]
            for s in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
            if f"{name}.{s}" in tensors
        }
        return from_ct_tensors(parts, int(args["num_bits"]), bool(args.get("symmetric", True)), dtype)

    return load


def load_quantized(
    path: str | os.PathLike[str],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> Llama:
    """A :class:`Llama` with ``QuantizedLinear`` layers from a GPTQ or compressed-tensors folder.

    Arguments:
        path: the checkpoint folder (``config.json`` with ``quantization_config`` + safetensors).
        device: where the tensors go.
        dtype: cast float tensors and scales (default: as stored).
        config_overrides: :class:`~lightning_llmopt.models.LlamaConfig` fields to override.
    """
    folder = Path(path)
    hf_config = read_config(folder)
    qc = hf_config.get("quantization_config")
    if not qc:
        raise ValueError(f"{str(folder / 'config.json')!r} has no quantization_config; use from_hf for float models")
    method = qc.get("quant_method")
    config, _ = config_from_hf({k: v for k, v in hf_config.items() if k != "quantization_config"}, **config_overrides)
    tensors = dict(iter_tensors(folder, device))
    if method == "gptq":
        loader = _gptq_loader(qc, tensors, dtype)
    elif method == "compressed-tensors":
        loader = _ct_loader(qc, tensors, dtype)
    else:
        raise ValueError(f"quant_method ({method!r}) must be 'gptq' or 'compressed-tensors'")
    return build_llama(config, tensors, loader, device, dtype)


__all__ = ["load_quantized"]
