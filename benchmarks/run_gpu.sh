#!/usr/bin/env bash
# The one command for the GPU machine: ceilings, then training throughput, each family in its own process,
# then docs/results.md regenerated from the records. Results (and logs) are copied into $OUT when it is set,
# also when a step fails. Extra arguments go to bench_train.py (e.g. `125m --steps 30`).
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p benchmarks/results
LOGS="$(mktemp -d)"

copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results" "$OUT/logs"
    cp benchmarks/results/*.json "$OUT/results/" 2>/dev/null || true
    cp "$LOGS"/*.log "$OUT/logs/" 2>/dev/null || true
    cp docs/results.md "$OUT/" 2>/dev/null || true
  fi
}
trap copy_out EXIT

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv | tee "$LOGS/nvidia-smi.log" || true
status=0
python benchmarks/bench_ceilings.py 2>&1 | tee "$LOGS/bench_ceilings.log" || status=1
python benchmarks/bench_train.py "$@" 2>&1 | tee "$LOGS/bench_train.log" || status=1
python benchmarks/render_results.py 2>&1 | tee "$LOGS/render_results.log" || status=1
exit "$status"
