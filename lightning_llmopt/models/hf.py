"""Hugging Face interop: load Llama, Mistral and Qwen2 checkpoints into :class:`Llama` and export back.

- :func:`from_hf` takes a transformers model or a checkpoint folder (read with safetensors and json only);
- :func:`to_hf` writes a folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads;
- :func:`config_from_hf`, :func:`config_to_hf`, :func:`state_dict_from_hf`, :func:`state_dict_to_hf` are the pure
  translations underneath.

Nothing here imports transformers, so ``import lightning_llmopt`` stays light.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.hf_config import ARCHITECTURES, arch_of, config_from_hf, config_to_hf
from lightning_llmopt.models.hf_files import iter_tensors, read_config, write_checkpoint, write_tokenizer_files
from lightning_llmopt.models.hf_weights import state_dict_from_hf, state_dict_to_hf
from lightning_llmopt.models.llama import Llama

__all__ = [
    "ARCHITECTURES",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "state_dict_from_hf",
    "state_dict_to_hf",
    "to_hf",
]


def _read_source(source: Any, device: torch.device | str) -> tuple[dict[str, Any] | Any, dict[str, Tensor]]:
    """``(hf config, hf state dict)`` of a transformers model or a checkpoint folder."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        hf_config = read_config(path)
        arch = hf_config.get("model_type")
        if arch not in ARCHITECTURES:  # fail before reading gigabytes of weights
            raise ValueError(
                f"model_type ({arch!r}) in {str(path / 'config.json')!r} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        return hf_config, dict(iter_tensors(path, device))
    if hasattr(source, "config") and hasattr(source, "state_dict"):
        return source.config, dict(source.state_dict())
    raise TypeError(f"from_hf expects a transformers model or a checkpoint folder path, got {type(source).__name__}")


def _build(config: LlamaConfig, sd: dict[str, Tensor], dtype: torch.dtype | None, device: torch.device | str) -> Llama:
    """A :class:`Llama` whose parameters are the tensors of ``sd`` (moved/cast only where asked), built on meta."""
    with torch.device("meta"):
        model = Llama(config)
    for k in list(sd):  # replace one at a time so a cast never holds two full copies
        v = sd[k]
        sd[k] = v.to(device=device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
    if config.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_embeddings:
        assert model.output is not None and model.tok_embeddings is not None
        model.output.weight = model.tok_embeddings.weight  # assign=True made two Parameters; share one again
    with torch.device(device):  # the RoPE table is computed, even under a caller's meta-device context
        model.reset_buffers(device)
    return model


def from_hf(
    source: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    config: LlamaConfig | None = None,
    **config_overrides: Any,
) -> Llama:
    """Load a Hugging Face Llama, Mistral or Qwen2 model as a :class:`Llama`.

    Arguments:
        source: a transformers ``*ForCausalLM`` (or bare ``*Model`` with tied embeddings) instance, or a local
            folder holding ``config.json`` and ``model.safetensors`` / sharded safetensors with
            ``model.safetensors.index.json`` / ``pytorch_model.bin`` (a folder needs no transformers).
        dtype: cast floating-point weights to this dtype; ``None`` keeps the stored dtype.
        device: where the parameters live.
        config: the :class:`LlamaConfig` to build (default: translated from the source's config); it must describe
            the same weights (e.g. the translated config with runtime fields such as ``attn_backend`` changed).
        config_overrides: :class:`LlamaConfig` fields to override, e.g. ``attn_backend="eager"`` or a smaller
            ``max_seq_len`` (sizes the RoPE table).

    The model is built on the meta device and the loaded tensors become its parameters (``assign=True``), so no
    second copy is made. Loading from a transformers instance therefore shares storage with it when neither
    ``dtype`` nor ``device`` changes the tensors: clone the result if both will be modified. This works inside a
    ``torch.device("meta")`` context too (a sharded strategy's ``configure_model``): the weights are read onto
    ``device`` all the same.
    """
    hf_config, hf_sd = _read_source(source, device)
    if config is None:
        config, _ = config_from_hf(hf_config, **config_overrides)
    elif config_overrides:
        raise ValueError(f"pass config or config overrides ({sorted(config_overrides)}), not both")
    sd = state_dict_from_hf(hf_sd, config)
    del hf_sd
    return _build(config, sd, dtype, device)


def to_hf(
    model: Llama,
    path: str | os.PathLike[str],
    arch: str | None = None,
    max_shard_size: int | str = "2GB",
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
) -> Path:
    """Export ``model`` as a Hugging Face checkpoint folder.

    Arguments:
        model: a complete :class:`Llama` (no pipeline stage, no DTensor or meta parameters).
        path: output folder (created if needed); existing ``model*.safetensors`` files and index there are removed.
        arch: ``"llama"``, ``"mistral"`` (sliding window) or ``"qwen2"`` (q/k/v biases, optional sliding window);
            ``None`` picks it from the config (:func:`~lightning_llmopt.models.hf_config.arch_of`).
        max_shard_size: bytes per safetensors file (int or e.g. ``"2GB"``, ``"500MiB"``); larger checkpoints are
            written as ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
        dtype: cast floating-point weights to this dtype; ``None`` keeps the model's dtype.
        tokenizer: the model's tokenizer (:class:`~lightning_llmopt.data.HFTokenizer`, ``ByteTokenizer`` or any
            object with ``save_pretrained``): its files and a ``generation_config.json`` are written beside the
            weights, so the folder is drop-in for transformers and serving engines.

    Writes ``config.json`` readable by transformers 4.51+ and 5.x. Returns ``path``.
    """
    config = model.config
    if model.tok_embeddings is None or model.norm is None or model.output is None:
        raise ValueError(
            "to_hf needs a complete model; this one lacks the embedding, final norm or output head (a pipeline stage?)"
        )
    hf_sd = state_dict_to_hf(model.state_dict(), config)
    weight_dtype = dtype if dtype is not None else model.tok_embeddings.weight.dtype
    out = Path(path)
    arch = arch if arch is not None else arch_of(config, None)
    write_checkpoint(out, hf_sd, config_to_hf(config, arch, dtype=weight_dtype), max_shard_size, dtype)
    write_tokenizer_files(out, tokenizer)
    return out
