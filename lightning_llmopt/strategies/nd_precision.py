"""Precision plugin of :class:`~lightning_llmopt.strategies.NDParallelStrategy`: clipping over DTensor shards and
pipeline stages."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_llmopt.parallel.data_parallel import clip_grad_norm_, local_tensor
from lightning_llmopt.parallel.pipeline import pipeline_grad_norm
from lightning_llmopt.parallel.zero import ZeroOptimizer
from lightning_llmopt.strategies.zero_precision import ZeroPrecision

__all__ = ["NDPrecision"]


class NDPrecision(ZeroPrecision):
    """:class:`ZeroPrecision` whose clipping works on any mix of DTensor shards (global norm, one all-reduce); with
    ``pipeline_parallel > 1`` (set by the strategy) the norm is over all stages, with every ZeRO stage."""

    pipeline_parallel: int = 1

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if isinstance(optimizer, ZeroOptimizer):
            if self.pipeline_parallel > 1:  # each stage's engine shards its own parameters over "dp_cp": sum the
                # shards' squares over every rank (all stages; ZeRO-1/2 never meets TP, so no element twice)
                optimizer.clip_grad_norm_(float(clip_val), norm_group=dist.group.WORLD)
                return None
            return super().clip_grad_by_norm(optimizer, clip_val)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.pipeline_parallel > 1:
            norm = pipeline_grad_norm([p for p in params if p.grad is not None], self.pipeline_parallel)
            coef = (float(clip_val) / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                if p.grad is not None:
                    g = local_tensor(p.grad)
                    g.mul_(coef.to(g.device, g.dtype))
            return None
        clip_grad_norm_(params, float(clip_val))
        return None

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        if isinstance(optimizer, ZeroOptimizer):
            return super().clip_grad_by_value(optimizer, clip_val)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    local_tensor(p.grad).clamp_(-clip_val, clip_val)
        return None
