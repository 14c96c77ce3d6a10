"""N-D parallelism in one call: TP -> CP -> kernels -> activation checkpointing -> compile -> ZeRO, over one
``DeviceMesh``.

Framework-free (no Lightning). For a model (or a container such as a LightningModule holding models):

1. :func:`validate`: every check that can fail (degrees against the model's heads, kv heads, vocabulary and MLP;
   Ulysses heads; ZeRO stage against the layout; combinations not available yet) raises ``ValueError``
   naming the values, before any collective;
2. :func:`parallelize`: tensor (+ sequence) parallelism over ``mesh["tp"]``, context parallelism over ``mesh["cp"]``,
   the fused kernels on the shards (:func:`~lightning_llmopt.parallel.fused.apply_kernels`), activation
   checkpointing, ``torch.compile`` of each block, then ZeRO-3 (FSDP2 ``fully_shard`` of every block and the root,
   with the model's other entry points registered: ``Llama.loss``) over ``mesh["dp_cp"]`` when ``zero_stage == 3``;
3. :func:`materialize`: meta-device models get their (local) storage and initialisation, then replicas are made
   equal (parameters replicated over ``"tp"``; everything over ``"dp_cp"`` without ZeRO-3);
4. after each backward, :func:`sync_gradients`: ``Partial`` gradients of replicated weights are reduced (when FSDP2 does
   not do it), and with ``zero_stage == 0`` gradients are averaged over ``"dp_cp"``.

ZeRO stages 1/2 (:class:`~lightning_llmopt.parallel.zero.ZeroOptimizer`) shard flat buffers of plain tensors, so they
compose with context and data parallelism but not with tensor parallelism (use stage 3, or stage 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_llmopt.parallel import zero_fsdp
from lightning_llmopt.parallel.compile import compile_blocks
from lightning_llmopt.parallel.context_parallel import CP_MODES, ContextParallelAttention, apply_cp, validate_cp
from lightning_llmopt.parallel.data_parallel import all_reduce_gradients, broadcast_parameters
from lightning_llmopt.parallel.fused import apply_kernels, check_kernels
from lightning_llmopt.parallel.mesh import ParallelDims
from lightning_llmopt.parallel.tensor_parallel import apply_tp, check_plan_paths, reduce_partial_grads, validate_tp
from lightning_llmopt.parallel.tp_plans import FAMILIES, ModelFamily

__all__ = ["NDConfig", "Parallelized", "find_models", "materialize", "parallelize", "sync_gradients", "validate"]

AC_POLICIES = ("none", "full", "every_n", "sqrt", "selective")


@dataclass
class NDConfig:
    """How :func:`parallelize` applies each dimension.

    Arguments:
        sequence_parallel: with TP, shard norms/residuals on the sequence (default on).
        loss_parallel: with TP, keep logits sharded on the vocabulary for the vocab-parallel loss.
        context_parallel_mode: ``"ring"`` or ``"ulysses"``.
        context_parallel_load_balance: sequence layout (``None``: load balanced for ring, contiguous for Ulysses).
        ring_impl: ring block kernels: ``"auto"`` (flash on CUDA with Triton), ``"flash"``, ``"reference"``.
        activation_checkpointing: policy of :func:`~lightning_llmopt.parallel.apply_activation_checkpointing`.
        compile: ``torch.compile`` each block.
        zero_stage: 0 (gradients all-reduced, replicated optimizer state), 1/2 (our engine, no TP), 3 (FSDP2).
        reshard_after_forward, param_dtype, reduce_dtype, offload_parameters: FSDP2 options (stage 3).
        fused_kernels: kernels the plan swaps into every decoder after TP and CP (names of
            :data:`~lightning_llmopt.models.config.FUSED_KERNELS` or ``"all"``; transformers models too); ``None``:
            what each model's config names (``LlamaConfig.fused_kernels``).
    """

    sequence_parallel: bool = True
    loss_parallel: bool = True
    context_parallel_mode: str = "ring"
    context_parallel_load_balance: bool | None = None
    ring_impl: str = "auto"
    activation_checkpointing: str = "none"
    compile: bool = False
    zero_stage: int = 3
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offload_parameters: bool = False
    fused_kernels: list[str] | None = None

    def __post_init__(self) -> None:
        if self.fused_kernels is not None:
            from lightning_llmopt.models.config import _check_fused_kernels

            self.fused_kernels = _check_fused_kernels(self.fused_kernels)
        if self.context_parallel_mode not in CP_MODES:
            raise ValueError(f"context_parallel_mode ({self.context_parallel_mode!r}) must be one of {CP_MODES}")
        if self.ring_impl not in ("auto", "flash", "reference"):
            raise ValueError(f"ring_impl ({self.ring_impl!r}) must be 'auto', 'flash' or 'reference'")
        if self.activation_checkpointing not in AC_POLICIES:
            raise ValueError(
                f"activation_checkpointing ({self.activation_checkpointing!r}) must be one of {AC_POLICIES}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage ({self.zero_stage}) must be 0, 1, 2 or 3")
        if self.offload_parameters and self.zero_stage != 3:
            raise ValueError(f"offload_parameters=True needs zero_stage 3 (got {self.zero_stage})")


@dataclass
class Parallelized:
    """What :func:`parallelize` did: the models it found, their families, the CP backend and whether FSDP2 runs."""

    models: list[nn.Module]
    families: list[ModelFamily]
    context_parallel: ContextParallelAttention | None = None
    fsdp: bool = False
    meta: bool = False
    notes: list[str] = field(default_factory=list)


def _family(module: nn.Module) -> ModelFamily | None:
    return next((f for f in FAMILIES if f.matches(module)), None)


def find_models(module: nn.Module) -> list[nn.Module]:
    """``module`` if it is a known decoder, else the outermost known decoders inside it (e.g. ``module.model``)."""
    if _family(module) is not None:
        return [module]
    found: list[nn.Module] = []
    for _, child in module.named_children():
        found += find_models(child)
    return found


def validate(module: nn.Module, dims: ParallelDims, config: NDConfig) -> list[nn.Module]:
    """All checks of :func:`parallelize`, with no collective; returns the models found."""
    if dims.pp > 1 and (dims.cp > 1 or dims.ep > 1):
        # The stage split itself is validated by parallel.pipeline.validate_pipeline before this runs.
        raise NotImplementedError(
            f"pipeline_parallel ({dims.pp}) composes with data, tensor (+ sequence) parallelism and ZeRO so far; "
            f"got context_parallel ({dims.cp}), expert_parallel ({dims.ep})"
        )
    if dims.ep > 1:
        _validate_ep(module, dims, config)
    if dims.tp > 1:
        _validate_moe_tp(module, dims)
    if config.zero_stage in (1, 2) and dims.tp > 1:
        raise ValueError(
            f"zero_stage ({config.zero_stage}) with tensor_parallel ({dims.tp}): the ZeRO-1/2 engine "
            "shards flat buffers of plain tensors; use zero_stage=3 (FSDP2, composes with TP) or 0"
        )
    if config.compile and dims.tp > 1:
        # Measured on torch 2.13 (CPU/gloo): the backward of a compiled block whose DTensor inputs are redistributed
        # fails inside torch ("'Tensor' object has no attribute '_local_tensor'"), with torch's own TP plan too.
        raise ValueError(
            f"compile=True with tensor_parallel ({dims.tp}) is not supported: torch.compile of tensor-parallel "
            "blocks fails in DTensor's backward on torch 2.13; compile works with data and context parallelism"
        )
    models = find_models(module)
    if (dims.tp > 1 or dims.cp > 1) and not models:
        raise ValueError(
            f"tensor_parallel ({dims.tp}) / context_parallel ({dims.cp}) need a known decoder in "
            f"{type(module).__name__}; known families: {[f.name for f in FAMILIES]}"
        )
    if config.fused_kernels:
        if not models:
            raise ValueError(
                f"fused_kernels ({config.fused_kernels}) are swapped into a known decoder, and {type(module).__name__} "
                f"holds none; known families: {[f.name for f in FAMILIES]}"
            )
        for model in models:
            check_kernels(model, config.fused_kernels)
    for model in models:
        family = _family(model)
        assert family is not None
        shape = family.shape(model)
        validate_tp(shape, dims.tp)
        if dims.tp > 1:
            check_plan_paths(model, family)
        if dims.cp > 1:
            if family.name != "llmopt-llama":
                raise NotImplementedError(
                    f"context_parallel ({dims.cp}) supports lightning_llmopt Llama models; got "
                    f"{type(model).__name__} (convert with lightning_llmopt.models.hf.from_hf)"
                )
            validate_cp(
                shape.n_heads // dims.tp, max(shape.n_kv_heads // dims.tp, 1), dims.cp, config.context_parallel_mode
            )
    return models


def _validate_ep(module: nn.Module, dims: ParallelDims, config: NDConfig) -> None:
    from lightning_llmopt.models.moe import moe_layers

    layers = moe_layers(module)
    if not layers:
        raise ValueError(
            f"expert_parallel ({dims.ep}) needs Mixture-of-Experts layers (LlamaConfig(moe=...)); "
            f"{type(module).__name__} has none"
        )
    for layer in layers:
        if layer.config.num_experts % dims.ep != 0:
            raise ValueError(
                f"num_experts ({layer.config.num_experts}) must be divisible by expert_parallel ({dims.ep})"
            )
    if dims.cp > 1:
        raise ValueError(
            f"expert_parallel ({dims.ep}) composes with data and tensor parallelism so far; got context_parallel "
            f"({dims.cp})"
        )
    if config.zero_stage in (1, 2):
        raise ValueError(
            f"expert_parallel ({dims.ep}) runs with zero_stage 0 (gradients all-reduced) or 3 (FSDP2; experts "
            f"sharded over 'dp_rep' x 'ep'); the ZeRO-1/2 engine's flat buffers span all data-parallel ranks, "
            f"got zero_stage={config.zero_stage}"
        )


def _validate_moe_tp(module: nn.Module, dims: ParallelDims) -> None:
    """Tensor parallelism routes each rank's slice of the sequence through the MoE layers: capacity limits are per
    sequence and would need the whole sequence's routing on every rank."""
    from lightning_llmopt.models.moe import moe_layers

    for layer in moe_layers(module):
        if layer.config.capacity_factor is not None:
            raise ValueError(
                f"tensor_parallel ({dims.tp}) with a Mixture-of-Experts capacity_factor "
                f"({layer.config.capacity_factor}): each tensor-parallel rank routes a slice of the sequence, and "
                "capacity is per sequence; use dropless routing (capacity_factor=None) with tensor parallelism"
            )


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _blocks(model: nn.Module, family: ModelFamily) -> list[nn.Module]:
    container: Any = model.get_submodule(family.blocks)
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def parallelize(module: nn.Module, mesh: Any, dims: ParallelDims, config: NDConfig) -> Parallelized:
    """Apply TP -> CP -> kernels -> AC -> compile -> ZeRO-3 in place (see the module docstring); ``mesh`` is from
    :func:`~lightning_llmopt.parallel.mesh.build_mesh`."""
    from lightning_llmopt.parallel.activation_checkpointing import apply_activation_checkpointing

    models = validate(module, dims, config)
    out = Parallelized(
        models=models, families=[f for m in models if (f := _family(m)) is not None], meta=_is_meta(module)
    )
    for model, family in zip(models, out.families, strict=True):
        if dims.tp > 1:
            apply_tp(model, mesh["tp"], sequence_parallel=config.sequence_parallel, loss_parallel=config.loss_parallel)
        if dims.cp > 1:
            out.context_parallel = apply_cp(
                model,
                mesh["cp"],
                config.context_parallel_mode,
                load_balance=config.context_parallel_load_balance,
                ring_impl=config.ring_impl,
                tensor_parallel=dims.tp,
            )
        apply_kernels(
            model, mesh["tp"] if dims.tp > 1 else None, config.sequence_parallel, kernels=config.fused_kernels
        )
        if dims.ep > 1:
            from lightning_llmopt.parallel.expert_parallel import apply_expert_parallel

            apply_expert_parallel(model, mesh["ep"])
        elif dims.tp > 1:
            from lightning_llmopt.parallel.tensor_parallel import replicate_experts

            replicate_experts(model, mesh["tp"])
        if config.activation_checkpointing != "none":
            apply_activation_checkpointing(model, config.activation_checkpointing)
        if config.compile:
            compile_blocks(_blocks(model, family))
    if config.zero_stage == 3 and dims.dp_cp > 1:
        if dims.ep > 1:
            _fully_shard_experts(module, mesh, dims, config)
        _fully_shard(module, out, mesh["dp_cp"], config)
        out.fsdp = True
    return out


def _fully_shard_experts(module: nn.Module, mesh: Any, dims: ParallelDims, config: NDConfig) -> None:
    """ZeRO-3 of expert weights, before the blocks: each ``experts`` module is its own FSDP2 unit over ``"dp_rep"``
    (the ranks holding the same experts), sharded on dim 1 (dim 0 is the expert dimension, already sharded over
    ``"ep"``). Its reduce-scatter averages over ``"dp_rep"``; the expert gradients arrive already divided by the EP
    size (``GroupedExperts.grad_scale``), so the result is the global mean like every other gradient. (FSDP2's own
    gradient divide factor would do the same with a PREMUL_SUM reduction, which gloo lacks.)"""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import Shard

    from lightning_llmopt.models.moe import moe_layers

    offload: Any = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.offload_parameters else OffloadPolicy()
    )
    policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    for layer in moe_layers(module):
        fully_shard(
            layer.experts,
            mesh=mesh["dp_rep"],
            offload_policy=offload,
            mp_policy=policy,
            reshard_after_forward=config.reshard_after_forward,
            shard_placement_fn=lambda _param: Shard(1),
        )


def _fully_shard(module: nn.Module, done: Parallelized, dp_mesh: Any, config: NDConfig) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "offload_parameters": config.offload_parameters,
        "param_dtype": config.param_dtype,
        "reduce_dtype": config.reduce_dtype,
        "reshard_after_forward": config.reshard_after_forward,
    }
    if _family(module) is None:
        # blocks, then each top-level child (a LightningModule's model)
        zero_fsdp.shard_module(module, dp_mesh, **kwargs)
        return
    offload: Any = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.offload_parameters else OffloadPolicy()
    )
    policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    blocks = _blocks(module, done.families[0])
    for block in [*blocks, module]:
        fully_shard(
            block,
            mesh=dp_mesh,
            offload_policy=offload,
            mp_policy=policy,
            reshard_after_forward=config.reshard_after_forward,
        )
    zero_fsdp.register_forward_methods([module])  # Llama.loss / hidden_states enter through the root's hooks too


@torch.no_grad()
def materialize(
    module: nn.Module,
    device: torch.device,
    mesh: Any,
    dims: ParallelDims,
    fsdp: bool,
    buffer_device: torch.device | None = None,
) -> None:
    """Allocate and initialise a meta-device module (local shards only), then equalise replicas (collective).

    ``buffer_device``: where buffers (RoPE tables) go when parameters are offloaded to the CPU (default ``device``).
    """
    # Only what is on the meta device: `to_empty` on a whole LightningModule would also replace the states of its
    # torchmetrics metrics (not meta) with uninitialised memory. A model with its own `init_weights` is allocated as
    # one piece (through a holder, so that its `init_weights` runs), anything else child by child.
    targets = [module] if callable(getattr(module, "init_weights", None)) else list(module.children())
    for target in targets:
        if _is_meta(target):
            holder = nn.Module()
            holder.add_module("target", target)
            zero_fsdp.materialize(holder, device, buffer_device=buffer_device)
            _reset_hf_rotary(target, buffer_device or device)
    broadcast_parameters(module, mesh, "tp")  # replicated over tp (init is already equal: a guard for user init)
    if not fsdp:
        experts = _expert_params(module)
        broadcast_parameters(module, mesh, "dp_cp", skip_sharded=False, exclude=experts)
        if experts:  # each EP rank holds other experts: equal only across the replicas of one expert shard
            broadcast_parameters(module, mesh, "dp_rep", only=experts)


def _reset_hf_rotary(module: nn.Module, device: torch.device) -> None:
    """transformers' rotary embeddings keep ``inv_freq`` in a buffer that ``to_empty`` leaves uninitialised."""
    for sub in module.modules():
        if type(sub).__name__.endswith("RotaryEmbedding") and hasattr(sub, "inv_freq") and hasattr(sub, "config"):
            fresh = type(sub)(sub.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(sub, name, buf.to(device))


def sync_gradients(module: nn.Module, mesh: Any, dims: ParallelDims, config: NDConfig, fsdp: bool) -> None:
    """After backward (collective): reduce ``Partial`` TP gradients unless FSDP2 did, then average over ``dp_cp``
    with ``zero_stage == 0``."""
    if dims.tp > 1:
        from lightning_llmopt.parallel.tensor_parallel import sum_moe_grads

        sum_moe_grads(module)
    if dims.tp > 1 and not fsdp:
        reduce_partial_grads(module)
    if config.zero_stage == 0 and dims.dp_cp > 1:
        experts = _expert_params(module)
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in experts]
        all_reduce_gradients(params, mesh["dp_cp"].get_group())
        if experts and dims.dp_rep > 1:
            # Expert gradients are already the EP group's mean (GroupedExperts.grad_scale): average over replicas.
            expert_params = [p for p in module.parameters() if id(p) in experts and p.grad is not None]
            all_reduce_gradients(expert_params, mesh["dp_rep"].get_group())


def _expert_params(module: nn.Module) -> set[int]:
    from lightning_llmopt.parallel.expert_parallel import expert_param_ids

    return expert_param_ids(module)
