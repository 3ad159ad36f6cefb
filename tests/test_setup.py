"""setup.py: the build only. Loading it has no side effect (the metadata and the version
live in pyproject.toml, and nothing is probed or written until the build command runs),
and its choice of host compiler (the first GPU run's segfault on every C++ error came from
an extension linked by a GCC whose libstdc++ was not the one torch runs with)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

import ulysses_kernels

SETUP = ROOT / "setup.py"


def _helpers():
    """setup.py as a module: its functions, without running setup() (that needs __main__)."""
    spec = importlib.util.spec_from_file_location("_setup_under_test", SETUP)
    module = importlib.util.module_from_spec(spec)
    saved = dict(os.environ)  # loading it points CUDA_HOME at the toolkit, for torch's build command
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return vars(module)


def _tree_state():
    """What a build writes into the source tree: the build info and the build folder."""
    info = ROOT / "ulysses_kernels" / "_build_info.py"
    return (info.stat().st_mtime_ns if info.exists() else None,
            sorted(os.listdir(ROOT / "build")) if (ROOT / "build").exists() else None)


def test_loading_setup_has_no_side_effect_and_the_version_has_one_home():
    before = _tree_state()
    helpers = _helpers()
    assert "BuildExtension" in helpers and "setup" in helpers
    version = subprocess.run([sys.executable, str(SETUP), "--version"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip().splitlines()[-1] == ulysses_kernels.__version__  # read from the package
    assert _tree_state() == before  # neither loading it nor a metadata command built or wrote anything
    # one home: pyproject.toml takes the version from the package, setup.py names none
    assert 'version = {attr = "ulysses_kernels.__version__"}' in (ROOT / "pyproject.toml").read_text()
    assert not re.search(r"version\s*=", SETUP.read_text())


RUNTIMES = {"/opt/gcc/bin/g++": "/opt/gcc/lib64/libstdc++.so.6.0.34",
            "/usr/bin/g++": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"}
LOADED = RUNTIMES["/usr/bin/g++"]


def _which(paths):
    return lambda name: paths.get(name)


def test_mismatched_cxx_is_replaced_by_a_matching_gxx():
    match = _helpers()["match_host_compiler"]
    compiler, why = match({"CXX": "/opt/gcc/bin/g++"}, LOADED, RUNTIMES.get,
                          _which({"g++": "/opt/gcc/bin/g++", "/usr/bin/g++": "/usr/bin/g++"}))
    assert compiler == "/usr/bin/g++" and "/opt/gcc/lib64" in why and LOADED in why


def test_a_cxx_without_a_shared_libstdcxx_is_replaced_too():
    """A compiler whose shared libstdc++ cannot be named (it may link a static one) is not
    taken for a match: the second GPU run kept such a CXX and its C++ errors crashed."""
    match = _helpers()["match_host_compiler"]
    compiler, why = match({"CXX": "/opt/static/g++"}, LOADED, RUNTIMES.get,
                          _which({"g++": "/opt/static/g++", "/usr/bin/g++": "/usr/bin/g++"}))
    assert compiler == "/usr/bin/g++" and "no shared libstdc++" in why


def test_matching_or_unknown_runtime_keeps_the_default(capsys):
    match = _helpers()["match_host_compiler"]
    assert match({"CXX": "/usr/bin/g++"}, LOADED, RUNTIMES.get, _which({})) == (None, None)
    assert match({"CXX": "/opt/gcc/bin/g++"}, None, RUNTIMES.get, _which({})) == (None, None)
    assert capsys.readouterr().err == ""
    # no libstdc++ named and no g++ that matches: kept, with the warning
    assert match({}, LOADED, lambda c: None, _which({})) == (None, None)
    assert "ULYSSES_KERNELS_HOST_COMPILER" in capsys.readouterr().err


def test_no_matching_compiler_warns_and_keeps_cxx(capsys):
    match = _helpers()["match_host_compiler"]
    assert match({"CXX": "/opt/gcc/bin/g++"}, LOADED, RUNTIMES.get,
                 _which({"g++": "/opt/gcc/bin/g++"})) == (None, None)
    assert "ULYSSES_KERNELS_HOST_COMPILER" in capsys.readouterr().err


def test_forced_compiler_wins():
    match = _helpers()["match_host_compiler"]
    assert match({"ULYSSES_KERNELS_HOST_COMPILER": "/x/g++", "CXX": "/usr/bin/g++"}, LOADED,
                 RUNTIMES.get, _which({}))[0] == "/x/g++"


def test_this_machines_probes_agree():
    """The real probes on this machine: the compiler CI builds with links the libstdc++
    torch runs with (so setup.py keeps it), and both paths exist."""
    import torch  # noqa: F401 - loads the libstdc++ the extension will run with

    helpers = _helpers()
    loaded = helpers["_loaded_libstdcxx"]()
    assert loaded is not None and os.path.exists(loaded)
    compiler, _ = helpers["match_host_compiler"](os.environ, loaded)
    assert compiler is None or compiler == os.environ.get("ULYSSES_KERNELS_HOST_COMPILER")


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject.toml lists the packages by hand:
    every folder of ulysses_kernels/ with an __init__.py must be among them, or an editable
    install works and a wheel lacks it."""
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "ulysses_kernels").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
    assert "ulysses_kernels.triton" in listed and (ROOT / "ulysses_kernels" / "triton" / "__init__.py").exists()


# ------------------------------------------------------------ the pinned test environment

def _requirements():
    """{name: Requirement} of the package's dependencies and its hf / deepspeed extras."""
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["hf"] + \
        project["optional-dependencies"]["deepspeed"]
    return {Requirement(line).name: Requirement(line) for line in lines}


def _pins(name="constraints.txt"):
    """{name: version} of .ci/constraints.txt (or another constraints file of .ci/)."""
    pins = {}
    for line in (ROOT / ".ci" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# Requirements tested on a newer minor than the one pinned, and how: {name: (minor, how)}.
CHECKED_BEYOND_THE_PIN = {"triton": ("3.9", "torch 2.14.1 pins Triton 3.8; CI's torch legs run 3.6 (torch 2.11) and "
                                            "3.9 (torch 2.15)"),
                          "torch": ("2.15", "CI's torch 2.15 leg (.ci/torch_leg.sh 2.15)")}


def test_requirements_are_ranges_capped_at_the_tested_minor_and_the_pins_meet_them():
    """Every requirement has an upper bound below the next minor version (a user never
    gets an untested minor by default); the integrations' ranges span TESTED_VERSIONS
    (hf/training/trainer.py) and the pins sit at its newest; every pin meets its range."""
    import ast

    from packaging.version import Version

    requirements, pins = _requirements(), _pins()
    for name, requirement in requirements.items():
        uppers = [Version(s.version) for s in requirement.specifier if s.operator == "<"]
        assert uppers, f"{name}: no upper bound ({requirement})"
        assert name in pins and requirement.specifier.contains(pins[name]), (name, pins.get(name), str(requirement))
        newest_tested = CHECKED_BEYOND_THE_PIN.get(name, (_minor(pins[name]),))[0]
        major, minor = (int(part) for part in newest_tested.split("."))
        assert uppers[0] == Version(f"{major}.{minor + 1}"), \
            f"{name}: capped below {uppers[0]}, but the newest tested minor is {newest_tested}"
    source = (ROOT / "ulysses_kernels" / "hf" / "training" / "trainer.py").read_text()
    tested = ast.literal_eval(re.search(r"^TESTED_VERSIONS = (\{.*\})$", source, flags=re.M).group(1))
    for name, minors in tested.items():
        lowers = [s.version for s in requirements[name].specifier if s.operator == ">="]
        assert [_minor(v) for v in lowers] == [minors[0]], (name, lowers, minors)
        assert _minor(pins[name]) == minors[-1], (name, pins[name], minors)


def test_the_torch_range_is_the_one_ci_runs_at_both_ends():
    """pyproject.toml admits exactly the torch and Triton minors of ulysses_kernels/support.py,
    in the build requirement too, and CI runs a leg at each end: its constraints pin the
    oldest and the newest torch with its own Triton, and .ci/run calls both legs."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    from ulysses_kernels import support

    requirements = _requirements()
    build = next(Requirement(r) for r in __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())
                 ["build-system"]["requires"] if r.startswith("torch"))
    for name, (lo, hi) in (("torch", support.TESTED_TORCH), ("triton", support.TESTED_TRITON)):
        spec = requirements[name].specifier
        major, minor = (int(x) for x in hi.split("."))
        assert {(s.operator, s.version) for s in spec} == {(">=", lo), ("<", f"{major}.{minor + 1}")}, (name, spec)
    assert build.specifier == requirements["torch"].specifier
    ends = {"2.11": ("3.6", "numpy"), "2.15": ("3.9", None)}
    assert sorted(ends) == sorted(support.TESTED_TORCH)
    ci = (ROOT / ".ci" / "run").read_text()
    for minor, (triton_minor, _) in ends.items():
        pins = _pins(f"constraints-torch{minor}.txt")
        assert _minor(pins["torch"]) == minor and _minor(pins["triton"]) == triton_minor, (minor, pins["torch"])
        assert requirements["torch"].specifier.contains(pins["torch"])
    # .ci/run prepares and runs a leg for each end, and nothing else
    loops = re.findall(r"for minor in ([0-9. ]+);", ci)
    assert loops and all(sorted(loop.split()) == sorted(ends) for loop in loops), loops
    assert 'bash .ci/torch_leg.sh "$1" prepare' in ci and 'bash .ci/torch_leg.sh "$minor" run' in ci
    assert all(f"prepare_leg {minor}" in ci for minor in ends)
    # Triton 3.6's interpreter needs numpy < 2.3 (the kernels fail on CPU with numpy 2.4)
    assert Version(_pins("constraints-torch2.11.txt")["numpy"]) < Version("2.3")


def test_the_test_command_installs_the_pins():
    """The README's test command and .ci/run install every package with the constraints
    (a fresh machine gets what CI proved); the README's main job stays one command."""
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "pip install" in line and line.rstrip().endswith("pytest -n 2"))
    installs = re.findall(r"pip install [^&]*", command)
    assert len(installs) == 3 and all("-c .ci/constraints.txt" in i for i in installs), installs
    ci = (ROOT / ".ci" / "run").read_text()
    pinned_part = ci[ci.index('if [ "${1:-}" = "--newest" ]'):]
    pinned_part = pinned_part[pinned_part.index("\nfi\n"):]
    ci_installs = re.findall(r"pip install [^&\n]*", pinned_part)
    assert len(ci_installs) == 3 and all("-c .ci/constraints.txt" in i for i in ci_installs), ci_installs
    assert "--newest" in ci and "tests/hf/families/test_hf_sweep.py" in ci
