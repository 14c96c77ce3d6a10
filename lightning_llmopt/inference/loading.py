"""Loading a model to serve from any of the three checkpoint formats the project produces or reads.

- our sharded DCP checkpoints (``root/step-N/`` with the ``COMPLETE`` marker whose ``config`` entry describes the
  model, as :class:`~lightning_llmopt.strategies.ZeroStrategy` writes them; a root folder means its newest complete
  checkpoint): only the model tensors are read, straight into the parameters;
- a Lightning ``.ckpt`` of :class:`~lightning_llmopt.module.CausalLMModule` (``state_dict`` with ``model.`` keys,
  the config under ``hyper_parameters["model"]``);
- a run folder holding either (``runs/NAME`` or ``runs/NAME/checkpoints``: ``last`` wins, else the newest; see
  :func:`~lightning_llmopt.checkpoint_io.find_checkpoint`, which also reads the two formats above);
- a Hugging Face folder (``config.json`` + safetensors) through :func:`~lightning_llmopt.models.hf.from_hf`, or,
  when its ``config.json`` holds a ``quantization_config`` (GPTQ or compressed-tensors, as ``llmopt quantize`` and
  ``llmopt export`` write them), through :func:`~lightning_llmopt.quantization.load_quantized`; the folder's
  tokenizer files are picked up when present.

A Lightning ``.ckpt`` remembers its tokenizer: :class:`~lightning_llmopt.CausalLMModule` stores the data module's
tokenizer spec under ``llmopt_tokenizer`` (and Lightning stores the data module's hyper-parameters), so text prompts
work without ``--tokenizer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.checkpoint_io import lightning_tokenizer
from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.init import to_empty
from lightning_llmopt.models.llama import Llama

__all__ = ["load_model", "model_from_state_dict", "random_model"]

_checkpoint_tokenizer = lightning_tokenizer  # its name before it moved to checkpoint_io


def _strip(name: str) -> str:
    name = name.replace("_orig_mod.", "")
    return name.removeprefix("model.")


def model_from_state_dict(
    config: LlamaConfig, state: dict[str, Tensor], dtype: torch.dtype | None, device: torch.device | str
) -> Llama:
    """A :class:`Llama` built on the meta device whose parameters become ``state``'s tensors (cast/moved)."""
    with torch.device("meta"):
        model = Llama(config)
    expected = set(model.state_dict())
    sd = {}
    for name, t in state.items():
        key = _strip(name)
        if key in expected:
            sd[key] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
    if config.tie_embeddings:
        sd.setdefault("output.weight", sd.get("tok_embeddings.weight"))  # type: ignore[arg-type]
    missing = sorted(expected - set(sd))
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} model tensor(s), e.g. {missing[:5]}")
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_embeddings:
        assert model.output is not None and model.tok_embeddings is not None
        model.output.weight = model.tok_embeddings.weight
    with torch.device(device):  # the RoPE table is computed, even under a caller's meta-device context
        model.reset_buffers(device)
    return model


def random_model(config: LlamaConfig, device: torch.device | str, dtype: torch.dtype) -> Llama:
    """A randomly initialised :class:`Llama` (``init_weights``) built where it will run, in its serving dtype.

    The model is laid out on the meta device, cast there (free), given storage on ``device`` and initialised in
    place: no fp32 copy on the host and no host-to-device transfer (for the llama2-7b shape, the former path wrote
    27 GB of fp32 normal samples on the host, then cast and copied them). With the same seed on the CPU in fp32 the
    weights equal ``Llama(config)``'s (the same initialisation, in the same order)."""
    with torch.device("meta"):
        model = Llama(config)
    model = to_empty(model.to(dtype=dtype), device)  # not Module.to_empty: from meta it imports sympy (~1 s)
    model.init_weights(buffer_device=device)
    return model


def _load_checkpoint(
    source: Path, dtype: torch.dtype | None, device: torch.device | str, trust_pickle: bool
) -> tuple[Llama, Any]:
    """A training checkpoint (a ``.ckpt``, a DCP folder, or a folder holding them): only the model tensors are
    read, straight into the parameters."""
    from lightning_llmopt.checkpoint_io import open_checkpoint

    reader = open_checkpoint(source, trust_pickle=trust_pickle)
    config = reader.saved_config()
    if config is None:
        raise ValueError(f"checkpoint {reader.path} stores no model config ({reader.config_source})")
    with torch.device("meta"):
        names = set(Llama(config).state_dict())
    state = reader.read(list(reader.model_tensors(names)))
    return model_from_state_dict(config, state, dtype, device), reader.tokenizer()


def _load_hf_folder(path: Path, dtype: torch.dtype | None, device: torch.device | str) -> Llama:
    """A float folder through ``from_hf``; a quantized one (``quantization_config``) through ``load_quantized``."""
    from lightning_llmopt.models.hf_files import read_config

    if read_config(path).get("quantization_config"):
        from lightning_llmopt.quantization.load import load_quantized

        return load_quantized(path, device=device, dtype=dtype)
    from lightning_llmopt.models.hf import from_hf

    return from_hf(path, dtype=dtype, device=device)


def load_model(
    source: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    trust_pickle: bool = False,
) -> tuple[Llama, Any]:
    """``(model, tokenizer or None)`` from a checkpoint path (formats in the module docstring).

    Arguments:
        dtype: cast floating-point weights (``None`` keeps the stored dtype).
        device: where the parameters go.
        trust_pickle: allow full unpickling of a Lightning ``.ckpt`` (weights-only loading is tried otherwise).
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    tokenizer = None
    if path.is_dir() and (path / "config.json").is_file():
        model = _load_hf_folder(path, dtype, device)
        if (path / "tokenizer.json").is_file():
            from lightning_llmopt.data.tokenizers import load_tokenizer

            tokenizer = load_tokenizer(path)
    else:
        model, tokenizer = _load_checkpoint(path, dtype, device, trust_pickle)
    return model.eval(), tokenizer
