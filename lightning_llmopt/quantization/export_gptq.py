"""GPTQ-format checkpoints (AutoGPTQ / GPTQModel layout, as vLLM's and transformers' GPTQ loaders read them).

Written spec, checked by ``tests/quantization/test_export_gptq.py``. For every quantized linear layer ``<m>`` with
``K`` inputs, ``N`` outputs, ``b`` bits and group size ``G`` (``G = K`` when ``group_size = -1``):

| tensor | dtype | shape | content |
|---|---|---|---|
| ``<m>.qweight`` | int32 | ``(K * b / 32, N)`` | codes packed along the **input** dim, ``32 / b`` per word, LSB first |
| ``<m>.qzeros`` | int32 | ``(K / G, N * b / 32)`` | zero points packed along the **output** dim (v1: ``zero - 1``) |
| ``<m>.scales`` | float16 | ``(K / G, N)`` | one scale per group and output |
| ``<m>.g_idx`` | int32 | ``(K,)`` | group of each input feature (``k // G`` unless ``desc_act``) |
| ``<m>.bias`` | float16 | ``(N,)`` | only if the layer has a bias |

Dequantization as the loaders' kernels do it: ``W[k, n] = (q[k, n] - (qz[g, n] + 1)) * s[g, n]``, ``g = g_idx[k]``
(v1; ``gptq_v2`` drops the ``+ 1``). With ``sym = True`` and 4 bits every stored zero is 7 (``0x77777777`` per
word): a checkpoint that stores 8 under a v1 label (or 7 under v2) decodes every weight one step off, the gibberish
of mislabelled zero points. ``config.json`` carries ``quantization_config`` with ``quant_method = "gptq"``,
``bits``, ``group_size``, ``desc_act``, ``sym``, ``checkpoint_format``, ``lm_head = false`` (and
``quantize_config.json`` holds the same for AutoGPTQ). Unquantized tensors (embeddings, norms, the head) are fp16.
Fast Hopper/Ampere kernels of other tools (Marlin, Machete) expect ``sym = True``, ``group_size`` 128 (or -1) and
``desc_act = False``: the defaults of :func:`save_gptq`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.models.hf_files import write_checkpoint
from lightning_llmopt.quantization.checkpoint import hf_view
from lightning_llmopt.quantization.packing import pack_bits, unpack_bits
from lightning_llmopt.quantization.weight import QuantizedWeight

GPTQ_BITS = (2, 3, 4, 8)
GPTQ_CONFIG_KEYS = ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")
GPTQ_FORMATS = ("gptq", "gptq_v2")


def _zero_offset(checkpoint_format: str) -> int:
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format ({checkpoint_format!r}) must be one of {GPTQ_FORMATS}")
    return 1 if checkpoint_format == "gptq" else 0


def gptq_tensors(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict[str, Tensor]:
    """``{qweight, qzeros, scales, g_idx}`` of one layer (module docstring), in the original input order."""
    if qw.bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ checkpoints hold {GPTQ_BITS}-bit codes, got {qw.bits}")
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    codes = qw.codes()
    g_idx = torch.arange(k, device=codes.device) // g
    if qw.perm is not None:  # act order: stored column j is input perm[j]; write input order with g_idx
        perm = qw.perm.to(codes.device)
        codes = torch.empty_like(codes).index_copy_(1, perm, codes)
        g_idx = torch.empty_like(g_idx).index_copy_(0, perm, g_idx)
    zeros = qw.zero_points().round().to(torch.int64) - _zero_offset(checkpoint_format)  # (N, K / G)
    if int(zeros.min()) < 0:
        raise ValueError(
            "a zero point of 0 cannot be stored in GPTQ v1 (it stores zero - 1); use "
            "checkpoint_format='gptq_v2' or a symmetric grid"
        )
    if (k * qw.bits) % 32 or (n * qw.bits) % 32:
        raise ValueError(
            f"GPTQ packing needs in_features ({k}) and out_features ({n}) times bits ({qw.bits}) to be multiples of 32"
        )
    return {
        "qweight": pack_bits(codes, qw.bits).t().contiguous(),  # (K * b / 32, N)
        "qzeros": pack_bits(zeros.t(), qw.bits).contiguous(),  # (K / G, N * b / 32)
        "scales": qw.scales.t().to(torch.float16).contiguous(),  # (K / G, N)
        "g_idx": g_idx.to(torch.int32),
    }


def from_gptq_tensors(
    t: dict[str, Tensor], bits: int, sym: bool, checkpoint_format: str = "gptq", scale_dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """Inverse of :func:`gptq_tensors`: a :class:`QuantizedWeight` (``perm`` rebuilt from a non-trivial ``g_idx``)."""
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t.get("g_idx")
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    groups = scales.shape[0]
    g = k // groups
    codes = unpack_bits(qweight.t().contiguous(), bits, k)  # (N, K)
    zeros = unpack_bits(qzeros, bits, n).t().to(torch.int64) + _zero_offset(checkpoint_format)  # (N, groups)
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(k) // g):
        counts = torch.bincount(g_idx.long().cpu(), minlength=groups)
        if not bool((counts == g).all()):
            raise ValueError(f"g_idx does not put exactly {g} inputs in every group; cannot be stored contiguously")
        perm = torch.argsort(g_idx.long(), stable=True)
        codes = codes[:, perm.to(codes.device)]
        perm = perm.to(codes.device)
    if int(zeros.max()) >= 1 << bits:
        raise ValueError(f"zero points exceed {bits} bits: is checkpoint_format ({checkpoint_format!r}) right?")
    symmetric = sym and bool((zeros == 1 << (bits - 1)).all())
    sc = scales.t().contiguous().to(scale_dtype or scales.dtype)
    return QuantizedWeight.from_codes(codes, sc, None if symmetric else zeros.to(torch.uint8), bits, g, perm)


def gptq_config(
    bits: int, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str = "gptq", damp: float = 0.01
) -> dict[str, Any]:
    """The ``quantization_config`` dict (module docstring)."""
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": checkpoint_format,
        "damp_percent": damp,
        "true_sequential": True,
        "static_groups": False,
        "lm_head": False,
    }


def save_gptq(
    model: nn.Module,
    path: str | os.PathLike[str],
    checkpoint_format: str = "gptq",
    arch: str = "llama",
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write ``model`` (our ``Llama`` or a transformers model whose linear layers are ``QuantizedLinear``) as a
    GPTQ checkpoint folder. All quantized layers must share bits, group size and symmetry (GPTQ's config is
    global). Returns ``path``."""
    view = hf_view(model, arch, dtype=torch.float16)
    layers = view.quantized
    bits_sym = {(m.bits, m.symmetric) for m in layers.values()}
    groups = {m.group_size for m in layers.values() if m.group_size < m.in_features}
    group = groups.pop() if len(groups) == 1 else -1
    # a layer whose single group spans all K inputs fits group_size G only if K == G (or G = -1)
    odd = [n for n, m in layers.items() if m.group_size == m.in_features and group not in (-1, m.in_features)]
    if len(bits_sym) != 1 or groups or odd:
        raise ValueError(
            f"GPTQ checkpoints have one global format; the model mixes bits/sym {sorted(bits_sym)}, "
            f"group sizes {sorted({m.group_size for m in layers.values()})} (export mixed precision as "
            "compressed-tensors)"
        )
    bits, sym = bits_sym.pop()
    desc_act = any(m.perm is not None for m in layers.values())
    tensors = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in view.tensors.items()}
    for name, layer in layers.items():
        for suffix, t in gptq_tensors(layer.quantized_weight(), checkpoint_format).items():
            tensors[f"{name}.{suffix}"] = t
    qconfig = gptq_config(bits, group, sym, desc_act, checkpoint_format)
    config = {**view.config, "quantization_config": qconfig}
    out = Path(path)
    write_checkpoint(out, tensors, config, max_shard_size)
    (out / "quantize_config.json").write_text(json.dumps(qconfig, indent=2) + "\n")
    return out


__all__ = ["GPTQ_BITS", "GPTQ_CONFIG_KEYS", "from_gptq_tensors", "gptq_config", "gptq_tensors", "save_gptq"]
