"""Environment variables: every variable the project reads, declared once (`VARIABLES`),
and the one parser of their values (docs/env.md is generated from this table:
`ulysses-kernels env > docs/env.md`, checked by tests/test_docs.py).

Every boolean goes through `flag`, so "false" means off everywhere and a typo is an error
that names the variable instead of a silent guess. The accepted spellings are Triton's
own (`triton.knobs` reads "1", "true", "yes", "on", "y" as true). Numbers go through
`number`, choices through `choice`; unset or empty always means the default.

This module imports nothing from the package: setup.py loads it by path before the
package is installed, and the Triton kernels (`ulysses_kernels.triton`) import it.
"""

import os
from dataclasses import dataclass
from typing import Tuple, Union

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, how its value is read, its default (as the
    table shows it), where it is read and what it does."""

    name: str
    kind: str          # "flag", "number", "integer", "choice", "path"
    default: str
    read_by: str       # the file that reads it
    meaning: str
    choices: Tuple[str, ...] = ()


# -- execution paths and kernels
BACKEND = Variable("ULYSSES_KERNELS_BACKEND", "choice", "auto", "ulysses_kernels/distributed/dispatch.py",
                   "The default execution path of every call: auto (fused on CUDA in a process group, else "
                   "Triton on CUDA, else reference), or one path forced.",
                   ("auto", "reference", "triton", "fused"))
ATTENTION = Variable("ULYSSES_KERNELS_ATTENTION", "choice", "auto", "ulysses_kernels/kernel_choice/choice.py",
                     "The attention kernel of every path: auto (the fastest candidate whose capability table "
                     "covers the call, timed once per call class on the GPU and agreed by every rank of the "
                     "group; ours on CPU), a family (sdpa, flash: the fastest of its members) or one candidate "
                     "forced. A forced kernel that cannot compute a call is the same ValueError on every rank.",
                     ("auto", "triton", "sdpa", "flash", "sdpa_cudnn", "sdpa_flash", "flash2", "fa3", "fa4",
                      "torch_varlen", "flex"))
CACHE_DIR = Variable("ULYSSES_KERNELS_CACHE_DIR", "path", "~/.cache/ulysses_kernels",
                     "ulysses_kernels/kernel_choice/choice.py",
                     "Where the kernel choice keeps its timed choices (attention_choice.json).")
DETERMINISTIC = Variable("ULYSSES_KERNELS_DETERMINISTIC", "flag", "0", "ulysses_kernels/triton/flash_bwd.py",
                         "The default of `deterministic`: the bitwise-reproducible attention backward (two "
                         "kernels, 7 GEMMs per tile) instead of fp32 dQ atomics (5 GEMMs).")
BWD_HEAD_SPLITS = Variable("ULYSSES_KERNELS_BWD_HEAD_SPLITS", "integer", "0 (automatic)",
                           "ulysses_kernels/triton/flash_bwd.py",
                           "Forces how many programs share one KV head's query-head group in the atomic "
                           "backward (a divisor of the GQA group; 0: by the grid rule).")
TRITON_AUTOTUNE = Variable("ULYSSES_KERNELS_TRITON_AUTOTUNE", "flag", "1", "ulysses_kernels/triton/launcher.py",
                           "Autotune the Triton kernels on a GPU (read when they are imported; 0: the default "
                           "configs, as the GPU check runs them).")
TRITON_INTERPRET = Variable("TRITON_INTERPRET", "flag", "0", "ulysses_kernels/env.py (and Triton itself)",
                            "Run Triton kernels in Triton's interpreter, on CPU tensors (set before importing "
                            "ulysses_kernels; tests/conftest.py sets it without a GPU).")
HOPPER_FEATURES = Variable("ULYSSES_KERNELS_HOPPER_FEATURES", "text", "(none: the measured kernels)",
                           "ulysses_kernels/triton/features.py",
                           "Opt-in Hopper features of the attention kernels, comma-separated. Forward: desc (K/V "
                           "through TMA tensor descriptors), fma_scale (the softmax scale in one FFMA), "
                           "lazy_rescale (rescale only when a row maximum grows by more than 2**8), "
                           "warp_specialize (Triton's warp-specialized loop); backward: dq_reduce (dQ added by TMA "
                           "reduce-adds), bwd_warp_specialize (warp-specialized dK/dV kernel with 64-row tiles, "
                           "then a warp-specialized dQ kernel); hopper: desc, fma_scale, warp_specialize and dq_reduce. Candidates until "
                           "measured on a GPU: none is on by default (docs/architecture.md, \"Hopper kernel "
                           "features\").")
# -- the fused path
NUM_CHUNKS = Variable("ULYSSES_KERNELS_NUM_CHUNKS", "integer", "0 (automatic)", "ulysses_kernels/fused/plan.py",
                      "Chunks of the fused pipeline (automatic by bytes moved; lowered to the largest count the "
                      "head layout allows).")
TRANSPORT = Variable("ULYSSES_KERNELS_TRANSPORT", "choice", "auto", "ulysses_kernels/fused/engine.py",
                     "How the fused path's exchanges cross ranks: nccl (its own NCCL communicator), symm (torch's "
                     "symmetric memory inside one node, copy-engine reads of the peers' windows; not yet run on a "
                     "GPU), or auto, which means nccl for now: auto will choose symmetric memory inside a node once "
                     "its GPU tests have passed. Read when an engine is created; a transport set by "
                     "`fused.use_transport` wins.",
                     ("auto", "symm", "nccl"))
NCCL_TIMEOUT = Variable("ULYSSES_KERNELS_NCCL_TIMEOUT", "number", "600", "ulysses_kernels/fused/transport.py",
                        "Seconds an NCCL init, launch or check may take before it raises (and aborts the "
                        "communicator) instead of hanging; also the limit of each symmetric-memory barrier "
                        "(ULYSSES_KERNELS_TRANSPORT=symm). Read when a transport is created.")
NCCL_CHECK = Variable("ULYSSES_KERNELS_NCCL_CHECK", "flag", "0", "ulysses_kernels/fused/transport.py",
                      "Wait on the host after every fused call for its exchanges (debugging: a hang inside NCCL "
                      "becomes an exception). Read when a communicator is created.")
NCCL_LAUNCH_ORDER = Variable("NCCL_LAUNCH_ORDER_IMPLICIT", "flag", "1 (set when ulysses_kernels is imported, unless set)",
                             "ulysses_kernels/nccl_order.py (and NCCL itself)",
                             "NCCL orders the operations of every communicator of a device by host launch order "
                             "(NCCL >= 2.26; read at the process's first NCCL launch). The fused path's NCCL "
                             "transport, a communicator beside torch's, refuses to start unless it is 1 "
                             "(docs/architecture.md, \"The engine beside torch's NCCL groups\").")
NCCL_BLOCKING = Variable("ULYSSES_KERNELS_NCCL_BLOCKING", "flag", "0", "ulysses_kernels/fused/transport.py",
                         "NCCL's blocking mode instead of the polled non-blocking one (launches stay in the "
                         "calling thread; init can then hang). Read when a communicator is created.")
# -- the build
SKIP_CUDA_BUILD = Variable("ULYSSES_KERNELS_SKIP_CUDA_BUILD", "flag", "0", "setup.py",
                           "Never build the CUDA extension (a pure-Python install).")
FORCE_CUDA_BUILD = Variable("ULYSSES_KERNELS_FORCE_CUDA_BUILD", "flag", "0", "setup.py",
                            "Fail the install when the CUDA extension cannot be built (CI and the GPU check).")
HOST_COMPILER = Variable("ULYSSES_KERNELS_HOST_COMPILER", "path", "CXX, or a g++ whose libstdc++ is torch's",
                         "setup.py", "The C++ compiler the extension is built with.")
# -- tests and the GPU check
TEST_TIMEOUT = Variable("ULYSSES_KERNELS_TEST_TIMEOUT", "number", "0 (no limit)", "tests/conftest.py",
                        "Seconds one test may run before it fails with TimeoutError (the GPU check sets 60).")
GPU_ISOLATE = Variable("ULYSSES_KERNELS_GPU_ISOLATE", "flag", "0", "tests/conftest.py",
                       "End a pytest worker whose CUDA context broke after a GPU test (the GPU check sets it "
                       "under pytest-xdist, so one fault costs one test).")
FAILURE_LOG = Variable("ULYSSES_KERNELS_FAILURE_LOG", "path", "(unset: none)", "tests/conftest.py",
                       "A file each failing test's report is appended to as soon as it fails (the GPU check "
                       "sets one per step, so a step cut off at its time limit still tells why its tests failed).")
GPU_CHECK_DRY_RUN = Variable("GPU_CHECK_DRY_RUN", "flag", "0", "bench/_steps.sh, bench/*.py",
                             "Walk `bench/gpu_check.sh` on a CPU with the GPU parts stubbed (CI runs it).")
GPU_CHECK_STEPS = Variable("GPU_CHECK_STEPS", "text", "every step", "bench/gpu_check.sh",
                           "The steps of `bench/gpu_check.sh` to run, in the script's order, e.g. \"install fp32_tests\".")
GPU_CHECK_DEADLINE_S = Variable("GPU_CHECK_DEADLINE_S", "integer", "540", "bench/_steps.sh",
                                "Seconds the whole `bench/gpu_check.sh` call may take; each step's limit is cut to "
                                "what remains, and a step that would get under 10 s is reported as not run.")
GPU_CHECK_COMMIT = Variable("GPU_CHECK_COMMIT", "text", "(unset: unknown)", "bench/gpu_check.sh",
                            "The commit the GPU check's report names where the tree it runs in has no .git.")
GPU_CHECK_SIMULATE_BUILD_FAILURE = Variable("GPU_CHECK_SIMULATE_BUILD_FAILURE", "flag", "0", "bench/_steps.sh",
                                            "With the dry run: walk the fallback after a failed CUDA build.")

VARIABLES = (BACKEND, ATTENTION, CACHE_DIR, DETERMINISTIC, BWD_HEAD_SPLITS, TRITON_AUTOTUNE, TRITON_INTERPRET,
             HOPPER_FEATURES,
             NUM_CHUNKS, TRANSPORT, NCCL_TIMEOUT, NCCL_CHECK, NCCL_BLOCKING, NCCL_LAUNCH_ORDER,
             SKIP_CUDA_BUILD, FORCE_CUDA_BUILD, HOST_COMPILER,
             TEST_TIMEOUT, GPU_ISOLATE, FAILURE_LOG, GPU_CHECK_DRY_RUN, GPU_CHECK_STEPS, GPU_CHECK_DEADLINE_S,
             GPU_CHECK_COMMIT, GPU_CHECK_SIMULATE_BUILD_FAILURE)

Name = Union[Variable, str]


def _name(var: Name) -> str:
    return var.name if isinstance(var, Variable) else var


def text(var: Name) -> str:
    """The stripped value of the variable ("" when unset)."""
    return os.environ.get(_name(var), "").strip()


def flag(var: Name, default: bool = False) -> bool:
    """The value of the boolean environment variable (`default` when unset or empty).

    Raises ValueError for a value that is neither true nor false, naming the variable.
    """
    name = _name(var)
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: use one of {', '.join(_TRUE)} "
                     f"or {', '.join(_FALSE)}")


def number(var: Name, default: float) -> float:
    """The value of the numeric environment variable (`default` when unset or empty)."""
    raw = text(var)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{_name(var)}={raw!r} is not a number") from None


def integer(var: Name, default: int) -> int:
    """The value of the integer environment variable (`default` when unset or empty)."""
    raw = text(var)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{_name(var)}={raw!r} is not an integer") from None


def choice(var: Name, allowed, default: str) -> str:
    """The value of the environment variable, one of `allowed` (lower-cased; `default`
    when unset or empty). Raises ValueError naming the variable and the choices."""
    raw = text(var)
    if not raw:
        return default
    if raw.lower() not in allowed:
        raise ValueError(f"{_name(var)}={raw!r} is not one of {', '.join(allowed)}")
    return raw.lower()


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (`TRITON_INTERPRET`): on CPU tensors."""
    return flag(TRITON_INTERPRET)


# ---------------------------------------------------------------- the generated table

_KINDS = {"flag": f"boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})", "number": "number",
          "integer": "integer", "path": "path", "text": "text"}


def markdown() -> str:
    """docs/env.md: every variable of `VARIABLES`, in one table."""
    lines = ["# Environment variables", "",
             "Every environment variable the project reads, generated from `ulysses_kernels/env.py`",
             "(`ulysses-kernels env > docs/env.md`; `tests/test_docs.py` fails when this file and the code",
             "disagree). Unset or empty means the default; a value that does not parse raises a `ValueError`",
             "naming the variable.", "",
             "| variable | value | default | read by | what it does |", "|---|---|---|---|---|"]
    for var in VARIABLES:
        kind = f"one of {', '.join(var.choices)}" if var.kind == "choice" else _KINDS[var.kind]
        lines.append(f"| `{var.name}` | {kind} | {var.default} | `{var.read_by}` | {var.meaning} |")
    return "\n".join(lines) + "\n"
