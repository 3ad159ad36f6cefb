"""The GPU benchmarks run end to end on CPU in smoke mode (`--smoke`: tiny shapes, the
Triton interpreter, and for the fused path torch stand-ins for the CUDA ops and the host
transport), so a script that would crash on its one GPU run fails CI instead. The
numbers mean nothing and are not checked; the tables and JSON they write are."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

from ulysses_kernels import extensions

pytestmark = pytest.mark.slow  # the benchmark scripts end to end (subprocesses)

BENCH = ROOT / "bench"


def _needs_triton():
    """The scripts run the Triton kernels in the interpreter (the subprocess sets
    TRITON_INTERPRET=1); the fused ones install `ulysses_kernels.testing`'s stand-ins, so
    they need no CUDA extension."""
    module, reason = extensions.triton_kernels()
    if module is None:
        pytest.skip(f"Triton kernels unavailable: {reason}")


def load_bench(name):
    """bench/<name>.py as a module (bench/ on sys.path for its shared helpers)."""
    import importlib.util

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(script, out, *extra):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--out", str(out), *extra], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_a2a_smoke(tmp_path):
    _needs_triton()
    _run("bench_a2a.py", tmp_path)
    data = json.loads((tmp_path / "a2a.json").read_text())
    sections = {r["section"] for r in data["rows"]}
    assert sections == {"kernels", "exchange"} and "smoke" in data["meta"]["device"]
    assert "| config | op |" in (tmp_path / "a2a.md").read_text()


def test_bench_layer_smoke(tmp_path):
    _needs_triton()
    out = _run("bench_layer.py", tmp_path)
    data = json.loads((tmp_path / "layer.json").read_text())
    assert data["measured"] and data["modelled"]
    assert {(b["overlap_projections"], b["chunks"]) for b in data["blocks"]} == {
        (False, 1), (False, 4), (True, 1), (True, 4)}
    row = data["modelled"][0]
    assert all(k in row for k in ("block_plain_c1_ms", "block_plain_c4_ms", "block_fused_c4_ms", "overlap_c4_ms"))
    assert "fused layer, 4 chunks" in (tmp_path / "layer.md").read_text() and "[P=1 block]" in out


def test_bench_attention_smoke(tmp_path):
    _needs_triton()
    _run("bench_attention.py", tmp_path)
    data = json.loads((tmp_path / "attention_results.json").read_text())
    assert len(data["results"]) == 4 and data["meta"]["complete"]  # fwd, fwd+bwd x causal or not
    for row in data["results"]:
        assert row.get("triton_ms") is not None, row  # a failing kernel is recorded, not raised
        if row["mode"] == "fwd_bwd":  # both backward modes
            assert row.get("triton_det_ms") is not None, row
    assert {e["kernel"] for e in data["sweep"]} == {"fwd", "bwd_atomic", "dq", "dkdv"}
    assert all("error" not in e for e in data["sweep"]), data["sweep"]
    assert (tmp_path / "attention_results.md").exists() and (tmp_path / "attention_tflops.png").exists()


def test_bench_user_step_smoke(tmp_path):
    """Every row of the user-shaped benchmark (one tiny length): each candidate that covers
    the class and runs here is timed, auto's pick is recorded with best/auto."""
    _needs_triton()
    _run("bench_user_step.py", tmp_path)
    data = json.loads((tmp_path / "user_step_results.json").read_text())
    rows = data["results"]
    assert len(rows) == 16 and data["meta"]["complete"]  # 4 models x 1 or 8 documents x fwd, fwd+bwd
    for row in rows:
        assert "ms" in row["candidates"]["triton"], row
        assert row["auto"] == "triton" and row["best_over_auto"] <= 1.0  # no timing on CPU: ours
        if row["mode"] == "fwd" and "sinks" not in row["call"]:
            assert "ms" in row["candidates"]["flex"], row  # FlexAttention's CPU forward
        assert "sdpa_cudnn" in row["excluded"]
    table = (tmp_path / "user_step_results.md").read_text()
    assert "| Llama-3-8B | 64 | 8 | fwd_bwd |" in table


def test_bench_global_batch_smoke(tmp_path):
    """One tiny global batch through both layouts at world 4 (the numbers mean nothing)."""
    pytest.importorskip("transformers")
    _run("bench_global_batch.py", tmp_path)
    data = json.loads((tmp_path / "global_batch_cpu_smoke.json").read_text())
    for name in ("fixed SP 4, in order", "planner"):
        assert data["result"][name]["seconds"] > 0 and data["result"][name]["micro_batches"] >= 1
    assert data["result"]["fixed SP 4, in order"]["sp_sizes"] == [4]


def test_bench_user_step_counts_visible_pairs():
    bench = load_bench("bench_user_step")
    assert bench.visible_pairs(10, 1, None) == 55
    assert bench.visible_pairs(10, 2, None) == 2 * 15
    brute = sum(min(i, 3) + 1 for i in range(10))
    assert bench.visible_pairs(10, 1, 3) == brute
    assert bench.visible_pairs(131072, 8, 128) == 8 * sum(min(i, 128) + 1 for i in range(16384))


def test_bench_hopper_smoke(tmp_path):
    """The features benchmark: the measured kernels and three feature lists, both modes,
    causal or not; the table shows each list's speed-up over the measured kernels; the
    config sweep times one config of each features' kernel."""
    _needs_triton()
    _run("bench_hopper.py", tmp_path, "--sweep")
    data = json.loads((tmp_path / "hopper_results.json").read_text())
    rows = data["results"]
    assert {r["impl"] for r in rows} == {"triton[]", "triton[desc,fma_scale]", "triton[desc,fma_scale,lazy_rescale]",
                                         "triton[desc,fma_scale,warp_specialize,bwd_warp_specialize]"}
    assert len(rows) == 16 and all("error" not in r for r in rows), [r for r in rows if "error" in r]
    assert data["meta"]["complete"]
    table = (tmp_path / "hopper_results.md").read_text()
    assert "| D | S | B | causal | mode | triton[] |" in table
    assert len(re.findall(r"\| [0-9.]+ \([0-9.]+x\)", table)) == 12  # 3 lists x 4 rows: speed-ups
    sweep = data["meta"]["sweep"]
    assert {(e["kernel"], e["features"]) for e in sweep} == {
        ("fwd", "desc,fma_scale"), ("fwd", "desc,fma_scale,warp_specialize"), ("bwd_atomic", "dq_reduce"),
        ("bwd_dkdv_ws", "bwd_warp_specialize"), ("bwd_dq_ws", "bwd_warp_specialize")}
    assert len(sweep) == 10 and all("tflops" in e for e in sweep), sweep
    assert "Config sweep" in table


def test_bench_hybrid_model(tmp_path):
    """The Ulysses x Ring model: every layout of 8 and 16 GPUs, invalid ones named."""
    _run("bench_hybrid_model.py", tmp_path)
    data = json.loads((tmp_path / "hybrid_model.json").read_text())
    rows = data["rows"]
    assert {(r["ulysses"], r["ring"]) for r in rows if r["gpus"] == 16} == {(16, 1), (8, 2), (4, 4), (2, 8), (1, 16)}
    invalid = [r for r in rows if not r["valid"]]
    assert invalid and all(r["model"] == "qwen2.5-7b" and "28" in r["why_not"] for r in invalid)
    assert all(r["layer_ms"] >= r["compute_ms"] > 0 for r in rows if r["valid"])
    assert "Sources of the defaults" in (tmp_path / "hybrid_model.md").read_text()


def test_bench_step_smoke(tmp_path):
    """bench_step.py at SP 2: every contender of both levels measured, the counts recorded;
    the trusted HF step and the direct API with seq_lens compile into one graph and read
    nothing back in the step (the HF step's shard_batch included: the position ids are the
    host's, context.cu_seqlens_from_position_ids)."""
    pytest.importorskip("deepspeed", reason="bench_step.py compares with DeepSpeed ALST")
    _run("bench_step.py", tmp_path)
    data = json.loads((tmp_path / "step.json").read_text())
    hf, api = data["ranks"][0]["hf"], data["ranks"][0]["api"]
    assert set(hf) == {"ulysses-kernels", "ALST", "no SP"} and all(r["step_s"] > 0 for r in hf.values())
    assert (hf["ulysses-kernels"]["graphs"], hf["ulysses-kernels"]["graph_breaks"]) == (1, 0)
    assert hf["ulysses-kernels"]["host_reads"] == 0, hf["ulysses-kernels"]["host_read_sites"]
    assert hf["ulysses-kernels"]["collectives"]["all_to_all_single"]["calls"] == 8
    assert api["ulysses-kernels (seq_lens)"]["host_reads"] == 0
    assert api["ulysses-kernels (seq_lens)"]["graph_breaks"] == 0
    assert "| HF path |" in (tmp_path / "step.md").read_text()


def test_bench_logprobs_smoke(tmp_path):
    _run("bench_logprobs.py", tmp_path)
    rows = json.loads((tmp_path / "logprobs_memory.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["full", "tiled"] and all(r["peak_growth_mb"] >= 0 for r in rows)


def test_bench_window_smoke(tmp_path):
    """bench_window.py end to end in the interpreter; its count of visible pairs equals a
    brute-force count of the causal window mask."""
    import torch

    _needs_triton()
    _run("bench_window.py", tmp_path)
    data = json.loads((tmp_path / "window_results.json").read_text())
    assert {r["impl"] for r in data["results"]} == {"triton_window", "triton_full"}
    assert {r["mode"] for r in data["results"]} == {"fwd", "fwd_bwd"}
    assert "| 96 | 16 | fwd |" in (tmp_path / "window_results.md").read_text()
    module = load_bench("bench_window")
    for S, W in ((96, 16), (10, 16), (4096, 256)):
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        assert module.visible_pairs(S, W) == int(((j <= i) & (j > i - W)).sum())


def test_bench_hopper_targets_and_table():
    """The targets rule on synthetic rows: the best feature list's ratio to cuDNN per target
    shape (D = 128, S >= 16k only), against 1.0 for the forward and 0.9 for fwd+bwd; the
    table shows each list's speed-up over the measured kernels and its ratio to cuDNN."""
    module = load_bench("bench_hopper")

    def row(S, mode, impl, tflops, D=128):
        return dict(D=D, S=S, B=1, H=16, causal=False, mode=mode, impl=impl, tflops=tflops)

    rows = [row(16384, "fwd", "triton[]", 500.0), row(16384, "fwd", "triton[desc,fma_scale]", 620.0),
            row(16384, "fwd", "sdpa_cudnn", 600.0),
            row(16384, "fwd_bwd", "triton[]", 300.0), row(16384, "fwd_bwd", "triton[hopper]", 500.0),
            row(16384, "fwd_bwd", "sdpa_cudnn", 600.0),
            row(4096, "fwd", "triton[]", 100.0), row(4096, "fwd", "sdpa_cudnn", 400.0),  # not a target shape
            row(16384, "fwd", "triton[]", 50.0, D=64), row(16384, "fwd", "sdpa_cudnn", 400.0, D=64)]
    targets = {t["mode"]: t for t in module.targets(rows)}
    assert set(targets) == {"fwd", "fwd_bwd"}
    fwd, both = targets["fwd"], targets["fwd_bwd"]
    assert fwd["best"] == "triton[desc,fma_scale]" and abs(fwd["ratio"] - 620 / 600) < 1e-12 and fwd["met"]
    assert abs(fwd["before"] - 500 / 600) < 1e-12
    assert both["best"] == "triton[hopper]" and abs(both["ratio"] - 500 / 600) < 1e-12 and not both["met"]
    meta = dict(gpu="test", torch="t", triton="t", dtype="bfloat16", autotune="0", targets=module.targets(rows))
    table = module.table(rows, meta)
    assert "620.0 (1.24x, 1.03 cuDNN)" in table and "| 16384 | False | fwd_bwd | triton[hopper] | 0.83 | 0.50 | False |" in table


def test_attention_benchmarks_refuse_where_they_cannot_run(monkeypatch):
    """The shared rule of bench_attention/window/hopper: --smoke needs the interpreter; a
    real run needs a GPU and the interpreter off."""
    import torch

    helper = load_bench("_attention_bench")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "set TRITON_INTERPRET=1" in helper.run_problem("b", smoke=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in helper.run_problem("b", smoke=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert helper.run_problem("b", smoke=False) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert helper.run_problem("b", smoke=True) is None
    assert "unset it" in helper.run_problem("b", smoke=False)
