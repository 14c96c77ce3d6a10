"""NDParallelStrategy on CPU/gloo: parity with one process for every layout of the issue, resharding checkpoints,
and validation errors.

Every parallel run trains ``CausalLMModule("tiny")`` (or a tiny transformers Llama) for 5 AdamW steps in fp32 on the
same global batches (4 rows of 16 tokens) from the same initial weights as Lightning's default single-process
strategy, which we did not write. Compared: the per-step losses (each rank's mean over its tokens, averaged over all
ranks) and all parameters together (norm of the difference over the norm), both to 1e-6 relative. The learning rate
is CausalLMModule's default 3e-4: at 3e-3 even fp32 against fp64 single-process training differs by ~4e-6 after 5
steps (Adam's normalised update amplifies rounding in weights whose gradient is near eps), below which no fp32
parallel run can be judged.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.strategies import NDParallelStrategy, NDPrecision

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

TOL = 1e-6


@pytest.fixture(scope="module")
def init_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("nd")
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny")
    module.configure_model()
    paths = {"llmopt": str(root / "llmopt.pt")}
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, paths["llmopt"])
    if importlib.util.find_spec("transformers") is not None:
        hf = J.HFModule()
        hf.configure_model()
        paths["hf"] = str(root / "hf.pt")
        torch.save({k: v.clone() for k, v in hf.state_dict().items()}, paths["hf"])
    return paths


_REFS: dict[tuple[Any, ...], dict[str, Any]] = {}


def _reference(
    init_paths: dict[str, str], packed: bool = False, hf: bool = False, clip: float | None = None
) -> dict[str, Any]:
    key = (packed, hf, clip)
    if key not in _REFS:
        path = init_paths["hf" if hf else "llmopt"]
        _REFS[key] = J.summary(*J.fit(None, packed=packed, hf=hf, clip=clip, init_path=path))
        _REFS[key]["init"] = path
    return _REFS[key]


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_parity(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses) == J.STEPS
    loss_err = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    assert sorted(result["params"]) == sorted(ref["params"])
    param_err = _rel(_flat(result["params"]), _flat(ref["params"]))
    assert loss_err <= TOL and param_err <= TOL, (loss_err, param_err)
    init = torch.load(ref["init"], weights_only=True)
    assert _rel(_flat(ref["params"]), _flat({k: init[k] for k in ref["params"]})) > 1e-3  # the weights moved
    return {"loss": loss_err, "params": param_err}


# ------------------------------------------------------------------ registration and early errors
def test_registered_name_resolves() -> None:
    trainer = L.Trainer(strategy="nd_parallel", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, NDParallelStrategy) and trainer.strategy.stage == 3
    assert isinstance(trainer.strategy.precision_plugin, NDPrecision)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tensor_parallel": 0}, ValueError, r"tensor_parallel \(0\) must be a positive integer"),
        ({"data_parallel": "all"}, ValueError, r"data_parallel \('all'\) must be a positive integer"),
        ({"zero_stage": 4}, ValueError, r"zero_stage \(4\) must be 0, 1, 2 or 3"),
        ({"context_parallel_mode": "zigzag"}, ValueError, r"context_parallel_mode \('zigzag'\) must be one of"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        NDParallelStrategy(**kwargs)


def _fit_expecting_error(nd: dict[str, Any], module_kwargs: dict[str, Any] | None = None, seq: int = J.SEQ) -> str:
    try:
        J.fit(nd, steps=1, module_kwargs=module_kwargs, seq=seq)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_layout_errors_before_any_collective(dist_pool: Any) -> None:
    """Degrees that do not fill the world or do not divide the model, and rows CP cannot split, fail on every rank
    alike before any collective of the step (no rank is left waiting), naming the values."""
    cases = [
        (
            {"data_parallel": 1},
            None,
            J.SEQ,
            r"data_parallel\*tensor_parallel\*context_parallel\*pipeline_parallel \(1\*1\*1\*1 = 1\) "
            r"!= world_size \(2\)",
        ),
        (
            {"tensor_parallel": 2},
            {"model_overrides": {"vocab_size": 321}},
            J.SEQ,
            r"vocab_size \(321\) must be divisible by tensor_parallel \(2\)",
        ),
        (
            {"tensor_parallel": 2},
            {"model_overrides": {"n_heads": 3, "n_kv_heads": 3, "dim": 48}},
            J.SEQ,
            r"n_heads \(3\) must be divisible by tensor_parallel \(2\)",
        ),
        ({"tensor_parallel": 2, "zero_stage": 2}, None, J.SEQ, r"zero_stage \(2\) with tensor_parallel \(2\)"),
        ({"tensor_parallel": 2, "compile": True}, None, J.SEQ, r"compile=True with tensor_parallel \(2\)"),
        (
            {"expert_parallel": 2, "zero_stage": 0},
            None,
            J.SEQ,
            r"expert_parallel \(2\) needs Mixture-of-Experts layers",
        ),
        (
            {"context_parallel": 2},
            None,
            18,
            r"sequence length \(18\) must be divisible by 2\*context_parallel = 4 \(context_parallel=2\)",
        ),
    ]
    pool = dist_pool(2)
    for nd, module_kwargs, seq, message in cases:
        for text in pool.run(_fit_expecting_error, nd, module_kwargs, seq):
            assert re.search(message, text), (message, text)


# ------------------------------------------------------------------ acceptance: parity with one process
TWO_RANKS = [
    {"nd": {"tensor_parallel": 2, "sequence_parallel": False}},  # TP=2
    {"nd": {"tensor_parallel": 2}},  # TP=2 + SP
    {"nd": {"tensor_parallel": 2}, "clip": 0.05},  # clipping by the global norm over DTensor shards
    {"nd": {"tensor_parallel": 2, "activation_checkpointing": "selective"}},  # TP -> AC
    {"nd": {"context_parallel": 2, "activation_checkpointing": "full"}},  # CP -> AC (the ring recomputed)
    {"nd": {"context_parallel": 2, "zero_stage": 0}},  # ring, causal, gradients all-reduced over cp
    {"nd": {"context_parallel": 2, "context_parallel_mode": "ulysses"}},  # Ulysses, causal, ZeRO-3 over cp
    {"nd": {"context_parallel": 2, "zero_stage": 2}, "packed": True},  # ring, packed documents, our ZeRO-2
    {"nd": {"context_parallel": 2, "context_parallel_mode": "ulysses", "zero_stage": 0}, "packed": True},
    {"nd": {"tensor_parallel": 2}, "hf": True},  # transformers LlamaForCausalLM built in configure_model
]


def test_parity_two_ranks(dist_pool: Any, init_paths: dict[str, str]) -> None:
    configs = [c for c in TWO_RANKS if not c.get("hf") or "hf" in init_paths]
    results = dist_pool(2).run(J.parity_job, init_paths, configs)[0]
    for config, result in zip(configs, results, strict=True):
        ref = _reference(init_paths, config.get("packed", False), config.get("hf", False), config.get("clip"))
        _assert_parity(result, ref)
    tp_memory, cp_memory = results[0]["memory"], results[5]["memory"]
    n_params = sum(v.numel() for v in _reference(init_paths)["params"].values())
    assert abs(tp_memory["parameters"] - 4 * n_params / 2) <= 4 * 64 * 8  # TP halves the weights (norms replicated)
    assert cp_memory["parameters"] == 4 * n_params  # CP replicates them


FOUR_RANKS = [
    {"nd": {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": 0}},  # dp x tp
    {"nd": {"data_parallel": 2, "context_parallel": 2}},  # dp x cp (ring), ZeRO-3 over dp*cp = 4
    {"nd": {"tensor_parallel": 2, "context_parallel": 2}},  # tp x cp (SP + ring), ZeRO-3 over cp
    {"nd": {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": 3}},  # ZeRO-3 x TP (FSDP2 2-D)
    # clipping by the norm over 2-D shards (FSDP2 gives TP-sharded dims _StridedShard placements)
    {"nd": {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": 3}, "clip": 0.05},
]


def test_parity_four_ranks(dist_pool: Any, init_paths: dict[str, str]) -> None:
    results = dist_pool(4).run(J.parity_job, init_paths, FOUR_RANKS)[0]
    ref = _reference(init_paths)
    for config, result in zip(FOUR_RANKS, results, strict=True):
        _assert_parity(result, _reference(init_paths, clip=config.get("clip")))
    n_params = sum(v.numel() for v in ref["params"].values())
    zero3_tp = results[3]["memory"]
    assert abs(zero3_tp["parameters"] - 4 * n_params / 4) <= 4 * 64 * 8  # sharded over dp and tp
    assert abs(zero3_tp["optimizer_state"] - 8 * n_params / 4) <= 8 * 64 * 8


def test_validation_matches_one_process(dist_pool: Any, init_paths: dict[str, str]) -> None:
    """``Trainer.validate`` (packed rows): the vocab-parallel loss and the gathered-logits perplexity under TP, the
    sharded sequence under CP, and metric states that ZeRO-3's meta-device allocation leaves intact."""
    layouts = [
        {"tensor_parallel": 2},
        {"context_parallel": 2},
        {"context_parallel": 2, "context_parallel_mode": "ulysses"},
        {"data_parallel": 2},
    ]
    ref = J.validate(None, init_paths["llmopt"])
    for layout, metrics in zip(
        layouts, dist_pool(2).run(J.validate_job, init_paths["llmopt"], layouts)[0], strict=True
    ):
        for key in ("val/loss", "val/ppl"):
            assert abs(metrics[key] - ref[key]) <= TOL * ref[key], (layout, key, metrics[key], ref[key])


# ------------------------------------------------------------------ acceptance: checkpoints across layouts
def _assert_resumed(out: dict[str, Any], split: int) -> None:
    assert out["folders"] == [f"step-{split:08d}"]
    assert _rel(_flat(out["resumed"]["start_params"]), _flat(out["saved"])) == 0.0  # bitwise after the load
    straight, resumed = out["straight"]["losses"][split:], out["resumed"]["losses"]
    assert len(resumed) == len(straight) > 0
    assert max(abs(a - b) / b for a, b in zip(resumed, straight, strict=True)) <= TOL
    assert _rel(_flat(out["resumed"]["params"]), _flat(out["straight"]["params"])) <= TOL


def test_checkpoint_tp2_loads_as_tp1(dist_pool: Any, init_paths: dict[str, str], tmp_path: Path) -> None:
    """Saved with TP=2 (+SP) on 2 ranks; resumed as plain data parallelism (TP=1, dp=2): the weights are the saved
    ones exactly, and the continued run (optimizer state included) follows the straight one."""
    out = dist_pool(2).run(
        J.reshard_job,
        init_paths["llmopt"],
        str(tmp_path / "ckpt"),
        {"tensor_parallel": 2},
        {"data_parallel": 2, "zero_stage": 0},
        3,
        6,
    )[0]
    _assert_resumed(out, 3)


def test_checkpoint_dp2_tp2_loads_as_dp4(dist_pool: Any, init_paths: dict[str, str], tmp_path: Path) -> None:
    """ZeRO-3 x TP as dp x tp = 2 x 2 on 4 ranks, resumed as 4 x 1 (ZeRO-3 over 4 data-parallel ranks)."""
    out = dist_pool(4).run(
        J.reshard_job,
        init_paths["llmopt"],
        str(tmp_path / "ckpt"),
        {"data_parallel": 2, "tensor_parallel": 2},
        {"data_parallel": 4},
        3,
        6,
    )[0]
    _assert_resumed(out, 3)
