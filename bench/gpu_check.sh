#!/usr/bin/env bash
# One-command GPU check: build in place, check the build, run the fused-path tests and
# benchmarks (bench/gpu_check_fused.sh), then the Triton GPU tests and the attention benchmark.
#
#   bash bench/gpu_check.sh
#
# Works offline. Logs and results go to bench/results, or with $OUT set (the lent GPU
# machine) to a scratch folder published into $OUT after every step (bench/_steps.sh), so a
# call cut off at its time limit still returns what ran. Every step runs under a timeout and
# a failing step does not stop the next one, except the build checks: without the CUDA
# extension every later step would only skip. Exits non-zero if any step failed.
# Budget, counting every timeout: install 120 s, preflight 40 s, fused tests 130 s, a2a 40 s,
# layer 60 s, Triton GPU tests 110 s, attention benchmark 75 s = 575 s, inside one 10-minute
# device call; the fused path (issue 4) runs first.
set -u

STEP_PREFIX=
source "$(dirname "${BASH_SOURCE[0]}")/_steps.sh"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"

{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $PYTHON"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
  timeout 60 "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__)" 2>&1
} | tee "$RESULTS/gpu_check_env.txt"

# FORCE: a build that fell back to pure Python would let every fused test skip and the run
# look green. -v: setup.py's own lines (arches, NCCL paths) reach the log.
step install 120 env ULYSSES_KERNELS_FORCE_CUDA_BUILD=1 "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e .
step preflight 40 "$PYTHON" -c "
import torch
assert torch.cuda.is_available(), 'torch sees no CUDA device'
import ulysses_kernels.triton  # the package_dir mapping of triton_kernels/, present only when installed
from ulysses_kernels import _backend, fused
module, why = _backend.load_extension()
assert module is not None, f'the CUDA extension did not load: {why}'
assert fused.is_supported(), 'the extension lacks the fused ops'
from ulysses_kernels import cli
cli.main(['doctor'])
"
if [[ " ${FAILED[*]} " == *" install "* || " ${FAILED[*]} " == *" preflight "* ]]; then
  echo "the build is not usable: stopping here (every later step would only skip); see the install and preflight logs"
  exit 1
fi

echo "=== running bench/gpu_check_fused.sh"
if bash "$ROOT/bench/gpu_check_fused.sh"; then
  echo "[fused] ok" | tee -a "$SUMMARY"
else
  echo "[fused] FAILED rc=$?" | tee -a "$SUMMARY"
  FAILED+=("fused")
fi
publish_results

# Correctness with the default (per-head-dim) configs: autotuning every test shape would
# compile every candidate config for each shape and blow the time budget.
step tests 110 env ULYSSES_KERNELS_TRITON_AUTOTUNE=0 "$PYTHON" -m pytest -m gpu -v -p no:cacheprovider -rs \
  --durations=15 --ignore=tests/test_fused_gpu.py
step bench 75 "$PYTHON" bench/bench_attention.py --out "$RESULTS" --budget-s 55

echo "=== summary (logs in $RESULTS)"
cat "$SUMMARY"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed steps: ${FAILED[*]}"
  exit 1
fi
echo "all steps passed"
