"""Stage boundaries of pipeline x tensor (+ sequence) parallelism: what crosses between stages is a plain tensor.

``torch.distributed.pipelining`` sends and receives plain tensors between the pipeline ranks of one tensor-parallel
coordinate (the ``"pp"`` group of a rank: same ``dp``, ``cp`` and ``tp`` coordinates), and hands the last stage's
output to the loss. Under :func:`~lightning_llmopt.parallel.tensor_parallel.apply_tp` a block already returns a plain
local tensor (``RowwiseParallel`` outputs are local), so the boundaries are:

- between stages: ``(B, T, D)`` replicated over ``tp`` without sequence parallelism; ``(B, T / tp, D)``, this rank's
  sequence shard, with it (the sequence-sharded activation is what is sent: ``tp`` times less traffic, Megatron's
  scatter/gather saving for free). Gradients travel back with the same shapes;
- the last stage's output: with ``loss_parallel`` a DTensor ``(B, T, V)`` sharded on the vocabulary. A forward hook
  returns its local shard ``(B, T, V / tp)`` to the schedule and :meth:`TPStageBoundary.wrap` rebuilds the DTensor
  (same mesh and placements) before the loss sees it, so the vocab-parallel cross-entropy runs on the last stage as
  without pipelining; validation broadcasts the local shard over ``"pp"`` and every rank rebuilds it on its own
  ``"tp"`` mesh (:meth:`TPStageBoundary.encode` / :meth:`TPStageBoundary.decode`).

Sequence parallelism on a stage without the embedding: the model derives the row length, the positions and the
causal mask from its input's shape, so a stage that receives ``(B, T / tp, D)`` would see ``T / tp``. A forward
pre-hook on the stage module gives it ``tp`` copies of the shard along the sequence (``(B, T, D)``, no
communication) and one on the stage's first block takes the first copy back, which is exactly the shard the block
expects under sequence parallelism. Only that block reads the stage input, so the other copies receive zero gradient
and the input gradient is the shard's (``repeat``'s backward sums the copies).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_llmopt.parallel.pipeline_split import StageSplit

__all__ = ["TPStageBoundary"]


def _dtensor_cls() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


class TPStageBoundary:
    """Hooks that keep pipeline stage boundaries plain tensors under tensor parallelism (see the module docstring).

    Arguments:
        tp_mesh: this rank's 1-D tensor-parallel ``DeviceMesh`` (``mesh["tp"]``).
        sequence_parallel: the model was parallelised with ``sequence_parallel=True``.
    """

    def __init__(self, tp_mesh: Any, sequence_parallel: bool) -> None:
        self.tp_mesh, self.sequence_parallel = tp_mesh, sequence_parallel
        self.tp = int(tp_mesh.size())
        self._placements: tuple[Any, ...] | None = None  # of the last stage's DTensor output, set by its hook

    def install(self, modules: dict[int, nn.Module], split: StageSplit) -> None:
        """Register the hooks on this rank's stage modules (``{stage index: module}`` of an apply_tp'd model)."""
        last = split.num_stages - 1
        for s, module in modules.items():
            if s > 0 and self.sequence_parallel and self.tp > 1:
                model = getattr(module, "stage_model", module)  # a HiddenStage holds the stage's model
                blocks: Any = model.get_submodule("layers")
                first_block = blocks[str(split.ranges[s][0])]
                module.register_forward_pre_hook(self._full_length)
                first_block.register_forward_pre_hook(self._first_copy)
            if s == last:
                module.register_forward_hook(self._local_output)

    # ------------------------------------------------------------------ hooks
    def _full_length(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        h = args[0]  # (B, T / tp, D): this rank's sequence shard from the previous stage
        return (h.repeat(1, self.tp, 1), *args[1:])  # (B, T, D): tp copies, so the model sees the row length T

    def _first_copy(self, block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]  # (B, T, D) from _full_length
        return (x[:, : x.shape[1] // self.tp], *args[1:])  # (B, T / tp, D): the shard itself

    def _local_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, _dtensor_cls()):
            return None
        from torch.distributed.tensor import Shard

        placements = tuple(output.placements)
        if output.device_mesh.ndim != 1 or not (placements[0].is_shard() or placements[0].is_replicate()):
            return output.full_tensor()  # not produced by our plans; sent whole
        if placements[0].is_shard():
            placements = (Shard(placements[0].dim % output.ndim),)  # Shard(-1) -> Shard(ndim - 1)
        self._placements = placements
        return output.to_local()  # (B, T, V / tp) under loss_parallel

    # ------------------------------------------------------------------ last stage output
    def wrap(self, output: Any) -> Any:
        """The last stage's output as the model returned it (the DTensor rebuilt from the local shard)."""
        if self._placements is None or not isinstance(output, Tensor) or isinstance(output, _dtensor_cls()):
            return output
        return _dtensor_cls().from_local(output, self.tp_mesh, self._placements, run_check=False)

    def encode(self) -> int:
        """Layout code of the last stage's output for the validation broadcast: 0 plain, 1 replicated, 2 + d sharded
        on dimension ``d`` over ``"tp"``."""
        if self._placements is None:
            return 0
        (placement,) = self._placements
        return 2 + int(placement.dim) if placement.is_shard() else 1

    def decode(self, local: Tensor, code: int) -> Any:
        """Rebuild on this rank's ``"tp"`` mesh the output broadcast with layout ``code``."""
        if code == 0:
            return local
        from torch.distributed.tensor import Replicate, Shard

        placement = Replicate() if code == 1 else Shard(code - 2)
        return _dtensor_cls().from_local(local, self.tp_mesh, (placement,), run_check=False)
