"""The kernels' signatures stay readable (docs/architecture.md, "Attention kernels"): no
@triton.jit function takes more than 40 parameters (tensors' strides travel as one tuple
per tensor, related scalars as tuples), and each call of a loop phase (the ``*_inner``
functions) passes at most 15 arguments (bundles built in the kernel). Read from the
source: no Triton needed."""

import ast
import pathlib

import pytest
from helpers import ROOT

KERNEL_DIR = pathlib.Path(ROOT) / "ulysses_kernels" / "triton"
MAX_PARAMETERS = 40
MAX_PHASE_CALL_ARGUMENTS = 15


def _modules():
    return [(path.name, ast.parse(path.read_text())) for path in sorted(KERNEL_DIR.glob("*.py"))]


def _jit_functions():
    for file, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield file, node


def test_the_kernels_are_found():
    names = {node.name for _, node in _jit_functions()}
    assert {"_flash_fwd_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel", "_fwd_inner", "_dkdv_inner",
            "_dq_inner"} <= names


@pytest.mark.parametrize("file,name,count", [(f, n.name, len(n.args.args)) for f, n in _jit_functions()])
def test_no_jit_function_takes_more_than_40_parameters(file, name, count):
    assert count <= MAX_PARAMETERS, f"{file}:{name} takes {count} parameters"


def test_phase_calls_pass_at_most_15_arguments():
    calls = [(file, call.lineno, len(call.args) + len(call.keywords))
             for file, tree in _modules() for call in ast.walk(tree)
             if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id.endswith("_inner")]
    assert len(calls) >= 14, calls  # the forward's, dQ's and dK/dV's phases
    assert [c for c in calls if c[2] > MAX_PHASE_CALL_ARGUMENTS] == []


# The host side: the launchers and the ops' runners take the call as one record
# (kernel_call.KernelCall, ops.CallOptions) plus the tensors and a few keywords.
HOST_FUNCTIONS = {"launch_fwd", "launch_bwd", "launch_dkdv", "launch_dq", "_run_fwd", "_run_bwd"}
MAX_HOST_PARAMETERS = 15
MAX_HOST_POSITIONAL = 8


def _host_functions():
    for file, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in HOST_FUNCTIONS:
                yield file, node


def test_host_launchers_take_a_call_record():
    found = {node.name: node for _, node in _host_functions()}
    assert set(found) == HOST_FUNCTIONS
    for name, node in found.items():
        positional, keyword = len(node.args.args), len(node.args.kwonlyargs)
        assert positional + keyword <= MAX_HOST_PARAMETERS, f"{name} takes {positional + keyword} parameters"
        assert positional <= MAX_HOST_POSITIONAL, f"{name} takes {positional} positional parameters"
        names = [a.arg for a in node.args.args]
        assert "call" in names or "options" in names, f"{name} does not take the call as one record"
