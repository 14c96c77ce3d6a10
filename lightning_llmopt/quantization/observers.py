"""Observers: choose the quantization range (hence scale and zero point) of a tensor.

Every observer reduces the rows of :func:`~lightning_llmopt.quantization.spec.rows_view` (one row per tensor,
output channel or group; see :class:`~lightning_llmopt.quantization.spec.QuantSpec`) to a range ``[lo, hi]`` and
turns it into ``(scale, zero)`` with :func:`~lightning_llmopt.quantization.spec.qparams_from_range`.

- :class:`MinMaxObserver`: the full range, no clipping (round-to-nearest's usual choice).
- :class:`MSEObserver`: the range shrunk by the factor in ``[1 - max_shrink, 1]`` that minimises
  ``sum |x - Q(x)|^norm`` per row (grid search; GPTQ's reference code searches the same way with norm 2.4).
- :class:`PercentileObserver`: ``lo``/``hi`` at the ``(1 - p)`` and ``p`` quantiles of each row, clipping outliers.
- :class:`CrossEntropyObserver`: for tensors that feed a softmax (attention scores, logits): the clipping of the
  upper and lower ends that minimises ``KL(softmax(x) || softmax(Q(x)))`` over the last dimension. Large negative
  inputs barely matter after the softmax, so the lower end is usually clipped hard; the error near the maximum is
  what the softmax sees.

Observers are used two ways: one call on a weight (``observer(w) -> QParams``), or streaming over activations
(``observer.update(x)`` per batch, then ``observer.qparams()``). Min/max streams its running extremes; the others
keep the observed values (rows must match across calls for channel/group granularity; activations are usually
per-tensor) up to ``max_samples`` elements, beyond which rows are subsampled with a fixed seed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.quantization.spec import QParams, QuantSpec, fake_quantize, qparams_from_range, rows_view


class Observer:
    """Base class: ``update`` accumulates, ``qparams`` returns the result, ``__call__`` does both at once.

    Arguments:
        spec: the :class:`QuantSpec` (bits, granularity, symmetry) the range is chosen for.
    """

    name = "base"

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        self._rows: Tensor | None = None

    def update(self, x: Tensor) -> None:
        rows = rows_view(x.detach(), self.spec).float()
        self._rows = rows if self._rows is None else torch.cat([self._rows, rows], dim=1)

    def _data(self) -> Tensor:
        if self._rows is None:
            raise RuntimeError(f"{type(self).__name__}.qparams() called before any update()")
        return self._rows

    def _range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def qparams(self) -> QParams:
        lo, hi = self._range(self._data())
        scale, zero = qparams_from_range(lo, hi, self.spec)
        return QParams(scale[:, None], zero[:, None], self.spec)

    def __call__(self, x: Tensor) -> QParams:
        """One-shot: the qparams of ``x`` alone (state is reset first)."""
        self.reset()
        self.update(x)
        out = self.qparams()
        self.reset()
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.describe()})"


def _minmax(rows: Tensor) -> tuple[Tensor, Tensor]:
    return rows.amin(dim=1), rows.amax(dim=1)


class MinMaxObserver(Observer):
    """Full range of each row; streams running extremes."""

    name = "minmax"

    def reset(self) -> None:
        self._lo: Tensor | None = None
        self._hi: Tensor | None = None

    def update(self, x: Tensor) -> None:
        lo, hi = _minmax(rows_view(x.detach(), self.spec).float())
        self._lo = lo if self._lo is None else torch.minimum(self._lo, lo)
        self._hi = hi if self._hi is None else torch.maximum(self._hi, hi)

    def qparams(self) -> QParams:
        if self._lo is None or self._hi is None:
            raise RuntimeError("MinMaxObserver.qparams() called before any update()")
        scale, zero = qparams_from_range(self._lo, self._hi, self.spec)
        return QParams(scale[:, None], zero[:, None], self.spec)


class _SampledObserver(Observer):
    """Keeps observed values (subsampling columns beyond ``max_samples`` elements in all)."""

    def __init__(self, spec: QuantSpec, max_samples: int = 1 << 22) -> None:
        self.max_samples = max_samples
        super().__init__(spec)

    def update(self, x: Tensor) -> None:
        super().update(x)
        rows = self._data()
        if rows.numel() > self.max_samples:
            keep = max(1, self.max_samples // rows.shape[0])
            g = torch.Generator(device="cpu").manual_seed(rows.shape[1])
            idx = torch.randperm(rows.shape[1], generator=g)[:keep].to(rows.device)
            self._rows = rows[:, idx]


class MSEObserver(_SampledObserver):
    """Per row, the shrink ``p`` of the min/max range minimising ``sum |x - Q(x)|^norm``.

    Arguments:
        grid: number of shrink factors tried, evenly spaced in ``[1 - max_shrink, 1]`` (1 included, so the result
            is never worse than min/max on the observed data).
        max_shrink: largest fraction of the range cut off.
        norm: exponent of the error (2 = mean squared error).
    """

    name = "mse"

    def __init__(
        self, spec: QuantSpec, grid: int = 80, max_shrink: float = 0.8, norm: float = 2.0, max_samples: int = 1 << 22
    ) -> None:
        if grid < 1 or not 0.0 <= max_shrink < 1.0:
            raise ValueError(f"grid ({grid}) must be >= 1 and max_shrink ({max_shrink}) in [0, 1)")
        self.grid, self.max_shrink, self.norm = grid, max_shrink, norm
        super().__init__(spec, max_samples)

    def _range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        lo0, hi0 = _minmax(rows)
        best_lo, best_hi = lo0.clone(), hi0.clone()
        best_err = torch.full_like(lo0, float("inf"))
        for i in range(self.grid):
            p = 1.0 - self.max_shrink * i / max(1, self.grid - 1) if self.grid > 1 else 1.0
            lo, hi = lo0 * p, hi0 * p
            scale, zero = qparams_from_range(lo, hi, self.spec)
            q = fake_quantize(rows, scale[:, None], zero[:, None], self.spec.maxq)
            err = (q - rows).abs().pow(self.norm).sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        return best_lo, best_hi


class PercentileObserver(_SampledObserver):
    """``lo``/``hi`` at the ``1 - percentile`` and ``percentile`` quantiles of each row (linear interpolation).

    Arguments:
        percentile: in ``(0.5, 1]``; 1 is min/max.
    """

    name = "percentile"

    def __init__(self, spec: QuantSpec, percentile: float = 0.999, max_samples: int = 1 << 22) -> None:
        if not 0.5 < percentile <= 1.0:
            raise ValueError(f"percentile ({percentile}) must be in (0.5, 1]")
        self.percentile = percentile
        super().__init__(spec, max_samples)

    def _range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        s = rows.sort(dim=1).values
        n = s.shape[1]

        def at(q: float) -> Tensor:
            pos = q * (n - 1)
            i0 = int(pos)
            i1 = min(i0 + 1, n - 1)
            frac = pos - i0
            return s[:, i0] * (1 - frac) + s[:, i1] * frac

        return at(1.0 - self.percentile), at(self.percentile)


class CrossEntropyObserver(_SampledObserver):
    """Clipping that minimises ``KL(softmax(x) || softmax(Q(x)))`` over the last dimension (softmax inputs).

    Tries ``hi * a`` for ``grid`` values of ``a`` in ``[1 - max_shrink, 1]`` and, for asymmetric grids, ``lo * b``
    for ``grid`` values of ``b`` in ``[0.05, 1]`` (all pairs); symmetric grids shrink the absolute maximum only.
    Only per-tensor granularity: the softmax couples a whole row.

    ``update`` reshapes its input to rows of the first input's last dimension (the softmax dimension).

    Arguments:
        grid: factors tried per end.
        max_shrink: largest fraction of the upper end cut off.
    """

    name = "cross_entropy"

    def __init__(self, spec: QuantSpec, grid: int = 12, max_shrink: float = 0.5, max_samples: int = 1 << 20) -> None:
        if spec.granularity != "tensor":
            raise ValueError(f"CrossEntropyObserver supports granularity 'tensor' only, got {spec.granularity!r}")
        self.grid, self.max_shrink = grid, max_shrink
        super().__init__(spec, max_samples)

    def reset(self) -> None:
        self._softmax_rows: Tensor | None = None
        self._width: int | None = None

    def update(self, x: Tensor) -> None:
        width = self._width or x.shape[-1]
        self._width = width
        rows = x.detach().float().reshape(-1, width)
        self._softmax_rows = rows if self._softmax_rows is None else torch.cat([self._softmax_rows, rows])
        if self._softmax_rows.numel() > self.max_samples:
            keep = max(1, self.max_samples // width)
            g = torch.Generator(device="cpu").manual_seed(self._softmax_rows.shape[0])
            idx = torch.randperm(self._softmax_rows.shape[0], generator=g)[:keep].to(rows.device)
            self._softmax_rows = self._softmax_rows[idx]

    def _kl(self, x: Tensor, logp: Tensor, lo: float, hi: float) -> float:
        scale, zero = qparams_from_range(torch.tensor([lo]), torch.tensor([hi]), self.spec)
        q = fake_quantize(x, scale.to(x.device), zero.to(x.device), self.spec.maxq)
        logq = torch.log_softmax(q, dim=-1)
        return float((logp.exp() * (logp - logq)).sum(-1).mean())

    def qparams(self) -> QParams:
        if self._softmax_rows is None:
            raise RuntimeError("CrossEntropyObserver.qparams() called before any update()")
        x = self._softmax_rows
        logp = torch.log_softmax(x, dim=-1)
        lo0, hi0 = float(x.min()), float(x.max())
        hi_factors = [1.0 - self.max_shrink * i / max(1, self.grid - 1) for i in range(self.grid)]
        lo_factors = [1.0 - 0.95 * i / max(1, self.grid - 1) for i in range(self.grid)]
        best = (float("inf"), lo0, hi0)
        for a in hi_factors:
            for b in [a] if self.spec.symmetric else lo_factors:
                kl = self._kl(x, logp, lo0 * b, hi0 * a)
                if kl < best[0]:
                    best = (kl, lo0 * b, hi0 * a)
        self.best_kl = best[0]
        scale, zero = qparams_from_range(torch.tensor([best[1]]), torch.tensor([best[2]]), self.spec)
        return QParams(scale[:, None].to(x.device), zero[:, None].to(x.device), self.spec)


OBSERVERS: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "mse": MSEObserver,
    "percentile": PercentileObserver,
    "cross_entropy": CrossEntropyObserver,
}


def get_observer(name: str | Observer, spec: QuantSpec, **kwargs: Any) -> Observer:
    """An observer by name (``minmax``, ``mse``, ``percentile``, ``cross_entropy``) for ``spec``, or ``name``
    itself when it already is an :class:`Observer` (its spec must then equal ``spec``)."""
    if isinstance(name, Observer):
        if name.spec != spec:
            raise ValueError(f"observer {name!r} was built for {name.spec}, not {spec}")
        return name
    if name not in OBSERVERS:
        raise ValueError(f"observer ({name!r}) must be one of {sorted(OBSERVERS)}")
    return OBSERVERS[name](spec, **kwargs)


__all__ = [
    "OBSERVERS",
    "CrossEntropyObserver",
    "MSEObserver",
    "MinMaxObserver",
    "Observer",
    "PercentileObserver",
    "get_observer",
]
