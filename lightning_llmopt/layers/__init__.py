"""layers: nn.Modules that use the kernels (see docs/architecture.md)."""

from lightning_llmopt.layers.attention import FlashAttention

__all__ = ["FlashAttention"]
