#!/usr/bin/env bash
# One-command GPU check: build in place, run the GPU tests, run the attention benchmark.
#
#   bash bench/gpu_check.sh
#
# Works offline. Logs and results go to bench/results, or with $OUT set (the lent GPU
# machine) to a scratch folder published into $OUT at the end (bench/_steps.sh). Every step runs
# under a timeout and a failing step does not stop the next one; the script exits non-zero
# at the end if any step failed. Budget: at most ~9.5 minutes on one H200 counting every
# timeout (install 120 s, tests 110 s, benchmark 100 s, then bench/gpu_check_fused.sh:
# tests 130 s, a2a 30 s, layer 70 s), so one 10-minute device call holds it all.
set -u

STEP_PREFIX=
source "$(dirname "${BASH_SOURCE[0]}")/_steps.sh"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"


{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $PYTHON"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__)" 2>&1
} | tee "$RESULTS/gpu_check_env.txt"

step install 120 "$PYTHON" -m pip install --no-build-isolation --no-deps -e .
# Correctness with the default (per-head-dim) configs: autotuning every test shape would
# compile every candidate config for each shape and blow the time budget.
# tests/test_fused_gpu.py runs in bench/gpu_check_fused.sh (with the extension checks).
step tests 110 env ULYSSES_KERNELS_TRITON_AUTOTUNE=0 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs \
  --durations=15 --ignore=tests/test_fused_gpu.py
step bench 100 "$PYTHON" bench/bench_attention.py --out "$RESULTS" --budget-s 80

if [ -f "$ROOT/bench/gpu_check_fused.sh" ]; then
  echo "=== running bench/gpu_check_fused.sh"
  if bash "$ROOT/bench/gpu_check_fused.sh"; then
    echo "[fused] ok" | tee -a "$SUMMARY"
  else
    echo "[fused] FAILED rc=$?" | tee -a "$SUMMARY"
    FAILED+=("fused")
  fi
fi

echo "=== summary (logs in $RESULTS)"
cat "$SUMMARY"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed steps: ${FAILED[*]}"
  exit 1
fi
echo "all steps passed"
