#!/usr/bin/env bash
# The GPU toolchain job (issue 51): the suite on CPU with the GPU image's versions, in a new virtual environment.
#   torch 2.11.0 (the CUDA build: pip has no CPU wheel of it; it imports and runs on CPU), triton 3.6.0 (torch 2.11's
#   pin), transformers 5.17.0, lightning 2.6.6; every other dependency of ".[dev]" at its declared lower bound's
#   series (.ci/lower_bounds.py), so each lower bound in pyproject.toml is a version CI runs (the main job, .ci/run,
#   installs the newest).
# Runs every test not marked `interpreter` (Triton 3.6's interpreter fails with numpy >= 2.4; the main job runs those
# with Triton 3.9): engine, serve, CLI, strategies, models on their reference (non-Triton) paths. Then
# .ci/toolchain_smoke.py calls the CUDA-only Triton hooks (the engine's knobs listeners) that no CPU test reaches.
# Alone: `bash .ci/toolchain_job.sh` (about 4 GB of wheels on a cold pip cache). The venv is deleted at the end.
# Phases: `prepare` (venv and torch 2.11), `test` (the package and the tests, in a venv `prepare` made); without an
# argument both. TOOLCHAIN_WORK=DIR keeps the venv there (`.ci/run` passes a folder it deletes); otherwise a
# temporary folder is deleted at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 WANDB_SILENT=true
unset PYTHONDONTWRITEBYTECODE  # bytecode written and reused: the venv installs with --no-compile (see .ci/run)
start=$(date +%s)
phase=${1:-all}
case "$phase" in all|prepare|test) ;; *) echo "usage: toolchain_job.sh [prepare|test]" >&2; exit 2 ;; esac
if [ -n "${TOOLCHAIN_WORK:-}" ]; then
  work=$TOOLCHAIN_WORK
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi

if [ "$phase" != test ]; then
echo "== toolchain job: torch 2.11 / triton 3.6 / transformers 5.17 / lightning 2.6.6, lower bounds elsewhere"
python3 .ci/lower_bounds.py >"$work/constraints.txt"
# the GPU image's exact versions, where the lower bound names only a series
sed -i -e 's/^torch==.*/torch==2.11.0/' -e 's/^triton==.*/triton==3.6.0/' -e 's/^transformers==.*/transformers==5.17.0/' \
  -e 's/^lightning==.*/lightning==2.6.6/' "$work/constraints.txt"
echo "pytorch-lightning==2.6.6" >>"$work/constraints.txt"
python3 -m venv "$work/venv"
# the 4.6 GB part and every other dependency of ".[dev]", what `prepare` runs early (in .ci/run, while the main job
# installs); --no-compile: Python compiles the modules the tests import, not all
"$work/venv/bin/pip" install -q --no-compile -c "$work/constraints.txt" torch
python3 .ci/lower_bounds.py --requirements >"$work/requirements.txt"
"$work/venv/bin/pip" install -q --no-compile -c "$work/constraints.txt" -r "$work/requirements.txt"
echo "== toolchain job: torch and the dependencies installed in $(($(date +%s) - start)) s"
fi
[ "$phase" = prepare ] && exit 0
if [ "$phase" = test ]; then start=$(date +%s); fi
# the package itself only now: an editable install writes into the tree, which the main job installs from too
"$work/venv/bin/pip" install -q --no-compile --no-deps -e .  # its dependencies came with `prepare`
"$work/venv/bin/python" - <<'PY'
import importlib.metadata as md

import torch

want = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "lightning": "2.6.6"}
have = {name: md.version(name) for name in want}
assert have == want, f"toolchain job: installed {have}, wanted {want}"
assert not torch.cuda.is_available(), "toolchain job: expected a machine without CUDA"
print("versions:", ", ".join(f"{k} {v}" for k, v in {**have, "numpy": md.version("numpy")}.items()))
PY
suite_start=$(date +%s)
echo "== toolchain job: install in $((suite_start - start)) s"
status=0
# torch 2.11 on gloo: the V-shaped schedules (zbv, dualpipev) post a send from a rank to itself while initialising
# their stages (torch 2.13 skips same-rank pairs), which gloo refuses ("Pair is not connected"); NCCL supports
# self-sends, so the GPU path is not concerned. These tests run in the main job (torch 2.13).
v_schedules=(
  "tests/parallel/test_pipeline.py::test_every_schedule_two_ranks"
  "tests/parallel/test_pipeline_trace.py::test_recorder_changes_nothing_and_records_each_action_once[dualpipev]"
  "tests/parallel/test_pipeline_trace.py::test_recorder_changes_nothing_and_records_each_action_once[zbv]"
  "tests/parallel/test_pipeline_wgrad.py::test_zero_bubble_schedules_match_one_process[zbv-deferred-0]"
  "tests/parallel/test_pipeline_wgrad.py::test_zero_bubble_schedules_match_one_process[dualpipev-deferred-0]"
  "tests/parallel/test_pipeline_wgrad.py::test_zero_bubble_schedules_match_one_process[zbv-deferred-2]"
  "tests/strategies/test_nd_pipeline.py::test_every_schedule_two_ranks"
  "tests/strategies/test_nd_pipeline.py::test_pipeline_with_tensor_parallel"
)
deselect=()
for t in "${v_schedules[@]}"; do deselect+=(--deselect "$t"); done
# FP8 under the strategies (2 gloo ranks, emulated FP8; ~4 min) runs in the main job only, to hold CI's time; the
# FP8 unit tests (tests/parallel/test_float8.py) run here, and ran on the GPU image too (torch 2.11,
# torchao 0.18) in benchmarks/run_gpu_fp8.sh
deselect+=(--deselect tests/strategies/test_float8_strategies.py)
"$work/venv/bin/python" -m pytest -m "not interpreter" -p no:cacheprovider --durations=15 "${deselect[@]}" || status=$?
echo "== toolchain job: pytest -m 'not interpreter' exit $status in $(($(date +%s) - suite_start)) s"
"$work/venv/bin/python" .ci/toolchain_smoke.py || status=$?
echo "== toolchain job done in $(($(date +%s) - start)) s (exit $status)"
exit "$status"
