#!/usr/bin/env bash
# Issue 53 (serving) on one GPU, in steps (default: all, in this order; pass names to run a subset):
#   smoke       benchmarks/gpu_smoke.py: every documented user path (record gpu-smoke-<device>.json), first;
#               SMOKE_ONLY="a b" runs those paths only (record gpu-smoke-subset-<device>.json)
#   structured  bench_structured.py --family engine: batch-64 decode with and without JSON-schema constraints
#   decode      bench_decode.py --family decode: batch 1 and 32, bf16 and int4, roofline, transformers static cache
#   serve       bench_serve.py --family serve: HTTP against offline at concurrency 1, 8 and 64
#   startup     bench_startup.py: llmopt serve's build, cold and warm, phase by phase
# Python packages the GPU image lacks travel as wheels in .whl/ (installed to /tmp/site first); the structured
# step's tokenizer is read from .whl/bpe32k/tokenizer.json when it is there (trained on the spot otherwise).
# Records and the log go to $OUT when it is set, after every step.
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
mkdir -p benchmarks/results
LOG="$(mktemp)"
SMOKE_LOGS="$(mktemp -d)"
STAMP="$(mktemp)"  # records written after it are this run's
copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    find "$ROOT/benchmarks/results" -name '*.json' -newer "$STAMP" -exec cp {} "$OUT/" \; 2>/dev/null || true
    cp "$LOG" "$OUT/run.log" 2>/dev/null || true
    tar czf "$OUT/smoke-logs.tgz" -C "$SMOKE_LOGS" . 2>/dev/null || true
  fi
}
trap copy_out EXIT
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(smoke structured decode serve startup)
source "benchmarks/gpu_step.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
TOK="$ROOT/.whl/bpe32k/tokenizer.json"
[ -f "$TOK" ] || TOK="$(mktemp -d)/tokenizer.json"
for s in "${steps[@]}"; do
  case "$s" in
    smoke) step 330 python3 benchmarks/gpu_smoke.py --logs "$SMOKE_LOGS" --deadline "${SMOKE_DEADLINE:-300}" \
      ${SMOKE_ONLY:+--only $SMOKE_ONLY} ;;
    structured) step 240 python3 benchmarks/bench_structured.py --family engine --tokenizer "$TOK" ;;
    decode) step 300 python3 benchmarks/bench_decode.py --family decode ;;
    serve) step 300 python3 benchmarks/bench_serve.py --family serve ;;
    startup) step 240 python3 benchmarks/bench_startup.py --preset llama2-7b ;;
    *) echo "unknown step $s" | tee -a "$LOG"; status=1 ;;
  esac
done
exit "$status"
