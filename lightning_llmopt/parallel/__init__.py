"""Framework-free parallelism over an unmodified model: activation checkpointing, ZeRO-1/2, atomic DCP checkpoints,
one named device mesh, tensor/sequence parallelism, context parallelism (ring attention, Ulysses).

PP and EP arrive with their issues. Nothing here imports Lightning.
"""

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
