"""Structured pruning: the smaller dense model computes what the masked model computes (fp32, tolerance derived
from a float64 reference), with a consistent config (GQA) and fewer parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_llmopt.compression import mask_structured, plan_structured, prune_structured
from lightning_llmopt.models import Llama, LlamaConfig


@pytest.mark.parametrize(
    "overrides,keep",
    [
        (dict(n_heads=4, n_kv_heads=2), dict(n_kv_heads=1, n_rep=2, ffn_hidden_dim=40)),  # drop a GQA group
        (dict(n_heads=4, n_kv_heads=2), dict(n_kv_heads=2, n_rep=1, ffn_hidden_dim=96)),  # heads inside groups
        (dict(n_heads=4, n_kv_heads=4, qkv_bias=True), dict(n_kv_heads=3, ffn_hidden_dim=17)),  # MHA, odd width
        (dict(n_heads=4, n_kv_heads=1), dict(n_rep=2)),  # MQA: query heads only
    ],
)
def test_pruned_matches_masked(overrides: dict, keep: dict) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig.from_preset("tiny", **overrides)
    model = Llama(cfg)
    for p in model.parameters():  # non-zero biases too
        p.data.add_(torch.randn_like(p) * 0.02)
    plan = plan_structured(model, **keep)
    masked = copy.deepcopy(model)
    mask_structured(masked, plan)
    pruned = prune_structured(copy.deepcopy(model), plan)
    c = pruned.config
    assert c.n_heads == c.n_kv_heads * c.n_rep and c.head_dim == cfg.head_dim
    assert c.n_kv_heads == keep.get("n_kv_heads", cfg.n_kv_heads)
    assert c.ffn_hidden_dim == keep.get("ffn_hidden_dim", cfg.ffn_hidden_dim)
    assert pruned.num_params() < model.num_params()
    att = pruned.layers["1"].attention
    assert att.wq.weight.shape == (c.n_heads * c.head_dim, c.dim)
    assert att.wk.weight.shape[0] == c.n_kv_heads * c.head_dim
    assert pruned.layers["0"].feed_forward.w2.weight.shape == (c.dim, c.ffn_hidden_dim)
    fresh = Llama(c)  # the new config builds a model with the same shapes
    fresh.load_state_dict(pruned.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        ref = copy.deepcopy(masked).double()(tokens)
        out_masked = masked(tokens).double()
        out_pruned = fresh(tokens).double()
    err_masked = (out_masked - ref).abs().max().item()
    err_pruned = (out_pruned - ref).abs().max().item()
    # same fp32 function, different summation lengths: within 2x the masked model's own fp32 error (+1 ulp at 1)
    assert err_pruned <= 2 * err_masked + 1.2e-7, (err_pruned, err_masked)


def test_plan_keeps_most_important_and_validates() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny"))
    with torch.no_grad():
        model.layers["0"].attention.wo.weight[:, 16:32] *= 10  # query head 1 (group 0) dominates
        model.layers["0"].feed_forward.w2.weight[:, 5] *= 100
    plan = plan_structured(model, n_kv_heads=1, n_rep=1, ffn_hidden_dim=1)
    assert plan.kv_heads[0] == [0] and plan.q_heads[0] == [1] and plan.channels[0] == [5]
    with pytest.raises(ValueError, match="n_kv_heads"):
        plan_structured(model, n_kv_heads=3)


@pytest.mark.parametrize(
    "overrides,found",
    [
        (dict(mla=dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)), "found MLA"),
        (dict(kv_sources=[0, 0]), "found K/V shared from another layer"),
    ],
)
def test_refuses_attention_without_own_gqa_heads(overrides: dict, found: str) -> None:
    model = Llama(LlamaConfig.from_preset("tiny", **overrides))
    with pytest.raises(ValueError, match=f"block [01]: structured pruning supports GQA attention .*{found}"):
        plan_structured(model, n_kv_heads=1)
