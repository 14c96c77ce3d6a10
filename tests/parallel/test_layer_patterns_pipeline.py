"""Layer patterns under pipeline parallelism: per-layer windows and K/V shared within a stage run 1F1B on 2 gloo
ranks like the unsplit model in one process; K/V shared across the stage split is refused before any collective."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.pipeline import PipelineConfig, validate_pipeline

# stages (0, 2) and (2, 4): layer 1 reads layer 0's K/V, layer 3 reads layer 2's
PATTERN: dict[str, Any] = dict(
    n_layers=4, sliding_window=5, layer_types=["local", "local", "global", "global"], kv_sources=[0, 0, 2, 2]
)


def _config(**overrides: Any) -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", **{**PATTERN, **overrides})


def test_shared_kv_across_stages_is_refused() -> None:
    with pytest.raises(ValueError, match=r"layer 2 reads the K/V of layer 0, which the split \[\(0, 2\), \(2, 4\)\]"):
        validate_pipeline(Llama(_config(layer_types=None, kv_sources=[0, 0, 0, 0])), PipelineConfig(pp=2))
    validate_pipeline(Llama(_config()), PipelineConfig(pp=2))  # within stages: fine


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _step(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_llmopt.parallel.pipeline import PipelineRunner, prune_to_stages, stage_modules

    model = Llama(_config())
    model.load_state_dict(state)
    config = PipelineConfig(pp=2, schedule="1f1b", microbatches=2)
    split = validate_pipeline(model, config)
    prune_to_stages(model, split, dist.get_rank())
    runner = PipelineRunner(
        stage_modules(model, split, dist.get_rank()), split, config, dist.group.WORLD, torch.device("cpu")
    )
    labels = batch["labels"]
    loss = runner.train_step({"input_ids": batch["input_ids"]}, lambda out, rows: _loss(out, labels[rows]))
    return {
        "loss": float(loss),
        "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
    }


def test_pattern_pipeline_matches_one_process(dist_pool: Any) -> None:
    torch.manual_seed(0)
    model = Llama(_config())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    data = torch.randint(0, 320, (4, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": data[:, :-1], "labels": data[:, 1:]}
    loss = _loss(model(batch["input_ids"]), batch["labels"])
    loss.backward()
    loss = loss.detach()
    per_rank = dist_pool(2).run(_step, state, batch)
    grads: dict[str, torch.Tensor] = {}
    for r in per_rank:
        assert abs(r["loss"] - float(loss)) <= 1e-6 * float(loss)  # fp32, micro-batch sums in another order
        grads.update(r["grads"])
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
