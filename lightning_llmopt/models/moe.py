"""Mixture-of-Experts feed-forward layer (Switch / GShard / Mixtral / DeepSeek-V3 style) for :class:`Llama`.

``MoEFeedForward`` replaces a block's SwiGLU ``FeedForward`` when ``LlamaConfig.moe`` is set. Per forward:

1. the router (``nn.Linear(dim, E)``, fp32 softmax) picks ``top_k`` experts per token
   (:func:`~lightning_llmopt.models.moe_routing.route`), optionally under a per-sequence capacity;
2. the kept assignments are sorted by expert and run through the experts' SwiGLU as three grouped GEMMs
   (:func:`~lightning_llmopt.kernels.grouped_gemm.grouped_mm`: a Triton kernel on GPU, a per-expert loop on CPU);
3. the outputs are scaled by the router weights and summed back per token; dropped assignments add nothing (the
   block's residual carries the token); shared experts (a dense SwiGLU) add to every token.

Balancing: ``aux_loss`` adds the Switch balance loss, ``aux_free`` keeps a per-expert selection bias that
:func:`update_balance_bias` nudges towards the mean load after each step (DeepSeek-V3), ``none`` does neither; the
router z-loss is independent of both. The losses of the last forward are in ``layer.aux_loss``
(:func:`moe_aux_loss` sums them over a model). How tokens reach the experts is the ``dispatcher``'s business: the
default runs every expert locally; :mod:`lightning_llmopt.parallel.expert_parallel` swaps in an all-to-all one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.kernels.grouped_gemm import grouped_mm
from lightning_llmopt.models.blocks import FeedForward
from lightning_llmopt.models.init import draw_base_seed, init_param_
from lightning_llmopt.models.moe_config import MoEConfig
from lightning_llmopt.models.moe_routing import Routing, aux_balance_loss, kept_assignments, load_stats, route, z_loss

__all__ = [
    "LocalDispatcher",
    "MoEConfig",
    "expert_swiglu",
    "MoEFeedForward",
    "moe_aux_loss",
    "moe_layers",
    "update_balance_bias",
]


class Dispatcher(Protocol):
    """Moves routed tokens to the experts and their outputs back: ``(x (N, D), routing, layer) -> (N, D)``."""

    def __call__(self, x: Tensor, routing: Routing, layer: MoEFeedForward) -> Tensor: ...


def expert_swiglu(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """SwiGLU of expert-sorted rows ``x`` ``(M, D)``; stacked weights ``w1, w3`` ``(E, H, D)``, ``w2`` ``(E, D, H)``."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    with torch.autocast(x.device.type, enabled=False):
        h = F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts)
        return grouped_mm(h, w2, counts)


class LocalDispatcher:
    """All experts on this process: sort the kept assignments by expert, grouped SwiGLU, weighted scatter-add."""

    def __call__(self, x: Tensor, routing: Routing, layer: MoEFeedForward) -> Tensor:
        n, k = x.shape[0], routing.experts.shape[-1]
        experts = routing.experts.reshape(n * k)
        keep = routing.keep.reshape(n * k)
        tokens = torch.arange(n, device=x.device).repeat_interleave(k)
        idx = kept_assignments(keep, routing.dropless)
        order = idx[torch.argsort(experts[idx], stable=True)]
        counts = torch.bincount(experts[order], minlength=layer.num_experts)
        y = layer.experts(x[tokens[order]], counts)
        weights = routing.weights.reshape(n * k)[order, None]
        y = y.to(weights.dtype) * weights
        return torch.zeros(n, x.shape[1], device=x.device, dtype=weights.dtype).index_add_(0, tokens[order], y)


class GroupedExperts(nn.Module):
    """The routed experts' stacked SwiGLU weights (a module of their own, so that parallel plans can shard them
    apart from the router and shared experts): ``w1``, ``w3`` ``(E, H, D)``, ``w2`` ``(E, D, H)``."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        # Multiplies the weights' gradients (identity forward). Expert parallelism sets 1/ep: the all-to-all
        # backward sums the EP group's contributions, and the scale turns that sum into the mean the replicated
        # weights get, so plain averaging over the expert's replicas (DDP-style or FSDP2) finishes the job.
        self.grad_scale = 1.0

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """SwiGLU of expert-sorted rows with ``counts`` rows per (local) expert. Going through ``forward`` lets
        wrappers such as FSDP2 gather the weights first; expert-parallel weights (``DTensor`` shards over the
        experts) are used through their local experts."""
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        return expert_swiglu(x, counts, w1, w2, w3)


class _SumForward(torch.autograd.Function):
    """Forward sums over ``group``; backward passes the gradient through unchanged: every rank computes the same
    function of the sum, and each rank's share of the gradient reaches the weights, whose gradients the strategy
    then sums over the group (:func:`~lightning_llmopt.parallel.parallelize.sync_gradients`)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _sum_over(x: Tensor, group: Any) -> Tensor:
    return x if group is None else _SumForward.apply(x, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class MoEFeedForward(nn.Module):
    """Routed experts (+ shared experts) in place of a dense SwiGLU; ``(B, T, D) -> (B, T, D)``.

    Parameters: ``router.weight`` ``(E, D)``; ``experts.w1``, ``experts.w3`` ``(E, H, D)``; ``experts.w2``
    ``(E, D, H)``; optional
    ``shared`` (a dense ``FeedForward``). Buffers: ``balance_bias`` ``(E,)`` (``aux_free``), ``load`` ``(E,)`` (kept
    assignments per expert since the last :func:`update_balance_bias`), ``dropped`` (scalar).
    """

    def __init__(self, dim: int, dense_hidden_dim: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        hidden = config.expert_hidden_dim or dense_hidden_dim
        self.router = nn.Linear(dim, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, dim, hidden)
        self.shared = FeedForward(dim, hidden * config.num_shared_experts) if config.num_shared_experts else None
        self.register_buffer("balance_bias", torch.zeros(config.num_experts))
        self.register_buffer("load", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        self.dispatcher: Any = LocalDispatcher()
        self.aux_loss: Tensor | None = None
        self.expert_offset = 0  # first global expert index held here (expert parallelism shards w1/w2/w3)
        # tensor parallelism (set by parallel.tensor_parallel.apply_tp): this rank routes its slice of the sequence;
        # the balance statistics are summed over the group, and the strategy sums the gradients of this layer's
        # weights over it after backward
        self.tp_group: Any = None

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, out_std: float = 0.02, seed: int | None = None) -> None:
        """Router and shared experts ~ N(0, std) (shared ``w2``: ``out_std``), then :meth:`init_experts`; each weight
        from its own generator (``seed``: the base seed, default one draw from the CPU default generator)."""
        seed = draw_base_seed() if seed is None else seed
        weights = [("router.weight", self.router.weight, std)]
        if self.shared is not None:
            s = self.shared
            weights += [("shared.w1.weight", s.w1.weight, std), ("shared.w3.weight", s.w3.weight, std)]
            weights.append(("shared.w2.weight", s.w2.weight, out_std))
        for name, w, sd in weights:
            init_param_(w, name, seed, _normal(sd))
        self.init_experts(std, out_std, seed=seed)

    @torch.no_grad()
    def init_experts(
        self, std: float, out_std: float, prefix: str = "", seed: int | None = None, device: Any = None
    ) -> None:
        """Expert weights ``w1``, ``w3`` ~ N(0, std), ``w2`` ~ N(0, out_std); balance bias and counters zero.

        Each weight is generated whole (all ``num_experts``) from a generator seeded by ``(seed, name)`` (names under
        ``prefix``, the layer's path in its model) and this process keeps its experts: the ``DTensor`` shard, or
        experts ``expert_offset ..`` of a plain tensor holding fewer than ``num_experts`` (expert parallelism).
        """
        seed = draw_base_seed() if seed is None else seed
        head = f"{prefix}.experts." if prefix else "experts."
        for name, sd in (("w1", std), ("w3", std), ("w2", out_std)):
            w = getattr(self.experts, name)
            shape = (self.num_experts, *w.shape[1:])
            init_param_(w, head + name, seed, _normal(sd), shape=shape, offset=self.expert_offset, device=device)
        self.balance_bias.zero_()
        self.load.zero_()
        self.dropped.zero_()

    def _weight(self, w: Tensor) -> Tensor:
        """``w`` as this rank uses it: the local tensor of a DTensor replicated over tensor parallelism."""
        return w.to_local() if hasattr(w, "to_local") else w

    def _shared(self, x: Tensor) -> Tensor:
        assert self.shared is not None
        if self.tp_group is None:
            return self.shared(x)
        s = self.shared
        h = F.silu(F.linear(x, self._weight(s.w1.weight))) * F.linear(x, self._weight(s.w3.weight))
        return F.linear(h, self._weight(s.w2.weight))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        cfg = self.config
        rdtype = torch.promote_types(x.dtype, torch.float32)
        router = self._weight(self.router.weight)
        logits = F.linear(x.to(rdtype), router.to(rdtype))  # (B, T, E): routing in fp32 (or fp64)
        routing = route(
            logits,
            cfg.top_k,
            renormalize=cfg.renormalize,
            bias=self.balance_bias if cfg.balance == "aux_free" else None,
            capacity_factor=cfg.capacity_factor,
        )
        out = self.dispatcher(x.reshape(b * t, d), _flatten(routing), self).reshape(b, t, d)
        if self.shared is not None:
            out = out + self._shared(x).to(out.dtype)
        aux = logits.new_zeros(())
        group = self.tp_group
        if cfg.balance == "aux_loss" and cfg.aux_loss_coef > 0:
            aux = aux + cfg.aux_loss_coef * aux_balance_loss(routing, lambda v: _sum_over(v, group))
        if cfg.z_loss_coef > 0:
            aux = aux + cfg.z_loss_coef * z_loss(routing, lambda v: _sum_over(v, group))
        self.aux_loss = aux
        if self.training:
            with torch.no_grad():
                counts, dropped = load_stats(routing)
                self.load += counts
                self.dropped += dropped
        return out.to(x.dtype)


def _normal(std: float) -> Callable[[Tensor, torch.Generator], Tensor]:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def _flatten(routing: Routing) -> Routing:
    b, t, k = routing.experts.shape
    return Routing(
        experts=routing.experts.reshape(b * t, k),
        weights=routing.weights.reshape(b * t, k),
        keep=routing.keep.reshape(b * t, k),
        probs=routing.probs.reshape(b * t, -1),
        logits=routing.logits.reshape(b * t, -1),
        dropless=routing.dropless,
    )


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """Sum of the balance and z-losses of every MoE layer's last forward (``None`` without MoE layers)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


@torch.no_grad()
def update_balance_bias(model: nn.Module, reduce: Any = None) -> dict[str, Tensor]:
    """After an optimizer step: read and reset every layer's load counters; for ``aux_free`` layers move the bias.

    ``reduce``: optional callable summing a tensor over data-parallel ranks (e.g. ``strategy.reduce(t, "sum")``),
    so every rank applies the same update. Returns per-layer statistics for logging: ``load`` ``(L, E)``,
    ``dropped_fraction`` ``(L,)`` and the load coefficient of variation ``load_cv`` ``(L,)``.
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    loads = torch.stack([m.load.float() for m in layers])  # (L, E)
    dropped = torch.stack([m.dropped.float() for m in layers])
    if reduce is not None:
        loads, dropped = reduce(loads), reduce(dropped)
    for m, load in zip(layers, loads, strict=True):
        if m.config.balance == "aux_free" and load.sum() > 0:
            m.balance_bias += m.config.bias_update_rate * torch.sign(load.mean() - load)
        m.load.zero_()
        m.dropped.zero_()
    total = loads.sum(1) + dropped
    cv = loads.std(1, unbiased=False) / loads.mean(1).clamp_min(1e-9)
    return {"load": loads, "dropped_fraction": dropped / total.clamp_min(1), "load_cv": cv}
