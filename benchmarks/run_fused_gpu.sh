#!/usr/bin/env bash
# GPU driver for the fused-kernel benchmarks (issue 12). Each benchmark family runs in its own process with its own
# time limit; records are written flat into $OUT (when set) as each finishes, so a late failure keeps the rest.
#
#   bash benchmarks/run_fused_gpu.sh micro     # a short e2e check of our kernels, then the per-kernel families
#   bash benchmarks/run_fused_gpu.sh e2e       # end to end (both peers and ours, one run), then the rope, swiglu and
#                                              # rmsnorm families again in the time left
#   bash benchmarks/run_fused_gpu.sh all       # end to end, then every family
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODE="${1:-all}"
shift || true
RESULTS="${OUT:-$(mktemp -d)}"  # records go straight to $OUT: a run cut off at its time limit keeps them
LOG="$RESULTS/fused_gpu.log"

copy_out() { :; }  # records are written straight to $RESULTS; nothing to copy after a step
source "benchmarks/gpu_step.sh"  # step <seconds> <command...>

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv | tee -a "$LOG"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

E2E_VARIANTS="lightning-sdpa,ours-kernels,lightning-sdpa-compile,ours-kernels-compile"
if [ "$MODE" = "micro" ]; then  # the whole training integration on the GPU, quickly (written to a scratch dir)
  step 100 python benchmarks/bench_e2e_kernels.py --variants ours-kernels --warmup-steps 3 --steps 5 \
    --timeout 90 --results-dir "$(mktemp -d)"
fi
if [ "$MODE" = "e2e" ] || [ "$MODE" = "all" ]; then  # peers (a) and (b) and ours, in one run
  step 330 python benchmarks/bench_e2e_kernels.py --variants "$E2E_VARIANTS" --warmup-steps 3 --steps 8 \
    --timeout 150 --results-dir "$RESULTS" "$@"
fi
if [ "$MODE" = "micro" ] || [ "$MODE" = "all" ]; then
  step 85 python benchmarks/bench_fused_kernels.py --family rmsnorm --results-dir "$RESULTS"
  step 75 python benchmarks/bench_fused_kernels.py --family swiglu --results-dir "$RESULTS"
  step 95 python benchmarks/bench_fused_kernels.py --family ce --results-dir "$RESULTS"
  step 60 python benchmarks/bench_fused_kernels.py --family rope --results-dir "$RESULTS"
  step 90 python benchmarks/bench_fused_kernels.py --family parity --results-dir "$RESULTS"
fi
if [ "$MODE" = "e2e" ]; then  # then, in what time is left, the families changed since the last run
  step 50 python benchmarks/bench_fused_kernels.py --family rope --results-dir "$RESULTS"
  step 55 python benchmarks/bench_fused_kernels.py --family swiglu --results-dir "$RESULTS"
  step 55 python benchmarks/bench_fused_kernels.py --family rmsnorm --results-dir "$RESULTS"
fi
ls -la "$RESULTS" | tee -a "$LOG"
for f in "$RESULTS"/*.json; do
  echo "--- $f"
  python -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({k: r[k] for k in ('name','ratios','notes')})[:3000])" "$f"
done
