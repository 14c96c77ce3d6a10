"""Forward-only pass (validation) of :class:`~lightning_llmopt.parallel.pipeline.PipelineRunner`, and its rank's stages.

No schedule and no ``PipelineStage``: each rank runs its stages in stage order with point-to-point sends over the
``"pp"`` group, then the last stage's output is broadcast to every pipeline rank. Steps:

1. Stage ``s`` on this rank takes ``input_ids`` (``s == 0``), the previous stage's output where that stage is local
   (``V > 1``), or receives it from the rank of stage ``s - 1``; its output is sent to the rank of stage ``s + 1``
   where that is another rank.
2. Each point-to-point tensor follows an 8-element int64 header: ``ndim``, 6 sizes (zero-padded), the dtype's index
   in :data:`_DTYPES`.
3. The last stage's rank broadcasts a 9-element header (the same 8 and the layout code of
   :meth:`~lightning_llmopt.parallel.pipeline_tp.TPStageBoundary.encode`: 0 plain, else a DTensor over ``"tp"``),
   then the output; every rank rebuilds it with
   :meth:`~lightning_llmopt.parallel.pipeline_tp.TPStageBoundary.decode` under tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.parallel.pipeline_split import StageSplit
from lightning_llmopt.parallel.pipeline_tp import TPStageBoundary

__all__ = ["PipelineForwardMixin"]


class PipelineForwardMixin:
    """A pipeline rank's place in the pipeline (its stages, the global ranks of its ``"pp"`` peers) and its
    forward-only pass; :class:`~lightning_llmopt.parallel.pipeline.PipelineRunner` sets the attributes below (see its
    ``Arguments:``) and adds the scheduled training step."""

    modules: dict[int, nn.Module]
    split: StageSplit
    group: Any
    device: torch.device
    boundary: TPStageBoundary | None
    pp_rank: int
    fused_head: nn.Module | None

    @property
    def has_first(self) -> bool:
        return 0 in self.modules

    @property
    def has_last(self) -> bool:
        return self.split.num_stages - 1 in self.modules

    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def _send(self, t: Tensor, dst: int) -> None:
        header = torch.tensor([t.ndim, *t.shape, *([0] * (6 - t.ndim)), _DTYPES.index(t.dtype)], dtype=torch.int64)
        dist.send(header.to(self.device), self._global(dst), group=self.group)
        dist.send(t.contiguous(), self._global(dst), group=self.group)

    def _recv(self, src: int) -> Tensor:
        header = torch.empty(8, dtype=torch.int64, device=self.device)
        dist.recv(header, self._global(src), group=self.group)
        ndim, values = int(header[0]), header.tolist()
        t = torch.empty(values[1 : 1 + ndim], dtype=_DTYPES[values[7]], device=self.device)
        dist.recv(t, self._global(src), group=self.group)
        return t

    def _logits(self, h: Tensor) -> Tensor:
        """The head on the hidden states of a :class:`~lightning_llmopt.parallel.pipeline.HiddenStage` (the last
        stage of a model with a fused loss); under tensor parallelism as the stage output hook would return it."""
        model: Any = self.fused_head
        if self.boundary is not None:
            h = self.boundary.wrap(h)  # the hidden states' own layout (sequence-sharded under SP)
        logits = model.output(h)
        if self.boundary is not None:
            local = self.boundary._local_output(model.output, (h,), logits)
            logits = logits if local is None else local
        return logits

    @torch.no_grad()
    def forward(self, batch: dict[str, Tensor]) -> Any:
        """Forward-only pass of the whole batch through every stage; the last stage's output (e.g. logits
        ``(B, T, vocab)``, a vocabulary-sharded DTensor on this rank's ``"tp"`` mesh under tensor parallelism with
        the vocab-parallel loss) on every pipeline rank."""
        kwargs = {k: batch[k] for k in ("positions", "doc_ids") if isinstance(batch.get(k), Tensor)}
        ranks = self.split.ranks
        h: Tensor | None = None
        for s in range(self.split.num_stages):
            if ranks[s] != self.pp_rank:
                continue
            if s == 0:
                x = batch["input_ids"]
            else:
                x = h if ranks[s - 1] == self.pp_rank and h is not None else self._recv(ranks[s - 1])
            h = self.modules[s](x, **kwargs)
            if s == self.split.num_stages - 1 and self.fused_head is not None:
                h = self._logits(h)
            if s + 1 < self.split.num_stages and ranks[s + 1] != self.pp_rank:
                self._send(h, ranks[s + 1])
        last = ranks[-1]
        # header: ndim, 6 sizes, dtype, layout (TPStageBoundary.encode: 0 plain, else a DTensor over "tp")
        if self.pp_rank == last:
            assert h is not None
            out = h.contiguous()
            layout = self.boundary.encode() if self.boundary is not None else 0
            header = torch.tensor(
                [out.ndim, *out.shape, *([0] * (6 - out.ndim)), _DTYPES.index(out.dtype), layout],
                dtype=torch.int64,
                device=self.device,
            )
        else:
            header = torch.empty(9, dtype=torch.int64, device=self.device)
        dist.broadcast(header, self._global(last), group=self.group)
        values = header.tolist()
        if self.pp_rank != last:
            out = torch.empty(values[1 : 1 + values[0]], dtype=_DTYPES[values[7]], device=self.device)
        dist.broadcast(out, self._global(last), group=self.group)
        return self.boundary.decode(out, values[8]) if self.boundary is not None else out


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
