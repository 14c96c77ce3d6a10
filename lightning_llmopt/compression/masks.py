"""Unstructured and semi-structured (N:M) sparsity masks, magnitude pruning and sparsity schedules.

A mask is a bool tensor of the weight's shape, True where the weight is kept. Masks are applied by multiplying in
place (:func:`apply_masks`), so layers stay plain ``nn.Linear`` and keep their Parameters (optimizers, ZeRO and
checkpoints see nothing new); a :class:`~lightning_llmopt.callbacks.pruning.Pruning` callback re-applies them
after every optimizer step during fine-tuning.

- Magnitude pruning (Han et al., arXiv 1506.02626): drop the smallest ``|w|``, per layer (each layer at the target
  sparsity) or globally (one threshold over all selected layers, so layers end up with different sparsities).
- N:M (2:4 for NVIDIA sparse tensor cores, Mishra et al., arXiv 2104.08378): in every group of ``M`` consecutive
  weights along the input dimension of a row, keep the ``N`` largest scores.
- Gradual schedule (Zhu & Gupta, arXiv 1710.01878): ``s(t) = s_f + (s_i - s_f) (1 - (t - t_0) / (t_1 - t_0))^3``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import Tensor, nn

DEFAULT_SKIP = ("output", "lm_head", "*.lm_head")


def prunable_linears(model: nn.Module, skip: Iterable[str] = DEFAULT_SKIP) -> dict[str, nn.Linear]:
    """``{name: layer}`` of every ``nn.Linear`` whose name matches none of the ``fnmatch`` patterns ``skip``."""
    skip = tuple(skip)
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(fnmatch.fnmatchcase(name, p) for p in skip)
    }


def _check_sparsity(sparsity: float) -> None:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity ({sparsity}) must be in [0, 1)")


def magnitude_mask(weight: Tensor, sparsity: float) -> Tensor:
    """Keep-mask of ``weight`` dropping its ``round(sparsity * numel)`` smallest magnitudes (ties: lowest index)."""
    _check_sparsity(sparsity)
    n_drop = int(round(sparsity * weight.numel()))
    mask = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
    if n_drop:
        idx = torch.argsort(weight.detach().abs().flatten().float(), stable=True)[:n_drop]
        mask[idx] = False
    return mask.view_as(weight)


def global_magnitude_masks(weights: dict[str, Tensor], sparsity: float) -> dict[str, Tensor]:
    """Keep-masks dropping the ``round(sparsity * total)`` smallest magnitudes over all ``weights`` together."""
    _check_sparsity(sparsity)
    flat = torch.cat([w.detach().abs().flatten().float().cpu() for w in weights.values()])
    n_drop = int(round(sparsity * flat.numel()))
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    if n_drop:
        keep[torch.argsort(flat, stable=True)[:n_drop]] = False
    masks, offset = {}, 0
    for name, w in weights.items():
        masks[name] = keep[offset : offset + w.numel()].view(w.shape).to(w.device)
        offset += w.numel()
    return masks


def nm_mask(scores: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """Keep-mask of an ``(N_out, K)`` score matrix keeping the ``n`` largest of every ``m`` consecutive columns of a
    row (``K % m == 0``); with ``scores = |w|`` this is N:M magnitude pruning."""
    if not 0 < n < m:
        raise ValueError(f"N:M pattern needs 0 < n ({n}) < m ({m})")
    if scores.ndim != 2 or scores.shape[1] % m != 0:
        raise ValueError(
            f"N:M masks need a 2-D weight whose input dim is a multiple of m ({m}), got {tuple(scores.shape)}"
        )
    groups = scores.detach().float().reshape(scores.shape[0], -1, m)  # (N_out, K/m, m)
    keep_idx = torch.topk(groups, n, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep_idx, True)
    return mask.reshape(scores.shape)


def is_nm_sparse(mask: Tensor, n: int = 2, m: int = 4) -> bool:
    """True when every group of ``m`` consecutive entries of each row keeps at most ``n``."""
    if mask.ndim != 2 or mask.shape[1] % m != 0:
        return False
    return bool((mask.reshape(mask.shape[0], -1, m).sum(-1) <= n).all())


def magnitude_masks(
    model: nn.Module,
    sparsity: float,
    scope: str = "layer",
    pattern: str = "unstructured",
    skip: Iterable[str] = DEFAULT_SKIP,
) -> dict[str, Tensor]:
    """Magnitude keep-masks ``{layer name: (N, K) bool}`` for the prunable linears of ``model``.

    Arguments:
        sparsity: fraction of weights dropped (ignored for ``pattern="2:4"``, which is 50% by construction).
        scope: ``"layer"`` (each layer at ``sparsity``) or ``"global"`` (one threshold over all layers).
        pattern: ``"unstructured"`` or ``"N:M"`` such as ``"2:4"``.
        skip: ``fnmatch`` patterns of layer names left dense (the output head by default).
    """
    if scope not in ("layer", "global"):
        raise ValueError(f"scope ({scope!r}) must be 'layer' or 'global'")
    layers = prunable_linears(model, skip)
    if pattern != "unstructured":
        n, m = parse_pattern(pattern)
        return {name: nm_mask(lin.weight.abs(), n, m) for name, lin in layers.items()}
    if scope == "global":
        return global_magnitude_masks({k: v.weight for k, v in layers.items()}, sparsity)
    return {name: magnitude_mask(lin.weight, sparsity) for name, lin in layers.items()}


def parse_pattern(pattern: str) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)``."""
    try:
        n, m = (int(v) for v in pattern.split(":"))
    except ValueError:
        raise ValueError(f"pattern ({pattern!r}) must be 'unstructured' or 'N:M' such as '2:4'") from None
    if not 0 < n < m:
        raise ValueError(f"pattern ({pattern!r}) needs 0 < N < M")
    return n, m


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, Tensor]) -> None:
    """Zero the dropped weights in place (``weight *= mask``) of each named linear layer."""
    for name, mask in masks.items():
        w = model.get_submodule(name).weight
        w.mul_(mask.to(device=w.device, dtype=w.dtype))


def sparsity_of(model: nn.Module, names: Iterable[str]) -> float:
    """Fraction of exactly-zero weights over the named layers."""
    zeros = total = 0
    for name in names:
        w = model.get_submodule(name).weight
        zeros += int((w == 0).sum())
        total += w.numel()
    return zeros / max(total, 1)


def cubic_sparsity(step: int, final: float, start_step: int, end_step: int, initial: float = 0.0) -> float:
    """Zhu & Gupta's gradual schedule: ``initial`` before ``start_step``, ``final`` from ``end_step`` on."""
    if step < start_step:
        return initial if step >= 0 else 0.0
    if step >= end_step or end_step <= start_step:
        return final
    frac = (step - start_step) / (end_step - start_step)
    return final + (initial - final) * (1.0 - frac) ** 3


__all__ = [
    "DEFAULT_SKIP",
    "apply_masks",
    "cubic_sparsity",
    "global_magnitude_masks",
    "is_nm_sparse",
    "magnitude_mask",
    "magnitude_masks",
    "nm_mask",
    "parse_pattern",
    "prunable_linears",
    "sparsity_of",
]
