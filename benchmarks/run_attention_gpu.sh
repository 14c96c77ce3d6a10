#!/usr/bin/env bash
# GPU driver for the flash-attention benchmarks (issue 7). Each step runs in its own process with its own time
# limit; records and logs go flat into $OUT (when set) as each finishes, so a late failure keeps the rest.
#
#   bash benchmarks/run_attention_gpu.sh sweep     # GPU tests of the kernels, the launch-configuration sweep, and
#                                                  # ours at hd128 with the code in .abold/ (an older checkout, when
#                                                  # present) beside the current code
#   bash benchmarks/run_attention_gpu.sh dense     # records: hd128 and hd64 families (ours + SDPA + Flex)
#   bash benchmarks/run_attention_gpu.sh other     # records: varlen (both packs), window and check families
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODE="${1:-dense}"
RESULTS="${OUT:-$(mktemp -d)}"
LOG="$RESULTS/attention_gpu.log"

copy_out() { :; }  # records are written straight to $RESULTS; nothing to copy after a step
source "benchmarks/gpu_step.sh"  # step <seconds> <command...>

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv | tee -a "$LOG"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

case "$MODE" in
  sweep)
    step 150 python -m pytest -q -x tests/kernels/test_flash_attention.py -p no:cacheprovider
    if [ -d .abold/lightning_llmopt ]; then
      mkdir -p "$RESULTS/old" "$RESULTS/new"
      step 120 env PYTHONPATH="$PWD/.abold" python benchmarks/bench_attention.py --family hd128 --variants ours \
        --seqs 1024,2048,4096,8192 --out "$RESULTS/old"
      step 120 python benchmarks/bench_attention.py --family hd128 --variants ours --seqs 1024,2048,4096,8192 \
        --out "$RESULTS/new"
    fi
    step 300 python benchmarks/sweep_attention.py --head-dims 128 --out "$RESULTS/sweep_hd128.jsonl"
    ;;
  dense)
    step 290 python benchmarks/bench_attention.py --family hd128 --out "$RESULTS"
    step 290 python benchmarks/bench_attention.py --family hd64 --out "$RESULTS"
    ;;
  other)
    step 150 python benchmarks/bench_attention.py --family varlen --out "$RESULTS"
    step 120 python benchmarks/bench_attention.py --family window --out "$RESULTS"
    step 120 python benchmarks/bench_attention.py --family check --out "$RESULTS"
    ;;
  *)
    echo "unknown mode $MODE" >&2
    exit 2
    ;;
esac
