"""The block-by-block GPTQ driver: the same quantized model as re-running the model prefix for every block
(bit for bit: the same operations on the same inputs), with two forwards per block instead of L(L+1)/2 over all;
works on a transformers decoder; a head outside the blocks is still quantized."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.quantization import QuantConfig, quantize_model
from lightning_llmopt.quantization import apply as apply_mod


def _tiny(n_layers: int = 3) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", n_layers=n_layers, init_std=0.05)).eval()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (2, 24), generator=g) for _ in range(3)]


def _count_block_calls(model: nn.Module, blocks: nn.Module) -> Counter:
    calls: Counter = Counter()
    for name, block in blocks.named_children():
        block.register_forward_hook(lambda m, a, out, name=name: calls.update([name]))  # completed forwards
    return calls


def _codes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.qweight.clone() for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def test_blockwise_equals_the_prefix_driver_with_fewer_forwards(monkeypatch) -> None:
    skip_head = False  # the head is quantized too: the group outside the blocks (tests/quantization/test_gptq.py
    # runs the block driver with the default config, head skipped)
    config = QuantConfig(bits=4, group_size=32, method="gptq", **({} if skip_head else {"skip": ()}))
    blockwise = _tiny()
    calls = _count_block_calls(blockwise, blockwise.layers)
    report = quantize_model(blockwise, config, _batches())
    assert calls == {str(i): 2 * 3 + (0 if skip_head else 3) for i in range(3)}  # 2 per block and batch (+ head)
    prefix = _tiny()
    prefix_calls = _count_block_calls(prefix, prefix.layers)
    monkeypatch.setattr("lightning_llmopt.quantization.gptq_blocks.quantize_blockwise", lambda *a, **k: False)
    prefix_report = quantize_model(prefix, config, _batches())
    assert prefix_calls == {str(i): 3 * (3 - i) + (0 if skip_head else 3) for i in range(3)}  # block i: L - i runs
    assert report.layers == prefix_report.layers and ("output" in report.layers) is not skip_head
    ours, theirs = _codes(blockwise), _codes(prefix)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    tokens = _batches()[0]
    with torch.no_grad():
        assert torch.equal(blockwise(tokens), prefix(tokens))


def test_blockwise_moves_one_block_at_a_time(monkeypatch) -> None:
    """``device``: each block is moved there for its turn, then back where it was (both the CPU here: the moves are
    recorded)."""
    model = _tiny(2)
    moves: list[str] = []
    original = nn.Module.to

    def recording_to(self, *args, **kwargs):
        if self in list(model.layers.values()):
            moves.append(str(args[0] if args else kwargs.get("device")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", recording_to)
    quantize_model(model, QuantConfig(bits=4, group_size=32, method="gptq"), _batches(), device="cpu")
    assert moves == ["cpu", "cpu", "cpu", "cpu"]  # block 0 there and back, then block 1


def test_blockwise_on_a_transformers_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    calls = _count_block_calls(model, model.model.layers)
    config = QuantConfig(bits=4, group_size=32, method="gptq")
    report = quantize_model(model, config, _batches())
    assert calls == {"0": 6, "1": 6} and len(report.layers) == 14
    assert apply_mod.quantizable_linears(model, config) == {}  # every targeted layer was replaced
