"""``Curriculum``: easy-to-hard sample order and sequence-length warm-up, installed into a ``TextDataModule``.

A thin adapter: scoring, ranks, pacing and the sampler live in :mod:`lightning_llmopt.data.curriculum`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_llmopt.data.curriculum import (
    SCORERS,
    CurriculumSampler,
    CurriculumSamplerFactory,
    Pacing,
    SeqLenSchedule,
    linear,
    pacing_params,
    root,
    score_dataset,
    seq_len_schedule,
    staged,
)

PACINGS = ("linear", "root", "staged")
TRUNCATED_KEYS = ("input_ids", "labels", "positions", "doc_ids")


def _name(obj: Any) -> str:
    return obj if isinstance(obj, str) else f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"


class Curriculum(L.Callback):
    """Curriculum learning for datamodules with a ``sampler_factory`` hook (:class:`TextDataModule`).

    In ``setup("fit")``, before the train dataloader is built, it scores the datamodule's ``train_dataset``, turns the
    scores into ranks in ``[0, 1]``, and sets ``datamodule.sampler_factory`` so that the train loader draws step
    ``t``'s samples from the easiest ``c(t)`` fraction (:class:`CurriculumSampler`; exactly resumable mid-epoch,
    sharded over ranks). The original factory is put back in ``teardown``. With ``seq_len_warmup`` it also truncates
    every training batch to the warm-up length of Li et al. 2022 in ``on_train_batch_start`` (the batch dict is
    modified in place; Lightning passes that same dict to ``training_step``). Logs ``curriculum/competence`` and, with
    the warm-up, ``curriculum/seq_len``.

    Arguments:
        scorer: ``"length"``, ``"lexical_diversity"``, ``"readability"``, ``"reference_loss"``, or a callable
            ``{"input_ids": (N, T), "labels": (N, T)} -> (N,)`` scores, higher = harder.
        pacing: ``"linear"``, ``"root"``, ``"staged"``, or a callable ``step -> competence in (0, 1]``.
        c0: initial competence of ``"linear"``/``"root"``.
        total_steps: step at which ``"linear"``/``"root"`` reach full competence; ``None``: ``trainer.max_steps``.
        stages: ``[(start_step, fraction), ...]`` for ``"staged"``, starting at step 0.
        p: the root of ``"root"`` (2: square root).
        seq_len_warmup: ``(start_len, warmup_steps)``: sequence length grows from ``start_len`` to the full length
            over ``warmup_steps`` steps, in multiples of ``multiple_of``; ``None``: no warm-up.
        multiple_of: rounding of the warm-up length.
        reference_model: the model of ``"reference_loss"``; moved to the training device while scoring.
        score_batch_size: samples per scorer call.
        tie_seed: orders samples of equal score.
    """

    def __init__(
        self,
        scorer: str | Callable[[dict[str, Tensor]], Tensor] = "length",
        pacing: str | Pacing = "linear",
        c0: float = 0.1,
        total_steps: int | None = None,
        stages: list[tuple[int, float]] | None = None,
        p: float = 2.0,
        seq_len_warmup: tuple[int, int] | None = None,
        multiple_of: int = 8,
        reference_model: torch.nn.Module | None = None,
        score_batch_size: int = 256,
        tie_seed: int = 0,
    ) -> None:
        if isinstance(scorer, str) and scorer not in SCORERS:
            raise ValueError(f"scorer ({scorer!r}) must be one of {SCORERS} or a callable")
        if scorer == "reference_loss" and reference_model is None:
            raise ValueError("scorer='reference_loss' needs reference_model")
        if isinstance(pacing, str) and pacing not in PACINGS:
            raise ValueError(f"pacing ({pacing!r}) must be one of {PACINGS} or a callable")
        if pacing == "staged" and not stages:
            raise ValueError("pacing='staged' needs stages=[(start_step, fraction), ...]")
        if not 0.0 < c0 <= 1.0:
            raise ValueError(f"c0 ({c0!r}) must be in (0, 1]")
        if total_steps is not None and total_steps <= 0:
            raise ValueError(f"total_steps ({total_steps!r}) must be positive or None")
        if seq_len_warmup is not None and (len(seq_len_warmup) != 2 or seq_len_warmup[0] < 1 or seq_len_warmup[1] < 0):
            raise ValueError(f"seq_len_warmup ({seq_len_warmup!r}) must be (start_len >= 1, warmup_steps >= 0)")
        self.scorer = scorer
        self.pacing = pacing
        self.c0 = c0
        self.total_steps = total_steps
        self.stages = stages
        self.p = p
        self.seq_len_warmup = seq_len_warmup
        self.multiple_of = multiple_of
        self.reference_model = reference_model
        self.score_batch_size = score_batch_size
        self.tie_seed = tie_seed
        self.difficulty: Tensor | None = None
        self.pacing_fn: Pacing | None = None
        self.seq_schedule: SeqLenSchedule | None = None
        self.scores_hash: str | None = None
        self._original_factory: Any = None
        self._loaded: dict[str, Any] | None = None

    # ------------------------------------------------------------------ setup
    def _build_pacing(self, trainer: L.Trainer) -> Pacing:
        if callable(self.pacing):
            return self.pacing
        if self.pacing == "staged":
            assert self.stages is not None
            return staged(self.stages)
        total = self.total_steps or (trainer.max_steps if trainer.max_steps > 0 else None)
        if total is None:
            raise ValueError(
                f"pacing={self.pacing!r} needs total_steps: pass Curriculum(total_steps=...) or set "
                f"Trainer(max_steps=...) (max_steps is {trainer.max_steps})"
            )
        return linear(self.c0, total) if self.pacing == "linear" else root(self.c0, total, self.p)

    def _score(self, trainer: L.Trainer, datamodule: Any) -> Tensor:
        tokenizer = getattr(datamodule, "tokenizer", None)
        model = self.reference_model
        param = None if model is None else next(iter(model.parameters()), None)
        home = None if param is None else param.device
        if model is not None:
            model.to(trainer.strategy.root_device)
        try:
            ranks = score_dataset(
                datamodule.train_dataset,
                self.scorer,
                tokenizer=tokenizer,
                model=model,
                eos_id=getattr(tokenizer, "eos_id", None),
                batch_size=self.score_batch_size,
                tie_seed=self.tie_seed,
            )
        finally:
            if model is not None and home is not None:
                model.to(home)
        return trainer.strategy.broadcast(ranks, src=0)  # every rank must build the same order

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "sampler_factory"):
            raise TypeError(
                f"Curriculum needs a datamodule with a `sampler_factory` hook (e.g. TextDataModule), got "
                f"{type(datamodule).__name__}; pass it as trainer.fit(model, datamodule=...)"
            )
        self.pacing_fn = self._build_pacing(trainer)
        self.difficulty = self._score(trainer, datamodule)
        self.scores_hash = hashlib.sha256(self.difficulty.numpy().tobytes()).hexdigest()[:16]
        self._original_factory = datamodule.sampler_factory
        datamodule.sampler_factory = CurriculumSamplerFactory(
            self.difficulty, self.pacing_fn, int(datamodule.batch_size), int(trainer.accumulate_grad_batches)
        )
        if self.seq_len_warmup is not None:
            start, warmup = self.seq_len_warmup
            end = int(getattr(datamodule, "seq_len", start))
            self.seq_schedule = seq_len_schedule(min(start, end), end, warmup, self.multiple_of)
        self._check_resume()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if stage == "fit" and datamodule is not None and self._original_factory is not None:
            datamodule.sampler_factory = self._original_factory
            self._original_factory = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        factory = getattr(getattr(trainer, "datamodule", None), "sampler_factory", None)
        if isinstance(sampler, CurriculumSampler) and isinstance(factory, CurriculumSamplerFactory):
            expected = factory.batches_per_epoch(len(sampler.order), sampler.num_replicas)
            if trainer.num_training_batches != expected:
                rank_zero_warn(
                    f"Curriculum: the trainer runs {trainer.num_training_batches} batches per epoch but the sampler "
                    f"has {expected} (limit_train_batches?): competence steps and optimizer steps drift apart"
                )

    # ------------------------------------------------------------------ per batch
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
            raise TypeError(f"Curriculum expects dict batches with 'input_ids', got {type(batch).__name__}")
        size = batch["input_ids"].shape[0]
        if self.pacing_fn is not None:
            pl_module.log("curriculum/competence", float(self.pacing_fn(step)), on_step=True, batch_size=size)
        if self.seq_schedule is not None:
            length = min(self.seq_schedule(step), batch["input_ids"].shape[-1])
            truncate_batch(batch, length)
            pl_module.log("curriculum/seq_len", float(length), on_step=True, batch_size=size)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        """The scores' hash and the schedule: what decides the sample order and the sequence lengths."""
        return {
            "scores_hash": self.scores_hash,
            "num_samples": None if self.difficulty is None else int(self.difficulty.numel()),
            "scorer": _name(self.scorer),
            "pacing": None if self.pacing_fn is None else pacing_params(self.pacing_fn),
            "seq_len_warmup": None if self.seq_schedule is None else self.seq_schedule.params(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Warns when the resumed run scores or paces differently (it then sees other samples than the saved run)."""
        self._loaded = dict(state_dict)
        self._check_resume()

    def _check_resume(self) -> None:
        if self._loaded is None or self.difficulty is None:
            return  # compared once both the checkpoint and setup are there (Lightning loads after setup)
        current = self.state_dict()
        changed = [f"{k}: {self._loaded.get(k)!r} -> {v!r}" for k, v in current.items() if self._loaded.get(k) != v]
        self._loaded = None
        if changed:
            rank_zero_warn(
                f"Curriculum differs from the checkpoint ({'; '.join(changed)}); training resumes with the new "
                "schedule, so the sample order is not the one of an uninterrupted run"
            )


def truncate_batch(batch: dict[str, Any], length: int) -> None:
    """Cuts ``input_ids``, ``labels``, ``positions`` and ``doc_ids`` (those present) to their first ``length`` tokens,
    in place: ``(B, T)`` -> ``(B, length)``. The dropped tokens are not trained on (Li et al. 2022 truncate too)."""
    if length <= 0:
        raise ValueError(f"length ({length}) must be positive")
    for key in TRUNCATED_KEYS:
        value = batch.get(key)
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[-1] > length:
            batch[key] = value[..., :length].contiguous()
