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


def test_failing_tests_are_logged_as_they_fail(tmp_path, monkeypatch):
    """tests/conftest.py appends each failing report to ULYSSES_KERNELS_FAILURE_LOG at once:
    on the second GPU run a step cut off at its limit lost every reason its tests failed."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("_conftest_under_test", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    log = tmp_path / "failures.txt"
    monkeypatch.setenv("ULYSSES_KERNELS_FAILURE_LOG", str(log))
    conftest.pytest_runtest_logreport(SimpleNamespace(failed=False, nodeid="t::ok", when="call", longreprtext=""))
    assert not log.exists()
    for name in ("t::first", "t::second"):
        conftest.pytest_runtest_logreport(SimpleNamespace(failed=True, nodeid=name, when="call",
                                                          longreprtext=f"E  IndexError in {name}"))
    text = log.read_text()
    assert "===== t::first (call)\nE  IndexError in t::first" in text and text.index("t::first") < text.index("t::second")
    monkeypatch.delenv("ULYSSES_KERNELS_FAILURE_LOG")
    conftest.pytest_runtest_logreport(SimpleNamespace(failed=True, nodeid="t::x", when="call", longreprtext="x"))
    assert "t::x" not in log.read_text()
