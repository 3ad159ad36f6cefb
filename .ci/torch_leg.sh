#!/usr/bin/env bash
# One CI leg on another torch release (docs/build.md, "Supported torch releases"):
#
#   bash .ci/torch_leg.sh 2.11           # torch 2.11.0, Triton 3.6, numpy 2.2 (the GPU image's torch)
#   bash .ci/torch_leg.sh 2.15           # torch 2.15.0, Triton 3.9 (the newest release)
#   bash .ci/torch_leg.sh 2.11 prepare   # only the copy and the environment (downloads)
#   bash .ci/torch_leg.sh 2.11 run       # only the build and the tests, in a prepared leg
#
# In its own copy of the working tree (.ci-legs/torch<minor>/src, ignored by git: the leg
# builds the CUDA extension in place against its own torch, which must not replace the main
# environment's build) and its own virtual environment, with the exact versions of
# .ci/constraints-torch<minor>.txt, it builds the package (the CUDA extension compiled with
# nvcc, ULYSSES_KERNELS_FORCE_CUDA_BUILD=1: a build that breaks on this torch fails the leg),
# then runs the fast tier and every kernel, fused, ring, Triton-path, exchange and
# distributed CPU test. .ci/run prepares both legs in the background while the main suite
# runs (the downloads overlap it), then runs them.
#
# PIP_CONSTRAINT replaces, for the leg's pip calls, any machine-wide constraint (a cap on torch
# in pip's global configuration would refuse 2.15).
set -euo pipefail
cd "$(dirname "$0")/.."
minor="${1:?usage: bash .ci/torch_leg.sh MINOR [prepare|run]}"
mode="${2:-all}"
constraints="$PWD/.ci/constraints-torch${minor}.txt"
[ -f "$constraints" ] || { echo "torch leg: no $constraints"; exit 2; }
leg="$PWD/.ci-legs/torch${minor}"
export PIP_CONSTRAINT="$constraints" PIP_DISABLE_PIP_VERSION_CHECK=1

prepare() {
    local start torch_pin
    start=$(date +%s)
    torch_pin="$(grep -E '^torch==' "$constraints")"
    rm -rf "$leg" && mkdir -p "$leg/src"
    # The files the main run sees: tracked, and untracked but not ignored (no venvs, no builds).
    git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$leg/src"
    # A repository of its own, its files in the index: tests list the project's files with git.
    (cd "$leg/src" && git init -q && git add -A)
    python3 -m venv "$leg/venv"
    "$leg/venv/bin/pip" install -q -U pip setuptools wheel ninja
    "$leg/venv/bin/pip" install -q "$torch_pin"
    # The package's dependencies and extras, pure Python for now (run builds the extension).
    (cd "$leg/src" && ULYSSES_KERNELS_SKIP_CUDA_BUILD=1 "$leg/venv/bin/pip" install -q --no-build-isolation \
        -e ".[test,hf]")
    echo "torch leg ${minor}: environment prepared in $(( $(date +%s) - start )) s"
}

run() {
    local start status
    start=$(date +%s)
    [ -x "$leg/venv/bin/python" ] || { echo "torch leg ${minor}: not prepared ($leg)"; exit 2; }
    cd "$leg/src" && . "$leg/venv/bin/activate"
    ULYSSES_KERNELS_FORCE_CUDA_BUILD=1 pip install -q --no-build-isolation --no-deps -e .
    echo "torch leg ${minor}: package build (CUDA extension) $(( $(date +%s) - start )) s"
    python - <<'PY'
import importlib.metadata as md
import torch
import ulysses_kernels._C  # noqa: F401 - the extension built against this torch loads
print("torch leg:", ", ".join(f"{n} {md.version(n)}" for n in ("torch", "triton", "numpy", "transformers")),
      "| extension:", torch.ops.ulysses_kernels.build_info())
PY
    ulysses-kernels doctor | grep -E "^(torch|triton|WARNING)" || true
    local tests_start
    tests_start=$(date +%s)
    # The fast tier, then the slow tests of the kernels and the paths (spawned process groups)
    # that the fast tier leaves out.
    status=0
    pytest -n 2 -q -p no:cacheprovider -m "not slow" || status=1
    pytest -n 2 -q -p no:cacheprovider -m "slow" tests/triton tests/fused tests/ring tests/kernel_choice tests/csrc \
        tests/exchange tests/reference tests/distributed tests/test_stream_order.py tests/test_nccl_order.py || status=1
    echo "torch leg ${minor}: $([ $status = 0 ] && echo green || echo RED); build and tests" \
         "$(( $(date +%s) - start )) s (tests $(( $(date +%s) - tests_start )) s)"
    return $status
}

case "$mode" in
    prepare) prepare ;;
    run) run ;;
    all) prepare && run ;;
    *) echo "torch leg: mode must be prepare, run or nothing, got $mode"; exit 2 ;;
esac
