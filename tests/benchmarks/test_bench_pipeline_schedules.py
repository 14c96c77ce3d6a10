"""bench_pipeline_schedules.py's record: speedups over 1F1B, the issue's acceptance checks, the CPU smoke marking
(records loaded and rendered like any other), on hand-made rows (the run itself is a benchmark, not a test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_llmopt.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
bench = load_script(BENCH / "bench_pipeline_schedules.py", "_test_bench_pipeline_schedules")
render_results = load_script(BENCH / "render_results.py", "_test_bench_render_results_pp")


def _row(schedule: str, step_s: float, measured: float, theory: float) -> dict:
    return {
        "variant": f"{schedule}-s32-m4",
        "schedule": schedule,
        "seq_len": 32,
        "microbatches": 4,
        "step_s": step_s,
        "measured_bubble": measured,
        "theory_bubble": theory,
        "bubble_gap_points": 100 * (measured - theory),
        "actions_per_rank": [{"F": {"count": 4, "seconds": 0.1}}, {"F": {"count": 4, "seconds": 0.2}}],
    }


def test_comparisons_and_checks() -> None:
    rows = [_row("1f1b", 1.0, 0.23, 0.2), _row("interleaved_1f1b", 0.95, 0.2, 0.11), _row("zbv", 0.8, 0.1, 0.04)]
    rows.append({"variant": "dualpipev-s32-deferred", "schedule": "dualpipev", "skipped": "no class"})
    checks = bench.add_comparisons(rows)
    assert rows[1]["speedup_vs_1f1b"] == pytest.approx(1 / 0.95)
    assert rows[2]["predicted_speedup_vs_1f1b"] == pytest.approx(0.96 / 0.8)
    assert checks == {
        "1f1b-s32-m4_bubble_within_5_points": True,  # 3 points above theory
        "interleaved_1f1b-s32-m4_speedup_ge_1.10": False,  # 1.053x
        "zbv-s32-m4_speedup_ge_1.15": True,  # 1.25x
    }


def test_cpu_record_is_marked_smoke_and_renders(tmp_path: Path) -> None:
    args = bench.parse(["--device", "cpu", "--results-dir", str(tmp_path)])
    assert (args.preset, args.seq_len, args.microbatches) == ("tiny", [32], 4)
    bench.write(args, [_row("1f1b", 1.0, 0.3, 0.2), _row("zbv", 0.9, 0.1, 0.04)], 2)
    (path,) = tmp_path.glob("*.json")
    assert path.name == "pipeline-schedules-tiny-8l-s32-2rank-smoke-cpu.json"
    record = json.loads(path.read_text())
    assert record["config"]["smoke"] is True and "SMOKE" in record["notes"][0]
    assert record["checks"]["1f1b-s32-m4_bubble_within_5_points"] is False  # 10 points above
    assert "actions_per_rank" not in record["results"][0]
    assert record["breakdown"]["zbv-s32-m4"][1]["F"]["count"] == 4
    assert "### pipeline-schedules-tiny-8l-s32-2rank-smoke" in render_results.render([record])
