"""Observers: the grid formulas, the three granularities, and that clipping observers reduce the error they
target (reconstruction error for MSE/percentile on heavy-tailed data, softmax KL for the cross-entropy one)."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.quantization import (
    CrossEntropyObserver,
    MinMaxObserver,
    MSEObserver,
    PercentileObserver,
    QuantSpec,
    fake_quantize,
    get_observer,
)
from lightning_llmopt.quantization.spec import qparams_from_range


def test_grid_formulas() -> None:
    # symmetric 4-bit over [-1, 1]: scale = 2 * 1 / 15, zero 8; asymmetric over [0.5, 3.5] widens to [0, 3.5]
    s, z = qparams_from_range(torch.tensor([-1.0]), torch.tensor([1.0]), QuantSpec(4, "tensor"))
    assert torch.allclose(s, torch.tensor([2 / 15])) and z.item() == 8
    s, z = qparams_from_range(torch.tensor([0.5]), torch.tensor([3.5]), QuantSpec(4, "tensor", symmetric=False))
    assert torch.allclose(s, torch.tensor([3.5 / 15])) and z.item() == 0
    s, z = qparams_from_range(torch.tensor([-1.0]), torch.tensor([2.0]), QuantSpec(8, "tensor", symmetric=False))
    assert torch.allclose(s, torch.tensor([3 / 255])) and z.item() == round(1 / (3 / 255))
    s, z = qparams_from_range(torch.zeros(1), torch.zeros(1), QuantSpec(4, "tensor"))  # all zero: no 0/0
    assert s.item() == 1.0


@pytest.mark.parametrize("granularity, shape", [("tensor", (1, 1)), ("channel", (6, 1)), ("group", (6, 4))])
def test_granularity_shapes_and_ranges(granularity: str, shape: tuple[int, int]) -> None:
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    spec = QuantSpec(4, granularity, 16, symmetric=False)
    scale, zero = MinMaxObserver(spec)(w).grid((6, 64))
    assert scale.shape == (6, 1 if granularity != "group" else 4) and zero.shape == scale.shape
    blocks = {"tensor": w.reshape(1, 1, -1), "channel": w.reshape(6, 1, 64), "group": w.reshape(6, 4, 16)}[granularity]
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    assert torch.allclose(scale, ((hi - lo) / 15).expand_as(scale))


def test_minmax_streaming_equals_one_shot() -> None:
    x = torch.randn(8, 32)
    spec = QuantSpec(8, "channel")
    obs = MinMaxObserver(spec)
    obs.update(x[:, :10])
    obs.update(x[:, 10:])
    one = MinMaxObserver(spec)(x)
    assert torch.equal(obs.qparams().scale, one.scale)


def _recon_error(x: torch.Tensor, spec: QuantSpec, observer: str, **kw) -> float:
    qp = get_observer(observer, spec, **kw)(x)
    rows = x.reshape(-1, spec.group_size) if spec.granularity == "group" else x
    return float((fake_quantize(rows, qp.scale, qp.zero, spec.maxq) - rows).pow(2).mean())


def test_clipping_observers_beat_minmax_on_heavy_tails() -> None:
    torch.manual_seed(0)
    w = torch.distributions.Laplace(0.0, 1.0).sample((64, 256))  # heavy-ish tails, as trained weights have
    # per tensor the min/max range is set by a handful of extreme values (16k samples): clipping pays a lot
    spec = QuantSpec(4, "tensor")
    minmax = _recon_error(w, spec, "minmax")
    assert _recon_error(w, spec, "mse") < 0.5 * minmax
    assert _recon_error(w, spec, "percentile", percentile=0.999) < 0.75 * minmax
    # per channel (256 values a row) the gain is smaller but still there
    spec = QuantSpec(4, "channel")
    assert _recon_error(w, spec, "mse") < 0.9 * _recon_error(w, spec, "minmax")


def test_percentile_matches_torch_quantile() -> None:
    x = torch.randn(5, 101, generator=torch.Generator().manual_seed(1))
    obs = PercentileObserver(QuantSpec(8, "channel", symmetric=False), percentile=0.95)
    lo, hi = obs._range(x)
    assert torch.allclose(lo, torch.quantile(x, 0.05, dim=1)) and torch.allclose(hi, torch.quantile(x, 0.95, dim=1))


def _kl(x: torch.Tensor, spec: QuantSpec, qp) -> float:  # type: ignore[no-untyped-def]
    q = fake_quantize(x, qp.scale, qp.zero, spec.maxq)
    logp, logq = torch.log_softmax(x, -1), torch.log_softmax(q, -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def test_cross_entropy_observer_lowers_softmax_kl() -> None:
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(64, 128, generator=g) * 2.0
    scores[:, :8] -= 60.0  # masked-ish keys: a long negative tail the softmax ignores
    spec = QuantSpec(4, "tensor", symmetric=False)
    obs = CrossEntropyObserver(spec)
    obs.update(scores[:32])
    obs.update(scores[32:])
    ce = _kl(scores, spec, obs.qparams())
    assert ce < 0.5 * _kl(scores, spec, MinMaxObserver(spec)(scores))
    assert ce <= _kl(scores, spec, MSEObserver(spec)(scores))


def test_observer_errors() -> None:
    with pytest.raises(ValueError, match="tensor"):
        CrossEntropyObserver(QuantSpec(4, "group"))
    with pytest.raises(ValueError, match="must be one of"):
        get_observer("nope", QuantSpec())
    with pytest.raises(RuntimeError, match="before any update"):
        MSEObserver(QuantSpec()).qparams()
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=9)
