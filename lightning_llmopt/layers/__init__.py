"""layers: nn.Modules that use the kernels (see docs/architecture.md)."""

from lightning_llmopt.layers.attention import FlashAttention
from lightning_llmopt.layers.loss import FusedLinearCrossEntropy
from lightning_llmopt.layers.mlp import FusedHFSwiGLUMLP, FusedSwiGLUMLP
from lightning_llmopt.layers.norms import FusedRMSNorm
from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.layers.rotary import FusedRotary

__all__ = [
    "FlashAttention",
    "FusedHFSwiGLUMLP",
    "FusedLinearCrossEntropy",
    "FusedRMSNorm",
    "FusedRotary",
    "FusedSwiGLUMLP",
    "QuantizedLinear",
]
