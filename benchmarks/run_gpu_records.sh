#!/usr/bin/env bash
# The multi-GPU records still missing (issues 3-6), as named steps so that each device call fits its time limit:
#   ep          MoE 1b: experts split over all GPUs (ep<N>) beside ZeRO-3 data parallelism alone (issue 6)
#   nd1b nd8b   TP=N, CP=N (ring, Ulysses) beside Lightning DTensor TP and torch context_parallel, 1b and the
#               llama3-8b shape with 8 layers (issue 4)
#   longest     longest trainable row, CP=N against CP=1: the 1b preset without activation checkpointing, one step
#               per length (issue 4). With full checkpointing the search reaches ~1M tokens on 4 GPUs, where one
#               step of even a 2-layer model took over 3 minutes (2026-11-22); without it the lengths stay near
#               50K (CP=1) and 200K (CP=4), a few minutes in all.
#   pptest      the pipeline tests (CPU, gloo) on this machine's torch, before the timings
#   pp pp44     every pipeline schedule at M=8 and 16 on all GPUs, 1b and 44 layers (issue 5); micro-batches of
#               2 rows x 2048 tokens: at 1 row one 11-layer stage is bound by the host (profile_stage.py)
#   ppsched ppsched4k  issue 44: every schedule (and torch's B/W split beside ours) at P=N, M=16 with the action
#               recorder: tokens/s, measured vs theoretical bubble, per-action breakdown, acceptance checks, timeline
#               PNGs (docs/pipeline_timelines/measured-<gpu>/, copied to $OUT); seq 2048 x 2 rows, 4096 x 1 row
#   ppfused     pp with our fused RMSNorm/RoPE/SwiGLU and flash attention (fewer kernel launches per layer)
#   zero        ZeRO stages against ddp and fsdp on all GPUs (issue 3); zero3: only fsdp and zero3, merged into the
#               record
#   zeroctas    fsdp and zero3 with NCCL_MAX_CTAS unset, 8 and 4 (collective kernels contend with GEMMs for SMs)
#   zeroprof    fsdp and zero3 under torch.profiler (top operators, device idle time, gzipped timelines in
#               $OUT/traces), record elsewhere
#
# NAME@K runs a step on the first K GPUs (e.g. pp@2 zero3@2 zeroprof@2 on a 4-GPU machine).
#
#   bash benchmarks/run_gpu_records.sh ep nd1b nd8b      # on the GPU machine; records and logs go to $OUT
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p benchmarks/results
LOGS="$(mktemp -d)"
LOG="$LOGS/records.log"
START_MARK="$(mktemp)"
copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results"
    find benchmarks/results -name '*.json' -newer "$START_MARK" -exec cp {} "$OUT/results/" \; 2>/dev/null || true
    tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null || true
    cp "$LOG" "$OUT/records.log" 2>/dev/null || true
    cp -r docs/pipeline_timelines/measured-* "$OUT/" 2>/dev/null || true
  fi
}
trap copy_out EXIT
source "benchmarks/gpu_step.sh"
ALL="$(nvidia-smi -L 2>/dev/null | wc -l)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
MOE='{"moe": {"num_experts": 8, "top_k": 2, "expert_hidden_dim": 1408}}'
for s in "$@"; do
  # NAME@K runs step NAME on the first K GPUs only (2-GPU records from a 4-GPU machine)
  name="${s%@*}"
  N="$ALL"
  if [ "$name" != "$s" ]; then N="${s#*@}"; fi
  export CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((N - 1)))"
  ND=(python3 benchmarks/bench_nd_parallel.py --nproc "$N" --log-dir "$LOGS")
  NDV=(dp "tp$N" "lightning-tp$N" "cp$N" "cp$N-ulysses" "torch-cp$N")
  case "$name" in
    ep) step 200 "${ND[@]}" --preset 1b --variants dp "ep$N" --model-overrides "$MOE" ;;
    nd1b) step 280 "${ND[@]}" --preset 1b --variants "${NDV[@]}" ;;
    nd8b) step 300 "${ND[@]}" --preset llama3-8b --layers 8 --variants "${NDV[@]}" ;;
    longest) step 480 "${ND[@]}" --preset 1b --longest --longest-cp "$N" --activation-checkpointing none \
      --warmup-steps 0 --steps 1 --longest-start 32768 --bisect 1 --timeout 200 ;;
    pptest) step 180 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_pipeline_wgrad.py \
      tests/parallel/test_pipeline.py ;;  # the deferred B/W split on this machine's torch (2.11) before timing it
    pp) step 280 torchrun --standalone --nproc-per-node="$N" benchmarks/bench_pipeline.py --preset 1b \
      --warmup 2 --steps 6 ;;
    ppsched) step 400 torchrun --standalone --nproc-per-node="$N" benchmarks/bench_pipeline_schedules.py --preset 1b \
      --seq-len 2048 --rows-per-microbatch 2 --microbatches 16 --split-backward deferred torch ;;
    ppsched4k) step 400 torchrun --standalone --nproc-per-node="$N" benchmarks/bench_pipeline_schedules.py \
      --preset 1b --seq-len 4096 --rows-per-microbatch 1 --microbatches 16 --split-backward deferred torch ;;
    ppfused) step 280 torchrun --standalone --nproc-per-node="$N" benchmarks/bench_pipeline.py --preset 1b \
      --fused-kernels rmsnorm rope swiglu --attn-backend triton --warmup 2 --steps 6 ;;
    pp44) step 300 torchrun --standalone --nproc-per-node="$N" benchmarks/bench_pipeline.py --preset 1b \
      --layers 44 --rows-per-microbatch 1 --warmup 2 --steps 4 ;;  # 2 rows: GPipe M=16 holds ~180 GB at PP=2
    zero) step 300 python3 benchmarks/bench_zero.py --nproc "$N" --log-dir "$LOGS" ;;
    zero3) step 120 python3 benchmarks/bench_zero.py --nproc "$N" --variants fsdp zero3 --merge --log-dir "$LOGS" ;;
    zeroprof) LLMOPT_PROFILE_TRACE="${OUT:-$LOGS}/traces" step 150 python3 benchmarks/bench_zero.py --nproc "$N" \
      --variants fsdp zero3 --profile --warmup-steps 3 --steps 4 --results-dir "$LOGS/prof" --log-dir "$LOGS" ;;
    zeroctas)  # fsdp and zero3 with NCCL limited to fewer CTAs (SMs), default first; records elsewhere
      for c in default 8 4; do
        if [ "$c" = default ]; then unset NCCL_MAX_CTAS; else export NCCL_MAX_CTAS="$c"; fi
        echo "--- NCCL_MAX_CTAS=$c" | tee -a "$LOG"
        step 130 python3 benchmarks/bench_zero.py --nproc "$N" --variants fsdp zero3 --results-dir "$LOGS/ctas-$c" \
          --log-dir "$LOGS"
      done
      unset NCCL_MAX_CTAS ;;
    *) echo "unknown step $s" | tee -a "$LOG"; status=1 ;;
  esac
done
unset CUDA_VISIBLE_DEVICES
python3 benchmarks/render_results.py 2>&1 | tail -1 | tee -a "$LOG" || status=1
exit "$status"
