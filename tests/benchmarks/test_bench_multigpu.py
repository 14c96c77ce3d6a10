"""bench_multigpu.py without GPUs: the packing of launches onto free GPUs, the deadline, and the record's ratios and
goals on hand-made rows (the launches themselves are a benchmark, not a test)."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_llmopt.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
mg = load_script(BENCH / "bench_multigpu.py", "_test_bench_multigpu")


def _job(name: str, ngpu: int) -> Any:
    return mg.Job("dp", name, BENCH / "bench_zero.py", [], ngpu, {"strategy": name, "world": ngpu})


def test_packing_never_shares_a_gpu_and_keeps_the_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lock = threading.Lock()
    busy: dict[int, str] = {}
    starts: list[str] = []

    def fake_launch(script: str, args: Any, variant: str, nproc: int, log: Path, timeout: float,
                    env: dict[str, str] | None = None, **_: Any) -> dict[str, Any]:
        gpus = [int(g) for g in (env or {})["CUDA_VISIBLE_DEVICES"].split(",")]
        assert len(gpus) == nproc
        with lock:
            starts.append(variant)
            for g in gpus:
                assert g not in busy, f"{variant} got GPU {g} held by {busy[g]}"
                busy[g] = variant
        time.sleep(0.05)
        with lock:
            for g in gpus:
                del busy[g]
        return {"tokens_per_s": 1.0}

    monkeypatch.setattr(mg.launch, "launch", fake_launch)
    jobs = [_job("a4", 4), _job("b2", 2), _job("c2", 2), _job("d1", 1), _job("e2", 2), _job("f1", 1), _job("g4", 4)]
    done: list[str] = []
    mg.run_packed(jobs, 4, tmp_path, 60.0, lambda job: done.append(job.name), smoke=False)
    assert sorted(starts) == sorted(j.name for j in jobs)
    assert [j.gpus for j in jobs[:3]] == [[0, 1, 2, 3], [0, 1], [2, 3]]
    assert sorted(done) == sorted(j.name for j in jobs)
    assert "c2" in jobs[1].beside and "b2" in jobs[2].beside  # the two 2-GPU launches ran side by side
    assert not jobs[0].beside and not jobs[-1].beside  # a 4-GPU launch runs alone


def test_the_deadline_leaves_later_launches_unrun(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[float] = []

    def fake_launch(*args: Any, **kw: Any) -> dict[str, Any]:
        calls.append(args[5])  # the launch's time limit: cut to what is left before the deadline
        return {"tokens_per_s": 1.0}

    monkeypatch.setattr(mg.launch, "launch", fake_launch)
    jobs = [_job("a", 1), _job("b", 1)]
    mg.run_packed(jobs, 1, tmp_path, 600.0, lambda job: None, smoke=False, deadline=time.monotonic() + 100)
    assert len(calls) == 2 and all(c <= 100 for c in calls)
    late = [_job("c", 1)]
    mg.run_packed(late, 1, tmp_path, 600.0, lambda job: None, smoke=False, deadline=time.monotonic() + 10)
    assert "deadline" in late[0].row["error"]


def _row(strategy: str, world: int, mb: int, tps: float, mem: float, seq: int = 2048) -> dict[str, Any]:
    return {"variant": f"{strategy} x{world} mb{mb}", "strategy": strategy, "world": world, "micro_batch": mb,
            "seq_len": seq, "preset": "1b", "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
            "peak_allocated_gib": mem}


def test_record_ratios_and_goals() -> None:
    a = argparse.Namespace(warmup_steps=3, steps=8, layers_8b=None, command="x")
    rows = [_row("single", 1, 8, 70_000, 40), _row("zero3", 4, 8, 4 * 66_500, 30),
            _row("fsdp-hf-liger", 4, 8, 4 * 50_000, 31), _row("ddp", 4, 8, 4 * 60_000, 50), _row("zero2", 2, 8, 0, 0)]
    rows[-1] = {**rows[-1], "error": "OOM on rank 0"}
    record = mg.build_record("dp", rows, a, 4)
    by = {r["variant"]: r for r in record["results"]}
    assert by["zero3 x4 mb8"]["per_gpu_vs_single"] == pytest.approx(0.95)
    assert by["zero3 x4 mb8"]["vs_fsdp_hf_liger"] == pytest.approx(1.33, abs=1e-3)
    assert by["ddp x4 mb8"]["per_gpu_vs_single"] == pytest.approx(60 / 70)
    notes = "\n".join(record["notes"])
    assert "zero3 x4 mb8: per-GPU 0.950x single (goal >= 0.9: MET); 1.330x fsdp-hf-liger at 0.968x" in notes
    assert "ddp x4 mb8: per-GPU 0.857x single (goal >= 0.9: NOT MET); 1.200x fsdp-hf-liger at 1.613x" in notes
    assert "zero2 x2 mb8 failed: OOM on rank 0" in notes
    assert [r["variant"] for r in record["peers"]] == ["fsdp-hf-liger x4 mb8"]
    assert {(r["variant"], r["peer"]) for r in record["ratios"]} == {("zero3 x4 mb8", "fsdp-hf-liger"),
                                                                     ("ddp x4 mb8", "fsdp-hf-liger")}
