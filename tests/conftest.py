import os
import signal
import sys
import threading

import pytest
import torch

# Triton kernels run in the interpreter on machines without a GPU; this must be set before
# triton is imported anywhere. On a GPU machine the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/helpers.py and the worker functions of multi-process tests (module-level functions
# of the test modules) are imported by module name, also by spawned ranks: keep this
# folder importable.
sys.path.insert(0, os.path.dirname(__file__))


def _spawn_from_a_forkserver():
    """Spawned ranks fork from one server that has imported torch (and transformers and the
    package's hf module when installed) once: a 4-rank group starts in 0.2 s instead of 15 s
    of imports on 2 cores. The ranks still get this process's environment at each spawn
    (ulysses_kernels.launch)."""
    import importlib.util

    from ulysses_kernels import launch

    preload = ["torch", "ulysses_kernels"]
    if importlib.util.find_spec("transformers") is not None:
        preload = ["torch", "transformers", "ulysses_kernels.hf"]
    launch.set_spawn_defaults(start_method="forkserver", preload=preload)


_spawn_from_a_forkserver()


# The two tiers: `pytest -m "not slow"` is the developer loop (single-process tests: the
# kernels in the interpreter, the rules, the stand-ins at one rank); `slow` marks the tests
# that spawn process groups, run Hugging Face models, the CLI or the benchmark scripts.
# A test that spawns a process group without the marker fails (`_spawn_needs_the_slow_marker`),
# so the fast tier stays fast. GPU tests are selected by their own marker.
@pytest.fixture(autouse=True)
def _spawn_needs_the_slow_marker(request, monkeypatch):
    if "slow" in request.keywords or "gpu" in request.keywords:
        return
    from ulysses_kernels import launch

    class _Refuse:
        def get_context(self, *args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} spawns a process group: mark it @pytest.mark.slow "
                                 "(tests/conftest.py)")

    monkeypatch.setattr(launch, "mp", _Refuse())


def pytest_collection_modifyitems(config, items):
    """GPU tests are the ones marked `gpu` (next to the CPU tests of the same module);
    without CUDA they skip one by one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Each failing test's report, appended to ULYSSES_KERNELS_FAILURE_LOG as soon as it arrives
# (in the xdist controller too): pytest prints the reasons only at the end of the session,
# which a GPU-check step cut off at its time limit never reaches.
FAILURE_LOG = "ULYSSES_KERNELS_FAILURE_LOG"


def pytest_runtest_logreport(report):
    path = os.environ.get(FAILURE_LOG)
    if not path or not report.failed:
        return
    with open(path, "a") as log:
        log.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


# Per-test time limit in seconds (bench/gpu_check.sh sets it for the GPU steps, where
# pytest-timeout may be missing): a test that runs past it fails with TimeoutError instead
# of eating the whole step. Unset, empty or 0: no limit.
TEST_TIMEOUT = "ULYSSES_KERNELS_TEST_TIMEOUT"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from ulysses_kernels import env

    limit = env.number(TEST_TIMEOUT, 0.0)
    if limit <= 0 or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past {TEST_TIMEOUT}={limit:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# A kernel fault (illegal address) poisons the CUDA context for the rest of the process:
# every later GPU test would fail with the same sticky error and hide its own result.
# bench/gpu_check.sh runs the GPU tests under pytest-xdist (one worker, restarted when it
# dies) with ULYSSES_KERNELS_GPU_ISOLATE=1: after a GPU test whose report is already sent,
# a broken context ends the worker, and the next test gets a fresh process. The same
# restart covers a segfault. Off by default (a local run keeps its process).
GPU_ISOLATE = "ULYSSES_KERNELS_GPU_ISOLATE"


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    from ulysses_kernels import env

    if "gpu" not in item.keywords or not env.flag(GPU_ISOLATE) or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - any CUDA error here is sticky
        print(f"\n{item.nodeid} left the CUDA context broken ({str(error).splitlines()[0]}); "
              f"ending this worker so the next test starts clean", file=sys.stderr, flush=True)
        os._exit(70)
