"""Triton kernels, each with a pure-PyTorch reference (see docs/architecture.md).

Importing this package imports no Triton: kernel modules load their Triton code on first use.

- :func:`flash_attention` / :func:`flash_attention_ref`: FlashAttention-2 forward and backward (causal, GQA/MQA,
  packed variable-length sequences, sliding window, log-sum-exp output); see docs/flash_attention.md.
"""

from lightning_llmopt.kernels.flash_attention import FlashAttnFunction, flash_attention
from lightning_llmopt.kernels.flash_attention_ref import flash_attention_ref

__all__ = ["FlashAttnFunction", "flash_attention", "flash_attention_ref"]
