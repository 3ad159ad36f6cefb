# Shared by bench/gpu_check.sh and bench/gpu_check_fused.sh (source it; set STEP_PREFIX
# first). Sets ROOT, RESULTS ($OUT or bench/results), PYTHON, SUMMARY, FAILED and defines
#   step NAME TIMEOUT_S CMD...
# which runs CMD under a timeout with its log in $RESULTS, prints the log's tail, records
# ok / FAILED / TIMED OUT in $SUMMARY and never stops the calling script.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/bench/results}"
mkdir -p "$RESULTS"
if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/ukvenv/bin/python ]; then PYTHON=/opt/ukvenv/bin/python; else PYTHON="$(command -v python3 || command -v python)"; fi
fi
export PYTHON
export TRITON_INTERPRET=0          # real kernels (the CPU test suite uses the interpreter)
export PYTHONUNBUFFERED=1
FAILED=()
SUMMARY="$RESULTS/gpu_check_${STEP_PREFIX}summary.txt"
: > "$SUMMARY"

step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"; shift 2
  local log="$RESULTS/gpu_check_${STEP_PREFIX}${name}.log"
  local t0=$SECONDS
  echo "=== [${STEP_PREFIX}${name}] $* (timeout ${limit}s) -> $log"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  tail -n 25 "$log"
  if [ $rc -eq 0 ]; then
    echo "[${STEP_PREFIX}${name}] ok (${dt}s)" | tee -a "$SUMMARY"
  else
    [ $rc -eq 124 ] && echo "[${STEP_PREFIX}${name}] TIMED OUT after ${limit}s" | tee -a "$SUMMARY"
    echo "[${STEP_PREFIX}${name}] FAILED rc=$rc (${dt}s)" | tee -a "$SUMMARY"
    FAILED+=("$name")
  fi
}
