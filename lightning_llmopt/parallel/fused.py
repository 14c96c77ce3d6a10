"""The fused-kernel step of the parallel plan: TP -> CP -> **kernels** -> activation checkpointing -> compile -> ZeRO.

Framework-free (no Lightning). :func:`apply_kernels` runs on a model that tensor and context parallelism have already
sharded, so every fused module is told the layout of the shard it sees:

1. the kernels the model's config names (``LlamaConfig.fused_kernels``) that are not in place yet are swapped in by
   :func:`~lightning_llmopt.optimize.optimize_model` (parameters, names and the module hooks of the sharding plan
   are kept);
2. under tensor parallelism, every fused RMSNorm learns whether its input is the sequence-parallel shard (its
   replicated weight then gets a ``Partial`` gradient, summed over ``tp`` like the unfused norm's) or replicated;
   SwiGLU runs on the local column shards of gate/up and the rotary kernel and attention on local heads (plain
   tensors there already); the fused linear + cross-entropy computes from the head's vocabulary shard, with its
   max and sum all-reduced over ``tp`` (vocab-parallel, never the full logits).

Importing this module registers the construction-time step of ``LlamaConfig.fused_kernels``
(:func:`~lightning_llmopt.optimize.apply_config_kernels`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_llmopt.optimize import apply_config_kernels

__all__ = ["apply_kernels", "check_kernels", "fused_modules"]


def fused_modules(model: nn.Module) -> list[str]:
    """Class names of the fused kernel modules in ``model`` (sorted, each once)."""
    names = {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")}
    if getattr(model, "fused_loss", None) is not None:
        names.add(type(model.fused_loss).__name__)
    return sorted(names)


def check_kernels(model: nn.Module, kernels: list[str]) -> None:
    """Raise ``ValueError`` (no collective) if ``kernels`` cannot be swapped into ``model``: it must be our ``Llama``
    or a transformers model of a family :func:`~lightning_llmopt.optimize.optimize_model` patches."""
    from lightning_llmopt.models.llama import Llama
    from lightning_llmopt.optimize import HF_MODEL_TYPES

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, Llama) and model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"fused_kernels ({kernels}) can be swapped into lightning_llmopt Llama models and transformers models of "
            f"type {HF_MODEL_TYPES}; got {type(model).__name__} (model_type {model_type!r})"
        )


def apply_kernels(
    model: nn.Module, tp_mesh: Any = None, sequence_parallel: bool = False, kernels: list[str] | None = None
) -> nn.Module:
    """Swap in the fused kernels and tell every fused module its shard's layout.

    Arguments:
        model: a decoder after :func:`~lightning_llmopt.parallel.tensor_parallel.apply_tp` and
            :func:`~lightning_llmopt.parallel.context_parallel.apply_cp` (or unsharded): our ``Llama`` or a
            transformers family :func:`~lightning_llmopt.optimize.optimize_model` supports.
        tp_mesh: the 1-D tensor-parallel mesh the model was sharded over (``None`` without tensor parallelism).
        sequence_parallel: the model was sharded with sequence parallelism.
        kernels: names of :data:`~lightning_llmopt.models.config.FUSED_KERNELS` (``None``: the model config's
            ``fused_kernels``, if it has that field).

    Returns ``model`` (changed in place; kernels already in place are kept).
    """
    from lightning_llmopt.layers.norms import FusedRMSNorm
    from lightning_llmopt.optimize import FUSED_KERNELS, optimize_model

    if kernels is None:
        apply_config_kernels(model)
    elif kernels:
        on = [name in kernels for name in FUSED_KERNELS]
        optimize_model(model, rmsnorm=on[0], rope=on[1], swiglu=on[2], fused_ce=on[3])
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    for module in model.modules():
        if isinstance(module, FusedRMSNorm):
            module.sequence_parallel = sequence_parallel
    return model
