"""Per-layer counts (parallel/layer_costs.py) against the built model, and what uses them: the memory estimator's
parameters and activations (measured on CPU) and the pipeline cost model, for MLA, layer patterns (per-layer
windows), cross-layer K/V sharing and MoE configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.models.attention import AttentionMask
from lightning_llmopt.parallel.activation_checkpointing import (
    POLICIES,
    activation_memory,
    apply_activation_checkpointing,
)
from lightning_llmopt.parallel.layer_costs import attention_flops, embedding_params, layer_counts
from lightning_llmopt.parallel.memory import activation_bytes, estimate_memory
from lightning_llmopt.parallel.pipeline_split import block_costs

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)
MLA_EQUAL = dict(MLA, v_head_dim=32)  # v as wide as q.k: SDPA's fused CPU kernel (see memory_attention.py)
CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {},
    "mla": dict(mla=MLA),
    "mla_q_lora": dict(mla=dict(MLA, q_lora_rank=24)),
    "layer_types": dict(n_layers=3, sliding_window=5, layer_types=["local", "global", "local:9"]),
    "kv_sources": dict(n_layers=3, kv_sources=[0, 0, 2], qkv_bias=True),
    "kv_sources_windows": dict(
        n_layers=4, sliding_window=6, layer_types=["local", "local", "global", "global"], kv_sources=[0, 0, 2, 2]
    ),
    "moe": dict(n_layers=3, moe=dict(num_experts=4, top_k=2, num_shared_experts=1, expert_hidden_dim=48, every=2)),
    "tied": dict(tie_embeddings=True, kv_sources=[0, 0]),
}


def _meta(cfg: LlamaConfig) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_counts_match_the_model(name: str) -> None:
    cfg = LlamaConfig.from_preset("tiny", **CONFIGS[name])
    model = _meta(cfg)
    counts = layer_counts(cfg)
    real = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    assert [c.params for c in counts] == real
    assert sum(real) + embedding_params(cfg) == model.num_params()
    kw = dict(world_size=2, precision="32-true", micro_batch=1, seq_len=8)
    assert estimate_memory(cfg, stage=3, **kw).num_params == model.num_params()
    linears = [
        sum(m.weight.numel() for m in b.modules() if isinstance(m, torch.nn.Linear)) for b in model.layers.values()
    ]
    assert [c.linear for c in counts] == linears


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seq_len", [1, 17, 64])
def test_flops_agree_with_llama_flops_per_token(name: str, seq_len: int) -> None:
    cfg = LlamaConfig.from_preset("tiny", **CONFIGS[name])
    model = _meta(cfg)
    head = cfg.vocab_size * cfg.dim + cfg.dim  # N counts the head and the final norm, not the embedding lookup
    ours = sum(6 * c.active for c in layer_counts(cfg)) + 6 * head + sum(attention_flops(cfg, seq_len))
    assert ours == pytest.approx(model.flops_per_token(seq_len), rel=1e-12)


@pytest.mark.parametrize(("seq_len", "window"), [(1, 4), (17, 4), (17, 17), (64, 9), (113, None), (10, 30)])
def test_attended_keys_count_the_mask(seq_len: int, window: int | None) -> None:
    """Attention FLOPs follow the model's own mask: ``12 H D (pairs / T - 1/2)`` (PaLM's ``T / 2`` convention)."""
    cfg = LlamaConfig.from_preset("tiny", n_layers=1, sliding_window=window)
    pairs = int(AttentionMask.causal(1, seq_len, torch.device("cpu"), window=window).dense().sum())
    want = 12 * cfg.n_heads * cfg.head_dim * (pairs / seq_len - 0.5)
    assert attention_flops(cfg, seq_len)[0] == pytest.approx(want, rel=1e-12)


def test_mla_flops_agree_with_lightning_counter() -> None:
    """MLA's per-head widths (q.k over ``d_n + d_r``, p.v over ``d_v``) against an independent FLOP counter, which
    charges full attention: the masked half is added back before comparing."""
    from lightning.fabric.utilities.throughput import measure_flops

    cfg = LlamaConfig.from_preset("tiny", vocab_size=64, mla=dict(MLA, q_lora_rank=24))
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.randint(0, 64, (2, 32))
    counted = measure_flops(model, lambda: model(tokens), lambda y: y.float().sum())
    assert cfg.mla is not None
    masked = 6 * cfg.n_layers * cfg.n_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) / 2 * 32
    assert counted == pytest.approx((model.flops_per_token(32) + masked) * tokens.numel(), rel=0.01)


def _measure(cfg: LlamaConfig, precision: str, policy: str, bf16_weights: bool = False) -> int:
    torch.manual_seed(0)
    model = Llama(cfg)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    if bf16_weights:  # FSDP2's param_dtype=bf16 under bf16-mixed: bf16 weights, fp32 buffers
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    apply_activation_checkpointing(model, policy)
    tokens = torch.randint(0, cfg.vocab_size, (2, 37))

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(tokens)

    return activation_memory(model, forward)


ACTIVATIONS = {
    "mla": dict(mla=MLA_EQUAL),
    "mla_q_lora": dict(mla=dict(MLA_EQUAL, q_lora_rank=24)),
    "kv_sources": dict(n_layers=3, kv_sources=[0, 0, 0]),
    "kv_sources_pairs": dict(n_layers=4, kv_sources=[0, 0, 2, 2]),
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_match_measurement_on_cpu(name: str, precision: str) -> None:
    """Exact on CPU (torch 2.13) for every checkpointing policy, including a K/V reader whose source block is
    checkpointed ("every_n": the reader then keeps k and v); 2% as tests/parallel/test_memory.py allows."""
    cfg = LlamaConfig.from_preset("tiny", **ACTIVATIONS[name])
    for policy in POLICIES:
        est = activation_bytes(cfg, precision=precision, micro_batch=2, seq_len=37, activation_checkpointing=policy)
        measured = _measure(cfg, precision, policy)
        assert est == pytest.approx(measured, rel=0.02), (policy, est, measured)
    if precision == "bf16-mixed":
        for policy in POLICIES:
            est = activation_bytes(
                cfg, precision=precision, micro_batch=2, seq_len=37, activation_checkpointing=policy, bf16_gathered=True
            )
            measured = _measure(cfg, precision, policy, bf16_weights=True)
            assert est == pytest.approx(measured, rel=0.02), ("bf16 gathered", policy, est, measured)


@pytest.mark.parametrize("name", ["mla", "layer_types", "kv_sources_windows", "moe"])
def test_pipeline_costs_follow_each_block(name: str) -> None:
    """``block_costs`` from the built model: each block's parameters (``numel``; MoE: the router, shared and top_k
    experts for the FLOPs) and its attention over the keys its mask allows (counted from the mask)."""
    cfg = LlamaConfig.from_preset("tiny", **CONFIGS[name])
    model, seq, weight = _meta(cfg), 24, 0.25
    params, active = [], []
    for block in model.layers.values():
        n = sum(p.numel() for p in block.parameters())
        ffn = block.feed_forward
        if hasattr(ffn, "experts"):
            e = ffn.experts
            n_active = n - (e.w1.numel() + e.w2.numel() + e.w3.numel()) * (1 - ffn.config.top_k / e.w1.shape[0])
        params.append(n)
        active.append(n if not hasattr(ffn, "experts") else n_active)
    mla = cfg.mla
    width = (mla.qk_head_dim + mla.v_head_dim) / 2 if mla is not None else cfg.head_dim
    attn = []
    for block in model.layers.values():
        window = getattr(block.attention, "window", None)
        pairs = int(AttentionMask.causal(1, seq, torch.device("cpu"), window=window).dense().sum())
        attn.append(12 * cfg.n_heads * width * (pairs / seq - 0.5))
    flops = [6 * a + f for a, f in zip(active, attn, strict=True)]
    vd = cfg.vocab_size * cfg.dim
    total_flops, total_params = sum(flops) + 6 * vd, sum(params) + 2 * vd + cfg.dim
    want = [f / total_flops + weight * p / total_params for f, p in zip(flops, params, strict=True)]
    blocks, _, _ = block_costs(cfg, seq, weight)
    assert blocks == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", ["layer_types", "kv_sources_windows", "mla"])
def test_recompute_overhead_counts_each_blocks_window(name: str) -> None:
    """Full checkpointing redoes each block's forward: ``2 x params`` plus its attention over the keys its own mask
    allows (counted from the mask; MLA at its q.k and p.v widths), over ``Llama.flops_per_token``."""
    from lightning_llmopt.parallel.activation_checkpointing import recompute_overhead

    cfg = LlamaConfig.from_preset("tiny", **CONFIGS[name])
    model, seq = Llama(cfg), 24
    apply_activation_checkpointing(model, "full")
    mla = cfg.mla
    width = (mla.qk_head_dim + mla.v_head_dim) / 2 if mla is not None else cfg.head_dim
    extra = 0.0
    for block in model.layers.values():
        window = getattr(block.attention, "window", None)
        pairs = int(AttentionMask.causal(1, seq, torch.device("cpu"), window=window).dense().sum())
        extra += 2 * sum(p.numel() for p in block.parameters()) + 4 * cfg.n_heads * width * (pairs / seq - 0.5)
    assert recompute_overhead(model, seq) == pytest.approx(extra / model.flops_per_token(seq), rel=1e-12)
