"""``SequencePacking``: switches the trainer's datamodule to packed rows and logs the padding it saves.

The packing itself lives in :mod:`lightning_llmopt.data.packing`; the datamodule builds the packed datasets.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_llmopt.data.packing import ALGORITHMS


class SequencePacking(L.Callback):
    """Packs documents into rows of the datamodule's ``seq_len`` (per-document positions and doc ids), so no row is
    padded document by document.

    In ``setup`` (after the datamodule's own ``setup``, before any dataloader is built) it calls
    ``trainer.datamodule.enable_packing(algorithm, buffer_size)``; the datamodule must offer that method (as
    :class:`~lightning_llmopt.data.TextDataModule` does). At the start of training it logs
    ``packing/padding_waste_before`` (fraction of padded tokens with one document per row) and
    ``packing/padding_waste_after`` from the datamodule's ``padding_stats``.

    Arguments:
        algorithm: ``"ffd"`` (first-fit decreasing) or ``"best_fit"``.
        buffer_size: documents the streaming packer holds at once.
    """

    def __init__(self, algorithm: str = "ffd", buffer_size: int = 1024) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm ({algorithm!r}) must be one of {ALGORITHMS}")
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size ({buffer_size!r}) must be a positive integer")
        self.algorithm = algorithm
        self.buffer_size = buffer_size
        self.padding_stats: dict[str, float] = {}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None:
            raise ValueError(
                "SequencePacking needs a datamodule that supports packing (e.g. TextDataModule), passed as "
                "trainer.fit(..., datamodule=...); got plain dataloaders"
            )
        enable = getattr(datamodule, "enable_packing", None)
        if not callable(enable):
            raise TypeError(
                f"SequencePacking cannot pack the batches of {type(datamodule).__name__}: it has no "
                "enable_packing(algorithm, buffer_size) method (TextDataModule has one)"
            )
        enable(self.algorithm, self.buffer_size)
        stats = getattr(datamodule, "padding_stats", None)
        self.padding_stats = {k: float(v) for k, v in stats.items()} if stats else {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.padding_stats:
            return
        pl_module.log("packing/padding_waste_before", self.padding_stats["waste_before"], rank_zero_only=True)
        pl_module.log("packing/padding_waste_after", self.padding_stats["waste_after"], rank_zero_only=True)

    @override
    def state_dict(self) -> dict[str, object]:
        return {"algorithm": self.algorithm, "buffer_size": self.buffer_size, "padding_stats": dict(self.padding_stats)}

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        """Warns when the resumed run packs differently (its batches then differ from the saved run's)."""
        saved = (state_dict.get("algorithm"), state_dict.get("buffer_size"))
        if saved != (self.algorithm, self.buffer_size):
            rank_zero_warn(
                f"SequencePacking settings differ from the checkpoint (algorithm, buffer_size: {saved} -> "
                f"{(self.algorithm, self.buffer_size)}); training resumes but will not see the same batches"
            )
        stats = state_dict.get("padding_stats")
        if isinstance(stats, dict) and not self.padding_stats:
            self.padding_stats = {str(k): float(v) for k, v in stats.items()}
