"""Action timelines of chosen training steps under pipeline parallelism, inside ``Trainer.fit``.

Thin: the recorder is :class:`~lightning_llmopt.parallel.pipeline_trace.ActionRecorder`, the analysis and the
picture :mod:`~lightning_llmopt.parallel.pipeline_timeline`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning as L
import torch.distributed as dist
from typing_extensions import override

from lightning_llmopt.parallel.pipeline_timeline import bubble_summary, draw_timelines
from lightning_llmopt.parallel.pipeline_trace import ActionRecorder, StepTrace

__all__ = ["PipelineTimeline"]


class PipelineTimeline(L.Callback):
    """Records every pipeline action (forward, backward, input/weight-gradient backward, loss, transfers and waits,
    per stage and micro-batch) of the training batches at the chosen global steps under
    :class:`~lightning_llmopt.strategies.NDParallelStrategy` with ``pipeline_parallel > 1``; every rank keeps the
    measured bubble of its pipeline (``summaries[step]``, see
    :func:`~lightning_llmopt.parallel.pipeline_timeline.bubble_summary`) and global rank 0 draws the measured
    timeline beside the theoretical one. Without a pipeline it does nothing. Recording does not change the numerics.

    Arguments:
        steps: global steps (optimizer steps done before the batch) to record; with gradient accumulation the last
            batch of the step is kept.
        png: PNG path on global rank 0, ``{step}`` replaced by the step (``None``: no picture; needs the ``plot``
            extra).
    """

    def __init__(self, steps: Iterable[int] = (3,), png: str | None = None) -> None:
        self.steps = {int(s) for s in steps}
        if any(s < 0 for s in self.steps):
            raise ValueError(f"steps ({sorted(self.steps)}) must be >= 0")
        self.png = png
        self.summaries: dict[int, dict[str, Any]] = {}
        self._step: int | None = None

    @staticmethod
    def _runner(trainer: L.Trainer) -> Any:
        return getattr(trainer.strategy, "_pipeline", None)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        runner = self._runner(trainer)
        if runner is not None and trainer.global_step in self.steps:
            runner.recorder, self._step = ActionRecorder(keep=1), trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        runner = self._runner(trainer)
        if runner is None or runner.recorder is None or self._step is None:
            return
        recorder, step = runner.recorder, self._step
        runner.recorder, self._step = None, None
        group = trainer.strategy._device_mesh["pp"].get_group()  # type: ignore[attr-defined]
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, recorder.last.to_dict(), group=group)
        traces = [StepTrace.from_dict(t) for t in gathered]
        cfg = runner.config
        self.summaries[step] = bubble_summary(traces, cfg.schedule, cfg.microbatches, cfg.virtual_stages)
        if self.png and trainer.global_rank == 0:
            draw_timelines(traces, self.png.format(step=step), cfg.schedule, cfg.microbatches, cfg.virtual_stages)
