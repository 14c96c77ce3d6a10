"""bench_fp8.py without a GPU: the loss bands and their signed excursions on hand-made curves, the layers whose
GEMMs the ``gemm`` mode times, and its record and bound on CPU (the FP8 timings themselves are a benchmark)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_llmopt.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
fp8 = load_script(BENCH / "bench_fp8.py", "_test_bench_fp8")


def _run(variant: str, seed: int, level: float) -> dict:
    return {"variant": variant, "seed": seed, "losses": [level] * 300}


def test_loss_bands_count_windows_and_sign_excursions() -> None:
    rows = [_run("bf16", 1, 1.00), _run("bf16", 2, 1.02), _run("bf16", 3, 1.10),
            _run("tensorwise-compile", 1, 0.99), _run("rowwise-compile", 1, 1.05)]  # fmt: skip
    notes = fp8._loss_notes(rows, start=100, window=50)
    assert "seeds 1, 2, 3" in notes[0] and "2-seed band at most 0.0200" in notes[0] and "3-seed band 0.1000" in notes[0]
    by = {n.split(" band:")[0]: n for n in notes[1:]}
    # below both bands: a lower loss, counted as below, never as above
    assert "0/4 windows inside, largest excursion above 0.0000 (higher loss), below 0.0100" in by[
        "loss tensorwise-compile vs the 2 seeds"]  # fmt: skip
    assert "above 0.0300 (higher loss), below 0.0000" in by["loss rowwise-compile vs the 2 seeds"]
    assert "4/4 windows inside" in by["loss rowwise-compile vs the 3 seeds"]


def test_loss_notes_need_two_bf16_runs() -> None:
    assert fp8._loss_notes([_run("bf16", 1, 1.0), _run("rowwise-compile", 1, 1.0)]) == [
        "loss: fewer than two bf16 runs finished; no band"
    ]


def test_linear_shapes_are_the_converted_layers() -> None:
    shapes = fp8.linear_shapes("tiny", {"n_layers": 3})
    assert sum(shapes.values()) == 3 * 7  # wq, wk, wv, wo, w1, w2, w3 per block; the LM head is kept
    assert all(a % 16 == 0 and b % 16 == 0 for a, b in shapes)


def test_gemm_mode_records_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8.records, "timeit_median", lambda fn, warmup=0, repeats=1: 1.0)  # every GEMM: 1 ms
    slug = fp8.records.environment()["device_slug"]
    speed = {"peers": [{"variant": "bf16", "median_step_ms": 100.0}]}
    (tmp_path / f"fp8-tiny-64-{slug}.json").write_text(json.dumps(speed))
    assert fp8.main(["gemm", "--smoke", "--results-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / f"fp8-gemm-tiny-64-{slug}.json").read_text())
    total = record["results"][0]
    layers = sum(fp8.linear_shapes("debug-1m", {}).values())
    assert total["variant"] == "all-converted" and total["bf16_ms_per_step"] == 3 * layers
    assert total["head_bf16_ms_per_step"] == 3
    assert any("bound: the bf16 step (100.0 ms" in n and "1.000x" in n for n in record["notes"])
