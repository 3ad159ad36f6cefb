"""The CLI: demo parity at small size, doctor output, argument errors."""

import subprocess
import sys

import pytest

from ulysses_kernels import extensions
from ulysses_kernels.demo import DemoConfig, run_demo

pytestmark = pytest.mark.slow  # the command line: demo runs, plan, doctor (subprocesses)


def test_demo_parity_small():
    # 3 ranks: uneven shards (67 tokens -> 23/22/22) and GQA replication (1 kv head).
    cfg = DemoConfig(ranks=3, seq_len=67, steps=2, dim=24, layers=2, heads=3, kv_heads=1, vocab=16)
    verdict = run_demo(cfg, timeout=180)
    assert verdict["ok"], verdict
    assert verdict["loss_rel_diff"] < 1e-5 and verdict["grad_rel_err"] < 1e-5, verdict


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ulysses_kernels.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_doctor_reports_versions_and_paths():
    out = _cli("doctor")
    assert out.returncode == 0, out.stderr
    for needle in ("torch", "triton", "CUDA extension", "Triton attention", "default path (cpu)"):
        assert needle in out.stdout, out.stdout
    if extensions.load_extension()[0] is not None:  # built: the fused ops are listed by name
        ops_line = next(line for line in out.stdout.splitlines() if line.strip().startswith("ops"))
        listed = {name.strip() for name in ops_line.split(None, 1)[1].split(",")}
        for op in ("pack_into", "unpack_into", "nccl_all_to_all", "build_info"):
            assert op in listed, ops_line
        assert "fused path" in out.stdout, out.stdout
        # the build's recorded choice of host compiler (setup.py, _build_info), with why
        host = next(line for line in out.stdout.splitlines() if line.strip().startswith("host compiler"))
        assert "libstdc++" in host and "torch runs with" in host and ("kept" in host or "chosen because" in host), host


def test_demo_rejects_bad_head_counts_before_spawning():
    out = _cli("demo", "--ranks", "3", "--heads", "4")
    assert out.returncode == 2
    assert "--heads 4 must be divisible by the Ulysses degree 3" in out.stderr
    out = _cli("demo", "--ranks", "4", "--ring", "3")
    assert out.returncode == 2 and "--ring 3 must be at least 1 and divide --ranks 4" in out.stderr


def test_demo_end_to_end_prints_progress_and_verdict():
    # 4 ranks, 2 query heads: pure Ulysses cannot run it (refused before spawning); 2 Ulysses x 2 ring can
    out = _cli("demo", "--ranks", "4", "--heads", "2", "--kv-heads", "1", "--dim", "16")
    assert out.returncode == 2 and "raise --ring" in out.stderr
    out = _cli("demo", "--ranks", "4", "--ring", "2", "--seq-len", "61", "--steps", "2", "--dim", "16", "--heads", "2",
               "--kv-heads", "1", "--timeout", "200")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 Ulysses x 2 ring" in out.stdout
    assert "step   2/2 | loss" in out.stdout and "tok/s" in out.stdout and "peak mem" in out.stdout
    assert "verdict: PASS" in out.stdout, out.stdout


def test_examples_started_without_torchrun_say_how_to_launch():
    """launch.torchrun_main (the examples' main): no RANK in the environment -> exit with
    the torchrun line, before any process group."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for script in ("examples/generate_hf.py", "examples/train_hf.py"):
        proc = subprocess.run([sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and f"launch with torchrun, e.g. torchrun --nproc-per-node 4 {script}" in proc.stderr
