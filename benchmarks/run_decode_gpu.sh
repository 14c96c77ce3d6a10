#!/usr/bin/env bash
# Issue 8 on one GPU: the gpu-marked inference/paged-attention tests, then each decode benchmark family in its own
# process with its own time limit (a family that fails or runs out of time does not stop the others), then
# docs/results.md. Records and one log are copied into $OUT when it is set, also after a failure.
#   bash benchmarks/run_decode_gpu.sh [families...]   (default: tests kernel decode serve; also: hf-compile, serve-queue,
#   serve-step-model, serve-gqa, serve-sharegpt)
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p benchmarks/results
LOG="$(mktemp)"
copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp benchmarks/results/decode-*.json "$OUT/" 2>/dev/null || true
    cp "$LOG" "$OUT/decode.log" 2>/dev/null || true
  fi
}
trap copy_out EXIT
families=("$@")
[ ${#families[@]} -eq 0 ] && families=(tests kernel decode serve)
source "benchmarks/gpu_step.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
for f in "${families[@]}"; do
  case "$f" in
    tests) step 240 python3 -m pytest -q -p no:cacheprovider tests/inference/test_gpu.py tests/kernels/test_paged_attention.py ;;
    kernel) step 90 python3 benchmarks/bench_decode.py --family kernel ;;
    decode) step 240 python3 benchmarks/bench_decode.py --family decode ;;
    serve) step 150 python3 benchmarks/bench_decode.py --family serve --requests 128 --no-hf ;;
    serve-queue) step 420 python3 benchmarks/bench_decode.py --family serve --requests 1024 --no-hf ;;
    serve-step-model) step 300 python3 benchmarks/bench_decode.py --family serve --requests 1024 --no-hf --no-variants --outputs lognormal:64-256 ;;
    serve-gqa) step 300 python3 benchmarks/bench_decode.py --family serve --requests 1024 --no-hf --no-variants --preset llama3-8b --outputs lognormal:64-256 ;;
    serve-sharegpt) step 560 python3 benchmarks/bench_decode.py --family serve --requests 1024 --no-hf --no-variants --preset llama3-8b --outputs sharegpt:1024 ;;
    hf-compile) step 200 python3 benchmarks/bench_decode.py --family decode --hf-compile --compile-budget 150 ;;
    *) echo "unknown family $f" | tee -a "$LOG"; status=1 ;;
  esac
done
python3 benchmarks/render_results.py 2>&1 | tee -a "$LOG" || status=1
exit "$status"
