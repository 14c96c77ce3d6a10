"""PipeDream-2BW without Lightning: the pipeline on gloo ranks against a single-process run of its update rule.

The oracle (:func:`simulate_2bw`, written here, no pipeline): the unsplit model, the same contiguous micro-batch
split and loss scaling, gradients computed at the current weights and applied one optimizer step later, i.e.
``W(t+1) = W(t) - lr * grad f(W(t-1))`` (the first step has no gradient yet). fp32 on CPU is deterministic and the
pipeline does the same operations in the same order, so losses and parameters must be equal bit for bit
(``torch.equal``). The same oracle with the gradient applied at once (synchronous training) must differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.pipeline import PipelineConfig
from lightning_llmopt.parallel.pipeline_2bw import Action, simulate_windows, window_actions
from lightning_llmopt.parallel.pipeline_plan import plan

STEPS, ROWS, SEQ, LR = 4, 8, 16, 1e-3


def _cfg(n_layers: int) -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", n_layers=n_layers)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _data(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        d = torch.randint(0, 320, (ROWS, SEQ + 1), generator=g)
        out.append({"input_ids": d[:, :-1].contiguous(), "labels": d[:, 1:].contiguous()})
    return out


def simulate_2bw(
    state: dict[str, torch.Tensor], n_layers: int, batches: list[dict[str, torch.Tensor]], m: int, delayed: bool = True
) -> dict[str, Any]:
    """One process: per batch, the mean loss over ``m`` micro-batches (row blocks) and its gradient at the current
    weights; AdamW applies it one step later (``delayed``) or at once (synchronous training)."""
    model = Llama(_cfg(n_layers))
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params = list(model.parameters())
    losses, pending = [], None
    for batch in batches:
        total = torch.zeros(())
        for rows in torch.arange(ROWS).tensor_split(m):
            loss = _loss(model(batch["input_ids"][rows]), batch["labels"][rows]) / m
            loss.backward()
            total = total + loss.detach().float()
        losses.append(total)
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if delayed:
            grads, pending = pending, grads
        if grads is not None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
            opt.zero_grad()
    return {"losses": torch.stack(losses), "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def _pipeline_job(
    state: dict[str, torch.Tensor], n_layers: int, batches: list[dict[str, torch.Tensor]], m: int
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_llmopt.parallel.pipeline import prune_to_stages, stage_modules, validate_pipeline
    from lightning_llmopt.parallel.pipeline_2bw import PipeDream2BWRunner

    pp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    model = Llama(_cfg(n_layers))
    model.load_state_dict(state)
    config = PipelineConfig(pp=pp, schedule="pipedream_2bw", microbatches=m)
    split = validate_pipeline(model, config)
    prune_to_stages(model, split, rank)
    bytes_before = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = PipeDream2BWRunner(
        stage_modules(model, split, rank), split, config, mesh["pp"].get_group(), torch.device("cpu")
    )
    runner.log = []
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads_seen = [], []
    for batch in batches:
        labels = batch["labels"]
        losses.append(runner.train_step(batch, lambda out, rows, labels=labels: _loss(out, labels[rows])))
        grads_seen.append(all(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    versions_at_end = runner._versions_in_use()
    runner.drain()
    storages = runner.weights.storages()
    logits = runner.forward({"input_ids": batches[0]["input_ids"]})
    return {
        "losses": torch.stack(losses),
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "log": runner.log,
        "max_versions": runner.max_versions,
        "max_in_flight": runner.max_in_flight,
        "versions_at_end": versions_at_end,
        "storages": storages,
        "n_params": len(list(model.parameters())),
        "bytes": (bytes_before, sum(t.numel() * t.element_size() for b in runner.weights.buffers for t in b)),
        "grads_seen": grads_seen,
        "logits": logits,
    }


@pytest.fixture(scope="module")
def states() -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for n in (2, 4):
        torch.manual_seed(0)
        out[n] = {k: v.clone() for k, v in Llama(_cfg(n)).state_dict().items()}
    return out


def _union(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for r in per_rank:
        assert not set(params) & set(r["params"])  # every parameter lives on exactly one stage
        params.update(r["params"])
    return params


def _assert_bitwise(per_rank: list[dict[str, Any]], ref: dict[str, Any], what: str) -> None:
    for r in per_rank:  # every pipeline rank returns the last stage's losses
        assert torch.equal(r["losses"], ref["losses"]), (what, r["losses"], ref["losses"])
    params = _union(per_rank)
    assert sorted(params) == sorted(ref["params"]), what
    for k, v in params.items():
        assert torch.equal(v, ref["params"][k]), (what, k, float((v - ref["params"][k]).abs().max()))


@pytest.mark.parametrize(("pp", "n_layers", "m"), [(2, 2, 2), (2, 4, 4)])
def test_two_ranks_equal_the_delayed_rule_bitwise(
    dist_pool: Any, states: dict[int, dict[str, torch.Tensor]], pp: int, n_layers: int, m: int
) -> None:
    batches = _data()
    ref = simulate_2bw(states[n_layers], n_layers, batches, m)
    per_rank = dist_pool(pp).run(_pipeline_job, states[n_layers], n_layers, batches, m)
    _assert_bitwise(per_rank, ref, f"pp={pp} m={m}")
    sync = simulate_2bw(states[n_layers], n_layers, batches, m, delayed=False)
    # 2BW is not synchronous training: batch 0 runs at W(0) in both, batch 1 at W(0) under 2BW, at W(1) without delay
    assert torch.equal(ref["losses"][0], sync["losses"][0]) and not torch.equal(ref["losses"][1], sync["losses"][1])
    assert not any(torch.equal(ref["params"][k], sync["params"][k]) for k in ref["params"])
    assert not any(torch.equal(ref["params"][k], states[n_layers][k]) for k in ref["params"])  # the weights moved
    # every rank: no gradient after the first window (nothing finished), the previous batch's after every other
    for r in per_rank:
        assert r["grads_seen"] == [False] + [True] * (STEPS - 1)
    # the forward-only pass after training uses the live weights: the logits of the trained single process
    model = Llama(_cfg(n_layers))
    model.load_state_dict(ref["params"], strict=False)
    with torch.no_grad():
        expected = model(batches[0]["input_ids"])
    assert torch.equal(per_rank[0]["logits"], expected)


def test_four_ranks_equal_the_delayed_rule_bitwise(dist_pool: Any, states: dict[int, dict[str, torch.Tensor]]) -> None:
    batches = _data()
    ref = simulate_2bw(states[4], 4, batches, 4)
    per_rank = dist_pool(4).run(_pipeline_job, states[4], 4, batches, 4)
    _assert_bitwise(per_rank, ref, "pp=4 m=4")
    # weight versions: two per stage, never more in use; the first stage keeps the stash across the step boundary
    for rank, r in enumerate(per_rank):
        assert r["storages"] == 2 * r["n_params"], rank
        assert r["bytes"][1] == 2 * r["bytes"][0], rank
        lag = 4 - 1 - rank
        assert r["max_versions"] == (2 if lag > 0 else 1), (rank, r["max_versions"])
        assert r["versions_at_end"] == (2 if lag > 0 else 1), rank
        assert r["max_in_flight"] == lag + 1, rank  # activations of at most w + 1 micro-batches, as 1F1B


def test_action_order_overlaps_batches_without_a_flush(
    dist_pool: Any, states: dict[int, dict[str, torch.Tensor]]
) -> None:
    """Rank 0 of 4 runs the forwards of batch t before the last backwards of batch t - 1 (the 1F1B order never
    drains between batches), each backward with the version its forward used."""
    batches = _data(3)
    per_rank = dist_pool(4).run(_pipeline_job, states[4], 4, batches, 4)
    m = 4
    for rank, r in enumerate(per_rank):
        order = [a for _, a, _ in r["log"]]
        expected = [a for t in range(3) for a in window_actions(4, rank, m, t)]
        lag = 4 - 1 - rank
        expected += [Action("B", j) for j in range(3 * m - lag, 3 * m)]  # the drain
        assert order == expected, rank
    log0 = per_rank[0]["log"]
    window1 = [a for t, a, _ in log0 if t == 1]
    assert window1[:2] == [Action("F", 4), Action("B", 1)]  # batch 1's forward, then batch 0's backward
    assert [a.microbatch for a in window1 if a.kind == "B"] == [1, 2, 3, 4]  # three of batch 0, one of batch 1
    # versions: forwards of window t use the live buffer; B(j) uses the buffer F(j) used
    version_of_forward = {a.microbatch: v for _, a, v in log0 if a.kind == "F"}
    assert {version_of_forward[j] for j in range(4)} == {version_of_forward[0]}
    assert version_of_forward[4] != version_of_forward[0]


def test_window_actions_is_1f1b_without_flush() -> None:
    # concatenated windows = warm-up forwards, then one forward and one backward alternating, across batches
    pp, m = 4, 4
    for rank in range(pp):
        lag = pp - 1 - rank
        order = [a for t in range(3) for a in window_actions(pp, rank, m, t)]
        warm = [Action("F", j) for j in range(lag)]
        steady = [x for j in range(lag, 3 * m) for x in (Action("F", j), Action("B", j - lag))]
        assert order == warm + steady


@pytest.mark.parametrize(("pp", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (8, 16)])
def test_steady_state_time_per_batch(pp: int, m: int) -> None:
    """Unit costs (F = 1, B = 2): with no synchronisation between steps a batch costs 3M once the pipeline is full
    (no bubble); the per-step loss broadcast adds (P - 1) F; 1F1B with its flush costs 3 (M + P - 1)."""
    ends = simulate_windows(pp, m, 12, sync=False)
    assert [ends[t] - ends[t - 1] for t in range(4, 12)] == [3.0 * m] * 8
    ends = simulate_windows(pp, m, 12, sync=True)
    assert [ends[t] - ends[t - 1] for t in range(4, 12)] == [3.0 * m + pp - 1] * 8
    assert plan("1f1b", pp, m).makespan == 3.0 * (m + pp - 1)


def test_pipeline_plan_cli_reports_the_steady_state(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_llmopt.cli.pipeline_plan import main

    main(["--schedule", "pipedream_2bw", "--pp", "4", "--microbatches", "8"])
    out = capsys.readouterr().out
    assert "time per batch 24 (bubble 0.0000), 27 with the per-step loss broadcast (bubble 0.1111); 1F1B 33" in out
    with pytest.raises(SystemExit):  # no per-batch timeline to draw: refused, not silently skipped
        main(["--schedule", "pipedream_2bw", "--png", "plan.png"])
    assert "--png draws one schedule's timeline, not pipedream_2bw" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 4, "schedule": "pipedream_2bw", "microbatches": 2}, r"microbatches \(2\) must be >= pipeline"),
        ({"pp": 2, "schedule": "pipedream_2bw", "virtual_stages": 2}, r"virtual_stages \(2\) must be 1"),
    ],
)
def test_config_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)
