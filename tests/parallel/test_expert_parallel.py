"""Expert parallelism (EP=2; EP=2 x DP=2 on 4 ranks) against one process with the same global batch: fp32,
5 AdamW steps, losses and parameters within 1e-6 relative, dropless and capacity modes.

The reference is the unsharded MoE network in one process; it shares the layer code but no dispatch code (the
local path sorts and computes on one process, the EP path moves rows with uneven all-to-alls). Capacity groups are
sequences, so the same tokens are dropped whatever the split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_llmopt.models.moe import MoEConfig, MoEFeedForward, update_balance_bias
from lightning_llmopt.parallel.expert_parallel import apply_expert_parallel, expert_groups, reduce_gradients

DIM, HIDDEN, SEQ, GLOBAL_BATCH, STEPS = 16, 24, 12, 4, 5
TOL = 1e-6


class Net(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoEFeedForward(DIM, HIDDEN, config)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, GLOBAL_BATCH, SEQ, DIM, generator=g)
    return x, torch.randn(STEPS, GLOBAL_BATCH, SEQ, DIM, generator=g)


def _net(config: MoEConfig) -> Net:
    torch.manual_seed(0)
    net = Net(config)
    net.moe.init_weights(0.3, 0.1)
    return net


def _train(net: Net, rows: slice, step_fn: Any) -> list[float]:
    x, y = _data()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for s in range(STEPS):
        loss = (net(x[s, rows]) - y[s, rows]).square().mean() + net.moe.aux_loss
        loss.backward()
        step_fn(net)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _full_params(net: Net, ep_group: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in net.named_parameters():
        t = p.detach()
        if getattr(p, "_expert_parallel", False):
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
            dist.all_gather(parts, t.contiguous(), group=ep_group)
            t = torch.cat(parts)
        out[name] = t.clone()
    return out


def ep_job(config: MoEConfig, ep: int) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_lists, dp_lists = expert_groups(world, ep)
    ep_groups = [dist.new_group(r) for r in ep_lists]  # every rank creates every group, in the same order
    dp_groups = [dist.new_group(r) for r in dp_lists]
    my_ep = ep_groups[rank // ep]
    my_dp = dp_groups[rank % ep]
    net = _net(config)
    apply_expert_parallel(net, my_ep)
    per_rank = GLOBAL_BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)

    def step(m: Net) -> None:
        reduce_gradients(m, None, my_dp)
        update_balance_bias(m, reduce=_sum)

    losses = torch.tensor(_train(net, rows, step))
    dist.all_reduce(losses)
    return {
        "losses": (losses / world).tolist(),
        "params": _full_params(net, my_ep),
        "bias": net.moe.balance_bias.clone(),
    }


def _sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CONFIGS = {
    "dropless-aux": MoEConfig(num_experts=4, top_k=2, z_loss_coef=1e-3),
    "capacity-auxfree": MoEConfig(
        num_experts=4, top_k=2, capacity_factor=0.75, balance="aux_free", bias_update_rate=0.05, num_shared_experts=1
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(dist_pool: Any, name: str, world: int) -> None:
    config = CONFIGS[name]
    ref_net = _net(config)
    ref_losses = _train(ref_net, slice(0, GLOBAL_BATCH), lambda m: update_balance_bias(m))
    results = dist_pool(world).run(ep_job, config, 2)
    for r in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses, strict=True)) <= TOL
        for key, want in ref_net.state_dict(keep_vars=False).items():
            if key in r["params"]:
                assert _rel(r["params"][key], want) <= TOL, key
        assert torch.equal(r["bias"], ref_net.moe.balance_bias)
    if config.capacity_factor is not None:
        assert ref_net.moe.balance_bias.abs().sum() > 0  # the aux-free update really ran
