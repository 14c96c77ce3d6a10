"""NDParallelStrategy with layer patterns and cross-layer KV sharing: TP (with SP), CP (ring) and ZeRO-3 data
parallelism on 2 gloo ranks against Lightning's single-process strategy, 5 AdamW steps of ``CausalLMModule("tiny")``
from the same weights (the harness of test_nd_parallel.py); losses and parameters to 1e-6 relative."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt import CausalLMModule

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

TOL = 1e-6
PATTERN = {"model_overrides": {"sliding_window": 5, "layer_types": ["local", "global"]}}
SHARED = {"model_overrides": {"kv_sources": [0, 0]}}  # layer 1 reads layer 0's K/V: no wk/wv of its own


@pytest.fixture(scope="module")
def init_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny")
    module.configure_model()
    path = tmp_path_factory.mktemp("nd_patterns") / "init.pt"
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, path)
    return str(path)


def _init_for(init_path: str, module: dict[str, Any]) -> str:
    """The common weights restricted to what ``module`` has (a K/V-sharing layer has no wk/wv), so every load is
    exact: the loader refuses entries a module lacks."""
    shaped = CausalLMModule("tiny", **module)
    shaped.configure_model()
    keys = set(shaped.state_dict())
    path = Path(init_path).with_name(f"init-{len(keys)}.pt")
    torch.save({k: v for k, v in torch.load(init_path).items() if k in keys}, path)
    return str(path)


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def _job(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [J.summary(*J.fit(c["nd"], init_path=c["init"], module_kwargs=c["module"])) for c in configs]


def test_patterns_under_tp_cp_and_zero(dist_pool: Any, init_path: str) -> None:
    configs = [
        {"nd": {"tensor_parallel": 2}, "module": PATTERN},
        {"nd": {"context_parallel": 2}, "module": PATTERN},
        {"nd": {"tensor_parallel": 2}, "module": SHARED},
        {"nd": {"context_parallel": 2, "zero_stage": 2}, "module": SHARED},
        {"nd": {"data_parallel": 2, "zero_stage": 3}, "module": SHARED},
    ]
    inits = {id(m): _init_for(init_path, m) for m in (PATTERN, SHARED)}
    for config in configs:
        config["init"] = inits[id(config["module"])]
    results = dist_pool(2).run(_job, configs)[0]
    refs = {id(m): J.summary(*J.fit(None, init_path=inits[id(m)], module_kwargs=m)) for m in (PATTERN, SHARED)}
    for config, result in zip(configs, results, strict=True):
        ref = refs[id(config["module"])]
        losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
        assert float(((losses - ref_losses).abs() / ref_losses.abs()).max()) <= TOL, config
        assert sorted(result["params"]) == sorted(ref["params"])
        a, b = _flat(result["params"]), _flat(ref["params"])
        assert float((a - b).norm() / b.norm()) <= TOL, config
    assert "layers.1.attention.wk.weight" not in refs[id(SHARED)]["params"]
