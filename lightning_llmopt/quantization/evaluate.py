"""Token-level loss and perplexity of a causal LM over batches (used by mixed-precision sensitivity and the
quality benchmark).

Perplexity here is **token-level**: ``exp`` of the mean next-token cross-entropy per token of the model's own
tokenizer (the GPTQ paper's convention; with the byte tokenizer, a token is a byte).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.quantization.apply import default_forward
from lightning_llmopt.quantization.calibration import _model_device, _to

IGNORE_INDEX = -100


def _logits(out: Any) -> Tensor:
    return out.logits if hasattr(out, "logits") else out


def _labels(batch: Any) -> tuple[Any, Tensor]:
    """``(model input batch, labels (B, T))``: dicts carry ``labels``; a bare ``(B, T + 1)`` tensor is split."""
    if isinstance(batch, Mapping):
        return batch, batch["labels"]
    if isinstance(batch, Tensor):
        return batch[:, :-1], batch[:, 1:]
    raise TypeError(f"batches must be dicts with input_ids/labels or (B, T + 1) token tensors, got {type(batch)}")


@torch.no_grad()
def causal_lm_loss(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Callable[[nn.Module, Any], Any] | None = None,
    max_batches: int | None = None,
) -> float:
    """Mean next-token cross-entropy (nats per token, fp32) over all labelled tokens of ``batches``.

    Arguments:
        batches: dicts ``{"input_ids": (B, T), "labels": (B, T)}`` (``-100`` ignored), or ``(B, T + 1)`` tensors.
        forward: ``forward(model, inputs)``, default :func:`~lightning_llmopt.quantization.apply.default_forward`;
            its output is the logits or has ``.logits`` (transformers).
        max_batches: stop after this many batches.
    """
    forward = forward or default_forward
    device = _model_device(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            inputs, labels = _labels(_to(batch, device))
            logits = _logits(forward(model, inputs)).float()
            total += float(
                F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            )
            count += int((labels != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no labelled tokens in the batches")
    return total / count


def perplexity(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Callable[[nn.Module, Any], Any] | None = None,
    max_batches: int | None = None,
) -> float:
    """Token-level perplexity ``exp(causal_lm_loss(...))``."""
    return math.exp(causal_lm_loss(model, batches, forward, max_batches))


__all__ = ["causal_lm_loss", "perplexity"]
