#!/usr/bin/env bash
# FP8 training on one GPU (issue 54), in steps `STEP[:SECONDS]` (default budget 600 s each), in the order given:
#   smoke   benchmarks/gpu_smoke.py: the two 1b configs (bf16, FP8) and the training steps of every strategy
#   tests   tests/parallel/test_float8.py on the GPU image's torch and torchao (FP8 device checks included)
#   speed   benchmarks/bench_fp8.py speed $FP8_ARGS (records fp8-<shape>-<device>.json)
#   profile benchmarks/bench_fp8.py speed --profile 3 $FP8_ARGS (records fp8-<shape>-profile-<device>.json: where the
#           device time of a step goes, GEMMs by precision, attention, compiled kernels, the top kernels)
#   gemm    benchmarks/bench_fp8.py gemm $FP8_ARGS (records fp8-gemm-<shape>-<device>.json: the converted linears'
#           GEMMs alone in bf16 and FP8, and the bound they put on the step's speed-up)
#   loss    benchmarks/bench_fp8.py loss --parallel 4 $FP8_ARGS (record fp8-loss-1b-<device>.json)
#   fit     llmopt fit --config examples/configs/1b_gpu_fp8.yaml --trainer.max_steps 100 (its header's figure)
# Wheels the GPU image lacks (torchao, jsonargparse, ...) travel in .whl/ and are installed to /tmp/site first.
# Records go to $OUT/results (else benchmarks/results), logs to $OUT/logs$FP8_TAG.tar.gz.
set -uo pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGS="$(mktemp -d)"
RESULTS="${OUT:+$OUT/results}"
RESULTS="${RESULTS:-benchmarks/results}"
mkdir -p "$RESULTS"
status=0
save_logs() {
  if [ -n "${OUT:-}" ]; then tar -czf "$OUT/logs${FP8_TAG:-}.tar.gz" -C "$LOGS" . 2>/dev/null || true; fi
}
trap save_logs EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/nvidia-smi.log" || true
python3 -c 'import torch, triton, torchao; print("torch", torch.__version__, "triton", triton.__version__,
"torchao", torchao.__version__)' 2>&1 | grep -v "^Failed to load" | tee -a "$LOGS/nvidia-smi.log"
for arg in "$@"; do
  step="${arg%%:*}"
  budget="${arg#*:}"
  [ "$budget" = "$arg" ] && budget=600
  start=$SECONDS
  case "$step" in
    smoke)
      timeout -k 10 "$budget" python3 benchmarks/gpu_smoke.py --logs "$LOGS/smoke" --deadline "$((budget - 20))" \
        --only fit:1b_gpu fit:1b_gpu_fp8 train-step: 2>&1 | tee "$LOGS/smoke.log" || status=1
      cp benchmarks/results/gpu-smoke-subset-*.json "$RESULTS/" 2>/dev/null ;;
    tests)
      timeout -k 10 "$budget" python3 -m pytest -q -p no:cacheprovider tests/parallel/test_float8.py -rA \
        2>&1 | tee "$LOGS/tests.log" || status=1 ;;
    speed)
      # shellcheck disable=SC2086  # FP8_ARGS is a list of flags
      timeout -k 10 "$budget" python3 benchmarks/bench_fp8.py speed --results-dir "$RESULTS" ${FP8_ARGS:-} \
        2>&1 | tee "$LOGS/speed.log" || status=1 ;;
    profile)
      # shellcheck disable=SC2086
      timeout -k 10 "$budget" python3 benchmarks/bench_fp8.py speed --profile 3 --results-dir "$RESULTS" \
        ${FP8_ARGS:-} 2>&1 | tee "$LOGS/profile.log" || status=1 ;;
    gemm)
      # shellcheck disable=SC2086
      timeout -k 10 "$budget" python3 benchmarks/bench_fp8.py gemm --results-dir "$RESULTS" ${FP8_ARGS:-} \
        2>&1 | tee "$LOGS/gemm.log" || status=1 ;;
    loss)
      # shellcheck disable=SC2086
      timeout -k 10 "$budget" python3 benchmarks/bench_fp8.py loss --parallel 4 --results-dir "$RESULTS" \
        ${FP8_ARGS:-} 2>&1 | tee "$LOGS/loss.log" || status=1 ;;
    fit)
      timeout -k 20 "$budget" python3 -m lightning_llmopt.cli fit --config examples/configs/1b_gpu_fp8.yaml \
        --trainer.max_steps 100 --trainer.default_root_dir /tmp/runs/fp8 --wandb false 2>&1 \
        | tee "$LOGS/fit-fp8.log" || status=1
      grep -E "^(throughput|float8|compile)|MFU" "$LOGS/fit-fp8.log" >"$RESULTS/fp8-config-fit.txt" ;;
    *) echo "unknown step $step (smoke, tests, speed, profile, gemm, loss, fit)" >&2; status=1 ;;
  esac
  echo "== step $step: $((SECONDS - start)) s" | tee -a "$LOGS/steps.log"
  save_logs
done
exit "$status"
