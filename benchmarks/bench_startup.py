"""How long ``llmopt serve`` takes to build its engine, phase by phase, cold and warm (issue 46: <= 20 s on an H100).

Each build runs in a fresh process (Triton's in-memory autotuning and the chooser's decisions would otherwise make
every build after the first warm), through ``llmopt serve``'s own ``build_engine`` with a
:class:`~lightning_llmopt.inference.startup.StartupLog`, and reports the build's seconds and each phase's seconds
and counters (chooser decisions timed, quantized matmul searches, Triton compilations and autotuning searches with
their seconds and disk-cache hits). Variants, in order, sharing one temporary cache folder:

- ``cold``: empty tuning cache (``LLMOPT_CACHE_DIR``) and empty Triton cache (``TRITON_CACHE_DIR``);
- ``warm-triton-only``: the Triton cache (compiled kernels, autotuning) from the cold run, ``LLMOPT_TUNING_CACHE=0``;
- ``warm``: both caches from the runs before.

Usage: ``python benchmarks/bench_startup.py --preset llama2-7b`` (records in benchmarks/results/); ``--smoke`` runs
on CPU with the tiny preset (records in a temporary folder). No GPU figure has been recorded yet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package

import records  # noqa: E402

CHILD = """
import json, sys
from lightning_llmopt.cli.serve import build_engine, build_parser
from lightning_llmopt.inference.startup import StartupLog
log = StartupLog()
engine = build_engine(build_parser().parse_args(sys.argv[1:]), log)
print("STARTUP " + json.dumps({"total_s": log.total_s, **log.summary()}))
"""


def build_once(serve_args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The start-up summary of one build in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *serve_args], env=env, capture_output=True, text=True, timeout=1800
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"the build failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(line.removeprefix("STARTUP "))


def run(preset: str, smoke: bool) -> dict[str, Any]:
    serve_args = ["--preset", preset, "--device", "cpu" if smoke else "cuda"]
    if smoke:
        serve_args += ["--num-blocks", "64"]
    root = Path(tempfile.mkdtemp(prefix="llmopt-startup-"))
    base = {**os.environ, "LLMOPT_CACHE_DIR": str(root / "llmopt"), "TRITON_CACHE_DIR": str(root / "triton")}
    variants = [("cold", {}), ("warm-triton-only", {"LLMOPT_TUNING_CACHE": "0"}), ("warm", {})]
    rows = []
    for name, extra in variants:
        summary = build_once(serve_args, {**base, **extra})
        rows.append({"variant": name, "build_s": summary["total_s"], "phases": summary["phases"],
                     "totals": summary["totals"]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    config = {"preset": preset, "device": "cpu" if smoke else "cuda", "serve_args": serve_args,
              "processes": "one fresh process per build"}  # fmt: skip
    notes = ["build_s: from the first phase (random init) to the engine's last graph captured"]
    return records.make_record(f"startup-{preset}", config, rows[2:], rows[:2], benchmark="startup",
                               ratio_metric="build_s", notes=notes)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Engine start-up, cold and warm (issue 46).")
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, temporary records")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    preset = "tiny" if args.smoke else args.preset
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    path = records.write_record(run(preset, args.smoke), results_dir)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
