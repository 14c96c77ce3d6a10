"""Knowledge-distillation losses: response (logit) KL, hidden-state features, attention maps.

- Response KL (Hinton, Vinyals, Dean, arXiv 1503.02531): ``T^2 * KL(softmax(z_t / T) || softmax(z_s / T))`` per
  token, averaged over the labelled tokens; the ``T^2`` factor keeps its gradient scale independent of ``T``.
  :func:`distillation_loss` mixes it with the hard-label cross-entropy: ``alpha * KL + (1 - alpha) * CE``.
- Feature loss (FitNets, Romero et al., arXiv 1412.6550; TinyBERT, Jiao et al., arXiv 1909.10351): mean squared
  error between student hidden states, mapped through a learned linear projection when the widths differ, and the
  teacher's. :class:`FeatureProjector` holds one projection per mapped layer pair.
- Attention-map loss (TinyBERT / MiniLM, Wang et al., arXiv 2002.10957): KL between the teacher's and the student's
  attention probabilities, per head when the head counts agree, else between head-averaged maps. The maps come from
  :mod:`lightning_llmopt.compression.attention_maps`.

All losses compute in fp32 whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100


def _token_mask(labels: Tensor | None, shape: torch.Size) -> Tensor | None:
    if labels is None:
        return None
    if labels.shape != shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the logits' leading shape {tuple(shape)}")
    return labels != IGNORE_INDEX


def kl_distillation_loss(
    student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0, labels: Tensor | None = None
) -> Tensor:
    """``T^2 * mean_t KL(p_teacher,t || p_student,t)`` with ``p = softmax(logits / T)``, fp32 scalar.

    Arguments:
        student_logits: ``(..., V)`` (gradients flow).
        teacher_logits: ``(..., V)`` same shape (treated as constants).
        temperature: ``T > 0``.
        labels: optional ``(...)`` int64; tokens with ``-100`` are left out of the mean (as in the CE loss).
    """
    if temperature <= 0:
        raise ValueError(f"temperature ({temperature}) must be > 0")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ"
        )
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)  # (...)
    mask = _token_mask(labels, per_token.shape)
    if mask is not None:
        per_token = per_token[mask]
    if per_token.numel() == 0:
        return student_logits.float().sum() * 0.0
    return per_token.mean() * temperature**2


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 2.0,
    alpha: float = 0.5,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(alpha * KL_T + (1 - alpha) * CE, KL_T, CE)``: the response loss mixed with the hard-label cross-entropy.

    Arguments:
        student_logits, teacher_logits: ``(B, T, V)``.
        labels: ``(B, T)`` int64 next tokens, ``-100`` ignored (by both terms).
        temperature: softmax temperature of the KL term.
        alpha: weight of the KL term in ``[0, 1]``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha ({alpha}) must be in [0, 1]")
    kl = kl_distillation_loss(student_logits, teacher_logits, temperature, labels)
    ce = F.cross_entropy(student_logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)
    return alpha * kl + (1 - alpha) * ce, kl, ce


def default_layer_map(student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """Student block ``i`` -> teacher block ``round((i + 1) * L_t / L_s) - 1`` (uniform; last maps to last)."""
    if student_layers <= 0 or teacher_layers <= 0:
        raise ValueError(f"layer counts ({student_layers}, {teacher_layers}) must be positive")
    return [(i, max(0, round((i + 1) * teacher_layers / student_layers) - 1)) for i in range(student_layers)]


class FeatureProjector(nn.Module):
    """Learned linear maps from student to teacher hidden width, one per mapped layer pair (identity if equal).

    Arguments:
        student_dim: student hidden width ``d_s``.
        teacher_dim: teacher hidden width ``d_t``.
        num_pairs: number of layer pairs (each gets its own projection).

    Shapes: ``forward(i, h)``: ``(..., d_s)`` -> ``(..., d_t)``.
    """

    def __init__(self, student_dim: int, teacher_dim: int, num_pairs: int) -> None:
        super().__init__()
        self.student_dim, self.teacher_dim = student_dim, teacher_dim
        self.proj = nn.ModuleList(
            [nn.Linear(student_dim, teacher_dim, bias=False) for _ in range(num_pairs)]
            if student_dim != teacher_dim
            else []
        )
        for p in self.proj:
            nn.init.normal_(p.weight, std=student_dim**-0.5)

    def forward(self, index: int, h: Tensor) -> Tensor:
        return self.proj[index](h) if len(self.proj) else h


def feature_loss(
    student_hidden: Sequence[Tensor],
    teacher_hidden: Sequence[Tensor],
    projector: FeatureProjector | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Mean over layer pairs of ``MSE(proj_i(h_s,i), h_t,i)``, fp32 scalar.

    Arguments:
        student_hidden: per pair, ``(B, T, d_s)``.
        teacher_hidden: per pair, ``(B, T, d_t)`` (constants).
        projector: required when ``d_s != d_t``.
        mask: optional ``(B, T)`` bool, the tokens that count.
    """
    if len(student_hidden) != len(teacher_hidden) or not student_hidden:
        raise ValueError(f"need the same non-zero number of layers ({len(student_hidden)} vs {len(teacher_hidden)})")
    total = torch.zeros((), device=student_hidden[0].device)
    for i, (hs, ht) in enumerate(zip(student_hidden, teacher_hidden, strict=True)):
        hs = projector(i, hs.float()) if projector is not None else hs.float()
        if hs.shape != ht.shape:
            raise ValueError(f"pair {i}: student {tuple(hs.shape)} vs teacher {tuple(ht.shape)}: pass a projector")
        err = (hs - ht.detach().float()).pow(2).mean(-1)  # (B, T)
        total = total + (err[mask].mean() if mask is not None else err.mean())
    return total / len(student_hidden)


def attention_map_loss(student_probs: Sequence[Tensor], teacher_probs: Sequence[Tensor], eps: float = 1e-8) -> Tensor:
    """Mean over layer pairs of ``KL(A_t || A_s)`` over keys, averaged over heads and queries, fp32 scalar.

    Arguments:
        student_probs: per pair, ``(B, H_s, T, T)`` attention probabilities (rows sum to 1 over visible keys).
        teacher_probs: per pair, ``(B, H_t, T, T)``. When ``H_s != H_t`` both are averaged over heads first.
        eps: floor inside the logarithms (masked keys have probability 0 on both sides and contribute 0).
    """
    if len(student_probs) != len(teacher_probs) or not student_probs:
        raise ValueError(f"need the same non-zero number of layers ({len(student_probs)} vs {len(teacher_probs)})")
    total = torch.zeros((), device=student_probs[0].device)
    for a_s, a_t in zip(student_probs, teacher_probs, strict=True):
        a_s, a_t = a_s.float(), a_t.detach().float()
        if a_s.shape[1] != a_t.shape[1]:
            a_s, a_t = a_s.mean(1, keepdim=True), a_t.mean(1, keepdim=True)
        kl = (a_t * ((a_t + eps).log() - (a_s + eps).log())).sum(-1)  # (B, H, T)
        total = total + kl.mean()
    return total / len(student_probs)


__all__ = [
    "FeatureProjector",
    "attention_map_loss",
    "default_layer_map",
    "distillation_loss",
    "feature_loss",
    "kl_distillation_loss",
]
