# Sourced by bench/gpu_check.sh (set STEP_PREFIX first). Sets ROOT, RESULTS, PYTHON,
# SUMMARY, FAILED, DRY_RUN and defines
#   step NAME TIMEOUT_S CMD...
# which runs CMD under a timeout with its log in $RESULTS, prints the log's tail, records
# ok / FAILED / TIMED OUT in $SUMMARY, returns CMD's status and never stops the calling
# script;
#   first_error NAME      the first error line of a failed step's log, into $SUMMARY;
#   print_budget          the timeouts of the steps in $STEPS (array LIMIT) and their sum
#                         (BUDGET_TOTAL);
#   publish_results       called after every step and at exit (see below).
#
# Dry run (GPU_CHECK_DRY_RUN=1): steps run on the CPU with the GPU parts stubbed: pytest
# only collects (PYTEST_ADDOPTS), the benchmarks stop after parsing their arguments and
# importing what they need (they read GPU_CHECK_DRY_RUN), and the script itself stubs the
# install.
#
# Where results go. Without $OUT: bench/results. With $OUT (the lent GPU machine), only
# 8 files come back from $OUT, and a full run writes about 16 (logs, JSON, Markdown, a
# plot), so the steps write into a scratch folder and publish_results puts a handful of
# files into $OUT: one tarball of everything, one report, the plot and the JSON results.
# The outermost script exports UK_RESULTS, so a nested script writes into the same folder.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${UK_RESULTS:-}" ]; then
  UK_RESULTS_OWNER=1
  if [ -n "${OUT:-}" ]; then UK_RESULTS="$(mktemp -d /tmp/ulysses_gpu_check.XXXXXX)"; else UK_RESULTS="$ROOT/bench/results"; fi
  export UK_RESULTS
else
  UK_RESULTS_OWNER=0
fi
RESULTS="$UK_RESULTS"
mkdir -p "$RESULTS"
if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/ukvenv/bin/python ]; then PYTHON=/opt/ukvenv/bin/python; else PYTHON="$(command -v python3 || command -v python)"; fi
fi
export PYTHON
export PYTHONUNBUFFERED=1
# The spellings of ulysses_kernels/env.py, which the Python steps use to read it too.
case "$(echo "${GPU_CHECK_DRY_RUN:-0}" | tr '[:upper:]' '[:lower:]')" in
  1|true|yes|on|y) DRY_RUN=1 ;;
  ""|0|false|no|off|n) DRY_RUN=0 ;;
  *) echo "GPU_CHECK_DRY_RUN=$GPU_CHECK_DRY_RUN is not a boolean (1/true/yes/on or 0/false/no/off)"; exit 2 ;;
esac
export GPU_CHECK_DRY_RUN=$DRY_RUN
KILL_GRACE=5   # seconds a step may take to die after its timeout (timeout --kill-after)
if [ "$DRY_RUN" = 1 ]; then
  export PYTEST_ADDOPTS="--collect-only -q ${PYTEST_ADDOPTS:-}"
  export TRITON_INTERPRET=1        # CPU: kernel modules import for the interpreter
else
  export TRITON_INTERPRET=0        # real kernels (the CPU test suite uses the interpreter)
fi
FAILED=()
trap publish_results EXIT
SUMMARY="$RESULTS/gpu_check_${STEP_PREFIX}summary.txt"
: > "$SUMMARY"

step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"; shift 2
  local log="$RESULTS/gpu_check_${STEP_PREFIX}${name}.log"
  local t0=$SECONDS
  echo "=== [${STEP_PREFIX}${name}] $* (timeout ${limit}s) -> $log"
  if [ "$DRY_RUN" = 1 ] && [ "$name" = install ] && [ "${GPU_CHECK_SIMULATE_BUILD_FAILURE:-0}" = 1 ]; then
    echo "error: simulated build failure (GPU_CHECK_SIMULATE_BUILD_FAILURE=1)" >"$log"
    false
  else
    # Each failing test's report as it happens (tests/conftest.py): a step cut off at its
    # limit never reaches pytest's own summary of why.
    ULYSSES_KERNELS_FAILURE_LOG="$RESULTS/gpu_check_${STEP_PREFIX}${name}_failures.txt" \
      timeout --kill-after="$KILL_GRACE" "$limit" "$@" >"$log" 2>&1
  fi
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
  publish_results
  return $rc
}

first_error() {  # first_error NAME: the first compiler/pip error of a failed step, for the report
  local log="$RESULTS/gpu_check_${STEP_PREFIX}$1.log" line
  line=$(grep -m1 -E "error:|Error:|ERROR|error [A-Z]+[0-9]+" "$log" 2>/dev/null)
  echo "[$1] first error: ${line:-none found, see the log}" | tee -a "$SUMMARY"
}

print_budget() {  # the timeouts of the steps in $STEPS, each with its kill grace, and their sum
  BUDGET_TOTAL=0
  local s n=0 line="step budget:"
  for s in $STEPS; do
    line+=" $s ${LIMIT[$s]}s +"
    BUDGET_TOTAL=$((BUDGET_TOTAL + LIMIT[$s] + KILL_GRACE))
    n=$((n + 1))
  done
  echo "${line% +}, + ${n} x ${KILL_GRACE}s kill grace = ${BUDGET_TOTAL} s (limit ${BUDGET_LIMIT} s; a failed build skips the fused steps and runs the fallback, ${LIMIT[fallback]}s, instead)" | tee -a "$SUMMARY"
}

# Runs after every step and on exit (trap): a call cut off at its time limit, or a failing
# step, still returns what the other steps wrote. Takes well under a second.
publish_results() {  # outermost script only, and only when $OUT is set
  [ "$UK_RESULTS_OWNER" = 1 ] && [ -n "${OUT:-}" ] || return 0
  local report="$OUT/gpu_check_report.md" f
  {
    echo "# gpu_check report ($(date -u +%FT%TZ))"
    for f in gpu_check_env.txt gpu_check_summary.txt \
             attention_results.md a2a.md layer.md; do
      [ -f "$RESULTS/$f" ] || continue
      printf '\n## %s\n\n' "$f"
      case "$f" in
        *.md) cat "$RESULTS/$f" ;;
        *) printf '```\n'; cat "$RESULTS/$f"; printf '```\n' ;;
      esac
    done
    # The end of every failed step's log: the 12,000 characters of output that come back
    # with the call may cut them off, and the tarball needs unpacking.
    local name
    for name in $(cat "$RESULTS"/gpu_check_*summary.txt 2>/dev/null | grep -E "FAILED|TIMED OUT" \
                  | sed -E 's/^\[([A-Za-z0-9_]+)\].*/\1/' | sort -u); do
      [ -f "$RESULTS/gpu_check_${name}.log" ] || continue
      printf '\n## last 60 lines of gpu_check_%s.log (failed)\n\n```\n' "$name"
      tail -n 60 "$RESULTS/gpu_check_${name}.log"
      printf '```\n'
      if [ -s "$RESULTS/gpu_check_${name}_failures.txt" ]; then
        printf '\n## failing tests of %s (first 150 lines of their reports)\n\n```\n' "$name"
        head -n 150 "$RESULTS/gpu_check_${name}_failures.txt"
        printf '```\n'
      fi
    done
  } > "$report"
  tar -czf "$OUT/gpu_check_results.tar.gz" -C "$RESULTS" .
  for f in attention_tflops.png attention_results.json a2a.json layer.json microbench.json; do
    [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUT/"
  done
  echo "published to \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
}
