"""Benchmark records and the results page, on records written to tmp_path (benchmarks/ is not a package)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from lightning_llmopt.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    return load_script(BENCH / f"{name}.py", f"_test_bench_{name}")


records = _load("records")
render_results = _load("render_results")

ENV = {
    "device": "NVIDIA H100 80GB HBM3",
    "device_slug": "nvidia-h100-80gb-hbm3",
    "gpu_count": 1,
    "torch": "2.13.0",
    "triton": "3.9.0",
    "lightning": "2.6.6",
    "transformers": None,
    "cuda": "12.8",
    "python": "3.11.7",
    "git_commit": "0123456789abcdef",
    "git_dirty": False,
}


def _attention_record(date: str = "2025-01-02T03:04:05Z") -> dict:
    return records.make_record(
        "attention-fwd",
        config={"shape": [4, 16, 4096, 128], "dtype": "bf16", "causal": True},
        results=[{"variant": "ours", "median_ms": 2.0, "tflops": 400.0}],
        peers=[{"variant": "sdpa-flash", "median_ms": 3.0, "tflops": 266.7}, {"variant": "no-timing"}],
        ceilings={"bf16_gemm_tflops": 750.0},
        env=ENV,
        date=date,
    )


def test_make_record_fields_and_ratios() -> None:
    record = _attention_record()
    assert record["schema"] == records.SCHEMA and record["benchmark"] == "attention"
    assert record["env"]["device"].startswith("NVIDIA H100")
    # one ratio: the peer without a median is skipped; times are peer/ours so > 1 means we are faster
    assert record["ratios"] == [{"variant": "ours", "peer": "sdpa-flash", "metric": "median_ms", "ratio": 1.5}]
    rates = records.compute_ratios(record["results"], record["peers"], "tflops")
    assert rates[0]["ratio"] == pytest.approx(400.0 / 266.7)


@pytest.mark.parametrize(
    ("metric", "lower"),
    [("median_ms", True), ("step_s", True), ("peak_memory_gib", True), ("tokens_per_s", False), ("mfu", False)],
)
def test_lower_is_better(metric: str, lower: bool) -> None:
    assert records.lower_is_better(metric) is lower


def test_make_record_requires_variant() -> None:
    with pytest.raises(ValueError, match="variant"):
        records.make_record("x", {}, [{"median_ms": 1.0}], env=ENV)


def test_environment_reports_this_process() -> None:
    import torch

    env = records.environment()
    assert env["torch"] == torch.__version__
    assert env["device_slug"] == ("cpu" if not torch.cuda.is_available() else records.slugify(env["device"]))
    assert env["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_write_record_round_trips(tmp_path: Path) -> None:
    record = _attention_record()
    path = records.write_record(record, tmp_path)
    assert path == tmp_path / "attention-fwd-nvidia-h100-80gb-hbm3.json"
    assert json.loads(path.read_text()) == record
    assert records.load_records(tmp_path) == [record]


def test_timeit_median_measures_the_call() -> None:
    import time

    import torch

    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.002)

    ms = records.timeit_median(fn, warmup=3, repeats=7)
    assert ms >= 2.0  # each call sleeps 2 ms
    if not torch.cuda.is_available():  # perf_counter path: exactly warmup + repeats calls
        assert len(calls) == 10


def test_render_groups_by_benchmark_and_is_deterministic(tmp_path: Path) -> None:
    records.write_record(_attention_record(), tmp_path)
    train = records.make_record(
        "train-125m",
        config={"seq_len": 4096, "micro_batch": 8},
        results=[{"variant": "lightning-bf16-mixed", "tokens_per_s": 123456.7, "mfu_vs_measured_gemm": 0.4123}],
        benchmark="train",
        ratio_metric=None,
        env=ENV,
        date="2025-01-02T00:00:00Z",
        notes=["steady state"],
    )
    records.write_record(train, tmp_path)
    out = tmp_path / "results.md"
    assert render_results.main(["--results-dir", str(tmp_path), "--output", str(out)]) == 0
    text = out.read_text()
    assert text.index("## attention") < text.index("## train")
    assert "| ours | 2 | 400 |" in text  # variant first, then sorted columns: median_ms, tflops
    assert "| ours | median_ms | sdpa-flash | 1.5 |" in text
    assert "123,457" in text and "0.4123" in text
    assert "NVIDIA H100 80GB HBM3 x1 · 2025-01-02T03:04:05Z · commit 0123456789ab" in text
    assert "- steady state" in text
    # same records in another order give the same page
    loaded = render_results.load(tmp_path)
    assert render_results.render(list(reversed(loaded))) == text


def test_render_empty_directory(tmp_path: Path) -> None:
    assert "No records yet" in render_results.render(render_results.load(tmp_path))
