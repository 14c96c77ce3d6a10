#!/usr/bin/env bash
# Single-GPU measurements, in one or a few calls on an H100/H200 (steps as listed; pass names to run a subset):
#   tests   every GPU-marked test of the engine and kernels (quantized fused decode, speculative steps in CUDA graphs,
#           graphs captured at engine start, grouped GEMM 'torch' backend, 2:4 conversion, paged attention, quant)
#   spec    speculative decoding (issue 9); after 2026-11-22's third run: probes at doubling intervals while the
#           cost rules speculation out, prompt lookup's incremental n-gram index (not yet measured)
#   decode  batch-1 decode of llama2-7b incl. int8/int4 in the engine (issues 8 and 10)
#   serve   continuous vs static batching, with grouped admission (issue 8)
#   kernel  paged decode attention, eager and as CUDA-graph replays, beside SDPA (issue 8)
#   e2e     end-to-end 1b training with our kernels against Lightning + SDPA, eager and compiled (issue 12)
#   startup llmopt serve's engine build for llama2-7b, cold / warm Triton caches / warm, phase by phase (issue 46)
# Results and logs go to $OUT when it is set. Time limits per step below (tests 240 s, spec 300 s, e2e 420 s):
#   bash benchmarks/run_gpu_pending.sh [tests] [spec] [decode] [serve] [kernel] [e2e] [startup]
set -uo pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$(mktemp)"
copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp benchmarks/results/speculative-*.json benchmarks/results/decode-batch1-*.json \
      benchmarks/results/decode-serve-*.json benchmarks/results/decode-kernel-*.json \
      benchmarks/results/e2e-kernels-*.json benchmarks/results/startup-*.json "$OUT/" 2>/dev/null || true
    cp "$LOG" "$OUT/pending.log" 2>/dev/null || true
  fi
}
trap copy_out EXIT
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests spec decode serve)
source "benchmarks/gpu_step.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
for s in "${steps[@]}"; do
  case "$s" in
    tests) step 240 python3 -m pytest -q -p no:cacheprovider tests/inference/test_gpu.py tests/compression/test_masks.py \
      tests/kernels/test_grouped_gemm.py tests/kernels/test_paged_attention.py tests/kernels/test_quant_matmul.py ;;
    spec) step 300 python3 benchmarks/bench_speculative.py --steps 1200 ;;
    decode) step 150 python3 benchmarks/bench_decode.py --family decode ;;
    serve) step 240 python3 benchmarks/bench_decode.py --family serve --requests 128 --no-hf ;;
    kernel) step 120 python3 benchmarks/bench_decode.py --family kernel ;;
    e2e) step 420 python3 benchmarks/bench_e2e_kernels.py --warmup-steps 3 --steps 8 ;;
    startup) step 480 python3 benchmarks/bench_startup.py --preset llama2-7b ;;
    *) echo "unknown step $s" | tee -a "$LOG"; status=1 ;;
  esac
done
python3 benchmarks/render_results.py 2>&1 | tail -1 | tee -a "$LOG" || status=1
exit "$status"
