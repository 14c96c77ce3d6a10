"""``compile_blocks`` (the plan's compile step, ``CausalLMModule(compile=True)``): every block compiled, none left to
eager past dynamo's recompile limit, the same logits as the eager model."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from lightning_llmopt import CausalLMModule


def test_every_block_compiles_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """10 blocks (more than dynamo's default limit of 8 entries per code object): each block's forward is compiled
    and the logits equal the eager model's (fp32; inductor's fused kernels reorder sums: 1e-5)."""
    for name in ("recompile_limit", "cache_size_limit", "allow_unspec_int_on_nn_module"):  # restored afterwards
        if hasattr(torch._dynamo.config, name):
            monkeypatch.setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = CausalLMModule("tiny", model_overrides={"n_layers": 10})
    eager.configure_model()
    compiled = CausalLMModule("tiny", model_overrides={"n_layers": 10}, compile=True)
    compiled.configure_model()
    compiled.model.load_state_dict(eager.model.state_dict())
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 0))
    assert limit >= 18
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), eager(ids), rtol=1e-5, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 10  # one per block at most; with dynamic module integers, far fewer
    torch._dynamo.reset()


def test_compile_refused_under_nd_parallel() -> None:
    """Under NDParallelStrategy the module does not compile before tensor parallelism: the strategy compiles."""
    from types import SimpleNamespace

    module = CausalLMModule("tiny")
    module.configure_model()
    module._trainer = SimpleNamespace(strategy=type("NDParallelStrategy", (), {})())  # type: ignore[assignment]
    with pytest.raises(ValueError, match="under NDParallelStrategy pass compile=True to the strategy"):
        module._compile_blocks()
