"""GPTQ and round to nearest: the layer objective GPTQ minimises is lower than RTN's on correlated inputs, the
Hessian is ``2 X^T X / n``, and ``quantize_model`` works on our Llama (sequentially, block by block)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.quantization import (
    HessianAccumulator,
    QuantConfig,
    QuantSpec,
    causal_lm_loss,
    gptq_quantize,
    quantize_model,
    rtn_quantize,
)


def _correlated_inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """Inputs with a few strong directions and unequal feature scales, as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, k, generator=g)
    scales = torch.logspace(0, -2, k)
    return (torch.randn(n, k, generator=g) * scales) @ basis  # (n, K)


def _hessian(x: torch.Tensor, chunks: int = 3) -> HessianAccumulator:
    acc = HessianAccumulator(x.shape[1])
    for part in x.chunk(chunks):
        acc.add(part)
    return acc


def test_hessian_is_two_xtx_over_n() -> None:
    x = torch.randn(50, 8, dtype=torch.float64)
    acc = _hessian(x.float(), chunks=4)
    assert acc.n == 50
    assert torch.allclose(acc.H.double(), 2 * x.t() @ x / 50, rtol=1e-5, atol=1e-6)


def _output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float(((x @ (w - wq).t()) ** 2).mean())


@pytest.mark.parametrize("bits, group, act_order", [(4, 32, False), (3, 32, True), (4, None, True)])
def test_gptq_beats_round_to_nearest_on_the_layer_objective(bits: int, group: int | None, act_order: bool) -> None:
    k, n = 128, 64
    x = _correlated_inputs(1024, k, seed=bits)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    spec = QuantSpec(bits, "group" if group else "channel", group or 128)
    result = gptq_quantize(w, _hessian(x).H, spec, act_order=act_order, block_size=48, scale_dtype=torch.float32)
    rtn = rtn_quantize(w, spec, scale_dtype=torch.float32)
    assert (result.weight.perm is not None) == act_order
    gptq_err = _output_error(x, w, result.weight.dequantize())
    rtn_err = _output_error(x, w, rtn.dequantize())
    assert gptq_err < 0.5 * rtn_err, f"GPTQ {gptq_err:.3g} vs RTN {rtn_err:.3g}"
    codes = result.weight.codes()
    assert int(codes.max()) <= (1 << bits) - 1


def test_gptq_zeroes_dead_inputs_and_handles_singular_hessians() -> None:
    x = _correlated_inputs(256, 32, seed=0)
    x[:, 5] = 0.0  # a feature that is never active
    x[:, 6] = x[:, 7]  # two identical features: H is singular without dampening
    w = torch.randn(16, 32)
    result = gptq_quantize(w, _hessian(x).H, QuantSpec(4, "group", 16), damp=0.01)
    deq = result.weight.dequantize()
    assert torch.all(deq[:, 5].abs() <= result.weight.scales[:, 0].float() / 2 + 1e-6)  # rounds to (nearly) 0
    assert torch.isfinite(deq).all()


def _tiny() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", ffn_hidden_dim=128, init_std=0.08)).eval()


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (4, 33), generator=g) for _ in range(n)]


def test_quantize_model_gptq_beats_rtn_on_our_llama() -> None:
    calib, held_out = _batches(6, 0), _batches(3, 1)
    float_model = _tiny()
    with torch.no_grad():
        ref = torch.cat([float_model(b[:, :-1]) for b in held_out])
    errors = {}
    for method in ("rtn", "gptq"):
        model = _tiny()
        report = quantize_model(
            model, QuantConfig(bits=3, group_size=32, method=method), calibration=[b[:, :-1] for b in calib]
        )
        assert len(report.layers) == 14 and "output" not in report.layers
        assert isinstance(model.layers["0"].attention.wq, QuantizedLinear) and type(model.output) is nn.Linear
        with torch.no_grad():
            out = torch.cat([model(b[:, :-1]) for b in held_out])
        errors[method] = float((out - ref).pow(2).mean() / ref.pow(2).mean())
    # Random weights and embeddings give nearly isotropic hidden states, where GPTQ's advantage is smallest (it
    # comes from correlated inputs, test above): ~17% lower error observed here; 10% is the bar.
    assert errors["gptq"] < 0.9 * errors["rtn"], errors
    assert causal_lm_loss(model, held_out) > 0


def test_quantize_model_config_errors() -> None:
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(_tiny(), QuantConfig(method="gptq"))
    with pytest.raises(ValueError, match="divisible by group_size"):
        quantize_model(_tiny(), QuantConfig(group_size=48))  # in_features 64 and 128
    with pytest.raises(ValueError, match="method"):
        QuantConfig(method="awq")
    config = QuantConfig(overrides={"*.attention.*": {"bits": 8, "group_size": None}, "layers.1.*": None})
    assert config.spec_for("layers.0.attention.wq") == QuantSpec(8, "channel", 128, True)
    assert config.spec_for("layers.1.feed_forward.w1") is None and config.spec_for("output") is None
    assert config.spec_for("layers.0.feed_forward.w1") == QuantSpec(4, "group", 128, True)
