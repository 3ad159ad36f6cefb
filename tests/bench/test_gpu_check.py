"""bench/gpu_check.sh on CPU (GPU_CHECK_DRY_RUN=1: GPU parts stubbed, pytest steps only
collect, benchmarks only parse their arguments). CI runs the whole dry run in .ci/run;
these tests walk what a real run reaches only on a GPU: a failed CUDA build, failing and
hanging tests, the deadline (docs/build.md, "The GPU check"), and the verdict block that
ends the output."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # the GPU check script walked on the CPU (subprocesses)

QUESTIONS = ("Q1a", "Q1b", "Q1c", "Q2 ", "Q3 ", "Q4 ", "Q5 ")

# A pytest plugin standing in for the GPU tests of one step: it writes a failing test's
# report as tests/conftest.py does (ULYSSES_KERNELS_FAILURE_LOG), sleeps, and fails the run.
FAKE_PLUGIN = '''
import json, os, time
import pytest

def pytest_collection_finish(session):
    log = os.environ.get("ULYSSES_KERNELS_FAILURE_LOG", "")
    plan = json.loads(os.environ.get("UK_TEST_FAKE", "{}"))
    for step, fake in plan.items():
        if os.path.basename(log) != f"gpu_check_{step}_failures.txt":
            continue
        if fake.get("failure") and not os.path.exists(log):
            with open(log, "a") as f:
                f.write(fake["failure"])
        time.sleep(fake.get("sleep", 0))
        pytest.exit("fake GPU test failure", returncode=1)
'''


def _run(tmp_path, *, results=True, fake=None, script_root=ROOT, **env):
    run_env = dict(os.environ, GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    run_env.update(env)
    for name in ("OUT", "UK_RESULTS", "UK_DEADLINE_AT", "UK_START_AT", "GPU_CHECK_STEPS", "GPU_CHECK_DEADLINE_S"):
        if name not in env:
            run_env.pop(name, None)
    if results:
        run_env["UK_RESULTS"] = str(tmp_path)
    if fake:
        (tmp_path / "fake_gpu_tests.py").write_text(FAKE_PLUGIN)
        run_env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), run_env.get("PYTHONPATH", "")])
        run_env["PYTEST_ADDOPTS"] = "-p fake_gpu_tests"
        run_env["UK_TEST_FAKE"] = json.dumps(fake)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(script_root / "bench" / "gpu_check.sh")], cwd=script_root, env=run_env,
                          capture_output=True, text=True, timeout=400)
    return proc, time.monotonic() - start


def _dry_run(tmp_path, **env):
    proc, _ = _run(tmp_path, **env)
    return proc, (tmp_path / "gpu_check_summary.txt").read_text()


def _verdict(proc):
    """The verdict block: the last lines of stdout, from its "=== verdict" line on."""
    lines = proc.stdout.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("=== verdict"))
    block = lines[start:]
    assert len(block) <= 30, block
    assert re.match(r"=== \d+ PASS, \d+ FAIL, \d+ NOT RUN/NOT FINISHED, \d+ SKIPPED \(exit code [01]\)$", block[-1])
    return block


def _line(block, label):
    found = [line for line in block if line.startswith(label)]
    assert len(found) == 1, (label, block)
    return found[0][50:].strip()


def test_failed_build_skips_only_the_fused_steps(tmp_path):
    proc, summary = _dry_run(tmp_path, GPU_CHECK_SIMULATE_BUILD_FAILURE="1",
                             GPU_CHECK_STEPS="install fused_tests bench_a2a triton_tests")
    assert "[install] FAILED" in summary and "[install] first error: error: simulated build failure" in summary
    assert "[fallback] ok" in summary
    assert "[fused_tests] SKIPPED" in summary and "[bench_a2a] SKIPPED" in summary
    assert "[triton_tests] ok" in summary, proc.stdout[-3000:]
    assert proc.returncode == 1  # the failed install fails the run
    block = _verdict(proc)
    assert _line(block, "Q1a") == ("FAIL: the CUDA build failed: error: simulated build failure "
                                   "(GPU_CHECK_SIMULATE_BUILD_FAILURE=1)")
    assert _line(block, "Q2 ").startswith("SKIPPED (no usable CUDA extension")
    assert _line(block, "Q3 ") == "SKIPPED (not in GPU_CHECK_STEPS)"
    assert _line(block, "    triton_tests").startswith("PASS (dry run")
    assert block[-1].endswith("(exit code 1)")


def test_deadline_leaves_later_steps_not_run(tmp_path):
    """GPU_CHECK_DEADLINE_S=30: the schedule says what the deadline reaches at the nominal
    limits, the steps that start get cut limits, the rest is NOT RUN (deadline), and the
    whole walk ends inside the deadline with the verdict block last."""
    proc, wall = _run(tmp_path, GPU_CHECK_DEADLINE_S="30")
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert wall < 30 + 3, wall
    assert "deadline schedule (GPU_CHECK_DEADLINE_S=30: 25s for the steps" in summary
    assert re.search(r"^  env +20s  ->   25s$", summary, re.M), summary
    assert re.search(r"^  install +80s  ->  110s  beyond the deadline", summary, re.M), summary
    assert "reached even so: env;" in summary
    assert re.search(r"=== \[install\] .*\(timeout \d+s, cut from 80s by the deadline", proc.stdout)
    assert "[microbench] NOT RUN (deadline:" in summary
    block = _verdict(proc)
    assert block[0].startswith("=== verdict: commit ") and "of the 30s deadline; DRY RUN" in block[0]
    assert [line[:3] for line in block[1:8]] == [q[:3] for q in QUESTIONS]
    assert _line(block, "    env").startswith("PASS (dry run")
    for label in ("Q4 ", "Q5 ", "    microbench", "    bench_hopper"):
        assert _line(block, label) == "NOT RUN (deadline)"
    assert (tmp_path / "gpu_check_verdict.txt").read_text().splitlines() == block


def test_a_step_is_cut_at_the_deadline_and_the_rest_not_run(tmp_path):
    """A hanging step gets what is left of the deadline, not its nominal limit; the call
    still ends by the deadline, and a hang with no failure before is NOT FINISHED."""
    proc, wall = _run(tmp_path, GPU_CHECK_DEADLINE_S="25", GPU_CHECK_STEPS="symm_tests hopper_tests microbench",
                      fake={"symm_tests": {"sleep": 120}})
    assert wall < 25 + 3, (wall, proc.stdout[-3000:])
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert re.search(r"\[symm_tests\] TIMED OUT after \d+s, cut from 60s by the deadline", summary), summary
    block = _verdict(proc)
    assert re.fullmatch(r"NOT FINISHED \(deadline: stopped after \d+s of its 60s, no failure before\)",
                        _line(block, "Q3 ")), block
    assert _line(block, "Q4 ") == "NOT RUN (deadline)" and _line(block, "    microbench") == "NOT RUN (deadline)"
    assert _line(block, "Q1a") == "SKIPPED (not in GPU_CHECK_STEPS)"
    assert proc.returncode == 0 and block[-1].endswith("(exit code 0)")


def test_failing_tests_are_named_in_the_verdict(tmp_path):
    """The IndexError of 2026-12-04 in a fused layer test: Q1b and Q2 name the test and
    its error line; a hopper test failing with an assertion is named the same way."""
    index_error = ("\n===== tests/fused/test_fused_layer.py::test_layer_gpu[bfloat16] (call)\n"
                   "    def test_layer_gpu(dtype):\n>       out.backward(grad)\n"
                   "E       RuntimeError: wrapped\nE       IndexError: tuple index out of range\n")
    assertion = ("\n===== tests/triton/test_triton_features_gpu.py::test_features[desc] (call)\n"
                 "E       AssertionError: dq rel err 0.3\n\n"
                 "===== tests/triton/test_triton_features_gpu.py::test_other (call)\nE   ValueError: x\n")
    proc, _ = _run(tmp_path, GPU_CHECK_STEPS="fused_tests hopper_tests offload_bitwise",
                   fake={"fused_tests": {"failure": index_error}, "hopper_tests": {"failure": assertion}})
    block = _verdict(proc)
    assert _line(block, "Q1b") == ("FAIL: tests/fused/test_fused_layer.py::test_layer_gpu[bfloat16]: "
                                   "IndexError: tuple index out of range")
    assert _line(block, "Q2 ") == ("FAIL: tests/fused/test_fused_layer.py::test_layer_gpu[bfloat16]: "
                                   "RuntimeError: wrapped")
    assert _line(block, "Q4 ") == ("FAIL: tests/triton/test_triton_features_gpu.py::test_features[desc]: "
                                   "AssertionError: dq rel err 0.3")
    assert _line(block, "Q1c").startswith("PASS (dry run")
    assert proc.returncode == 1 and block[-1].startswith("=== 1 PASS, 3 FAIL, 0 NOT RUN/NOT FINISHED, 13 SKIPPED")


def test_other_fused_failures_answer_q1b_and_q2(tmp_path):
    """A failure outside the pipeline/layer/ring tests and without an IndexError: the
    questions pass and say where the failure was."""
    ops = "\n===== tests/fused/test_fused_ops.py::test_pack[float16] (call)\nE   AssertionError: pack\n"
    proc, _ = _run(tmp_path, GPU_CHECK_STEPS="fused_tests", fake={"fused_tests": {"failure": ops}})
    block = _verdict(proc)
    assert _line(block, "Q1b") == "PASS (no IndexError; other failures: see Q2)"
    assert _line(block, "Q2 ") == ("PASS (the fused ops or schemas failed: "
                                   "tests/fused/test_fused_ops.py::test_pack[float16]: AssertionError: pack)")


def test_report_has_the_commit_the_facts_and_the_verdict(tmp_path):
    """With $OUT: the report's header names the commit and the env step's facts, and the
    verdict block is in it, as printed."""
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = _run(tmp_path, results=False, GPU_CHECK_STEPS="env", OUT=str(out), TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = (out / "gpu_check_report.md").read_text()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert f"commit: {head}" in report.split("\n## ")[0]
    for fact in ("torch: ", "triton: ", "CUDA (torch build): ", "cuDNN: ", "SDPA backends: order ", "NCCL (torch): ",
                 "GPU clocks: nvidia-smi unavailable"):
        assert fact in report, fact
    block = _verdict(proc)
    assert "\n".join(block) in report
    (verdict_file,) = tmp_path.glob("ulysses_gpu_check.*/gpu_check_verdict.txt")
    assert verdict_file.read_text().splitlines() == block


def test_without_git_the_commit_comes_from_the_environment(tmp_path):
    """The device machine may get the tree without .git: GPU_CHECK_COMMIT names it."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    for name in ("gpu_check.sh", "_steps.sh"):
        shutil.copy(ROOT / "bench" / name, tree / "bench" / name)
    proc, _ = _run(tmp_path / "tree", script_root=tree, GPU_CHECK_STEPS="env", GPU_CHECK_COMMIT="abc1234",
                   GIT_CEILING_DIRECTORIES=str(tmp_path))
    assert _verdict(proc)[0].startswith("=== verdict: commit abc1234 (no git repository here; GPU_CHECK_COMMIT)")


def test_the_cpp_probe_answers_q1a_for_real(tmp_path):
    """Not a dry run: the doctor's C++ error probe on this machine's extension (no install,
    no GPU needed), its words in the summary and in Q1a."""
    from ulysses_kernels import extensions

    if extensions.load_extension()[0] is None:
        pytest.skip("the CUDA extension is not built here")
    proc, _ = _run(tmp_path, GPU_CHECK_DRY_RUN="0", GPU_CHECK_STEPS="cpp_probe")
    assert "[cpp_probe] C++ errors: raised as RuntimeError" in (tmp_path / "gpu_check_summary.txt").read_text()
    block = _verdict(proc)
    assert "DRY RUN" not in block[0]
    assert _line(block, "Q1a") == "PASS (raised as RuntimeError)" and proc.returncode == 0


def test_bad_settings_are_errors(tmp_path):
    for env, message in ((dict(GPU_CHECK_DRY_RUN="maybe"), "is not a boolean"),
                         (dict(GPU_CHECK_DEADLINE_S="9m"), "GPU_CHECK_DEADLINE_S=9m is not a whole number"),
                         (dict(GPU_CHECK_STEPS="env hoper_tests"), "GPU_CHECK_STEPS: unknown step 'hoper_tests'")):
        proc, _ = _run(tmp_path, **env)
        assert proc.returncode == 2 and message in proc.stdout, (env, proc.stdout[-2000:])


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


def test_a_cut_step_whose_log_names_an_exception_in_passing_is_not_a_failure(tmp_path):
    """The preflight's doctor lines ("C++ errors  raised as RuntimeError", "not importable
    (ModuleNotFoundError: ...)") name exceptions without one being raised: a preflight cut by
    the deadline after them is NOT FINISHED; an exception's own line makes it a FAIL."""
    log = tmp_path / "gpu_check_preflight.log"
    log.write_text("fused path: unavailable\n  C++ errors           raised as RuntimeError\n"
                   "  flash2   unavailable (not importable (ModuleNotFoundError: No module named 'flash_attn'))\n")
    script = ('declare -A LIMIT=([preflight]=20); STEP_PREFIX=""; source "$1" > /dev/null 2>&1; '
              'STATUS[preflight]=cut; USED[preflight]=11; status_text preflight')
    env = dict(os.environ, UK_RESULTS=str(tmp_path), GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)

    def verdict():
        return subprocess.run(["bash", "-c", script, "bash", str(ROOT / "bench" / "_steps.sh")], env=env,
                              capture_output=True, text=True, timeout=60).stdout.strip()

    assert verdict() == "NOT FINISHED (deadline: stopped after 11s of its 20s, no failure before)"
    log.write_text(log.read_text() + "RuntimeError: the Triton kernels do not import\n")
    assert verdict() == "FAIL: RuntimeError: the Triton kernels do not import (then cut by the deadline after 11s)"
