"""Framework-free parallelism over an unmodified model: activation checkpointing, ZeRO-1/2, atomic DCP checkpoints.

TP/SP, CP, PP and EP arrive with their issues. Nothing here imports Lightning.
"""

from lightning_llmopt.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler, LossScaleError
from lightning_llmopt.parallel.memory import MemoryEstimate, activation_bytes, estimate_memory
from lightning_llmopt.parallel.zero import ZeroOptimizer, apply_zero
from lightning_llmopt.parallel.zero_state import consolidate_state_dicts, master_weights, to_torch_optimizer_state

__all__ = [
    "DynamicLossScaler",
    "LossScaleError",
    "MemoryEstimate",
    "ZeroOptimizer",
    "activation_bytes",
    "apply_activation_checkpointing",
    "apply_zero",
    "consolidate_state_dicts",
    "estimate_memory",
    "master_weights",
    "to_torch_optimizer_state",
]
