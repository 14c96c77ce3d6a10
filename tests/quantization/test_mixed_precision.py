"""Mixed precision: sensitivities are measured on an untouched model, and the greedy allocation respects the
budget, spends bits where the loss is most sensitive, and refuses impossible budgets."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.quantization import QuantConfig, QuantSpec, allocate_bits, layer_sensitivity, quantize_model
from lightning_llmopt.quantization.mixed_precision import option_bytes

INT8 = QuantSpec(8, "channel")
INT4 = QuantSpec(4, "group", 32)
INT2 = QuantSpec(2, "group", 32)


def test_allocation_respects_budget_and_sensitivity() -> None:
    shapes = {"attn": (64, 64), "mlp": (128, 64)}
    # the attention layer is very sensitive to 4 bits, the MLP is not
    sens = {
        "attn": {"bf16": 0.0, INT8.describe(): 0.001, INT4.describe(): 0.5},
        "mlp": {"bf16": 0.0, INT8.describe(): 0.001, INT4.describe(): 0.01},
    }
    options = [None, INT8, INT4]
    full = sum(option_bytes(INT8, s) for s in shapes.values())
    budget = option_bytes(INT8, shapes["attn"]) + option_bytes(INT4, shapes["mlp"])
    alloc = allocate_bits(sens, shapes, options, budget)
    assert alloc.size_bytes <= budget < full
    assert alloc.plan == {"attn": INT8, "mlp": INT4}
    assert alloc.predicted_increase == pytest.approx(0.011)
    everything = allocate_bits(sens, shapes, options, 10**9)
    assert everything.plan == {"attn": None, "mlp": None}
    with pytest.raises(ValueError, match="below the smallest"):
        allocate_bits(sens, shapes, options, 100)


def test_sensitivity_restores_the_model_and_orders_bit_widths() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=1, ffn_hidden_dim=128, init_std=0.1)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sens = layer_sensitivity(model, batches, [INT8, INT2])
    assert set(sens) == {
        f"layers.0.{n}"
        for n in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    mean8 = sum(s[INT8.describe()] for s in sens.values()) / len(sens)
    mean2 = sum(abs(s[INT2.describe()]) for s in sens.values()) / len(sens)
    assert abs(mean8) < mean2
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in sens}
    budget = sum(option_bytes(INT8, s) for s in shapes.values()) * 6 // 10
    alloc = allocate_bits(sens, shapes, [INT8, INT2], budget)
    report = quantize_model(model, QuantConfig().with_overrides(alloc.plan))
    assert len(report.layers) == 7 and {v for v in report.layers.values()} <= {INT8.describe(), INT2.describe()}
