"""gpu_smoke.py's coverage and bookkeeping (the run itself needs a GPU; ``--device cpu`` checks it by hand):
every GPU example config is a path, dependent paths wait for their source and are reported as not run when it
failed, a failure's error line is the exception, and the record names every path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from lightning_llmopt.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
smoke = load_script(ROOT / "benchmarks" / "gpu_smoke.py", "_test_gpu_smoke")


def test_every_gpu_example_config_is_a_path():
    names = {p.name for p in smoke.build_paths("cuda")}
    for config in sorted((ROOT / "examples" / "configs").glob("*.yaml")):
        trainer = yaml.safe_load(config.read_text()).get("trainer", {})
        if trainer.get("accelerator") != "gpu":
            continue
        devices = trainer.get("devices", 1)
        expected = f"fit:{config.stem}" if devices == 1 else f"fit:{config.stem}@1gpu"
        assert expected in names, f"{config.name} has no smoke path ({expected})"
    for family in ("gqa", "mla", "patterns"):
        assert f"engine:{family}" in names
    assert {"serve:openai", "kernels:flash-attention", "quantize+generate:gptq", "train-step:zero3"} <= names


def test_error_line_is_the_exception():
    text = "Traceback (most recent call last):\n  File x\nValueError: kv_dtype ('int9') must be one of\nmore\n"
    assert smoke._error_line(text) == "ValueError: kv_dtype ('int9') must be one of"
    assert smoke._error_line("just output\nlast line\n") == "last line"


def test_run_records_pass_fail_and_skips_dependents(tmp_path, monkeypatch):
    ok = smoke.SmokePath("a:ok", [sys.executable, "-c", "print('detail: fine')"], limit=60, detail_pattern=r"^detail.*")
    bad = smoke.SmokePath("b:bad", [sys.executable, "-c", "raise RuntimeError('broken on purpose')"], limit=60)
    child = smoke.SmokePath("c:child", [sys.executable, "-c", "print(1)"], limit=60, needs="b:bad")
    slow = smoke.SmokePath("d:slow", [sys.executable, "-c", "import time; time.sleep(30)"], limit=1)
    monkeypatch.setattr(smoke, "build_paths", lambda device: [ok, bad, child, slow])
    assert smoke.main(["--device", "cpu", "--out", str(tmp_path), "--jobs", "2"]) == 1
    record = json.loads(next(tmp_path.glob("gpu-smoke-*.json")).read_text())
    rows = {r["path"]: r for r in record["results"]}
    assert list(rows) == ["a:ok", "b:bad", "c:child", "d:slow"]
    assert rows["a:ok"]["ok"] and rows["a:ok"]["detail"] == "detail: fine"
    assert not rows["b:bad"]["ok"] and rows["b:bad"]["error"] == "exit 1: RuntimeError: broken on purpose"
    assert not rows["c:child"]["ok"] and rows["c:child"]["error"] == "not run: b:bad failed"
    assert not rows["d:slow"]["ok"] and rows["d:slow"]["error"].startswith("timed out after 1 s")
    assert record["notes"][0].startswith("1 of 4 paths passed")
