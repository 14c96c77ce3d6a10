#!/usr/bin/env bash
# The one command for the N-D parallel records on a multi-GPU machine (nvidia-h200-x2 / -x4): on all visible GPUs,
# NDParallelStrategy TP/CP (ring, Ulysses) beside Lightning ModelParallelStrategy DTensor TP and torch
# context_parallel, for the 1b preset and the llama3-8b shape with its layers reduced (ND_LAYERS, default 8), then the
# longest trainable sequence with CP=<all GPUs> against CP=1 (1b), then docs/results.md. Each variant is its own
# torchrun launch. Records and logs are copied into $OUT when it is set, also when a step fails. Extra arguments go
# to every bench_nd_parallel.py call (e.g. `--steps 5`).
#
#   bash benchmarks/run_gpu_nd.sh                       # on the GPU machine, from anywhere
#   ND_SKIP_LONGEST=1 bash benchmarks/run_gpu_nd.sh     # throughput records only
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p benchmarks/results
LOGS="$(mktemp -d)"
LAYERS="${ND_LAYERS:-8}"

copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results" "$OUT/logs"
    cp benchmarks/results/nd-*.json "$OUT/results/" 2>/dev/null || true
    tar -czf "$OUT/logs/nd-logs.tar.gz" -C "$LOGS" . 2>/dev/null || true
    cp docs/results.md "$OUT/" 2>/dev/null || true
  fi
}
trap copy_out EXIT

NGPU="$(nvidia-smi -L 2>/dev/null | wc -l)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/nvidia-smi.log" || true
echo "GPUs visible: $NGPU"
if [ "$NGPU" -lt 2 ]; then
  echo "run_gpu_nd.sh needs at least 2 GPUs (nvidia-smi -L lists $NGPU)" >&2
  exit 1
fi
status=0
python3 benchmarks/bench_nd_parallel.py --nproc "$NGPU" --preset 1b --log-dir "$LOGS" "$@" 2>&1 \
  | tee "$LOGS/nd-1b.log" || status=1
python3 benchmarks/bench_nd_parallel.py --nproc "$NGPU" --preset llama3-8b --layers "$LAYERS" --log-dir "$LOGS" "$@" \
  2>&1 | tee "$LOGS/nd-8b.log" || status=1
if [ -z "${ND_SKIP_LONGEST:-}" ]; then
  python3 benchmarks/bench_nd_parallel.py --nproc "$NGPU" --preset 1b --longest --longest-cp "$NGPU" \
    --log-dir "$LOGS" "$@" 2>&1 | tee "$LOGS/nd-longest.log" || status=1
fi
python3 benchmarks/render_results.py 2>&1 | tee "$LOGS/render_results.log" || status=1
exit "$status"
