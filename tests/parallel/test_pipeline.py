"""Pipeline parallelism without Lightning: the stage split (pure), and one step of every schedule on 2 gloo ranks
against the unsplit model's loss and gradients in one process (which we did not pipeline)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.pipeline import SCHEDULES, PipelineConfig, validate_pipeline
from lightning_llmopt.parallel.pipeline_split import block_costs, partition, split_stages, stage_ranks


def _config(**overrides: Any) -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", **overrides)


# ------------------------------------------------------------------ split (pure)
def test_even_split_and_remainder() -> None:
    assert split_stages(_config(n_layers=8), 4).ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert split_stages(_config(n_layers=7), 3).ranges == ((0, 3), (3, 5), (5, 7))


def test_llama3_balance_gives_fewer_blocks_to_the_ends() -> None:
    split = split_stages(_config(n_layers=14), 4, balance_ends=True)
    assert [b - a for a, b in split.ranges] == [3, 4, 4, 3]
    assert split.costs == (4.0, 4.0, 4.0, 4.0)  # the embedding and the head count as one block each


def test_cost_split_charges_the_head() -> None:
    # A large vocabulary makes the head expensive: the last stage gets fewer blocks than the first.
    cfg = _config(n_layers=8, vocab_size=32000)
    blocks, emb, head = block_costs(cfg, seq_len=16)
    assert head > blocks[0] > 0 and emb > 0
    split = split_stages(cfg, 2, split="cost", balance_ends=True, seq_len=16)
    sizes = [b - a for a, b in split.ranges]
    assert sum(sizes) == 8 and sizes[1] < sizes[0]
    # the DP optimum: no contiguous split has a smaller most expensive stage
    best = min(max(sum(blocks[:k]) + emb, sum(blocks[k:]) + head) for k in range(1, 8))
    assert abs(max(split.costs) - best) < 1e-12
    assert split_stages(cfg, 2, split="cost", seq_len=16).ranges == ((0, 4), (4, 8))  # equal blocks, no ends


def test_partition_optimal_on_uneven_costs() -> None:
    costs = [1.0, 5.0, 1.0, 1.0, 1.0, 4.0]
    ranges = partition(costs, 3)
    worst = max(sum(costs[a:b]) for a, b in ranges)
    assert worst == 6.0 and [b - a for a, b in ranges][0] >= 1


def test_stage_placement() -> None:
    assert stage_ranks(8, 4, "loop") == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_ranks(4, 2, "v") == (0, 1, 1, 0)
    split = split_stages(_config(n_layers=4), 2, 2, style="v")
    assert split.local_stages(0) == [0, 3] and split.layers_of([0, 3]) == [0, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "pipedream"}, r"schedule \('pipedream'\) must be one of"),
        ({"pp": 4, "schedule": "1f1b", "microbatches": 2}, r"microbatches \(2\) must be >= pipeline_parallel \(4\)"),
        ({"pp": 2, "schedule": "gpipe", "virtual_stages": 2}, r"virtual_stages \(2\) must be 1"),
        ({"pp": 2, "schedule": "zbv", "virtual_stages": 3}, r"virtual_stages \(3\) must be 2"),
        ({"pp": 2, "schedule": "zbv", "microbatches": 2}, r"microbatches \(2\) must be >= 2\*pipeline_parallel \(4\)"),
        ({"pp": 4, "schedule": "interleaved_1f1b", "microbatches": 6}, r"multiple of pipeline_parallel \(4\)"),
        ({"split": "random"}, r"pipeline split \('random'\) must be"),
    ],
)
def test_config_errors_name_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)


def test_model_errors_name_values() -> None:
    with pytest.raises(ValueError, match=r"n_layers \(2\) must be >= pipeline_parallel\*virtual_stages \(2\*2 = 4\)"):
        validate_pipeline(Llama(_config()), PipelineConfig(pp=2, schedule="interleaved_1f1b"))
    with pytest.raises(ValueError, match=r"tie_embeddings=True"):
        validate_pipeline(Llama(_config(tie_embeddings=True)), PipelineConfig(pp=2))


# ------------------------------------------------------------------ one step on 2 ranks vs one process
def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _pipeline_step(
    state: dict[str, torch.Tensor], schedule: str, batch: dict[str, torch.Tensor], microbatches: int
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_llmopt.parallel.pipeline import PipelineRunner, prune_to_stages, stage_modules

    pp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    model = Llama(_config(n_layers=4))
    model.load_state_dict(state)
    config = PipelineConfig(pp=pp, schedule=schedule, microbatches=microbatches)
    split = validate_pipeline(model, config)
    rank = dist.get_rank()
    prune_to_stages(model, split, rank)
    runner = PipelineRunner(
        stage_modules(model, split, rank), split, config, mesh["pp"].get_group(), torch.device("cpu")
    )
    labels = batch["labels"]
    loss = runner.train_step({"input_ids": batch["input_ids"]}, lambda out, rows: _loss(out, labels[rows]))
    logits = runner.forward({"input_ids": batch["input_ids"]})
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss), "grads": grads, "logits": logits, "names": sorted(dict(model.named_parameters()))}


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(_config(n_layers=4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 320, (4, 17), generator=g)
    batch = {"input_ids": data[:, :-1], "labels": data[:, 1:]}
    logits = model(batch["input_ids"])
    loss = _loss(logits, batch["labels"])
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return {"state": state, "batch": batch, "loss": float(loss), "grads": grads, "logits": logits.detach()}


def test_every_schedule_two_ranks(dist_pool: Any, one_process: dict[str, Any]) -> None:
    """Loss, gradients (the union over both ranks, named as in the full model) and forward-only logits match one
    process for every schedule; fp32, bound 1e-6 relative (measured ~1e-7: the order of micro-batch sums)."""
    import torch.distributed.pipelining as pipelining

    pool = dist_pool(2)
    for name, (cls, _, style, _) in SCHEDULES.items():
        if getattr(pipelining, cls, None) is None:
            continue  # dualpipev on an older torch: PipelineConfig names the missing class (tested below)
        m = 4
        per_rank = pool.run(_pipeline_step, one_process["state"], name, one_process["batch"], m)
        grads: dict[str, torch.Tensor] = {}
        for r in per_rank:
            err = float((r["logits"] - one_process["logits"]).norm() / one_process["logits"].norm())
            assert err <= 1e-6, (name, err)
            assert abs(r["loss"] - one_process["loss"]) <= 1e-6 * one_process["loss"], (name, r["loss"])
            assert not set(grads) & set(r["grads"])  # every parameter lives on exactly one rank
            grads.update(r["grads"])
        assert sorted(grads) == sorted(one_process["grads"]), name
        ref = torch.cat([one_process["grads"][k].flatten() for k in sorted(grads)])
        got = torch.cat([grads[k].flatten() for k in sorted(grads)])
        assert float((got - ref).norm() / ref.norm()) <= 1e-6, name
        if style == "v":  # rank 0 holds the first and the last stage
            assert "tok_embeddings.weight" in per_rank[0]["names"] and "output.weight" in per_rank[0]["names"]


def _strided_step(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """1F1B step on 2 rows per micro-batch, recording whether each stage-0 micro-batch reached the module contiguous."""
    import torch.distributed as dist

    from lightning_llmopt.parallel.pipeline import PipelineRunner, prune_to_stages, stage_modules

    model = Llama(_config(n_layers=4))
    model.load_state_dict(state)
    config = PipelineConfig(pp=2, schedule="1f1b", microbatches=2)
    split = validate_pipeline(model, config)
    prune_to_stages(model, split, dist.get_rank())
    modules = stage_modules(model, split, dist.get_rank())
    seen: list[bool] = []
    if 0 in modules:
        modules[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
    runner = PipelineRunner(modules, split, config, dist.group.WORLD, torch.device("cpu"))
    labels = batch["labels"]
    loss = runner.train_step({"input_ids": batch["input_ids"]}, lambda out, rows: _loss(out, labels[rows]))
    return {"loss": float(loss), "contiguous": seen}


def test_strided_rows_of_several_per_microbatch(dist_pool: Any, one_process: dict[str, Any]) -> None:
    """``input_ids = data[:, :-1]`` (row stride T + 1) in micro-batches of 2 rows: torch 2.11's stages compare each
    micro-batch's strides with the ones they inferred and raised a stride mismatch, so the runner hands stage 0
    contiguous micro-batches; the loss still matches one process."""
    batch = one_process["batch"]
    assert not batch["input_ids"].is_contiguous()
    per_rank = dist_pool(2).run(_strided_step, one_process["state"], batch)
    assert per_rank[0]["contiguous"] and all(per_rank[0]["contiguous"]), per_rank[0]["contiguous"]
    for r in per_rank:
        assert abs(r["loss"] - one_process["loss"]) <= 1e-6 * one_process["loss"], r["loss"]


# ------------------------------------------------------------------ schedule plans (pure)
@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]
)
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_simulated_bubble_equals_theory(schedule: str, v: int, pp: int, m: int) -> None:
    """The event simulation of each rank's operation order (ours for GPipe/1F1B, torch's table for interleaved)
    reproduces the closed forms (P-1)/(M+P-1) and (P-1)/(VM+P-1) of ANCHORS exactly."""
    from lightning_llmopt.parallel.pipeline_plan import plan, theoretical_bubble

    p = plan(schedule, pp, m, v)
    theory = theoretical_bubble(schedule, pp, m, v)
    assert theory is not None and abs(p.bubble - theory) < 1e-12, (p.bubble, theory)


def test_zero_bubble_schedules_beat_1f1b() -> None:
    from lightning_llmopt.parallel.pipeline_plan import plan

    one_f_one_b = plan("1f1b", 4, 8).bubble
    for name in ("zero_bubble", "zbv"):
        assert plan(name, 4, 8, 2).bubble < 0.25 * one_f_one_b


def test_pipeline_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_llmopt.cli.pipeline_plan import main

    main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"])
    out = capsys.readouterr().out
    assert "rank 0: F0" in out and "rank 1: " in out and "theoretical 0.2000" in out  # (2-1)/(4+2-1)
    main(["--all", "--pp", "2", "--microbatches", "4"])
    assert "zbv" in capsys.readouterr().out
