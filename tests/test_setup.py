"""setup.py's choice of host compiler (the first GPU run's segfault on every C++ error
came from an extension linked by a GCC whose libstdc++ was not the one torch runs with)."""

import os
from pathlib import Path

SETUP = Path(__file__).resolve().parent.parent / "setup.py"


def _helpers():
    """setup.py's functions, without running setup() (the module ends in a build)."""
    source = SETUP.read_text()
    start = source.index("def _loaded_libstdcxx")
    end = source.index("def _cuda_extension_or_reason")
    namespace = {}
    exec("import os, shutil, subprocess, sys\n" + source[start:end], namespace)
    return namespace


RUNTIMES = {"/opt/gcc/bin/g++": "/opt/gcc/lib64/libstdc++.so.6.0.34",
            "/usr/bin/g++": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"}
LOADED = RUNTIMES["/usr/bin/g++"]


def _which(paths):
    return lambda name: paths.get(name)


def test_mismatched_cxx_is_replaced_by_a_matching_gxx():
    match = _helpers()["_match_host_compiler"]
    compiler, why = match({"CXX": "/opt/gcc/bin/g++"}, LOADED, RUNTIMES.get,
                          _which({"g++": "/opt/gcc/bin/g++", "/usr/bin/g++": "/usr/bin/g++"}))
    assert compiler == "/usr/bin/g++" and "/opt/gcc/lib64" in why and LOADED in why


def test_matching_or_unknown_runtime_keeps_the_default():
    match = _helpers()["_match_host_compiler"]
    assert match({"CXX": "/usr/bin/g++"}, LOADED, RUNTIMES.get, _which({})) == (None, None)
    assert match({"CXX": "/opt/gcc/bin/g++"}, None, RUNTIMES.get, _which({})) == (None, None)
    assert match({}, LOADED, lambda c: None, _which({})) == (None, None)


def test_no_matching_compiler_warns_and_keeps_cxx(capsys):
    match = _helpers()["_match_host_compiler"]
    assert match({"CXX": "/opt/gcc/bin/g++"}, LOADED, RUNTIMES.get,
                 _which({"g++": "/opt/gcc/bin/g++"})) == (None, None)
    assert "ULYSSES_KERNELS_HOST_COMPILER" in capsys.readouterr().err


def test_forced_compiler_wins():
    match = _helpers()["_match_host_compiler"]
    assert match({"ULYSSES_KERNELS_HOST_COMPILER": "/x/g++", "CXX": "/usr/bin/g++"}, LOADED,
                 RUNTIMES.get, _which({}))[0] == "/x/g++"


def test_this_machines_probes_agree():
    """The real probes on this machine: the compiler CI builds with links the libstdc++
    torch runs with (so setup.py keeps it), and both paths exist."""
    import torch  # noqa: F401 - loads the libstdc++ the extension will run with

    helpers = _helpers()
    loaded = helpers["_loaded_libstdcxx"]()
    assert loaded is not None and os.path.exists(loaded)
    compiler, _ = helpers["_match_host_compiler"](os.environ, loaded)
    assert compiler is None or compiler == os.environ.get("ULYSSES_KERNELS_HOST_COMPILER")
