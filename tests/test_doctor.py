"""`ulysses-kernels doctor`'s stack lines (torch, Triton, torch's CUDA build, cuDNN, SDPA's
backend order and switches, NCCL), each read on its own so one failing query never ends
the doctor, and its WARNING for a torch or Triton outside the tested range
(ulysses_kernels/support.py), which does not change the exit code."""

import pytest
import torch

from ulysses_kernels import cli, extensions, support


@pytest.fixture
def doctor(monkeypatch, capsys):
    """Runs the doctor in this process, without the extension (its C++ probe is a subprocess
    and tests/test_cli.py runs it), and returns (exit code, its lines)."""
    monkeypatch.setattr(extensions, "load_extension", lambda: (None, "skipped in this test"))

    def run():
        code = cli.main(["doctor"])
        return code, capsys.readouterr().out.splitlines()

    return run


def _value(lines, name):
    found = [line[len(name):].strip() for line in lines if line.startswith(name + " ")]
    assert len(found) == 1, (name, lines)
    return found[0]


def test_doctor_prints_the_stack(doctor):
    code, lines = doctor()
    assert code == 0
    assert _value(lines, "torch") == torch.__version__
    assert _value(lines, "CUDA (torch build)") == (torch.version.cuda or "none (CPU-only torch)")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    assert _value(lines, "cuDNN") == (cli._cudnn() if cudnn else "n/a")
    if cudnn:
        assert _value(lines, "cuDNN").endswith(f"({cudnn})")
    sdpa = _value(lines, "SDPA backends")
    assert sdpa.startswith("order ") and "; enabled: " in sdpa, sdpa
    if hasattr(torch._C, "_get_sdp_priority_order"):  # torch 2.11+: the order is known
        assert "unknown" not in sdpa.split(";")[0] and "math" in sdpa.split(";")[0], sdpa
    if torch.backends.cuda.math_sdp_enabled():
        assert "math" in sdpa.split("enabled: ")[1].split(";")[0], sdpa
    assert _value(lines, "NCCL (torch)")
    assert _value(lines, "NCCL launch order").startswith("NCCL_LAUNCH_ORDER_IMPLICIT=1 ")
    # every CI environment (the pinned torch and both legs) is inside the tested range: no warning
    assert support.problems(torch.__version__, cli._triton_version()) == []
    assert not [line for line in lines if line.startswith("WARNING:")], lines


def test_doctor_warns_outside_the_tested_range(doctor, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu999")
    code, lines = doctor()
    assert code == 0  # a warning, not a failure
    warnings = [line for line in lines if line.startswith("WARNING:")]
    assert any(w.startswith("WARNING: torch 2.99.0+cu999 is outside the tested range") for w in warnings), lines
    # the warning follows the version lines, before the extension's
    assert lines.index(warnings[0]) < next(i for i, line in enumerate(lines) if line.startswith("CUDA extension"))


def test_doctor_warns_for_triton_outside_the_tested_range(doctor, monkeypatch):
    version = cli._triton_version()
    if version is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(support, "TESTED_TRITON", ("1.0", "1.1"))
    code, lines = doctor()
    assert code == 0
    assert f"WARNING: Triton {version} is outside the tested range 1.0 to 1.1" in "\n".join(lines), lines


def test_a_failing_query_never_ends_the_doctor(doctor, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("query failed")

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", broken)
    monkeypatch.delattr(torch._C, "_get_sdp_priority_order", raising=False)
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", broken)
    monkeypatch.delattr(torch.backends.cuda, "cudnn_sdp_enabled", raising=False)
    monkeypatch.setattr(support, "problems", broken)
    code, lines = doctor()
    assert code == 0
    assert _value(lines, "cuDNN") == "unknown (RuntimeError: query failed)"
    sdpa = _value(lines, "SDPA backends")
    assert sdpa.startswith("order unknown; enabled: ") and "disabled: flash (unknown), cudnn (unknown)" in sdpa, sdpa
    assert "WARNING: could not compare the torch/Triton versions with the tested range (query failed)" in lines


@pytest.mark.parametrize("raw, text", [(92400, "9.24.0 (92400)"), (90100, "9.1.0 (90100)"), (8902, "8.9.2 (8902)"),
                                       (None, "n/a")])
def test_cudnn_versions_are_decoded(monkeypatch, raw, text):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: raw)
    assert cli._cudnn() == text
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert cli._cudnn() == "n/a"


def test_the_explain_lines_in_the_docs_are_the_commands(monkeypatch, capsys, tmp_path):
    """docs/api.md shows `doctor --explain`'s kernel-choice lines for one call on a CPU machine
    without FlashAttention: they are what the command prints in that environment."""
    import re
    from pathlib import Path

    from ulysses_kernels import env, kernel_choice

    if torch.cuda.is_available() or any(kernel_choice.CANDIDATES[n].importable()[0] for n in ("flash2", "fa3", "fa4")):
        pytest.skip("the documented lines are those of a CPU machine without FlashAttention")
    monkeypatch.setenv(env.CACHE_DIR.name, str(tmp_path))
    monkeypatch.delenv(env.ATTENTION.name, raising=False)
    kernel_choice.clear_memory_cache()
    docs = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    command = "doctor --explain --world 8 --heads 32 --kv-heads 8 --documents 8"
    assert f"`ulysses-kernels {command}`" in docs
    block = re.search(r"```\n(kernel choice .*?)\n```", docs, re.S).group(1)
    assert cli.main(command.split()) == 0
    out = capsys.readouterr().out
    printed = out[out.index("kernel choice"):]
    printed = printed[:printed.index("\n", printed.index("  choice "))]
    assert printed == block
