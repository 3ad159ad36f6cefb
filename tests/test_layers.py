"""The import contracts (pyproject.toml, docs/architecture.md, "Import layers") hold on
this tree, and they are not contracts that cannot fail: a copy of the package with an
import cycle, or with an import that climbs a layer, breaks them."""

import os
import shutil
import subprocess

import pytest
from helpers import ROOT


def _lint(root):
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install '.[test]')")
    env = dict(os.environ, PYTHONPATH=str(root))  # the copy shadows the installed package
    return subprocess.run([lint, "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def _copy(tmp_path):
    shutil.copytree(ROOT / "ulysses_kernels", tmp_path / "ulysses_kernels",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("module,line,contract", [
    # a cycle inside a package (also through an import inside a function)
    ("ring/layout.py", "\n\ndef _cycle():\n    from . import schedule  # noqa: F401\n", "No import cycles"),
    # the shared ring code reaching up into a path
    ("ring/merge.py", "\nfrom ..reference import attention  # noqa: F401,E402\n", "Layers"),
    # the fused path reaching into the Triton path's modules instead of its interface
    ("fused/plan.py", "\nfrom ..triton_path import block_ops  # noqa: F401,E402\n", "package interface"),
    # a model family reaching up into the core of the Hugging Face layer, inside a function
    ("hf/families/attention/llama4.py", "\n\ndef _up():\n    from ...core import attention  # noqa: F401\n", "rooms one way down"),
    # one mechanism's folder reaching into another's, and the shared pieces reaching up
    ("hf/families/halo/short_conv.py", "\nfrom ..by_heads import mamba2  # noqa: F401,E402\n", "one folder per mechanism"),
    ("hf/families/mixers.py", "\n\ndef _up():\n    from .sparse import dsa  # noqa: F401\n", "one folder per mechanism"),
    # training and generation are independent rooms
    ("hf/training/loss.py", "\nfrom ..inference import cache  # noqa: F401,E402\n", "rooms one way down"),
])
def test_a_broken_import_fails(tmp_path, module, line, contract):
    root = _copy(tmp_path)
    with open(root / "ulysses_kernels" / module, "a") as f:
        f.write(line)
    run = _lint(root)
    assert run.returncode != 0, run.stdout[-3000:]
    assert "Broken contracts" in run.stdout, run.stdout[-3000:]
    assert contract in run.stdout.split("Broken contracts", 1)[1], run.stdout[-3000:]


def test_the_hugging_face_rooms_stay_small():
    """docs/architecture.md, "The Hugging Face layer": no file of ulysses_kernels/hf over 400
    lines, and at most three modules at its top level besides __init__.py (the rest lives in
    its rooms)."""
    hf = ROOT / "ulysses_kernels" / "hf"
    long = {str(p.relative_to(hf)): n for p in hf.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
    top = sorted(p.name for p in hf.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 3, top
