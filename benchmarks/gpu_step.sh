# Sourced by the run_*_gpu.sh scripts: `step SECONDS CMD...` runs CMD under a time limit, appends its output to
# $LOG, sets status=1 when it fails, and calls the script's copy_out afterwards (a later step that runs out of time
# keeps what came before).
status=0
step() {
  local limit=$1; shift
  echo "=== $* (limit ${limit}s)" | tee -a "$LOG"
  local start=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" || status=1
  echo "=== done in $((SECONDS - start))s" | tee -a "$LOG"
  copy_out
}
