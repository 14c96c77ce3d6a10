"""Lightning glue of :class:`~lightning_llmopt.strategies.NDParallelStrategy` for pipeline parallelism.

The user's ``training_step`` / ``validation_step`` stay as written for one process. On a pipeline rank the model
attribute (e.g. ``module.model``) holds only this rank's stages, so the strategy runs the pipeline itself and calls
the user's step with the model replaced by a stand-in that returns the pipeline's output:

- training: the schedule calls the user's ``training_step`` once per micro-batch on the last stage, with the
  micro-batch's rows, and back-propagates its loss. Its ``self.log`` calls are collected, reduced over micro-batches
  (tensors: mean, so a logged loss is the step's mean loss; Python numbers: the last value, e.g. counters) and logged
  on every pipeline rank, so loggers on any rank see them. The step returns the mean loss on every rank;
- validation / test / predict: a forward-only pass; the last stage's output (logits) is broadcast over the pipeline
  ranks and every rank runs the user's step on it, so metric states are updated alike on every rank (as under tensor
  parallelism) and their cross-rank synchronisation is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["LogCapture", "Replay", "model_path", "replaced", "take_rows"]


class Replay(nn.Module):
    """Returns ``output`` whatever it is called with (the pipeline already ran the model)."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def model_path(container: nn.Module, model: nn.Module) -> str:
    """Dotted name of ``model`` inside ``container`` (e.g. ``"model"``)."""
    for name, sub in container.named_modules():
        if sub is model and name:
            return name
    raise ValueError(f"pipeline parallelism needs the model as a submodule of {type(container).__name__}")


@contextmanager
def replaced(container: nn.Module, path: str, stand_in: nn.Module) -> Iterator[None]:
    """Temporarily put ``stand_in`` at ``path`` inside ``container``."""
    parent_name, _, attr = path.rpartition(".")
    parent = container.get_submodule(parent_name) if parent_name else container
    original = parent._modules[attr]
    parent._modules[attr] = stand_in
    try:
        yield
    finally:
        parent._modules[attr] = original


def take_rows(batch: Any, rows: Tensor, batch_size: int) -> Any:
    """The rows ``rows`` of every tensor in ``batch`` whose first dimension is ``batch_size`` (dicts, lists)."""
    if isinstance(batch, Tensor):
        return batch[rows.to(batch.device)] if batch.ndim and batch.shape[0] == batch_size else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: take_rows(v, rows, batch_size) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        return type(batch)(take_rows(v, rows, batch_size) for v in batch)
    return batch


class LogCapture:
    """Collects ``LightningModule.log`` calls made per micro-batch and replays them once per step on every
    pipeline rank (see the module docstring)."""

    def __init__(self) -> None:
        self.records: dict[str, tuple[list[Any], dict[str, Any]]] = {}

    @contextmanager
    def capturing(self, module: Any) -> Iterator[None]:
        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("pass LightningModule.log options by keyword under pipeline parallelism")
            if isinstance(value, Tensor):
                value = value.detach().float().cpu()
            elif not isinstance(value, (int, float)):
                raise TypeError(
                    f"under pipeline parallelism training_step may log tensors and numbers; {name!r} is a "
                    f"{type(value).__name__} (update metrics in validation_step)"
                )
            self.records.setdefault(name, ([], kwargs))[0].append(value)

        module.log = log  # instance attribute shadows the method (log_dict calls self.log)
        try:
            yield
        finally:
            del module.log

    def reduced(self) -> list[tuple[str, Any, dict[str, Any]]]:
        out = []
        for name, (values, kwargs) in self.records.items():
            if isinstance(values[0], Tensor):
                value: Any = torch.stack([v.reshape(()) for v in values]).mean()
            else:
                value = values[-1]
            out.append((name, value, kwargs))
        return out

    def replay(self, module: Any, group: Any, src: int, device: torch.device) -> None:
        """Broadcast the reduced records from global rank ``src`` over ``group`` and log them on this rank."""
        payload: list[Any] = [self.reduced() if dist.get_rank() == src else None]
        dist.broadcast_object_list(payload, src=src, group=group)
        for name, value, kwargs in payload[0]:
            module.log(name, value.to(device) if isinstance(value, Tensor) else value, **kwargs)
        self.records = {}
