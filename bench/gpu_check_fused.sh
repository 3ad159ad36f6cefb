#!/usr/bin/env bash
# GPU check of the fused path (CUDA pack/unpack kernels + NCCL engine + overlap).
# Builds nothing: bench/gpu_check.sh installs the package first, then runs this script.
#
#   bash bench/gpu_check_fused.sh          # logs and results: see bench/_steps.sh
#
# Steps (each under its own timeout; a failing step does not stop the next one; the
# script exits non-zero if any failed). Budget: under ~4 minutes on one H200.
#   tests        pytest tests/test_fused_gpu.py tests/test_extension.py           (130 s)
#   bench_a2a    bench/bench_a2a.py --quick                                       (40 s)
#   bench_layer  bench/bench_layer.py --quick                                     (60 s)
set -u

STEP_PREFIX=fused_
source "$(dirname "${BASH_SOURCE[0]}")/_steps.sh"
# Default Triton configs (no autotuning): every test shape and spawned rank would otherwise
# compile every candidate config. Benchmarks report this setting in their JSON.
export ULYSSES_KERNELS_TRITON_AUTOTUNE="${ULYSSES_KERNELS_TRITON_AUTOTUNE:-0}"
# A hung NCCL init or exchange becomes an exception well inside the step timeouts
# (a one-rank communicator initialises in a few seconds).
export ULYSSES_KERNELS_NCCL_TIMEOUT="${ULYSSES_KERNELS_NCCL_TIMEOUT:-30}"
# NCCL's own warnings in the logs: the first GPU run is the only chance to see them.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"


# test_extension.py is unmarked (CPU checks: schemas, fakes, dispatch); -m gpu would
# deselect it, so both files run without a marker filter (test_fused_gpu.py is all gpu).
# Not with ULYSSES_KERNELS_NCCL_CHECK=1: its host wait after every call would hide
# missing stream dependencies between calls, which these tests are meant to catch.
# The host-compiled kernel index test is CPU-only and already runs in CPU CI.
step tests 130 "$PYTHON" -m pytest -v -p no:cacheprovider -rs --durations=10 \
  tests/test_fused_gpu.py tests/test_extension.py \
  --deselect tests/test_extension.py::test_kernel_index_math_on_host
step bench_a2a 40 "$PYTHON" bench/bench_a2a.py --quick --out "$RESULTS"
step bench_layer 60 "$PYTHON" bench/bench_layer.py --quick --out "$RESULTS"

for f in a2a.md layer.md; do
  [ -f "$RESULTS/$f" ] && cat "$RESULTS/$f"
done
echo "=== fused summary"
cat "$SUMMARY"
[ ${#FAILED[@]} -eq 0 ]
