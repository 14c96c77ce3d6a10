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
from lightning_llmopt.strategies import NDParallelStrategy
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

_spec = importlib.util.spec_from_file_location("_fused_jobs", Path(__file__).with_name("_fused_jobs.py"))
assert _spec is not None and _spec.loader is not None
F = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_fused_jobs", F)
_spec.loader.exec_module(F)

TOL = 1e-5
INTERPRETER = triton_available() and (torch.cuda.is_available() or triton_interpreter_enabled())


LAYERS = {"n_layers": 4}  # every layout below, pipelines with 2 stages per rank included, on one model


@pytest.fixture(scope="module")
def init_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fused")
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny", model_overrides=LAYERS)
    module.configure_model()
    paths = {"llmopt": str(root / "llmopt.pt"), "llmopt2": str(root / "llmopt2.pt"), "moe": str(root / "moe.pt")}
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, paths["llmopt"])
    two = {
        k: v.clone() for k, v in module.state_dict().items() if not k.startswith(("model.layers.2", "model.layers.3"))
    }
    torch.save(two, paths["llmopt2"])  # the 2-layer tiny model: the first two blocks
    L.seed_everything(0, verbose=False)
    moe = CausalLMModule("tiny", model_overrides=MOE)
    moe.configure_model()
    torch.save({k: v.clone() for k, v in moe.state_dict().items()}, paths["moe"])
    if importlib.util.find_spec("transformers") is not None:
        hf = F.J.HFModule()
        hf.configure_model()
        paths["hf"] = str(root / "hf.pt")
        torch.save({k: v.clone() for k, v in hf.state_dict().items()}, paths["hf"])
    return paths


MOE = {"moe": {"num_experts": 4, "top_k": 2, "z_loss_coef": 1e-3}}  # tests/strategies/test_nd_expert_parallel.py's
_REF: dict[str, dict[str, Any]] = {}


def _reference(init_paths: dict[str, str], which: str = "llmopt") -> dict[str, Any]:
    """One process, Lightning's default strategy, no fused kernels."""
    if which not in _REF:
        config: dict[str, Any] = {"nd": None, "fused": False}
        config.update(
            {"hf": {"hf": True}, "llmopt": {"overrides": LAYERS}, "llmopt2": {}, "moe": {"overrides": MOE}}[which]
        )
        _REF[which] = F.run(config, init_paths[which])
    return _REF[which]


def _errors(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses) == len(ref["grads"]) == 5
    errors = {
        "loss": float(((losses - ref_losses).abs() / ref_losses.abs()).max()),
        "params": F.rel_error(result["params"], ref["params"]),
    }
    if result["grads"]:  # not with ZeRO-1/2, whose engine keeps the reduced gradients in its flat shards
        assert len(result["grads"]) == 5
        errors["grad"] = max(F.rel_error(g, r) for g, r in zip(result["grads"], ref["grads"], strict=True))
    return errors


def _check(configs: list[dict[str, Any]], results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for config, result in zip(configs, results, strict=True):
        fused = result["fused"]  # the kernels really ran: every norm, dense MLP and the loss were swapped
        moe = "moe" in config.get("overrides", {})  # Mixture-of-Experts feed-forwards keep their own experts
        assert fused["rmsnorm"] > 0 and fused["rope"] > 0 and fused["fused_ce"] == 1, fused
        assert (fused["swiglu"] == 0) if moe else (fused["swiglu"] > 0), fused
        errors = _errors(result, ref)
        print(f"fused parity {config}: {errors}")  # the figures docs/fused_kernels.md quotes (pytest -s)
        assert max(errors.values()) <= TOL, (config, errors)


def _with_layers(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**c, "overrides": LAYERS} for c in configs]


TWO_RANKS = _with_layers(
    [
        {"zero": {"stage": 1}},  # Trainer(strategy="zero1")
        {"zero": {"stage": 2}},  # Trainer(strategy="zero2")
        {"nd": {"zero_stage": 3}},  # NDParallelStrategy(zero_stage=3): FSDP2 over dp = 2
        {"zero": {"stage": 3}},  # Trainer(strategy="zero3")
        {"zero": {"stage": 3, "offload_parameters": True, "offload_optimizer": True}},  # "zero3_offload"
        {"nd": {"tensor_parallel": 2, "sequence_parallel": False}},  # TP without SP: replicated norm inputs
        {"nd": {"context_parallel": 2}},  # ring attention, ZeRO-3 over cp
        {"nd": {"context_parallel": 2, "context_parallel_mode": "ulysses", "zero_stage": 0}},
        {"nd": {"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2}},  # fused loss on the last stage
        # 2 stages per rank and no zero_stage given: the default becomes ZeRO-2, which such schedules support
        {"nd": {"pipeline_parallel": 2, "schedule": "zero_bubble", "microbatches": 4}},
    ]
)


def test_two_ranks_reference_kernels(dist_pool: Any, init_paths: dict[str, str]) -> None:
    """ZeRO-1/2/3 (the strategy names and NDParallelStrategy, parameter offload), TP without SP, CP (ring,
    Ulysses) and PP (1F1B, zero bubble), with the kernels' PyTorch reference path (the CPU default)."""
    results = dist_pool(2).run(F.parity_job, init_paths, TWO_RANKS)[0]
    _check(TWO_RANKS, results, _reference(init_paths))


TRITON = [{"nd": {"tensor_parallel": 2}, "init": "llmopt2"}]  # TP=2 + SP; 2 blocks: the interpreter is slow


@pytest.mark.skipif(not INTERPRETER, reason="needs triton (and TRITON_INTERPRET=1 without CUDA)")
def test_tensor_sequence_parallel_triton_kernels(dist_pool: Any, init_paths: dict[str, str]) -> None:
    """TP=2 with sequence parallelism through the Triton kernels (the interpreter on CPU): RMSNorm on sequence
    shards, SwiGLU on the local gate/up columns, rotary on local heads, and the chunked vocab-parallel linear +
    cross-entropy on the head's vocabulary shard."""
    results = dist_pool(2).run(F.parity_job, init_paths, TRITON, "triton")[0]
    _check(TRITON, results, _reference(init_paths, "llmopt2"))


HF = [{"nd": {"tensor_parallel": 2, "fused_kernels": "all"}, "hf": True}]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_transformers_llama_tensor_parallel(dist_pool: Any, init_paths: dict[str, str]) -> None:
    """A transformers ``LlamaForCausalLM`` (tiny random config) under TP=2 + SP with ``fused_kernels="all"`` swapped
    in after the sharding, against the unpatched model in one process."""
    results = dist_pool(2).run(F.parity_job, init_paths, HF)[0]
    _check(HF, results, _reference(init_paths, "hf"))


EXPERTS = [
    {"nd": {"expert_parallel": 2, "zero_stage": 3}, "overrides": MOE, "init": "moe"},  # EP x ZeRO-3 (dp_rep 1)
    {"nd": {"tensor_parallel": 2, "activation_checkpointing": "selective"}, "overrides": MOE, "init": "moe"},
]


def test_mixture_of_experts(dist_pool: Any, init_paths: dict[str, str]) -> None:
    """A MoE model (every feed-forward routed, so no fused SwiGLU): norms, rotary and the fused loss under expert
    parallelism with ZeRO-3, and under TP + SP (each rank routes its sequence shard) with selective activation
    checkpointing, which recomputes the fused modules."""
    results = dist_pool(2).run(F.parity_job, init_paths, EXPERTS)[0]
    _check(EXPERTS, results, _reference(init_paths, "moe"))


FOUR_RANKS = _with_layers(
    [
        {"nd": {"data_parallel": 2, "tensor_parallel": 2}},  # dp x tp, ZeRO-3 2-D (FSDP2 over dp, TP shards)
        {"nd": {"data_parallel": 2, "pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2}},  # PP x ZeRO-3
        # PP x TP + SP: the last stage's sequence-sharded hidden states cross the stage boundary, the vocab-parallel
        # fused loss runs there
        {"nd": {"tensor_parallel": 2, "pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 0}},
    ]
)


def test_four_ranks(dist_pool: Any, init_paths: dict[str, str]) -> None:
    results = dist_pool(4).run(F.parity_job, init_paths, FOUR_RANKS)[0]
    _check(FOUR_RANKS, results, _reference(init_paths))


# ------------------------------------------------------------------ defaults and errors (no collective)
@pytest.mark.parametrize(
    ("kwargs", "stage"),
    [
        ({"pipeline_parallel": 2, "microbatches": 8, "schedule": "zero_bubble"}, 2),  # V = 2: FSDP2 cannot wrap it
        ({"pipeline_parallel": 4, "schedule": "zbv"}, 2),
        ({"pipeline_parallel": 2, "schedule": "interleaved_1f1b", "tensor_parallel": 2}, 0),  # no ZeRO-1/2 with TP
        ({"pipeline_parallel": 2, "schedule": "1f1b"}, 3),  # one stage per rank: FSDP2
        ({}, 3),
    ],
)
def test_default_zero_stage_fits_the_schedule(kwargs: dict[str, Any], stage: int) -> None:
    """A schedule with several stages per rank and no ``zero_stage`` given constructs (the user did not ask for the
    ZeRO-3 that such schedules cannot take); naming ``zero_stage=3`` there is still refused."""
    assert NDParallelStrategy(**kwargs).stage == stage
    if stage != 3 and "tensor_parallel" not in kwargs:
        with pytest.raises(NotImplementedError, match=r"zero_stage=3 with virtual_stages \(2\) > 1"):
            NDParallelStrategy(zero_stage=3, **kwargs)


def test_kernel_errors_name_the_values() -> None:
    """Bad kernel names fail when the strategy is built; kernels for a model the kernel step cannot patch fail in
    ``validate`` (which runs before any collective)."""
    from lightning_llmopt.parallel.mesh import ParallelDims
    from lightning_llmopt.parallel.parallelize import NDConfig, validate

    with pytest.raises(ValueError, match=r"fused_kernels \(\['layernorm'\]\) must name kernels of"):
        NDParallelStrategy(fused_kernels=["layernorm"])
    dims = ParallelDims.resolve(2, data_parallel=2)
    with pytest.raises(ValueError, match=r"fused_kernels \(\['rmsnorm'\]\) are swapped into a known decoder, and "):
        validate(torch.nn.Sequential(torch.nn.Linear(2, 2)), dims, NDConfig(fused_kernels=["rmsnorm"]))


def test_pipeline_validation_applies_the_head(dist_pool: Any, init_paths: dict[str, str]) -> None:
    """Forward-only passes (``Trainer.validate``, packed rows) of a pipeline whose last stage returns hidden states
    for the fused loss: the head runs on that stage, and the loss and perplexity equal one process without the
    kernels (1e-6: the same logits up to the kernels' reordered fp32 sums)."""
    path = init_paths["llmopt"]
    layouts = [{"pipeline_parallel": 2, "zero_stage": 0}, {"pipeline_parallel": 2, "schedule": "zero_bubble"}]
    pool = dist_pool(2)
    ref = F.validate_job(path, None, LAYERS, fused=False)
    for nd in layouts:
        got = pool.run(F.validate_job, path, nd, LAYERS)[0]
        assert got.keys() == ref.keys()
        for key in ref:
            assert abs(got[key] - ref[key]) <= 1e-6 * abs(ref[key]), (nd, key, got, ref)


def test_fused_norm_without_its_layout_is_refused(dist_pool: Any) -> None:
    for text in dist_pool(2).run(F.unknown_layout_job):
        assert "whether it is the sequence-parallel shard is unknown; apply" in text, text
        assert "apply_kernels(model, tp_mesh, sequence_parallel)" in text
