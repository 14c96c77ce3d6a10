"""Layer patterns (per-layer windows) and cross-layer K/V sharing with the fused kernels (``fused_kernels=["all"]``,
their PyTorch reference path on CPU) under ``NDParallelStrategy``: TP=2 (+SP), CP=2 (ring), ZeRO-3 and PP=2 (1F1B)
on 2 gloo ranks, against one process without the kernels.

The harness of tests/strategies/test_nd_fused.py (``_fused_jobs.py``): 5 AdamW steps of ``CausalLMModule("tiny")``
in fp32 from the same weights on the same global batches; losses, every step's full gradient and the final
parameters as relative errors. Tolerance 1e-5 as there (measured: at most 4.1e-7, printed with ``pytest -s``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

_spec = importlib.util.spec_from_file_location("_fused_jobs", Path(__file__).with_name("_fused_jobs.py"))
assert _spec is not None and _spec.loader is not None
F = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_fused_jobs", F)
_spec.loader.exec_module(F)

TOL = 1e-5
# 4 layers: windows 5 / 5 / global / global; layers 1 and 3 read the K/V of 0 and 2 (PP=2 keeps each pair on a stage)
PATTERN = {
    "n_layers": 4,
    "sliding_window": 5,
    "layer_types": ["local", "local", "global", "global"],
    "kv_sources": [0, 0, 2, 2],
}
CONFIGS = [
    {"nd": {"tensor_parallel": 2}},  # TP + SP: fused norms on sequence shards, rotary on local heads
    {"nd": {"context_parallel": 2}},  # ring attention with per-layer windows and shared K/V
    {"nd": {"data_parallel": 2, "zero_stage": 3}},
    {"nd": {"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2}},
]


@pytest.fixture(scope="module")
def init_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(F.save_init(tmp_path_factory.mktemp("nd_patterns_fused"), PATTERN))


def test_patterns_with_fused_kernels_under_strategies(dist_pool: Any, init_path: str) -> None:
    configs = [{**c, "overrides": PATTERN} for c in CONFIGS]
    results = dist_pool(2).run(F.parity_job, {"llmopt": init_path}, configs)[0]
    ref = F.run({"nd": None, "fused": False, "overrides": PATTERN}, init_path)
    assert "model.layers.1.attention.wk.weight" not in ref["params"] and len(ref["grads"]) == 5
    for config, result in zip(configs, results, strict=True):
        fused = result["fused"]  # summed over the blocks this rank holds
        assert fused["rmsnorm"] > 0 and fused["rope"] > 0 and fused["swiglu"] > 0 and fused["fused_ce"] == 1, fused
        losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
        assert len(result["grads"]) == 5
        errors = {
            "loss": float(((losses - ref_losses).abs() / ref_losses.abs()).max()),
            "params": F.rel_error(result["params"], ref["params"]),
            "grad": max(F.rel_error(g, r) for g, r in zip(result["grads"], ref["grads"], strict=True)),
        }
        print(f"pattern fused parity {config['nd']}: {errors}")  # the figures docs/layer_patterns.md quotes
        assert max(errors.values()) <= TOL, (config, errors)
