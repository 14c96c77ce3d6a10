"""The fused kernels (``fused_kernels=["all"]``: RMSNorm, rotary, SwiGLU, linear + cross-entropy) under every
strategy, on CPU/gloo, against one process without them (Lightning's default strategy, the unfused model).

Each run trains ``CausalLMModule("tiny")`` for 5 AdamW steps in fp32 on the same global batches from the same initial
weights (``_nd_jobs.py``). Compared: per-step losses (each rank's mean over its tokens, averaged over ranks), the full
gradient of every step and the final parameters, as norm-wise relative errors.

Tolerance 1e-5 (the issue's): the fused kernels compute the same fp32 math in another order, which alone moves losses
and logits by ~1e-6 relative (tests/test_optimize.py), and the sharded reductions reorder sums again (1e-6 in
tests/strategies/test_nd_parallel.py). Measured here: at most ~3e-7 on every case; a wrong shard layout (a missing
reduction of a norm's gradient, a vocabulary offset) gives O(1e-2) and more.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

_spec = importlib.util.spec_from_file_location("_fused_jobs", Path(__file__).with_name("_fused_jobs.py"))
assert _spec is not None and _spec.loader is not None
F = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_fused_jobs", F)
_spec.loader.exec_module(F)

TOL = 1e-5
INTERPRETER = triton_available() and (torch.cuda.is_available() or triton_interpreter_enabled())


@pytest.fixture(scope="module")
def init_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny")
    module.configure_model()
    path = tmp_path_factory.mktemp("fused") / "init.pt"
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, path)
    return str(path)


_REF: dict[str, dict[str, Any]] = {}


def _reference(init_path: str) -> dict[str, Any]:
    """One process, Lightning's default strategy, no fused kernels."""
    if init_path not in _REF:
        _REF[init_path] = F.run({"nd": None, "fused": False}, init_path)
    return _REF[init_path]


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    x, y = _flat(a), _flat(b)
    return float((x - y).norm() / y.norm())


def _errors(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses) == len(result["grads"]) == len(ref["grads"]) == 5
    return {
        "loss": float(((losses - ref_losses).abs() / ref_losses.abs()).max()),
        "grad": max(_rel(g, r) for g, r in zip(result["grads"], ref["grads"], strict=True)),
        "params": _rel(result["params"], ref["params"]),
    }


def _assert_parity(configs: list[dict[str, Any]], results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for config, result in zip(configs, results, strict=True):
        errors = _errors(result, ref)
        assert max(errors.values()) <= TOL, (config, errors)


ZERO3 = [
    {"nd": {"zero_stage": 3}},  # NDParallelStrategy(zero_stage=3): FSDP2 over dp = 2
    {"zero": {"stage": 3}},  # Trainer(strategy="zero3")
    {"zero": {"stage": 3, "offload_parameters": True, "offload_optimizer": True}},  # "zero3_offload"
    {"nd": {"context_parallel": 2}},  # ring attention, ZeRO-3 over cp
    {"nd": {"context_parallel": 2, "context_parallel_mode": "ulysses", "zero_stage": 0}},
]


@pytest.mark.skipif(not INTERPRETER, reason="needs triton (and TRITON_INTERPRET=1 without CUDA)")
def test_zero3_runs_the_triton_kernels(dist_pool: Any, init_path: str) -> None:
    """ZeRO-3 with the kernels themselves (Triton interpreter on CPU): the fused loss enters the model through
    ``Llama.loss``, which FSDP2 now hooks like ``forward``."""
    results = dist_pool(2).run(F.parity_job, init_path, ZERO3[:1], "triton")[0]
    _assert_parity(ZERO3[:1], results, _reference(init_path))


def test_zero3_and_context_parallel(dist_pool: Any, init_path: str) -> None:
    """Every ZeRO-3 entry (strategy names and NDParallelStrategy, parameter offload) and CP (ring, Ulysses), with
    the kernels' PyTorch reference path (the CPU default)."""
    results = dist_pool(2).run(F.parity_job, init_path, ZERO3)[0]
    _assert_parity(ZERO3, results, _reference(init_path))
