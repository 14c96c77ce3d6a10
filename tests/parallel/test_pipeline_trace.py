"""Action recorder of pipeline steps: recording changes nothing, records every scheduled action exactly once in the
schedule's own order (torch's tables; GPipe/1F1B by their definition), and the bubble arithmetic against hand-computed
timelines and the closed form (P-1)/(M+P-1)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.pipeline import SCHEDULES, PipelineConfig, validate_pipeline
from lightning_llmopt.parallel.pipeline_trace import ActionRecord, StepTrace

MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _config() -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", n_layers=4)


def _step(state: dict[str, torch.Tensor], schedule: str, data: torch.Tensor, record: bool) -> dict[str, Any]:
    """Two steps of ``schedule`` (M = 4) on this rank, with or without the recorder."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from lightning_llmopt.parallel.pipeline import PipelineRunner, prune_to_stages, stage_modules
    from lightning_llmopt.parallel.pipeline_trace import ActionRecorder

    originals = (schedules._batch_p2p, schedules._wait_batch_p2p)
    model = Llama(_config())
    model.load_state_dict(state)
    config = PipelineConfig(pp=dist.get_world_size(), schedule=schedule, microbatches=4)
    split = validate_pipeline(model, config)
    rank = dist.get_rank()
    prune_to_stages(model, split, rank)
    runner = PipelineRunner(stage_modules(model, split, rank), split, config, dist.group.WORLD, torch.device("cpu"))
    if record:
        runner.recorder = ActionRecorder()
    losses = []
    for _ in range(2):
        loss = runner.train_step(
            {"input_ids": data[:, :-1]}, lambda out, rows: F.cross_entropy(out.flatten(0, 1), data[rows, 1:].flatten())
        )
        losses.append(float(loss))
    wrapped = any("forward_one_chunk" in vars(s) for s in runner._stages)
    return {
        "losses": losses,
        "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
        "traces": [t.to_dict() for t in runner.recorder.traces] if record else [],
        "wrapped": wrapped,
        "restored": (schedules._batch_p2p, schedules._wait_batch_p2p) == originals,
    }


@pytest.fixture(scope="module")
def state_and_data() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Llama(_config()).state_dict().items()}
    return state, torch.randint(0, 320, (4, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_recorder_changes_nothing_and_records_each_action_once(
    dist_pool: Any, state_and_data: tuple[dict[str, torch.Tensor], torch.Tensor], schedule: str
) -> None:
    """Recorder on vs off: bitwise equal losses and gradients; nothing of the recorder left installed after a
    recorded step (stage and schedule methods, torch's p2p functions). The recorded compute actions of each rank are
    exactly its action list in the schedule's order (GPipe/1F1B by definition, the others from torch's schedule
    tables, ``pipeline_plan.schedule_orders``): every stage x micro-batch has one F and one B, or one I and one W,
    and the last stage one loss per micro-batch; every posted transfer is waited on."""
    import torch.distributed.pipelining as pipelining

    from lightning_llmopt.parallel.pipeline_plan import schedule_orders

    if getattr(pipelining, SCHEDULES[schedule][0], None) is None:
        pytest.skip(f"this torch has no {SCHEDULES[schedule][0]}")
    state, data = state_and_data
    pool = dist_pool(2)
    off = pool.run(_step, state, schedule, data, False)
    on = pool.run(_step, state, schedule, data, True)
    v = SCHEDULES[schedule][3] if SCHEDULES[schedule][1] else 1
    orders = schedule_orders(schedule, 2, 4, v)
    last = 2 * v - 1
    for rank, (a, b) in enumerate(zip(off, on, strict=True)):
        assert a["losses"] == b["losses"], (schedule, a["losses"], b["losses"])
        assert a["grads"].keys() == b["grads"].keys()
        assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"]), schedule
        assert not a["wrapped"] and not b["wrapped"] and a["restored"] and b["restored"]  # nothing left installed
        assert len(b["traces"]) == 2
        for trace in map(StepTrace.from_dict, b["traces"]):
            compute = [(x.stage, x.kind, x.microbatch) for x in trace.actions if x.kind in "FBIW"]
            assert compute == [tuple(op) for op in orders[rank]], (schedule, rank, compute)
            losses = sorted(x.microbatch for x in trace.actions if x.kind == "L")
            assert losses == (list(range(4)) if any(s == last for s, _, _ in compute) else []), (schedule, losses)
            posted = [x for x in trace.actions if x.kind in ("send", "recv", "sendrecv")]
            waited = [x.detail for x in trace.actions if x.kind == "wait"]
            assert sorted(p.detail for p in posted) == sorted(waited), schedule
            assert all(x.end >= x.start >= 0 and x.end <= trace.duration for x in trace.actions)
    every = [op for r in on for t in map(StepTrace.from_dict, r["traces"][-1:]) for op in _ops(t)]
    for s in range(2 * v):
        for m in range(4):
            kinds = sorted(k for s2, k, m2 in every if (s2, m2) == (s, m))
            allowed = {"gpipe": [["B", "F"]], "1f1b": [["B", "F"]], "interleaved_1f1b": [["B", "F"]]}.get(
                schedule, [["F", "I", "W"]] if schedule != "dualpipev" else [["B", "F"], ["F", "I", "W"]]
            )  # DualPipeV's overlapped F+B steps run full backwards
            assert kinds in allowed, (schedule, s, m, kinds)
    assert len(every) == len(set(every)), schedule  # nothing twice


def _ops(trace: StepTrace) -> list[tuple[int | None, str, int | None]]:
    return [(x.stage, x.kind, x.microbatch) for x in trace.actions if x.kind in "FBIW"]


# ------------------------------------------------------------------ bubble arithmetic (pure)
def _trace(rank: int, t0: float, duration: float, actions: list[tuple[str, float, float]]) -> StepTrace:
    recs = [ActionRecord(k, 0, 0, s, e, s, e) for k, s, e in actions]
    return StepTrace(rank, int(t0 * 1e9), duration, duration, "cpu", recs)


def _synthetic() -> list[StepTrace]:
    # rank 0 from t=0 for 8 s; its loss overlaps its second forward and a wait (counted once in busy time)
    r0 = _trace(0, 0.0, 8.0, [("F", 0, 1), ("F", 1, 2), ("L", 1.5, 2.5), ("wait", 2, 3), ("B", 3, 5), ("B", 5, 7)])
    # rank 1 starts 1 s later and runs 7 s: the common window is [0, 8]
    r1 = _trace(1, 1.0, 7.0, [("F", 0, 1), ("B", 1, 3), ("recv", 3, 3.5), ("F", 3.5, 4), ("B", 4, 6)])
    return [r1, r0]  # any order


def test_bubble_of_a_hand_built_timeline() -> None:
    from lightning_llmopt.parallel.pipeline_timeline import bubble_summary, union_seconds

    assert union_seconds([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == pytest.approx(3.0)
    s = bubble_summary(_synthetic(), "1f1b", 2)
    # busy: rank 0 [0, 2.5] + [3, 7] = 6.5 s; rank 1 [0, 3] + [3.5, 6] = 5.5 s; window 8 s, 2 ranks
    assert s["window_s"] == pytest.approx(8.0)
    assert s["measured_bubble"] == pytest.approx(1 - (6.5 + 5.5) / 16)
    assert s["idle_fraction_per_rank"] == pytest.approx([1 - 6.5 / 8, 1 - 5.5 / 8])
    assert s["imbalance"] == pytest.approx(6.5 / 6.0)
    # host time outside every action: rank 0 covers [0, 7] of 8 s, rank 1 [0, 6] of 7 s
    assert s["bookkeeping_host_s_per_rank"] == pytest.approx([1.0, 1.0])
    assert s["wait_s_per_rank"] == pytest.approx([1.0, 0.0])
    assert s["ranks"][0]["actions"]["F"] == {"count": 2, "seconds": 2.0}
    assert s["theory_bubble"] == pytest.approx(1 / 3)  # (P-1)/(M+P-1) with P = 2, M = 2
    assert s["bubble_gap_points"] == pytest.approx(100 * (0.25 - 1 / 3))


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_bubble_of_a_perfect_1f1b_timeline_is_the_closed_form(pp: int, m: int) -> None:
    """A trace whose actions take the plan's unit-cost times gives (P-1)/(M+P-1) exactly."""
    from lightning_llmopt.parallel.pipeline_plan import plan
    from lightning_llmopt.parallel.pipeline_timeline import bubble_summary

    p = plan("1f1b", pp, m)
    traces = [
        StepTrace(
            r,
            0,
            p.makespan,
            p.makespan,
            "cpu",
            [ActionRecord(op.kind, op.stage, op.microbatch, s, e, s, e) for s, e, op in ops],
        )
        for r, ops in enumerate(p.timeline)
    ]
    assert bubble_summary(traces)["measured_bubble"] == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


@pytest.mark.skipif(not MATPLOTLIB, reason="matplotlib (the plot extra) is not installed")
def test_timeline_png_and_plan_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    from lightning_llmopt.cli.pipeline_plan import main
    from lightning_llmopt.parallel.pipeline_timeline import draw_timelines

    measured = tmp_path / "measured.png"
    draw_timelines(_synthetic(), str(measured), "1f1b", 2)
    theory = tmp_path / "plan.png"
    main(["--schedule", "zbv", "--pp", "2", "--microbatches", "4", "--png", str(theory)])
    assert f"wrote {theory}" in capsys.readouterr().out
    for path in (measured, theory):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image[..., :3].std() > 0  # not blank
