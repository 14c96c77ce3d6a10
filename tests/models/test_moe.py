"""MoE routing and the MoE layer against brute-force references we wrote independently (plain loops, float64)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.models import Llama
from lightning_llmopt.models.moe import MoEConfig, MoEFeedForward, moe_aux_loss, update_balance_bias
from lightning_llmopt.models.moe_routing import aux_balance_loss, capacity, capacity_keep, route, z_loss


def _keep_loop(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Per sequence: visit choices in order; within a choice, tokens by descending weight (ties: lower token)."""
    b, t, k = experts.shape
    keep = torch.zeros(b, t, k, dtype=torch.bool)
    for row in range(b):
        used = [0] * num_experts
        for c in range(k):
            tokens = sorted(range(t), key=lambda i: (-float(weights[row, i, c]), i))
            for i in tokens:
                e = int(experts[row, i, c])
                if used[e] < cap:
                    used[e] += 1
                    keep[row, i, c] = True
    return keep


@pytest.mark.parametrize(("b", "t", "e", "k", "factor"), [(2, 17, 4, 2, 1.0), (3, 9, 8, 1, 0.5), (1, 33, 5, 3, 1.25)])
def test_capacity_matches_loop(b: int, t: int, e: int, k: int, factor: float) -> None:
    g = torch.Generator().manual_seed(b * 100 + t)
    logits = torch.randn(b, t, e, generator=g)
    logits[0, :3] = logits[0, 0]  # tied weights: order by position
    routing = route(logits, k, capacity_factor=None)
    cap = capacity(t, k, e, factor)
    got = capacity_keep(routing.experts, routing.weights, e, cap)
    assert torch.equal(got, _keep_loop(routing.experts, routing.weights, e, cap))
    counts = torch.zeros(b, e, dtype=torch.int64)
    for row in range(b):
        counts[row] = torch.bincount(routing.experts[row][got[row]], minlength=e)
    assert int(counts.max()) <= cap


def test_router_weights_and_bias() -> None:
    logits = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(-1)
    top1 = route(logits, 1)
    assert torch.allclose(top1.weights[..., 0], probs.max(-1).values)  # Switch: the chosen probability
    topk = route(logits, 2)
    assert torch.allclose(topk.weights.sum(-1), torch.ones(2, 5))
    raw = route(logits, 2, renormalize=False)
    assert torch.allclose(raw.weights, probs.topk(2).values)
    bias = torch.zeros(6)
    bias[3] = 10.0  # forces expert 3 into every token's selection, but its weight stays its probability
    biased = route(logits, 2, bias=bias, renormalize=False)
    assert (biased.experts[..., 0] == 3).all()
    assert torch.allclose(biased.weights[..., 0], probs[..., 3])


def test_balance_losses() -> None:
    uniform = route(torch.zeros(3, 8, 4), 2)
    assert aux_balance_loss(uniform).item() == pytest.approx(1.0)  # E * sum(1/E * 1/E) * E... = 1
    logits = torch.randn(2, 7, 4, generator=torch.Generator().manual_seed(1))
    r = route(logits, 1)
    want = torch.logsumexp(logits.double(), -1).pow(2).mean()
    assert z_loss(r).double().item() == pytest.approx(want.item(), rel=1e-6)
    # Per sequence, averaged: the batch's value is the mean of its sequences' values.
    halves = [route(logits[i : i + 1], 1) for i in range(2)]
    assert aux_balance_loss(r).item() == pytest.approx(sum(aux_balance_loss(h).item() for h in halves) / 2)


def _naive(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    cfg = layer.config
    logits = F.linear(x.double(), layer.router.weight.double())
    routing = route(logits, cfg.top_k, capacity_factor=cfg.capacity_factor, renormalize=cfg.renormalize)
    out = torch.zeros_like(x, dtype=torch.float64)
    w1, w2, w3 = layer.experts.w1.double(), layer.experts.w2.double(), layer.experts.w3.double()
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            for c in range(cfg.top_k):
                if routing.keep[b, i, c]:
                    e = int(routing.experts[b, i, c])
                    h = F.silu(w1[e] @ x[b, i].double()) * (w3[e] @ x[b, i].double())
                    out[b, i] += routing.weights[b, i, c].double() * (w2[e] @ h)
    if layer.shared is not None:
        s = layer.shared
        xd = x.double()
        out += F.linear(
            F.silu(F.linear(xd, s.w1.weight.double())) * F.linear(xd, s.w3.weight.double()), s.w2.weight.double()
        )
    return out


@pytest.mark.parametrize(
    "config",
    [
        MoEConfig(num_experts=4, top_k=2),
        MoEConfig(num_experts=5, top_k=1, router="top1", capacity_factor=0.75),
        MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0, num_shared_experts=1, z_loss_coef=1e-3),
    ],
)
def test_layer_matches_naive(config: MoEConfig) -> None:
    torch.manual_seed(0)
    layer = MoEFeedForward(12, 20, config).double()
    layer.init_weights(0.3, 0.2)
    x = torch.randn(2, 11, 12, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    ref = _naive(layer, x.detach())
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # Gradients through the grouped path equal those of the naive loop (float64 autograd on both).
    x2 = x.detach().clone().requires_grad_(True)
    weights = [layer.experts.w1, layer.experts.w2, layer.router.weight]
    grads = torch.autograd.grad(out.square().sum(), [x, *weights])
    ref_grads = torch.autograd.grad(_naive(layer, x2).square().sum(), [x2, *weights])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert moe_aux_loss(layer) is not None


def test_aux_free_bias_moves_towards_balance() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=1, router="top1", balance="aux_free", bias_update_rate=0.05)
    layer = MoEFeedForward(8, 16, cfg)
    layer.init_weights(0.5, 0.02)  # distinct experts: with near-identical ones every sign update flips them together
    with torch.no_grad():
        layer.router.weight[0, 0] += 2.0  # skewed router: expert 0 wins most tokens (x[..., 0] is mostly > 0)
    x = torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(0))
    x[..., 0] += 1.0
    cvs = []
    for _ in range(60):
        layer(x)
        cvs.append(float(update_balance_bias(layer)["load_cv"][0]))
    assert sum(cvs[-20:]) / 20 < 0.3 * cvs[0]  # sign updates oscillate around balance: compare a window
    assert layer.balance_bias[0] < 0  # the overloaded expert is pushed down


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="top_k \\(3\\)"):
        MoEConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="'top1'"):
        MoEConfig(router="top1", top_k=2)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEConfig(capacity_factor=0)
    assert capacity(10, 2, 4, 1.0) == math.ceil(5.0)


def test_llama_with_moe_trains_and_logs(tmp_path: Any) -> None:
    import lightning as L

    from lightning_llmopt import CausalLMModule, LlamaConfig, TrainingMonitor
    from lightning_llmopt.testing.data import RandomTokens

    moe = {"num_experts": 4, "top_k": 2, "balance": "aux_free", "bias_update_rate": 0.01, "capacity_factor": 1.0,
           "every": 2}
    cfg = LlamaConfig.from_preset("tiny", moe=moe)
    assert isinstance(cfg.moe, MoEConfig) and LlamaConfig.from_dict(cfg.to_dict()) == cfg
    with torch.device("meta"):
        meta = Llama(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert all(torch.isfinite(p).all() for p in meta.parameters())
    kinds = [type(b.feed_forward).__name__ for b in meta.layers.values()]
    assert kinds[1] == "MoEFeedForward" and kinds[0] == "FeedForward"  # every=2: blocks 1, 3, ...
    dense = Llama(LlamaConfig.from_preset("tiny"))
    assert meta.flops_per_token(64) > 0 and meta.num_params() > dense.num_params()

    L.seed_everything(0, verbose=False)
    module = CausalLMModule(cfg, warmup_steps=1, max_steps=4)
    monitor = TrainingMonitor(log_every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=tmp_path)
    data = RandomTokens(cfg.vocab_size, 32, 16, seed=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    metrics = monitor.last_metrics
    assert 0 <= metrics["moe/dropped_fraction"] < 1 and metrics["moe/load_cv"] >= 0
    layer = module.model.layers["1"].feed_forward
    assert sum(metrics[f"moe/expert_tokens/0/{e}"] for e in range(4)) > 0
    assert layer.balance_bias.abs().sum() > 0  # the aux-free bias moved
    assert "train/moe_aux_loss" in trainer.callback_metrics


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_load_stats_and_kept_assignments_match_masks(capacity_factor: float | None) -> None:
    """The synchronisation-free statistics and kept indices equal the boolean-mask forms they replace."""
    from lightning_llmopt.models.moe_routing import kept_assignments, load_stats, route

    torch.manual_seed(0)
    routing = route(torch.randn(3, 17, 6), top_k=2, capacity_factor=capacity_factor)
    assert routing.dropless == (capacity_factor is None)
    counts, dropped = load_stats(routing)
    expected = torch.bincount(routing.experts[routing.keep].reshape(-1), minlength=6)
    assert torch.equal(counts, expected) and int(dropped) == int((~routing.keep).sum())
    keep = routing.keep.reshape(-1)
    assert torch.equal(kept_assignments(keep, routing.dropless), torch.nonzero(keep).squeeze(1))
    if capacity_factor is not None:
        assert int(dropped) > 0  # the capacity case really drops assignments
