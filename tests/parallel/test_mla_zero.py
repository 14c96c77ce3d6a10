"""An MLA model under ZeRO-2 on 2 gloo ranks matches single-process training on the same global batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.llama import Llama
from lightning_llmopt.parallel.zero import ZeroOptimizer

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24)
GLOBAL_BATCH, SEQ, LR, STEPS = 4, 16, 3e-3, 5


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", mla=dict(MLA)))


def _batches() -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 320, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)


def _loss(model: Llama, tokens: Tensor) -> Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())


def _factory(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _zero_worker() -> dict[str, Tensor] | None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _model()
    opt = ZeroOptimizer(model, _factory, stage=2, bucket_size_mb=0.05)
    for tokens in _batches():
        _loss(model, tokens.chunk(ws)[rank]).backward()
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.remove_hooks()
    return params if rank == 0 else None


def test_zero2_two_ranks_matches_single_process(dist_pool: Any) -> None:
    ref = _model()
    opt = _factory(ref.parameters())
    for tokens in _batches():
        torch.stack([_loss(ref, part) for part in tokens.chunk(2)]).mean().backward()
        opt.step()
        opt.zero_grad()
    got = dist_pool(2).run(_zero_worker)[0]
    assert got is not None and got.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        rel = float((got[name].double() - p.detach().double()).norm() / p.detach().double().norm())
        assert rel < 1e-6, (name, rel)  # fp32, 2 ranks: the reduction order matches autograd's sum
