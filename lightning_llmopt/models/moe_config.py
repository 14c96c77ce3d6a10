"""Mixture-of-Experts options of :class:`~lightning_llmopt.models.LlamaConfig` (no imports beyond the stdlib)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BALANCING", "ROUTERS", "MoEConfig"]

ROUTERS = ("top1", "topk")
BALANCING = ("aux_loss", "aux_free", "none")


@dataclass
class MoEConfig:
    """Mixture-of-Experts options of :class:`~lightning_llmopt.models.LlamaConfig` (field ``moe``).

    Arguments:
        num_experts: routed experts per MoE layer.
        top_k: experts per token (``router="top1"`` needs 1).
        router: ``"top1"`` (Switch: the chosen expert's probability is the weight) or ``"topk"`` (GShard/Mixtral).
        renormalize: ``topk``: the k weights are renormalised to sum to 1.
        num_shared_experts: experts every token passes through (one dense SwiGLU of that many times the width).
        expert_hidden_dim: hidden width of one expert (default: the dense ``ffn_hidden_dim``).
        capacity_factor: ``None`` for dropless; else each expert accepts ``ceil(c * T * k / E)`` assignments per
            sequence, in priority order (first choices first, then by router probability).
        balance: ``"aux_loss"`` (Switch balance loss), ``"aux_free"`` (DeepSeek-V3 bias), or ``"none"``.
        aux_loss_coef: weight of the balance loss.
        z_loss_coef: weight of the router z-loss (ST-MoE); 0 disables it.
        bias_update_rate: ``aux_free``: step of the bias update ``b_i += rate * sign(mean_load - load_i)``.
        every: MoE in blocks ``i`` with ``i % every == every - 1`` (1: every block); the others stay dense.
    """

    num_experts: int = 8
    top_k: int = 2
    router: str = "topk"
    renormalize: bool = True
    num_shared_experts: int = 0
    expert_hidden_dim: int | None = None
    capacity_factor: float | None = None
    balance: str = "aux_loss"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    bias_update_rate: float = 1e-3
    every: int = 1

    def __post_init__(self) -> None:
        if self.num_experts < 2:
            raise ValueError(f"moe.num_experts ({self.num_experts}) must be >= 2")
        if self.router not in ROUTERS:
            raise ValueError(f"moe.router ({self.router!r}) must be one of {ROUTERS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        if self.router == "top1" and self.top_k != 1:
            raise ValueError(f"moe.router 'top1' (Switch) routes one expert per token; got top_k={self.top_k}")
        if self.balance not in BALANCING:
            raise ValueError(f"moe.balance ({self.balance!r}) must be one of {BALANCING}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"moe.capacity_factor ({self.capacity_factor}) must be > 0 or None (dropless)")
        for name in ("num_shared_experts", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name} ({getattr(self, name)}) must be >= 0")
        if self.expert_hidden_dim is not None and self.expert_hidden_dim <= 0:
            raise ValueError(f"moe.expert_hidden_dim ({self.expert_hidden_dim}) must be positive")
        if self.every < 1:
            raise ValueError(f"moe.every ({self.every}) must be >= 1")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id % self.every == self.every - 1
