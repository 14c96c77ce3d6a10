"""Per-layer parameter and FLOP counts of a :class:`~lightning_llmopt.models.config.LlamaConfig`, from the config
alone: blocks differ once a model uses multi-head latent attention (``mla``), cross-layer K/V sharing
(``kv_sources``: a reader has no ``wk``/``wv``), per-layer windows (``layer_types``) or Mixture-of-Experts layers.
Used by the memory estimator (:mod:`lightning_llmopt.parallel.memory`) and the pipeline cost model
(:mod:`lightning_llmopt.parallel.pipeline_split`); tests compare every count with the built model.

Attention FLOPs follow PaLM (arXiv 2204.02311, appendix B): a training step costs ``6 x 2 x H x w x k`` per token
and layer for ``k`` attended keys per query and per-head width ``w`` (``D``; MLA: ``(q.k width + p.v width) / 2``),
with ``k = T / 2`` under a causal mask, which gives PaLM's ``6 L H D T``. PaLM's ``T / 2`` is the exact mean
``(T + 1) / 2`` less half a key; a window of ``W < T`` keys is counted the same way: its exact mean
``(W (W + 1) / 2 + (T - W) W) / T``, less one half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_llmopt.models.layer_pattern import attended_keys, layer_windows

__all__ = ["LayerCount", "attended_keys", "attention_flops", "embedding_params", "layer_counts"]


@dataclass(frozen=True)
class LayerCount:
    """One block's counts.

    Arguments:
        params: every parameter of the block (all experts of an MoE layer).
        active: parameters a token's matmuls use (MoE: the router, ``top_k`` experts and the shared experts).
        linear: weights of the block's ``nn.Linear`` modules (what autocast copies to the compute dtype).
        attn_width: per-head width of the attention matmuls, ``(q.k width + p.v width) / 2``.
        window: the layer's sliding window in keys (``None``: global).
        kv_reader: the layer reads another layer's keys/values (no ``wk``/``wv``, no key rotation).
    """

    params: int
    active: int
    linear: int
    attn_width: float
    window: int | None
    kv_reader: bool


def _attention(config: Any, layer: int) -> tuple[int, int, float, bool]:
    """``(params, Linear weights, attn_width, kv_reader)`` of layer ``layer``'s attention."""
    d, h = config.dim, config.n_heads
    mla = getattr(config, "mla", None)
    if mla is not None:  # models/mla.py: wq or wq_a/q_norm/wq_b, wkv_a, kv_norm, wkv_b, wo (no biases)
        qk = h * mla.qk_head_dim
        q = d * qk if mla.q_lora_rank is None else d * mla.q_lora_rank + mla.q_lora_rank * qk
        linear = q + d * mla.latent_dim + mla.kv_lora_rank * h * (mla.qk_nope_head_dim + mla.v_head_dim)
        linear += h * mla.v_head_dim * d
        norms = mla.kv_lora_rank + (mla.q_lora_rank or 0)
        return linear + norms, linear, (mla.qk_head_dim + mla.v_head_dim) / 2, False
    q, kv = h * config.head_dim, config.n_kv_heads * config.head_dim
    sources = getattr(config, "kv_sources", None)
    reader = sources is not None and sources[layer] != layer
    kv = 0 if reader else kv  # a K/V reader has no wk/wv
    linear = d * q + 2 * d * kv + q * d
    bias = (q + 2 * kv) if config.qkv_bias else 0
    return linear + bias, linear, float(config.head_dim), reader


def _feed_forward(config: Any, layer: int) -> tuple[int, int, int]:
    """``(params, active params, Linear weights)`` of layer ``layer``'s feed-forward (models/moe.py for MoE)."""
    d, f = config.dim, config.ffn_hidden_dim
    moe = getattr(config, "moe", None)
    if moe is None or not moe.is_moe_layer(layer):
        return 3 * d * f, 3 * d * f, 3 * d * f
    hidden = moe.expert_hidden_dim or f
    router, shared = d * moe.num_experts, 3 * d * hidden * moe.num_shared_experts
    experts = 3 * d * hidden * moe.num_experts
    active = router + shared + 3 * d * hidden * moe.top_k
    return router + shared + experts, active, router + shared  # the experts are stacked Parameters, not Linear


def layer_counts(config: Any) -> list[LayerCount]:
    """The :class:`LayerCount` of every block of ``Llama(config)``."""
    windows = layer_windows(config)
    out = []
    for i in range(config.n_layers):
        a_params, a_linear, width, reader = _attention(config, i)
        f_params, f_active, f_linear = _feed_forward(config, i)
        norms = 2 * config.dim
        out.append(
            LayerCount(
                a_params + f_params + norms, a_params + f_active + norms, a_linear + f_linear, width, windows[i], reader
            )
        )
    return out


def embedding_params(config: Any) -> int:
    """Parameters outside the blocks: the embedding, the final norm and the (untied) head."""
    embedding = config.vocab_size * config.dim
    return embedding + config.dim + (0 if config.tie_embeddings else embedding)


def attention_flops(config: Any, seq_len: int, training: bool = True) -> list[float]:
    """Attention-score and weighted-value FLOPs per token of every layer: ``6 x 2 H w k`` for training (forward and
    backward), ``2 x 2 H w k`` for a forward pass."""
    factor = 12 if training else 4
    return [factor * config.n_heads * c.attn_width * attended_keys(seq_len, c.window) for c in layer_counts(config)]
