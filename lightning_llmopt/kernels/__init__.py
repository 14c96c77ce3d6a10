"""Triton kernels, each with a pure-PyTorch reference (see docs/architecture.md).

Importing this package imports no Triton: kernel modules load their Triton code on first use.

- :func:`flash_attention` / :func:`flash_attention_ref`: FlashAttention-2 forward and backward (causal, GQA/MQA,
  packed variable-length sequences, sliding window, log-sum-exp output); see docs/flash_attention.md.
- fused training ops :func:`rms_norm`, :func:`apply_rotary_`, :func:`swiglu`, :func:`fused_linear_cross_entropy`;
  see docs/fused_kernels.md.
- :func:`grouped_mm`: grouped GEMM over experts (Mixture-of-Experts); see docs/moe.md.
- :func:`paged_attention`: paged-KV decode attention (GQA grouped, split-KV); see docs/inference.md.
- :func:`quant_matmul`: weight-only int8/int4 matmul; see docs/quantization.md.
"""

from lightning_llmopt.kernels.flash_attention import FlashAttnFunction, flash_attention
from lightning_llmopt.kernels.flash_attention_ref import flash_attention_ref
from lightning_llmopt.kernels.fused_linear_ce import FusedLinearCrossEntropyFunction, fused_linear_cross_entropy
from lightning_llmopt.kernels.fused_ref import fused_linear_cross_entropy_ref, rms_norm_ref, rotary_ref, swiglu_ref
from lightning_llmopt.kernels.grouped_gemm import grouped_mm, grouped_mm_ref
from lightning_llmopt.kernels.paged_attention import paged_attention
from lightning_llmopt.kernels.paged_attention_ref import paged_attention_ref
from lightning_llmopt.kernels.quant_matmul import QuantMatmulFunction, quant_matmul
from lightning_llmopt.kernels.quant_matmul_ref import dequantize_packed, quant_matmul_ref
from lightning_llmopt.kernels.rmsnorm import RMSNormFunction, rms_norm
from lightning_llmopt.kernels.rotary import RotaryFunction, apply_rotary_
from lightning_llmopt.kernels.swiglu import SwiGLUFunction, swiglu

__all__ = [
    "FlashAttnFunction",
    "FusedLinearCrossEntropyFunction",
    "QuantMatmulFunction",
    "RMSNormFunction",
    "RotaryFunction",
    "SwiGLUFunction",
    "apply_rotary_",
    "dequantize_packed",
    "flash_attention",
    "flash_attention_ref",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_ref",
    "grouped_mm",
    "grouped_mm_ref",
    "paged_attention",
    "paged_attention_ref",
    "quant_matmul",
    "quant_matmul_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_ref",
    "swiglu",
    "swiglu_ref",
]
