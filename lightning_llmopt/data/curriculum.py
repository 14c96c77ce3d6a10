"""Curriculum learning: difficulty scorers, ranks, pacing functions and the curriculum sampler.

A curriculum (Bengio et al. 2009, "Curriculum learning") trains on easy samples first. Here it has three parts:

1. **Difficulty**: a scorer maps a batch of samples ``{"input_ids": (N, T), "labels": (N, T)}`` to ``(N,)`` scores,
   higher = harder; :func:`score_dataset` scores a whole dataset and turns the scores into ranks in ``[0, 1]``.
2. **Pacing**: ``c(t)`` in ``(0, 1]``, the fraction of easiest samples available at optimizer step ``t``
   (:mod:`lightning_llmopt.data.curriculum_pacing`: :func:`linear`, :func:`root`, :func:`staged`).
3. **Order**: :class:`CurriculumSampler` (:mod:`lightning_llmopt.data.curriculum_sampler`) draws step ``t``'s
   samples from the easiest ``c(t)`` fraction, resumable mid-epoch and sharded over ranks.

:func:`seq_len_schedule` is the sequence-length warm-up of Li et al. 2022. Framework-free: no Lightning imports; the
Lightning side is :class:`lightning_llmopt.callbacks.curriculum.Curriculum`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sized
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import default_collate

from lightning_llmopt.data.chunks import ChunkDataset
from lightning_llmopt.data.curriculum_pacing import (
    LinearPacing,
    Pacing,
    RootPacing,
    SeqLenSchedule,
    StagedPacing,
    linear,
    pacing_params,
    root,
    seq_len_schedule,
    staged,
)
from lightning_llmopt.data.curriculum_sampler import CurriculumSampler, CurriculumSamplerFactory

__all__ = [
    "SCORERS",
    "CurriculumSampler",
    "CurriculumSamplerFactory",
    "LinearPacing",
    "Pacing",
    "RootPacing",
    "SeqLenSchedule",
    "StagedPacing",
    "count_syllables",
    "difficulty_ranks",
    "flesch_kincaid_grade",
    "length_scores",
    "lexical_diversity_scores",
    "linear",
    "make_scorer",
    "pacing_params",
    "readability_scores",
    "reference_loss_scores",
    "root",
    "score_dataset",
    "seq_len_schedule",
    "staged",
]

Scorer = Callable[[dict[str, Tensor]], Tensor]
SCORERS = ("length", "lexical_diversity", "readability", "reference_loss")
IGNORE_INDEX = -100

_WORD = re.compile(r"[^\W\d_]+")  # runs of letters (any script)
_SENTENCE_END = re.compile(r"[.!?]+")
_VOWEL_GROUP = re.compile(r"[aeiouy]+")


class _Decoder(Protocol):
    def decode(self, ids: Any) -> str: ...


# ------------------------------------------------------------------ token-level scorers


def length_scores(input_ids: Tensor, pad_id: int | None = None, eos_id: int | None = None) -> Tensor:
    """Length of the longest document piece in each sample: ``(N, T)`` ids -> ``(N,)`` float64.

    The sample is split at ``eos_id`` tokens (which are not counted); ``pad_id`` tokens are not counted either. With
    neither id the score is ``T`` for every sample. A chunk made of several short documents is easier than one inside
    a long document; a padded short sample is easier than a long one.
    """
    ids = input_ids.long()
    n, t = ids.shape
    counted = torch.ones_like(ids, dtype=torch.bool)
    segment = torch.zeros_like(ids)
    if eos_id is not None:
        is_eos = ids == eos_id
        counted &= ~is_eos
        segment = torch.cumsum(is_eos.long(), dim=1)  # (N, T) in [0, T]
    if pad_id is not None:
        counted &= ids != pad_id
    flat = torch.arange(n).unsqueeze(1) * (t + 1) + segment  # (N, T) one bin per (sample, segment)
    sizes = torch.bincount(flat[counted], minlength=n * (t + 1)).view(n, t + 1)
    return sizes.max(dim=1).values.double()


def lexical_diversity_scores(input_ids: Tensor, pad_id: int | None = None) -> Tensor:
    """Type-token ratio (distinct tokens / tokens, pad excluded) per sample: ``(N, T)`` -> ``(N,)`` float64 in
    ``[0, 1]``; higher = more varied = harder. A sample of only padding scores 0."""
    ids = input_ids.long()
    valid = torch.ones_like(ids, dtype=torch.bool) if pad_id is None else ids != pad_id
    masked = torch.where(valid, ids, torch.full_like(ids, -1))
    s = torch.sort(masked, dim=1).values
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    distinct = (new & (s != -1)).sum(dim=1).double()
    return distinct / valid.sum(dim=1).clamp(min=1).double()


# ------------------------------------------------------------------ readability


def count_syllables(word: str) -> int:
    """Syllables estimated as groups of consecutive vowels (``aeiouy``), minus a silent final ``e`` (not after
    ``l``, as in "table"), at least 1."""
    w = word.lower()
    count = len(_VOWEL_GROUP.findall(w))
    if count > 1 and w.endswith("e") and not w.endswith(("le", "ee")):
        count -= 1
    return max(1, count)


def flesch_kincaid_grade(text: str) -> float:
    """Flesch-Kincaid grade level (Kincaid et al. 1975)::

        grade = 0.39 * words / sentences + 11.8 * syllables / words - 15.59

    Words are runs of letters; sentences are runs of ``.``, ``!`` or ``?`` (at least 1); syllables come from
    :func:`count_syllables`. Text without words scores 0.
    """
    words = _WORD.findall(text)
    if not words:
        return 0.0
    sentences = max(1, len(_SENTENCE_END.findall(text)))
    syllables = sum(count_syllables(w) for w in words)
    return 0.39 * len(words) / sentences + 11.8 * syllables / len(words) - 15.59


def readability_scores(input_ids: Tensor, tokenizer: _Decoder) -> Tensor:
    """:func:`flesch_kincaid_grade` of each decoded sample: ``(N, T)`` -> ``(N,)`` float64; higher = harder."""
    grades = [flesch_kincaid_grade(tokenizer.decode(row)) for row in input_ids.tolist()]
    return torch.tensor(grades, dtype=torch.float64)


# ------------------------------------------------------------------ reference model


@torch.no_grad()
def reference_loss_scores(batch: dict[str, Tensor], model: torch.nn.Module) -> Tensor:
    """Mean next-token cross-entropy of ``model`` on each sample: ``(N,)`` float64; higher = harder.

    ``model(input_ids)`` must return logits ``(N, T, V)`` (or an object with ``.logits``). Uses ``batch["labels"]``
    (``-100`` ignored) when present, else predicts ``input_ids[:, 1:]`` from ``input_ids[:, :-1]``. Runs in eval mode
    under ``no_grad`` on the model's device; the model's training flag is restored afterwards.
    """
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    ids = batch["input_ids"].to(device)
    labels = batch.get("labels")
    if labels is None:
        ids, labels = ids[:, :-1], ids[:, 1:]
    labels = labels.to(device)
    was_training = model.training
    model.eval()
    try:
        out = model(ids)
    finally:
        model.train(was_training)
    logits = getattr(out, "logits", out)  # (N, T, V)
    loss = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    mask = labels != IGNORE_INDEX  # (N, T)
    return ((loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).double().cpu()


# ------------------------------------------------------------------ datasets


def make_scorer(
    scorer: str | Scorer,
    *,
    tokenizer: _Decoder | None = None,
    model: torch.nn.Module | None = None,
    pad_id: int | None = None,
    eos_id: int | None = None,
) -> Scorer:
    """A batch scorer ``{"input_ids": (N, T), ...} -> (N,)`` from a name in :data:`SCORERS` or a callable.

    Arguments:
        scorer: ``"length"``, ``"lexical_diversity"``, ``"readability"`` (needs ``tokenizer``),
            ``"reference_loss"`` (needs ``model``), or a callable taking the batch dict.
        tokenizer: anything with ``decode(ids) -> str``.
        model: the reference model for ``"reference_loss"``.
        pad_id, eos_id: token ids excluded from counts (see :func:`length_scores`).
    """
    if callable(scorer):
        return scorer
    if scorer == "length":
        return lambda b: length_scores(b["input_ids"], pad_id=pad_id, eos_id=eos_id)
    if scorer == "lexical_diversity":
        return lambda b: lexical_diversity_scores(b["input_ids"], pad_id=pad_id)
    if scorer == "readability":
        if tokenizer is None:
            raise ValueError("scorer 'readability' needs a tokenizer to decode the samples")
        tok = tokenizer
        return lambda b: readability_scores(b["input_ids"], tok)
    if scorer == "reference_loss":
        if model is None:
            raise ValueError("scorer 'reference_loss' needs a reference model (reference_model=...)")
        ref = model
        return lambda b: reference_loss_scores(b, ref)
    raise ValueError(f"unknown scorer {scorer!r}; expected one of {SCORERS} or a callable")


def difficulty_ranks(scores: Tensor, seed: int = 0) -> Tensor:
    """Ordinal ranks of ``scores`` scaled to ``[0, 1]``: ``(N,)`` -> ``(N,)`` float64, easiest 0, hardest 1.

    Rank ``i / (N - 1)`` goes to the ``i``-th smallest score; equal scores are ordered by a permutation seeded with
    ``seed``, so ties do not favour low dataset indices. All ranks are distinct (a single sample gets 0).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape (N,), got {tuple(scores.shape)}")
    n = scores.numel()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    order = perm[torch.sort(scores.double()[perm], stable=True).indices]  # (N,) easiest first
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64) / max(n - 1, 1)
    return ranks


def _batch(dataset: Sized, lo: int, hi: int) -> dict[str, Tensor]:
    if isinstance(dataset, ChunkDataset):  # slice the chunks instead of hi - lo __getitem__ calls
        rows = dataset.chunks[lo:hi].long()  # (n, T + 1)
        return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}
    items = [dataset[i] for i in range(lo, hi)]  # type: ignore[index]
    batch = default_collate(items)
    return batch if isinstance(batch, dict) else {"input_ids": batch}


def score_dataset(
    dataset: Sized,
    scorer: str | Scorer,
    *,
    tokenizer: _Decoder | None = None,
    model: torch.nn.Module | None = None,
    pad_id: int | None = None,
    eos_id: int | None = None,
    batch_size: int = 256,
    normalize: bool = True,
    tie_seed: int = 0,
) -> Tensor:
    """Difficulty of every sample of ``dataset``, scored in batches.

    Arguments:
        dataset: map-style; items are ``{"input_ids": (T,), "labels": (T,)}`` dicts or ``(T,)`` id tensors.
        scorer, tokenizer, model, pad_id, eos_id: see :func:`make_scorer`.
        batch_size: samples per scorer call (bounds the reference model's memory).
        normalize: return :func:`difficulty_ranks` (in ``[0, 1]``) instead of the raw scores.
        tie_seed: orders equal scores (see :func:`difficulty_ranks`).

    Returns:
        ``(len(dataset),)`` float64 tensor; higher = harder.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size ({batch_size}) must be positive")
    n = len(dataset)
    if n == 0:
        raise ValueError("dataset is empty: nothing to score")
    fn = make_scorer(scorer, tokenizer=tokenizer, model=model, pad_id=pad_id, eos_id=eos_id)
    parts = []
    for lo in range(0, n, batch_size):
        hi = min(n, lo + batch_size)
        part = torch.as_tensor(fn(_batch(dataset, lo, hi))).double().reshape(-1)
        if part.numel() != hi - lo:
            raise ValueError(f"scorer returned {part.numel()} scores for a batch of {hi - lo} samples")
        parts.append(part)
    scores = torch.cat(parts)
    if not bool(torch.isfinite(scores).all()):
        bad = int((~torch.isfinite(scores)).nonzero()[0])
        raise ValueError(f"scorer gave a non-finite score ({float(scores[bad])}) to sample {bad}")
    return difficulty_ranks(scores, seed=tie_seed) if normalize else scores
