"""Bytes one attention layer keeps for backward, per token: the attention terms of
:func:`lightning_llmopt.parallel.memory.activation_bytes`, for grouped-query attention, for a layer that reads
another layer's keys/values (``kv_sources``) and for multi-head latent attention (``mla``).

``p``/``c`` are the residual stream's and the matmuls' dtype bytes, ``buffer`` the RoPE table's; ``autocast`` means
every ``nn.Linear`` casts its input (a saved copy per Linear). Attention is a fused kernel that saves q, k, v (as the
storage they view), its output and the fp32 logsumexp: SDPA flash or memory-efficient, cuDNN, ours. On CPU, SDPA
takes its math path when the key and value widths differ (MLA with ``v_head_dim != qk_nope + qk_rope``), which also
keeps the ``(B, H, T, T)`` probabilities; that path is not modelled.
"""

from __future__ import annotations

from typing import Any

from lightning_llmopt.parallel.layer_costs import LayerCount

__all__ = ["attention_saved_bytes", "norm_saved_bytes"]


def norm_saved_bytes(width: int, input_bytes: int, input_storage: int | None = None) -> int:
    """Our ``RMSNorm`` over ``width`` channels of an input of ``input_bytes`` per channel: the fp32 input (the input
    itself when fp32, of ``input_storage`` channels when it is a view of a wider tensor; else its fp32 copy), the
    fp32 ``rsqrt`` and the normalised value before the weight (fp32, or cast back to the input dtype)."""
    fp32_input = 4 * (input_storage or width) if input_bytes == 4 else 4 * width
    return fp32_input + 4 + (4 * width if input_bytes == 4 else 2 * width)


def attention_saved_bytes(
    config: Any, layer: LayerCount, p: int, c: int, autocast: bool, buffer: int
) -> tuple[int, int]:
    """``(no checkpointing, selective)`` bytes per token of one attention layer, from its input (the attention
    norm's output) to ``wo``'s input; ``selective`` keeps the matmul outputs, the kernel's output and logsumexp."""
    d, h = config.dim, config.n_heads
    mla = getattr(config, "mla", None)
    if mla is not None:
        return _mla(config, mla, p, c, autocast, buffer)
    q, kv = h * config.head_dim, config.n_kv_heads * config.head_dim
    if layer.kv_reader:  # only wq: k and v are the source layer's tensors, counted there
        inputs = c * d if autocast else p * d
        full = inputs + buffer * config.head_dim + c * q + c * q + 4 * h + c * q
        return full, c * q + c * q + 4 * h
    inputs = 3 * c * d if autocast else p * d
    rope = 2 * buffer * config.head_dim  # the gathered (cos, sin) rows, for q and for k
    kernel = c * (q + 2 * kv) + c * q + 4 * h  # q and k after RoPE, v; output and logsumexp
    return inputs + rope + kernel + c * q, c * (q + 2 * kv) + c * q + 4 * h


def _mla(config: Any, mla: Any, p: int, c: int, autocast: bool, buffer: int) -> tuple[int, int]:
    """models/mla.py's naive (training) form: see the comments for what each term is."""
    d, h, r, dr, ql = config.dim, config.n_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank
    qk, kv_up, v = h * mla.qk_head_dim, h * (mla.qk_nope_head_dim + mla.v_head_dim), h * mla.v_head_dim
    inputs = 2 * c * d if autocast else p * d  # the input of wq (or wq_a) and of wkv_a: one tensor, or two casts
    q_lora = 0
    if ql is not None:  # q_norm over wq_a's output, then wq_b's input (its cast, or the norm's output)
        q_lora = norm_saved_bytes(ql, c) + c * ql
    rope = 2 * buffer * dr  # (cos, sin) rows for q_rope and for the shared k_rope
    # kv_norm over c, a view of wkv_a's output [c, k_rope] (its storage when fp32); wkv_b's input: a view of the
    # latent [c, k_rope] without autocast, else its cast
    kv_norm = norm_saved_bytes(r, c, input_storage=r + dr)
    wkv_b_in = c * r if autocast else c * (r + dr)
    # q = cat(q_nope, q_rope) and k = cat(k_nope, k_rope) (under autocast k is fp32, k_rope being fp32: the
    # kernel's bf16 cast is saved), v a view of wkv_b's output, the output and logsumexp; wo's input
    kernel = c * qk + c * qk + c * kv_up + c * v + 4 * h
    full = inputs + q_lora + rope + kv_norm + wkv_b_in + kernel + c * v
    projections = (qk + (ql or 0)) + (r + dr) + kv_up  # matmul outputs: wq (or wq_a, wq_b), wkv_a, wkv_b
    return full, c * projections + c * v + 4 * h
