"""Memory estimate: the ZeRO paper's figures, per-stage ratios, activations against measurement (CPU and the recorded
H100 run), model states against the tensor sizes the ZeRO engine really holds, and bad inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.activation_checkpointing import activation_memory, apply_activation_checkpointing
from lightning_llmopt.parallel.memory import activation_bytes, estimate_memory, parameter_counts

POLICIES = ("none", "full", "every_n", "sqrt", "selective")
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_paper_example_7_5b_on_64_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # ZeRO (arXiv 1910.02054) Figure 1: Ψ = 7.5B, N = 64, K = 12: 120 GB -> 31.4 / 16.6 / 1.9 GB.
    import lightning_llmopt.parallel.memory as memory

    real = memory.parameter_counts
    monkeypatch.setattr(memory, "parameter_counts", lambda cfg: (7_500_000_000, *real(cfg)[1:]))
    figures = {}
    for stage in (0, 1, 2, 3):
        est = estimate_memory(LlamaConfig.from_preset("tiny"), stage=stage, world_size=64, precision="16-mixed",
                              micro_batch=1, seq_len=8, accounting="paper")
        assert est.num_params == 7_500_000_000
        assert est.paper_model_states == est.model_states
        figures[stage] = round(est.model_states / 1e9, 1)
    assert figures == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_stage_ratios(n: int) -> None:
    cfg = LlamaConfig.from_preset("1b")
    psi = parameter_counts(cfg)[0]

    def est(stage: int, **kw: Any) -> Any:
        return estimate_memory(cfg, stage=stage, world_size=n, precision="bf16-mixed", micro_batch=1, seq_len=128,
                               **kw)

    paper = [est(s, accounting="paper") for s in range(4)]
    assert paper[0].model_states == 16 * psi
    assert paper[1].model_states == 4 * psi + 12 * psi // n
    assert paper[2].model_states == 2 * psi + 14 * psi // n
    assert paper[3].model_states == 16 * psi // n
    ours = [est(s) for s in range(4)]
    shard = -(-psi // n)
    # fp32 weights under autocast: 4 + 4 + 8 bytes, the master is the parameter itself.
    assert ours[1].optimizer_state == 8 * shard and ours[1].master_weights == 0
    assert ours[1].gradients == 4 * psi  # stage 1 keeps full gradients
    assert ours[2].gradients == 4 * shard and ours[2].parameters == 4 * psi
    assert ours[3].parameters == ours[3].gradients == 4 * shard
    if n == 1:
        assert ours[0].model_states == 16 * psi
    else:
        assert ours[0].gradients == 8 * psi  # param.grad plus DDP's gradient buckets
    # Activations do not depend on stages 0-2; stage 3 computes on gathered bf16 weights (no autocast weight copies,
    # bf16 residual stream), so it keeps less. The peak decreases with the stage.
    assert len({e.activations for e in ours[:3]}) == 1 and ours[3].activations < ours[2].activations
    assert ours[3].peak <= ours[2].peak <= ours[1].peak


def test_bf16_true_keeps_fp32_masters_and_offload_moves_state() -> None:
    cfg = LlamaConfig.from_preset("tiny")
    psi = parameter_counts(cfg)[0]
    kw: dict[str, Any] = dict(world_size=4, precision="bf16-true", micro_batch=1, seq_len=16)
    shard = -(-psi // 4)
    s1 = estimate_memory(cfg, stage=1, **kw)
    assert s1.parameters == 2 * psi and s1.master_weights == 4 * shard
    assert s1.optimizer_state == 12 * shard and s1.gradients == 2 * psi + 4 * shard
    off = estimate_memory(cfg, stage=2, offload_optimizer=True, **kw)
    assert off.optimizer_state == 0 and off.cpu == 16 * shard
    off3 = estimate_memory(cfg, stage=3, offload_optimizer=True, offload_parameters=True, **kw)
    assert off3.parameters == off3.gradients == off3.optimizer_state == 0 and off3.cpu > 0
    assert "optimizer state" in str(s1) and "ZeRO paper" in str(s1)


def _measure(cfg: LlamaConfig, precision: str, policy: str, batch: int, seq_len: int) -> int:
    torch.manual_seed(0)
    model = Llama(cfg)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)  # what Lightning's bf16-true does (buffers included)
    apply_activation_checkpointing(model, policy)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(tokens)

    return activation_memory(model, forward)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize(("preset", "overrides", "batch", "seq_len"), [
    ("tiny", {}, 2, 37),
    ("tiny", dict(n_layers=5, dim=96, n_heads=6, n_kv_heads=2, ffn_hidden_dim=160), 1, 113),
    ("debug-1m", {}, 3, 17),  # tied embeddings, 4 blocks
])
def test_activations_match_measurement_on_cpu(precision: str, preset: str, overrides: dict[str, Any], batch: int,
                                              seq_len: int) -> None:
    cfg = LlamaConfig.from_preset(preset, **overrides)
    for policy in POLICIES:
        measured = _measure(cfg, precision, policy, batch, seq_len)
        est = activation_bytes(cfg, precision=precision, micro_batch=batch, seq_len=seq_len,
                               activation_checkpointing=policy)
        # The count is exact on CPU (torch 2.11-2.13); 2% leaves room for a torch release saving one small tensor
        # more (e.g. an RNG state of the attention kernel) without hiding a missed term (the smallest per-block
        # term, RoPE, is about 3% of a tiny block).
        assert est == pytest.approx(measured, rel=0.02), (policy, est, measured)


@pytest.mark.parametrize(("preset", "overrides", "batch", "seq_len"), [
    ("tiny", {}, 2, 37),
    ("tiny", dict(n_layers=5, dim=96, n_heads=6, n_kv_heads=2, ffn_hidden_dim=160), 1, 113),
    ("debug-1m", {}, 3, 17),
])
def test_stage3_bf16_gathered_activations_match_measurement_on_cpu(preset: str, overrides: dict[str, Any],
                                                                  batch: int, seq_len: int) -> None:
    # What FSDP2's MixedPrecisionPolicy(param_dtype=bf16) runs under autocast: bf16 weights (the gathered copies,
    # excluded like parameters), buffers (the RoPE table) left in fp32.
    cfg = LlamaConfig.from_preset(preset, **overrides)
    for policy in POLICIES:
        torch.manual_seed(0)
        model = Llama(cfg)
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
        assert model.rope.dtype == torch.float32
        apply_activation_checkpointing(model, policy)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))

        def forward(model: Llama = model, tokens: torch.Tensor = tokens) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(tokens)

        measured = activation_memory(model, forward)
        est = activation_bytes(cfg, precision="bf16-mixed", micro_batch=batch, seq_len=seq_len,
                               activation_checkpointing=policy, bf16_gathered=True)
        assert est == pytest.approx(measured, rel=0.02), (policy, est, measured)  # exact on CPU; 2% as above


def test_activations_and_peak_match_recorded_h100_run() -> None:
    records = sorted(RESULTS.glob("ac-1b-*.json"))
    if not records:
        pytest.skip("no recorded ac-1b benchmark")
    record = json.loads(records[0].read_text())
    cfg = record["config"]
    rows = {r["variant"]: r for r in record["results"] + record["peers"]}
    assert set(rows) == set(POLICIES)
    for policy, row in rows.items():
        est = estimate_memory(LlamaConfig.from_preset(cfg["preset"]), stage=0, world_size=1, precision="bf16-mixed",
                              micro_batch=cfg["micro_batch"], seq_len=cfg["seq_len"],
                              activation_checkpointing=policy, every_n=cfg["every_n"], loop="plain")
        # The goal: measured memory within 10% of the estimate.
        assert est.activations / 2**30 == pytest.approx(row["saved_activation_gib"], rel=0.1), policy
        assert est.peak / 2**30 == pytest.approx(row["peak_allocated_gib"], rel=0.1), policy


@pytest.mark.parametrize("n", [2, 4])
def test_peak_matches_recorded_multigpu_runs(n: int) -> None:
    # benchmarks/bench_zero.py: Lightning Trainer, bf16-mixed, AdamW; max over ranks of max_memory_allocated.
    records = sorted(RESULTS.glob(f"zero-1b-{n}gpu-*.json"))
    if not records:
        pytest.skip(f"no recorded zero-1b-{n}gpu benchmark")
    record = json.loads(records[0].read_text())
    cfg = record["config"]
    assert cfg["world_size"] == n and cfg["precision"] == "bf16-mixed" and cfg["activation_checkpointing"] == "none"
    rows = {r["variant"]: r for r in record["results"] + record["peers"]}
    assert {"ddp", "zero1", "zero2", "zero3"} <= set(rows)
    for variant, row in rows.items():
        est = estimate_memory(LlamaConfig.from_preset(cfg["preset"]), stage=row["estimate_stage"], world_size=n,
                              precision="bf16-mixed", micro_batch=cfg["micro_batch_per_rank"],
                              seq_len=cfg["seq_len"])
        # The goal: measured memory within 10% of the estimate (ddp is a peer: its max rank holds one
        # unexplained transient full gradient more, see docs/memory_estimate.md; it still lands within 10%).
        assert est.peak / 2**30 == pytest.approx(row["peak_allocated_gib"], rel=0.1), variant


def test_stage3_peak_falls_by_the_model_states_shrinkage() -> None:
    # From N=2 to N=4 only the 1/N terms change: parameters, last step's gradients (alive at the end of forward
    # under Lightning) and AdamW state, 16 bytes per parameter; activations and the gathered root do not.
    cfg = LlamaConfig.from_preset("1b")
    psi = parameter_counts(cfg)[0]
    e2, e4 = (estimate_memory(cfg, stage=3, world_size=n, precision="bf16-mixed", micro_batch=4, seq_len=4096)
              for n in (2, 4))
    assert e2.peak - e4.peak == 16 * psi // 2 - 16 * psi // 4
    assert e2.activations == e4.activations < estimate_memory(cfg, stage=2, world_size=2, precision="bf16-mixed",
                                                             micro_batch=4, seq_len=4096).activations


def _zero_memory(stage: int, dtype_name: str) -> dict[str, int]:
    """Worker: per-rank tensor sizes the ZeRO engine holds after one step of the tiny model."""
    from lightning_llmopt.parallel.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny")).to(getattr(torch, dtype_name))
    opt = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage)
    tokens = torch.randint(0, 320, (2, 16))
    model(tokens).float().square().mean().backward()
    opt.step()
    memory = opt.memory_bytes()
    opt.remove_hooks()
    return memory


@pytest.mark.parametrize(("stage", "dtype_name", "precision"), [
    (1, "float32", "32-true"), (2, "float32", "32-true"), (1, "bfloat16", "bf16-true"), (2, "bfloat16", "bf16-true"),
])
def test_model_states_match_zero_engine(dist_pool: Any, stage: int, dtype_name: str, precision: str) -> None:
    est = estimate_memory(LlamaConfig.from_preset("tiny"), stage=stage, world_size=2, precision=precision,
                          micro_batch=1, seq_len=16)
    for memory in dist_pool(2).run(_zero_memory, stage, dtype_name):
        # Padding (< N elements per bucket) and one `step` scalar per bucket are not modelled: 1% covers both.
        assert memory["parameters"] == pytest.approx(est.parameters, rel=0.01)
        assert memory["gradients"] == pytest.approx(est.gradients, rel=0.01)
        assert memory["master_weights"] == pytest.approx(est.master_weights, rel=0.01, abs=64)
        assert memory["optimizer_state"] + memory["master_weights"] == pytest.approx(est.optimizer_state, rel=0.01)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(stage=4), r"stage \(4\) must be 0 \(DDP\), 1, 2 or 3"),
    (dict(world_size=0), r"world_size \(0\) must be a positive integer"),
    (dict(precision="fp8"), r"precision \('fp8'\) must be one of"),
    (dict(micro_batch=0), r"micro_batch \(0\) must be a positive integer"),
    (dict(seq_len=-3), r"seq_len \(-3\) must be a positive integer"),
    (dict(activation_checkpointing="half"), r"activation_checkpointing \('half'\) must be one of"),
    (dict(activation_checkpointing="every_n", every_n=0), r"every_n \(0\) must be a positive integer"),
    (dict(optimizer="lion"), r"optimizer \('lion'\) must be one of"),
    (dict(stage=0, offload_optimizer=True), r"offload_optimizer=True needs ZeRO stage >= 1, got stage \(0\)"),
    (dict(stage=2, offload_parameters=True), r"offload_parameters=True needs stage 3, got stage \(2\)"),
    (dict(accounting="deepspeed"), r"accounting \('deepspeed'\) must be one of"),
    (dict(loop="fabric"), r"loop \('fabric'\) must be one of"),
])
def test_bad_inputs_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = dict(stage=1, world_size=2, precision="bf16-mixed", micro_batch=1, seq_len=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        estimate_memory(LlamaConfig.from_preset("tiny"), **args)
