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
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "FusedReplay",
    "LogCapture",
    "PipelineSteps",
    "Replay",
    "check_pipeline_combination",
    "default_zero_stage",
    "model_path",
    "replaced",
    "take_rows",
]


class Replay(nn.Module):
    """Returns ``output`` whatever it is called with (the pipeline already ran the model)."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


class FusedReplay(nn.Module):
    """Stands in for a model whose last pipeline stage returned its final-norm hidden states (a fused loss, see
    :class:`~lightning_llmopt.parallel.pipeline.HiddenStage`): :meth:`loss` runs the model's fused linear +
    cross-entropy on them with the head's weight (``Llama.loss``'s signature, so ``CausalLMModule.train_loss`` takes
    it), and calling it returns the head's logits.

    Arguments:
        hidden: the last stage's output for the micro-batch ``(B/M, T, dim)``.
        model: the last stage's model (its ``output`` head and ``fused_loss``).
    """

    _model: Any

    def __init__(self, hidden: Any, model: nn.Module) -> None:
        super().__init__()
        self.hidden = hidden
        object.__setattr__(self, "_model", model)  # not a submodule: the stand-in owns no parameters

    @property
    def output(self) -> Any:
        return self._model.output

    @property
    def fused_loss(self) -> Any:
        return self._model.fused_loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output(self.hidden)

    def loss(
        self,
        tokens: Tensor,
        labels: Tensor,
        positions: Tensor | None = None,
        doc_ids: Tensor | None = None,
        ignore_index: int = -100,
    ) -> Tensor:
        return self.fused_loss(self.hidden, self.output.weight, labels, ignore_index=ignore_index)


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


class PipelineSteps:
    """Step hooks of :class:`~lightning_llmopt.strategies.NDParallelStrategy` (mixed in before the Lightning
    strategy): with a pipeline (``self._pipeline``) they run the schedule, otherwise they defer to the strategy."""

    _pipeline: Any
    _pipeline_model: Any
    _pipelined_step: bool
    _sync_blocked: bool
    _device_mesh: Any
    dims: Any

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Without pipeline parallelism: Lightning's. With it: run the schedule over micro-batches (the user's
        ``training_step`` computes each micro-batch loss on the last stage, see ``strategies/nd_pipeline.py``) and
        return the mean loss on every rank; gradients are already accumulated, so ``backward`` only syncs them."""
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        assert module is not None and self.dims is not None
        batch = args[0] if args else kwargs.pop("batch")
        rest = args[1:]
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
            raise TypeError(
                f"pipeline parallelism needs dict batches with an 'input_ids' (B, T) tensor, got {type(batch).__name__}"
            )
        rows_total = batch["input_ids"].shape[0]
        capture = LogCapture()

        def loss_fn(output: Any, rows: Tensor) -> Tensor:
            micro = take_rows(batch, rows, rows_total)
            head = self._pipeline.fused_head
            stand_in = Replay(output) if head is None else FusedReplay(output, head)
            with replaced(module, self._pipeline_model, stand_in), capture.capturing(module):
                out = module.training_step(micro, *rest, **kwargs)
            loss = out.get("loss") if isinstance(out, dict) else out
            if not isinstance(loss, Tensor):
                raise TypeError("under pipeline parallelism training_step must return the loss (or a dict with it)")
            return loss

        batch_idx = rest[0] if rest else kwargs.get("batch_idx", 0)
        if batch_idx % max(int(getattr(module.trainer, "accumulate_grad_batches", 1)), 1) == 0:
            # Lightning zeroes gradients between training_step and backward; the schedule's backward already ran,
            # so zero them now (before it) and skip that one call (_skip_next_zero_grad)
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self._skip_next_zero_grad()
        with ExitStack() as stack:
            stack.enter_context(self.precision_plugin.train_step_context())
            for zero in self.zero_optimizers:  # reduce once after all micro-batches (below)
                stack.enter_context(zero.no_sync())
            mean = self._pipeline.train_step(batch, loss_fn)
        if not self._sync_blocked:
            for zero in self.zero_optimizers:
                zero._sync_started = True  # step() -> synchronize() reduces every bucket in order
        group = self._device_mesh["pp"].get_group()
        last = self._pipeline.split.ranks[-1]
        capture.replay(module, group, torch.distributed.get_global_rank(group, last), self.root_device)
        self._pipelined_step = True
        return mean

    def on_train_end(self) -> None:
        """PipeDream-2BW leaves backwards in flight between steps: run them before anything else communicates."""
        drain = getattr(self._pipeline, "drain", None)
        if drain is not None:
            drain()
        super().on_train_end()  # type: ignore[misc]

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not self._pipelined_step:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self._pipelined_step = False  # the schedule ran forward and backward already
        self._restore_zero_grad()
        self.post_backward(closure_loss)
        return closure_loss

    def _skip_next_zero_grad(self) -> None:
        for opt in self.optimizers:

            def skip(*args: Any, _opt: Any = opt, **kwargs: Any) -> None:
                del _opt.zero_grad  # one call only: the class's method is back

            opt.zero_grad = skip  # type: ignore[method-assign]

    def _restore_zero_grad(self) -> None:
        for opt in self.optimizers:
            if "zero_grad" in vars(opt):
                del opt.zero_grad

    def _pipelined_eval(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and self._pipeline is not None
        batch = args[0] if args else kwargs["batch"]
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
            raise TypeError(
                f"pipeline parallelism needs dict batches with an 'input_ids' (B, T) tensor, got {type(batch).__name__}"
            )
        output = self._pipeline.forward(batch)
        with replaced(module, self._pipeline_model, Replay(output)):
            return getattr(module, hook)(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._pipelined_eval("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self._pipelined_eval("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self._pipelined_eval("predict_step", *args, **kwargs)


def default_zero_stage(pp: int, virtual_stages: int, tp: int) -> int:
    """The ZeRO stage when the user names none: 3 (FSDP2), except with several pipeline stages per rank, which FSDP2
    cannot wrap (:func:`check_pipeline_combination`): there our ZeRO-2 engine, or stage 0 (gradients all-reduced)
    under tensor parallelism, which the engine's flat buffers do not take."""
    if pp > 1 and virtual_stages > 1:
        return 0 if tp > 1 else 2
    return 3


def check_pipeline_combination(
    pp: int, tp: int, cp: int, ep: int, zero_stage: int, virtual_stages: int, compile: bool
) -> None:
    """Layouts pipeline parallelism does not compose with yet; named errors in ``__init__``."""
    if cp > 1 or ep > 1:
        raise NotImplementedError(
            f"pipeline_parallel ({pp}) composes with data, tensor (+ sequence) parallelism and ZeRO so far; got "
            f"context_parallel ({cp}), expert_parallel ({ep})"
        )
    if zero_stage == 3 and virtual_stages > 1:
        raise NotImplementedError(
            f"zero_stage=3 with virtual_stages ({virtual_stages}) > 1 is not supported yet (FSDP2 wraps one "
            "module per rank); use zero_stage 0, 1 or 2, or one stage per rank"
        )
    if compile:
        raise NotImplementedError(f"compile=True with pipeline_parallel ({pp}) is not tested yet")
