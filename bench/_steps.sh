# Sourced by bench/gpu_check.sh (set STEP_PREFIX first, and the nominal limits in the
# associative array LIMIT). Sets ROOT, RESULTS, PYTHON, SUMMARY, FAILED, DRY_RUN, the
# deadline (DEADLINE_S, UK_DEADLINE_AT) and defines
#   step NAME CMD...      runs CMD under its limit (below) with its log in $RESULTS, prints
#                         the log's tail, records ok / FAILED / TIMED OUT in $SUMMARY and
#                         STATUS[NAME], returns CMD's status (125: not run, the deadline)
#                         and never stops the calling script;
#   step_limit NAME       the limit step would give NAME now: LIMIT[NAME], cut to what is
#                         left of the deadline; 0 when that is under MIN_STEP_S;
#   skip NAME WHY         records a step that is not started, and why;
#   first_error_line NAME the first compiler/pip error line of a step's log;
#   first_error NAME      that line of a failed step, into $SUMMARY;
#   failing_test NAME [TEST_RE [BODY_RE]]  the first failing test of a step whose id
#                         matches TEST_RE and whose report matches BODY_RE, with that line;
#   first_failure NAME    the first failing test of a step (and its first E line), else the
#                         first error line of its log;
#   status_text NAME      PASS / FAIL: ... / NOT RUN (deadline) / SKIPPED (why) / NOT
#                         FINISHED (deadline), the verdict block's words for one step;
#   print_plan            the deadline schedule of the steps in $STEPS;
#   publish_results       called after every step and at exit (see below).
#
# One deadline (docs/build.md, "The GPU check"): the whole call ends within
# GPU_CHECK_DEADLINE_S (default 540) seconds of its start, so it fits one 600 s device call
# with time left for the start and the transfers. Every step's timeout is its own nominal
# limit cut to what remains, less its kill grace and END_RESERVE (the verdict and the last
# publish); a step left with less than MIN_STEP_S is not started ("NOT RUN (deadline)").
#
# Dry run (GPU_CHECK_DRY_RUN=1): steps run on the CPU with the GPU parts stubbed: pytest
# only collects (PYTEST_ADDOPTS), the benchmarks stop after parsing their arguments and
# importing what they need (they read GPU_CHECK_DRY_RUN), and the script itself stubs the
# install. The deadline applies to the dry run's own wall time.
#
# Where results go. Without $OUT: bench/results. With $OUT (the lent GPU machine), only
# 8 files come back from $OUT, and a full run writes about 16 (logs, JSON, Markdown, a
# plot), so the steps write into a scratch folder and publish_results puts a handful of
# files into $OUT: one tarball of everything, one report, the plot and the JSON results.
# The outermost script exports UK_RESULTS (and UK_DEADLINE_AT), so a nested script writes
# into the same folder and ends by the same deadline.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${UK_RESULTS:-}" ]; then
  UK_RESULTS_OWNER=1
  if [ -n "${OUT:-}" ]; then UK_RESULTS="$(mktemp -d "${TMPDIR:-/tmp}/ulysses_gpu_check.XXXXXX")"; else UK_RESULTS="$ROOT/bench/results"; fi
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
DEADLINE_S="${GPU_CHECK_DEADLINE_S:-540}"
if ! [[ "$DEADLINE_S" =~ ^[0-9]+$ ]]; then
  echo "GPU_CHECK_DEADLINE_S=$DEADLINE_S is not a whole number of seconds"; exit 2
fi
UK_START_AT="${UK_START_AT:-$(date +%s)}"
UK_DEADLINE_AT="${UK_DEADLINE_AT:-$((UK_START_AT + DEADLINE_S))}"
export UK_START_AT UK_DEADLINE_AT
KILL_GRACE=5    # seconds a step may take to die after its timeout (timeout --kill-after)
MIN_STEP_S=10   # a step left with less is not started
END_RESERVE=5   # seconds kept after the last step: the verdict block and the last publish
if [ "$DRY_RUN" = 1 ]; then
  export PYTEST_ADDOPTS="--collect-only -q ${PYTEST_ADDOPTS:-}"
  export TRITON_INTERPRET=1        # CPU: kernel modules import for the interpreter
else
  export TRITON_INTERPRET=0        # real kernels (the CPU test suite uses the interpreter)
fi
FAILED=()
declare -A STATUS=() TOOK=() USED=() WHY=()
trap publish_results EXIT
SUMMARY="$RESULTS/gpu_check_${STEP_PREFIX}summary.txt"
: > "$SUMMARY"

elapsed() { echo $(( $(date +%s) - UK_START_AT )); }

step_limit() {  # step_limit NAME: LIMIT[NAME] cut to the deadline; 0 when under MIN_STEP_S
  local nominal="${LIMIT[$1]:?no LIMIT for step $1}"
  local left=$(( UK_DEADLINE_AT - $(date +%s) - END_RESERVE - KILL_GRACE ))
  local limit=$(( nominal < left ? nominal : left ))
  local least=$(( nominal < MIN_STEP_S ? nominal : MIN_STEP_S ))
  if [ "$limit" -lt "$least" ]; then echo 0; else echo "$limit"; fi
}

skip() {  # skip NAME WHY
  STATUS[$1]=skipped
  WHY[$1]="$2"
  echo "[${STEP_PREFIX}$1] SKIPPED: $2" | tee -a "$SUMMARY"
}

step() {  # step NAME CMD...: CMD under step_limit NAME
  local name="$1"; shift
  local log="$RESULTS/gpu_check_${STEP_PREFIX}${name}.log"
  local nominal="${LIMIT[$name]:?no LIMIT for step $name}" limit
  limit=$(step_limit "$name")
  if [ "$limit" = 0 ]; then
    STATUS[$name]=notrun
    echo "[${STEP_PREFIX}${name}] NOT RUN (deadline: $(( UK_DEADLINE_AT - $(date +%s) ))s left of" \
         "GPU_CHECK_DEADLINE_S=${DEADLINE_S}; a step needs ${MIN_STEP_S}s, + ${KILL_GRACE}s kill grace," \
         "+ ${END_RESERVE}s kept for the verdict)" | tee -a "$SUMMARY"
    publish_results
    return 125
  fi
  local t0=$SECONDS cut=""
  [ "$limit" -lt "$nominal" ] && cut=", cut from ${nominal}s by the deadline"
  USED[$name]=$limit
  echo "=== [${STEP_PREFIX}${name}] $* (timeout ${limit}s${cut}; $(elapsed)s of ${DEADLINE_S}s used) -> $log"
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
  TOOK[$name]=$dt
  tail -n 25 "$log"
  if [ $rc -eq 0 ]; then
    STATUS[$name]=ok
    echo "[${STEP_PREFIX}${name}] ok (${dt}s)" | tee -a "$SUMMARY"
  else
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      if [ -n "$cut" ]; then STATUS[$name]=cut; else STATUS[$name]=timeout; fi
      echo "[${STEP_PREFIX}${name}] TIMED OUT after ${limit}s${cut}" | tee -a "$SUMMARY"
    else
      STATUS[$name]=failed
    fi
    echo "[${STEP_PREFIX}${name}] FAILED rc=$rc (${dt}s)" | tee -a "$SUMMARY"
    FAILED+=("$name")
  fi
  publish_results
  return $rc
}

first_error_line() {  # first_error_line NAME: the first compiler/pip error line of a step's log
  grep -m1 -E "error:|Error:|ERROR|error [A-Z]+[0-9]+" "$RESULTS/gpu_check_${STEP_PREFIX}$1.log" 2>/dev/null
}

first_error() {  # first_error NAME: the first compiler/pip error of a failed step, for the report
  local line
  line=$(first_error_line "$1")
  echo "[$1] first error: ${line:-none found, see the log}" | tee -a "$SUMMARY"
}

failing_test() {  # failing_test NAME [TEST_RE [BODY_RE]]: "test: line" of the first failing test matching both
  local failures="$RESULTS/gpu_check_${STEP_PREFIX}$1_failures.txt"
  [ -s "$failures" ] || return 0
  # tests/conftest.py writes "===== NODEID (WHEN)" and then the report; the line shown is the
  # report's first line matching BODY_RE, else its first "E " line.
  awk -v tre="${2:-}" -v bre="${3:-}" '
    function flush() {
      if (!done && test != "" && test ~ tre && (bre == "" || hit != "")) {
        print test ((hit != "" ? hit : err) != "" ? ": " (hit != "" ? hit : err) : ""); done = 1
      }
    }
    /^===== / { flush(); if (done) exit; test = substr($0, 7); sub(/ \(call\)$/, "", test); err = ""; hit = ""; next }
    test != "" && err == "" && /^E / { err = $0; sub(/^E +/, "", err) }
    test != "" && bre != "" && hit == "" && $0 ~ bre { hit = $0; sub(/^E +/, "", hit); sub(/^ +/, "", hit) }
    END { flush() }' "$failures" | cut -c1-220
}

first_failure() {  # first_failure NAME: the first failing test (and why), else the log's first error line
  local log="$RESULTS/gpu_check_${STEP_PREFIX}$1.log" found
  found=$(failing_test "$1")
  if [ -z "$found" ] && [ -f "$log" ]; then  # pytest -v ("t FAILED"; xdist "[gw0] [ 5%] FAILED t"), else an error
    found=$(grep -m1 -oE "[^ ]+::[^ ]+ (FAILED|ERROR)|(FAILED|ERROR) [^ ]+::[^ ]+" "$log")
    # an exception's own line starts with its name ("RuntimeError: ..."); a word such as
    # "RuntimeError" inside a line (the doctor's "raised as RuntimeError") is no failure
    [ -n "$found" ] || found=$(grep -m1 -E "^[A-Za-z_.]*(Error|Exception)\b|error:|ERROR|Traceback|Segmentation fault|core dumped" "$log")
  fi
  echo "$found" | cut -c1-220
}

status_text() {  # status_text NAME: the verdict block's words for one step
  local name="$1" failure
  case "${STATUS[$name]:-}" in
    ok)
      if [ "$DRY_RUN" = 1 ]; then echo "PASS (dry run: walked, ${TOOK[$name]}s)"; else echo "PASS (${TOOK[$name]}s)"; fi ;;
    failed)
      failure=$(first_failure "$name")
      echo "FAIL: ${failure:-exit code non-zero, see gpu_check_${STEP_PREFIX}${name}.log}" ;;
    timeout)
      failure=$(first_failure "$name")
      echo "FAIL: timed out after ${USED[$name]}s${failure:+; first failure: $failure}" ;;
    cut)
      failure=$(first_failure "$name")
      if [ -n "$failure" ]; then
        echo "FAIL: $failure (then cut by the deadline after ${USED[$name]}s)"
      else
        echo "NOT FINISHED (deadline: stopped after ${USED[$name]}s of its ${LIMIT[$name]}s, no failure before)"
      fi ;;
    notrun) echo "NOT RUN (deadline)" ;;
    skipped) echo "SKIPPED (${WHY[$name]})" ;;
    *)
      if [[ " $STEPS " == *" $name "* ]]; then echo "NOT RUN (not reached yet)"; else echo "SKIPPED (not in GPU_CHECK_STEPS)"; fi ;;
  esac
}

print_plan() {  # the deadline schedule of $STEPS: each nominal limit + kill grace, cumulated
  local s total=0 fits="" lines="" budget=$((DEADLINE_S - END_RESERVE))
  for s in $STEPS; do
    total=$((total + LIMIT[$s] + KILL_GRACE))
    lines+=$(printf '  %-16s %4ss  -> %4ss' "$s" "${LIMIT[$s]}" "$total")
    if [ "$total" -le "$budget" ]; then
      fits+=" $s"
    else
      lines+="  beyond the deadline if every step before ran to its limit"
    fi
    lines+=$'\n'
  done
  {
    echo "deadline schedule (GPU_CHECK_DEADLINE_S=${DEADLINE_S}: ${budget}s for the steps, ${END_RESERVE}s for the" \
         "verdict; each step's nominal limit, and the sum with ${KILL_GRACE}s kill grace each):"
    printf '%s' "$lines"
    echo "every step at its limit: ${total}s; reached even so:${fits:- none}; the rest runs as time remains" \
         "(cut to what is left, not started with under ${MIN_STEP_S}s)"
  } | tee -a "$SUMMARY"
}

# Runs after every step and on exit (trap): a call cut off at its time limit, or a failing
# step, still returns what the other steps wrote. Takes well under a second.
publish_results() {  # outermost script only, and only when $OUT is set
  if declare -F write_verdict >/dev/null; then write_verdict; fi  # the caller's verdict, so far
  [ "$UK_RESULTS_OWNER" = 1 ] && [ -n "${OUT:-}" ] || return 0
  local report="$OUT/gpu_check_report.md" f
  {
    echo "# gpu_check report ($(date -u +%FT%TZ))"
    [ -n "${REPORT_HEADER:-}" ] && printf '\n%s\n' "$REPORT_HEADER"
    for f in gpu_check_env.txt gpu_check_verdict.txt gpu_check_summary.txt \
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
