"""QAT: the straight-through gradient is 1 inside the clipping range and 0 outside, fake-quantized layers share
their Parameters, and conversion reproduces the fake-quantized forward."""

from __future__ import annotations

import torch
from torch import nn

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.quantization import (
    FakeQuantLinear,
    QuantConfig,
    QuantSpec,
    convert_qat,
    fake_quantize_ste,
    get_observer,
    prepare_qat,
    remove_qat,
)


def test_ste_gradient_is_the_clipping_mask() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    w[0, 0] = 5.0  # far outside a 90th-percentile range
    spec = QuantSpec(4, "group", 32)
    leaf = w.clone().requires_grad_()
    out = fake_quantize_ste(leaf, spec, "percentile")
    upstream = torch.randn_like(w)
    (grad,) = torch.autograd.grad(out, leaf, upstream)
    scale, zero = get_observer("percentile", spec)(w).grid((8, 64))
    raw = torch.round(w.reshape(8, 2, 32) / scale[..., None]) + zero[..., None]
    inside = ((raw >= 0) & (raw <= 15)).reshape(8, 64)
    assert not inside[0, 0] and inside.float().mean() > 0.9
    assert torch.equal(grad, upstream * inside)
    assert torch.allclose(out, ((raw.clamp(0, 15) - zero[..., None]) * scale[..., None]).reshape(8, 64))


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", ffn_hidden_dim=128))


def test_prepare_shares_parameters_and_keeps_state_dict_keys() -> None:
    model = _model()
    keys = list(model.state_dict())
    params = {n: id(p) for n, p in model.named_parameters()}
    names = prepare_qat(model, QuantConfig(bits=4, group_size=32))
    assert len(names) == 14 and isinstance(model.layers["1"].feed_forward.w2, FakeQuantLinear)
    assert type(model.output) is nn.Linear  # the head is skipped by default
    assert list(model.state_dict()) == keys
    assert {n: id(p) for n, p in model.named_parameters()} == params
    tokens = torch.randint(0, 320, (2, 9))
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert model.layers["0"].attention.wq.weight.grad is not None
    remove_qat(model)
    assert type(model.layers["1"].feed_forward.w2) is nn.Linear and list(model.state_dict()) == keys


def test_convert_reproduces_the_fake_quantized_forward() -> None:
    model = _model().eval()
    prepare_qat(model, QuantConfig(bits=4, group_size=32, symmetric=False))
    tokens = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        fake = model(tokens)
    assert convert_qat(model)
    assert isinstance(model.layers["0"].attention.wk, QuantizedLinear)
    with torch.no_grad():
        real = model(tokens)
    assert torch.allclose(real, fake, rtol=1e-5, atol=1e-5)
