"""bench/gpu_check.sh on CPU (GPU_CHECK_DRY_RUN=1: GPU parts stubbed, pytest steps only
collect, benchmarks only parse their arguments). CI runs the whole dry run in .ci/run;
this test walks the path a failed CUDA build takes, which a real run reaches only on a
broken device image."""

import os
import subprocess

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # the GPU check script walked on the CPU (subprocesses)


def _dry_run(tmp_path, **env):
    run_env = dict(os.environ, GPU_CHECK_DRY_RUN="1", UK_RESULTS=str(tmp_path), **env)
    run_env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=300)
    return proc, (tmp_path / "gpu_check_summary.txt").read_text()


def test_failed_build_skips_only_the_fused_steps(tmp_path):
    proc, summary = _dry_run(tmp_path, GPU_CHECK_SIMULATE_BUILD_FAILURE="1",
                             GPU_CHECK_STEPS="install fused_tests bench_a2a triton_tests")
    assert "[install] FAILED" in summary and "[install] first error: error: simulated build failure" in summary
    assert "[fallback] ok" in summary
    assert "[fused_tests] SKIPPED" in summary and "[bench_a2a] SKIPPED" in summary
    assert "[triton_tests] ok" in summary, proc.stdout[-3000:]
    assert proc.returncode == 1  # the failed install fails the run


def test_budget_is_printed_and_capped(tmp_path):
    proc, summary = _dry_run(tmp_path, GPU_CHECK_STEPS="env")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "step budget: env 15s, + 1 x 5s kill grace = 20 s (limit 480 s" in summary


def test_bad_dry_run_value_is_an_error(tmp_path):
    run_env = dict(os.environ, GPU_CHECK_DRY_RUN="maybe", UK_RESULTS=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not a boolean" in proc.stdout
