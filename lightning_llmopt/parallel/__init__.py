"""Framework-free parallelism over an unmodified model: activation checkpointing, ZeRO-1/2, atomic DCP checkpoints,
one named device mesh, tensor/sequence parallelism, context parallelism (ring attention, Ulysses).

PP and EP arrive with their issues. Nothing here imports Lightning. The names below load on first access, so
``lightning_llmopt.parallel.checkpoint`` (``llmopt consolidate``) or ``.pipeline`` does not import the rest (context
parallelism's ``torch.compiler.disable`` imports ``torch._dynamo``, as long to import as torch itself).
"""

from typing import TYPE_CHECKING

from lightning_llmopt._lazy import lazy_exports

if TYPE_CHECKING:  # the names below, for type checkers and IDEs
    from lightning_llmopt.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_llmopt.parallel.context_parallel import ContextParallelSpec, apply_cp, shard_batch
    from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler, LossScaleError
    from lightning_llmopt.parallel.memory import MemoryEstimate, activation_bytes, estimate_memory
    from lightning_llmopt.parallel.mesh import ParallelDims, build_mesh
    from lightning_llmopt.parallel.parallelize import NDConfig, parallelize
    from lightning_llmopt.parallel.ring_attention import ring_attention
    from lightning_llmopt.parallel.tensor_parallel import apply_tp
    from lightning_llmopt.parallel.vocab_parallel import vocab_parallel_cross_entropy
    from lightning_llmopt.parallel.zero import ZeroOptimizer, apply_zero
    from lightning_llmopt.parallel.zero_state import consolidate_state_dicts, master_weights, to_torch_optimizer_state

_EXPORTS: dict[str, str] = {
    "apply_activation_checkpointing": "activation_checkpointing",
    "ContextParallelSpec": "context_parallel",
    "apply_cp": "context_parallel",
    "shard_batch": "context_parallel",
    "DynamicLossScaler": "loss_scaler",
    "LossScaleError": "loss_scaler",
    "MemoryEstimate": "memory",
    "activation_bytes": "memory",
    "estimate_memory": "memory",
    "ParallelDims": "mesh",
    "build_mesh": "mesh",
    "NDConfig": "parallelize",
    "parallelize": "parallelize",
    "ring_attention": "ring_attention",
    "apply_tp": "tensor_parallel",
    "vocab_parallel_cross_entropy": "vocab_parallel",
    "ZeroOptimizer": "zero",
    "apply_zero": "zero",
    "consolidate_state_dicts": "zero_state",
    "master_weights": "zero_state",
    "to_torch_optimizer_state": "zero_state",
}

__all__ = [
    "ContextParallelSpec",
    "DynamicLossScaler",
    "LossScaleError",
    "MemoryEstimate",
    "NDConfig",
    "ParallelDims",
    "ZeroOptimizer",
    "activation_bytes",
    "apply_activation_checkpointing",
    "apply_cp",
    "apply_tp",
    "apply_zero",
    "build_mesh",
    "consolidate_state_dicts",
    "estimate_memory",
    "master_weights",
    "parallelize",
    "ring_attention",
    "shard_batch",
    "to_torch_optimizer_state",
    "vocab_parallel_cross_entropy",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
