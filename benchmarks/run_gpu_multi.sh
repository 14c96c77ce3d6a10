#!/usr/bin/env bash
# The one command for a multi-GPU machine (nvidia-h200-x2 / -x4): ZeRO stages 1/2/3 against Lightning's ddp, fsdp
# (and fsdp2 = ModelParallelStrategy + fully_shard) on all visible GPUs, each variant in its own torchrun launch,
# then docs/results.md regenerated from the records. Records and logs are copied into $OUT when it is set, also
# when a step fails. Extra arguments go to bench_zero.py (e.g. `--micro-batch 2 --variants ddp zero2`).
#
#   bash benchmarks/run_gpu_multi.sh                 # on the GPU machine, from anywhere
set -uo pipefail
# NVLink multicast must stay off on these shared hosts (device KINDS.md); bench_zero.py sets them again per launch.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p benchmarks/results
LOGS="$(mktemp -d)"

copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results" "$OUT/logs"
    cp benchmarks/results/zero-*.json "$OUT/results/" 2>/dev/null || true
    # $OUT returns at most 8 files: one archive of all logs instead of one file per variant.
    tar -czf "$OUT/logs/zero-logs.tar.gz" -C "$LOGS" . 2>/dev/null || true
    cp "$LOGS/bench_zero.log" "$OUT/logs/" 2>/dev/null || true
    cp docs/results.md "$OUT/" 2>/dev/null || true
  fi
}
trap copy_out EXIT

NGPU="$(nvidia-smi -L 2>/dev/null | wc -l)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv \
  | tee "$LOGS/nvidia-smi.log" || true
nvidia-smi topo -m >>"$LOGS/nvidia-smi.log" 2>&1 || true
echo "GPUs visible: $NGPU"
if [ "$NGPU" -lt 2 ]; then
  echo "run_gpu_multi.sh needs at least 2 GPUs (nvidia-smi -L lists $NGPU)" >&2
  exit 1
fi
status=0
python3 benchmarks/bench_zero.py --nproc "$NGPU" --log-dir "$LOGS" "$@" 2>&1 | tee "$LOGS/bench_zero.log" || status=1
python3 benchmarks/render_results.py 2>&1 | tee "$LOGS/render_results.log" || status=1
exit "$status"
