"""What the exporters share: the Hugging Face view of a quantized model, and rebuilding our model from a folder.

:func:`hf_view` lists, under Hugging Face names, the quantized layers and the float tensors of a model, and its
``config.json`` dict: for our :class:`~lightning_llmopt.models.Llama` through the same name map as
:func:`~lightning_llmopt.models.to_hf`; for a transformers model as they are. :func:`build_llama` is the inverse
used by the loaders: a :class:`Llama` on the meta device whose quantized layers become
:class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear` and whose float tensors are assigned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.hf_config import config_to_hf
from lightning_llmopt.models.hf_weights import key_map
from lightning_llmopt.models.llama import Llama
from lightning_llmopt.quantization.apply import set_module
from lightning_llmopt.quantization.weight import QuantizedWeight


@dataclass
class HFView:
    """``quantized``: ``{HF module name: QuantizedLinear}``; ``tensors``: ``{HF name: float tensor}`` of the rest
    (biases of quantized layers included); ``config``: the ``config.json`` dict; ``unquantized_linears``: HF names of
    linear layers left in float (written to the formats' ignore lists)."""

    quantized: dict[str, QuantizedLinear]
    tensors: dict[str, Tensor]
    config: dict[str, Any]
    unquantized_linears: list[str]


def _quant_buffers(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for prefix, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            names.update(f"{prefix}.{b}" for b, _ in m.named_buffers(recurse=False))
    return names


def hf_view(model: nn.Module, arch: str = "llama", dtype: torch.dtype | None = None) -> HFView:
    """The Hugging Face view of ``model`` (our ``Llama`` or a transformers ``*ForCausalLM``) with quantized layers.

    ``dtype``: the ``torch_dtype`` written to the config (default: the dtype of the float tensors).
    """
    skip = _quant_buffers(model)
    own = {k: v for k, v in model.state_dict().items() if k not in skip and k != "rope"}
    if not any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("the model has no QuantizedLinear layer: quantize it first (quantize_model / convert_qat)")
    if isinstance(model, Llama):
        config = model.config
        names = key_map(config)

        def rename(ours: str) -> str:
            return names[ours]

        if config.tie_embeddings:
            own.pop("output.weight", None)
        float_dtype = dtype or next(v.dtype for v in own.values() if v.is_floating_point())
        hf_config = config_to_hf(config, arch, dtype=float_dtype)
    else:
        if not hasattr(model, "config"):
            raise TypeError(f"expected a Llama or a transformers model with .config, got {type(model).__name__}")

        def rename(ours: str) -> str:
            return ours

        hf_cfg: Any = model.config  # a transformers PretrainedConfig
        hf_config = {k: v for k, v in hf_cfg.to_dict().items() if k != "quantization_config"}
        if getattr(hf_cfg, "tie_word_embeddings", False):
            own.pop("lm_head.weight", None)
        if dtype is not None:
            hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype).removeprefix("torch.")
    quantized = {
        rename(f"{n}.weight").removesuffix(".weight"): m
        for n, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
    }
    unquantized = [
        rename(f"{n}.weight").removesuffix(".weight") for n, m in model.named_modules() if isinstance(m, nn.Linear)
    ]
    return HFView(quantized, {rename(k): v for k, v in own.items()}, hf_config, unquantized)


def build_llama(
    config: LlamaConfig,
    tensors: dict[str, Tensor],
    quantized: Callable[[str], QuantizedWeight | None],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Llama:
    """A :class:`Llama` from Hugging Face-named ``tensors``; ``quantized(hf_module_name)`` returns the layer's
    :class:`QuantizedWeight` (or ``None`` for a float layer). ``dtype`` casts float tensors and scales."""
    names = key_map(config)
    with torch.device("meta"):
        model = Llama(config)
    used: set[str] = set()
    for ours, theirs in names.items():
        if not ours.endswith(".weight") or config.tie_embeddings and ours == "output.weight":
            continue
        module_name = ours.removesuffix(".weight")
        module = model.get_submodule(module_name)
        if not isinstance(module, nn.Linear):
            continue
        qw = quantized(theirs.removesuffix(".weight"))
        if qw is None:
            continue
        bias_name = names.get(f"{module_name}.bias")
        bias = tensors.get(bias_name) if bias_name else None
        if bias_name:
            used.add(bias_name)
        layer = QuantizedLinear.from_quantized(qw.to(device), bias.to(device) if bias is not None else None, dtype)
        set_module(model, module_name, layer)
    sd = {}
    for ours, theirs in names.items():
        if theirs in used or (config.tie_embeddings and ours == "output.weight"):
            continue
        if isinstance(model.get_submodule(ours.rsplit(".", 1)[0]), QuantizedLinear):
            continue
        if theirs not in tensors:
            raise KeyError(f"checkpoint lacks {theirs!r}")
        t = tensors[theirs]
        sd[ours] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
    if config.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not isinstance(model.get_submodule(k.rsplit(".", 1)[0]), QuantizedLinear)]
    if missing or unexpected:
        raise KeyError(f"could not rebuild the model: missing {missing[:10]}, unexpected {unexpected[:10]}")
    if config.tie_embeddings:
        assert model.output is not None and model.tok_embeddings is not None
        if not isinstance(model.output, QuantizedLinear):
            model.output.weight = model.tok_embeddings.weight
    with torch.device(device):  # the RoPE table is computed, even under a caller's meta-device context
        model.reset_buffers(device)
    return model


__all__ = ["HFView", "build_llama", "hf_view"]
