"""compressed-tensors ``pack-quantized`` checkpoints (what transformers loads with the ``compressed-tensors``
package installed, and vLLM serves).

Per quantized linear layer ``<m>`` (``N`` outputs, ``K`` inputs, ``b`` bits, group ``G``):

| tensor | dtype | shape | content |
|---|---|---|---|
| ``<m>.weight_packed`` | int32 | ``(N, K * b / 32)`` | codes packed along the input dim (our ``qweight``) |
| ``<m>.weight_scale`` | model dtype | ``(N, K / G)`` (``(N, 1)`` per channel) | scales |
| ``<m>.weight_shape`` | int64 | ``(2,)`` | ``[N, K]`` |
| ``<m>.weight_zero_point`` | int32 | ``(N * b / 32, K / G)`` | asymmetric only: packed along the **output** dim |

compressed-tensors quantizes to signed values ``round(w / s) + zp`` in ``[-2**(b-1), 2**(b-1) - 1]`` and packs
``value + 2**(b-1)``; our unsigned code is exactly that packed value, and its signed zero point is
``zero - 2**(b-1)`` (0 when symmetric), stored packed the same way, i.e. as our zero code.
``quantization_config``: ``quant_method = "compressed-tensors"``, ``format = "pack-quantized"``,
``quantization_status = "compressed"``, one ``config_groups`` entry per distinct (bits, group, symmetry) with
``weights = {num_bits, type: "int", symmetric, strategy: "group" | "channel", group_size}`` and ``targets``
(``["Linear"]`` when every quantized layer shares one format, else the layers' names), and ``ignore`` listing the
linear layers kept in float (the head). Widths 4 and 8 only: other widths changed packing across
compressed-tensors releases. Activation order (a ``perm``) is refused: compressed-tensors deprecated the group
activation ordering that needs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.models.hf_files import write_checkpoint
from lightning_llmopt.quantization.checkpoint import hf_view
from lightning_llmopt.quantization.packing import pack_bits, unpack_bits
from lightning_llmopt.quantization.weight import QuantizedWeight

CT_BITS = (4, 8)
FORMAT = "pack-quantized"


def ct_tensors(qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, Tensor]:
    """``{weight_packed, weight_scale, weight_shape[, weight_zero_point]}`` of one layer (module docstring)."""
    if qw.bits not in CT_BITS:
        raise ValueError(f"pack-quantized export supports {CT_BITS}-bit codes, got {qw.bits}")
    if qw.perm is not None:
        raise ValueError(
            "compressed-tensors export does not support activation order (quantize with "
            "act_order=False, or export GPTQ format with desc_act)"
        )
    out = {
        "weight_packed": qw.packed.contiguous(),
        "weight_scale": qw.scales.to(dtype).contiguous(),
        "weight_shape": torch.tensor([qw.out_features, qw.in_features], dtype=torch.int64),
    }
    if qw.zeros is not None:
        out["weight_zero_point"] = pack_bits(qw.zeros.t(), qw.bits).t().contiguous()  # (N * b / 32, K / G)
    return out


def from_ct_tensors(
    t: dict[str, Tensor], bits: int, symmetric: bool, scale_dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """Inverse of :func:`ct_tensors`."""
    n, k = (int(v) for v in t["weight_shape"].tolist())
    scales = t["weight_scale"]
    zeros = None
    if not symmetric:
        zeros = unpack_bits(t["weight_zero_point"].t().contiguous(), bits, n).t().contiguous()
    packed = t["weight_packed"]
    return QuantizedWeight(
        packed.contiguous(), scales.to(scale_dtype or scales.dtype).contiguous(), zeros, bits, k // scales.shape[1], k
    )


def _weights_args(bits: int, group: int | None, symmetric: bool) -> dict[str, Any]:
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group" if group else "channel",
        "group_size": group,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def ct_config(formats: dict[tuple[int, int | None, bool], list[str]], ignore: list[str]) -> dict[str, Any]:
    """``quantization_config`` for layers grouped by ``(bits, group or None, symmetric)`` (module docstring)."""
    groups = {}
    single = len(formats) == 1
    for i, ((bits, group, sym), names) in enumerate(sorted(formats.items(), key=lambda kv: str(kv[0]))):
        groups[f"group_{i}"] = {
            "targets": ["Linear"] if single else sorted(names),
            "weights": _weights_args(bits, group, sym),
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def save_compressed_tensors(
    model: nn.Module,
    path: str | os.PathLike[str],
    arch: str = "llama",
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write ``model`` (our ``Llama`` or a transformers model with ``QuantizedLinear`` layers) as a
    compressed-tensors ``pack-quantized`` folder. ``dtype``: dtype of float tensors and scales (default: the
    model's). Mixed precision is kept (one config group per format). Returns ``path``."""
    view = hf_view(model, arch, dtype=dtype)
    float_dtype = dtype or next((v.dtype for v in view.tensors.values() if v.is_floating_point()), torch.float16)
    tensors = {k: v.to(float_dtype) if v.is_floating_point() else v for k, v in view.tensors.items()}
    formats: dict[tuple[int, int | None, bool], list[str]] = {}
    for name, layer in view.quantized.items():
        group = None if layer.group_size == layer.in_features else layer.group_size
        formats.setdefault((layer.bits, group, layer.symmetric), []).append(name)
        for suffix, t in ct_tensors(layer.quantized_weight(), float_dtype).items():
            tensors[f"{name}.{suffix}"] = t
    config = {**view.config, "quantization_config": ct_config(formats, view.unquantized_linears)}
    out = Path(path)
    write_checkpoint(out, tensors, config, max_shard_size)
    return out


__all__ = ["CT_BITS", "ct_config", "ct_tensors", "from_ct_tensors", "save_compressed_tensors"]
