#!/usr/bin/env bash
# Issue 56 on a 4-GPU host (nvidia-h200-x4), in named steps so that each device call fits its time limit:
#   tests  the multigpu parity tests (every strategy, fused kernels, bf16, 2 and 4 GPUs against one GPU)
#   8b     llama3-8b, 32 layers, sequence 8192, 4 GPUs: our compositions, Lightning FSDP + transformers + Liger,
#          torchtitan (its wheels from .whl_titan/, when that folder is there)
#   dp     1b, sequence 2048, micro-batch 8 and 4: single, ddp, zero1/2/3, FSDP + transformers + Liger, 2 and 4 GPUs
#   nd     1b tp2, pp2, cp2 (sequence 8192) beside one GPU
#   configs  `llmopt fit` with each 4-GPU example config unchanged but 40 steps (the figure its header states)
#   refs   the parity tests' one-GPU references alone (bf16 and fp32; the code path on a one-GPU machine)
# $MG_ARGS goes to every bench_multigpu.py call (e.g. "--micro-batches 8 --layers-8b 8" on one GPU).
# A step may carry its time budget in seconds (`8b:300`): no launch of it starts or runs past that. Records are
# written into $OUT/results as each launch ends and logs are archived after each step, so a call cut short keeps
# what ran. Liger-Kernel travels as a wheel in .whl/, torchtitan and its needs in .whl_titan/.
#
#   bash benchmarks/run_gpu_multigpu.sh tests:330 8b:250    # on the GPU machine, from the repository root
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGS="$(mktemp -d)"
RESULTS="${OUT:+$OUT/results}"
RESULTS="${RESULTS:-benchmarks/results}"
mkdir -p "$RESULTS"
status=0

save_logs() {
  if [ -n "${OUT:-}" ]; then tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null || true; fi
}
trap save_logs EXIT

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/nvidia-smi.log" || true
nvidia-smi topo -m >>"$LOGS/nvidia-smi.log" 2>&1 || true
TITAN=()
if [ -d .whl_titan ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/titan .whl_titan/*.whl \
    && TITAN=(--titan-site /tmp/titan)
fi
for arg in "$@"; do
  step="${arg%%:*}"
  budget="${arg#*:}"
  [ "$budget" = "$arg" ] && budget=600
  start=$SECONDS
  case "$step" in
    tests)
      LLMOPT_MULTIGPU_SUMMARY="$RESULTS/multigpu-parity-curves.json" \
        timeout -k 10 "$budget" python3 -m pytest -q -p no:cacheprovider tests/strategies/test_multigpu_parity.py \
        -rA 2>&1 | tee "$LOGS/tests.log" || status=1
      pkill -f _multigpu_job.py 2>/dev/null; sleep 2  # a launch the time limit cut short
      cp /tmp/pytest-of-*/pytest-*/multigpu*/*.log /tmp/pytest-of-*/pytest-*/multigpu*/*.json "$LOGS/" 2>/dev/null
      ;;
    refs)
      layouts='[["llama-bf16",{"single":true},"llama"],["moe-bf16",{"single":true},"moe"]]'
      timeout -k 10 "$budget" python3 tests/strategies/_multigpu_job.py --layouts "$layouts" \
        --out "$RESULTS/multigpu-refs-bf16.json" 2>&1 | tee "$LOGS/refs-bf16.log" || status=1
      timeout -k 10 "$budget" python3 tests/strategies/_multigpu_job.py --layouts "${layouts//bf16/fp32}" \
        --precision 32-true --out "$RESULTS/multigpu-refs-fp32.json" 2>&1 | tee "$LOGS/refs-fp32.log" || status=1 ;;
    configs)
      for cfg in 1b_4gpu llama3-8b_4gpu; do
        timeout -k 20 "$((budget / 2))" python3 -m lightning_llmopt.cli fit --config "examples/configs/$cfg.yaml" \
          --trainer.max_steps 40 --trainer.default_root_dir "/tmp/runs/$cfg" 2>&1 | tee "$LOGS/config-$cfg.log" \
          || status=1
        { echo "== $cfg (40 steps)"; grep -E "^(throughput|steps|step [0-9]+:)|tokens/s" "$LOGS/config-$cfg.log"; } \
          >>"$RESULTS/multigpu-configs.txt"
      done ;;
    8b | dp | nd)
      # shellcheck disable=SC2086  # MG_ARGS is a list of flags
      python3 benchmarks/bench_multigpu.py --family "$step" "${TITAN[@]}" ${MG_ARGS:-} --results-dir "$RESULTS" \
        --log-dir "$LOGS" --deadline "$budget" 2>&1 | tee "$LOGS/bench-$step.log" || status=1 ;;
    *) echo "unknown step $step (tests, 8b, dp, nd, configs, refs)" >&2; status=1 ;;
  esac
  echo "== step $step: $((SECONDS - start)) s" | tee -a "$LOGS/steps.log"
  save_logs
done
exit "$status"
