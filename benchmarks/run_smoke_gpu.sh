#!/usr/bin/env bash
# One GPU call for issue 51's records, in steps (default: all, in this order; pass names to run a subset):
#   fit1b   llmopt fit --config examples/configs/1b_gpu.yaml --trainer.max_steps 100 (the MFU acceptance run)
#   smoke   benchmarks/gpu_smoke.py: every documented user path (record gpu-smoke-<device>.json), stopped after
#           $SMOKE_DEADLINE seconds (default 300)
#   mla     benchmarks/bench_mla.py --family decode (record mla-*.json; limit $MLA_LIMIT, default 240 s)
#   tests   the gpu-marked tests of kernels, engine, models, module and strategies (240 s limit)
#   fit125m llmopt fit --config examples/configs/125m_gpu.yaml --trainer.max_steps 100
# Python packages the GPU image lacks (jsonargparse, fastapi, uvicorn, openai, ...) travel as wheels in .whl/
# (see the device README); they are installed to /tmp/site first. Logs and records go to $OUT when it is set.
set -uo pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
ROOT="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$(mktemp)"
SMOKE_LOGS="$(mktemp -d)"
copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$ROOT"/benchmarks/results/gpu-smoke-*.json "$ROOT"/benchmarks/results/mla-*.json "$OUT/" 2>/dev/null || true
    cp "$LOG" "$OUT/run.log" 2>/dev/null || true
    tar czf "$OUT/smoke-logs.tgz" -C "$SMOKE_LOGS" . 2>/dev/null || true
  fi
}
trap copy_out EXIT
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(fit1b smoke mla tests fit125m)
source "benchmarks/gpu_step.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
python3 -c 'import torch, triton, lightning, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"lightning", lightning.__version__, "transformers", transformers.__version__)' 2>&1 | tee -a "$LOG"
for s in "${steps[@]}"; do
  case "$s" in
    smoke) step 330 python3 benchmarks/gpu_smoke.py --logs "$SMOKE_LOGS" --deadline "${SMOKE_DEADLINE:-300}" ;;
    tests) step 240 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels tests/inference tests/models \
      tests/test_module.py tests/strategies ;;
    fit1b|fit125m)  # in a scratch folder: the configs write runs/ under the working directory
      name=$([ "$s" = fit1b ] && echo 1b_gpu || echo 125m_gpu)
      pushd "$(mktemp -d)" >/dev/null
      step 150 python3 -m lightning_llmopt.cli fit --config "$ROOT/examples/configs/$name.yaml" --trainer.max_steps 100
      popd >/dev/null ;;
    mla) step "${MLA_LIMIT:-240}" python3 benchmarks/bench_mla.py --family decode ;;
    *) echo "unknown step $s" | tee -a "$LOG"; status=1 ;;
  esac
done
exit "$status"
