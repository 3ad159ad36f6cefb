"""Optional compiled pieces, loaded on demand: the CUDA extension (`ulysses_kernels._C`,
built from csrc/) and the Triton attention kernels (`ulysses_kernels.triton`).

Like xformers, a missing or broken build never breaks `import ulysses_kernels`: each
loader returns (module, None) or (None, why not), the reason is kept for
`ulysses-kernels doctor` and for the error of a forced path, and the reference path
keeps working.
"""

import functools
import importlib
import subprocess
import sys
from typing import Optional, Tuple

import torch

# How to add the Hugging Face extras: the package installs from its checkout (README, "Two
# commands"), not from an index.
HF_INSTALL_HINT = "pip install --no-build-isolation -e '.[hf]' in the ulysses-kernels checkout"


@functools.lru_cache(maxsize=None)
def load_extension() -> Tuple[Optional[object], Optional[str]]:
    """Import `ulysses_kernels._C` once; returns (module, None) or (None, why not)."""
    try:
        module = importlib.import_module("ulysses_kernels._C")
    except ImportError as exc:
        reason = str(exc)
        skipped = build_info("CUDA_EXTENSION_SKIPPED_REASON")
        if skipped:
            reason = f"not built: {skipped}"
        if "undefined symbol" in reason or "cannot open shared object" in reason:
            reason = (f"built against a different torch/CUDA than the one installed "
                      f"(torch {torch.__version__}); rebuild with "
                      f"`pip install --no-build-isolation -e .`: {reason}")
        return None, reason
    return module, None


# A call that raises in C++ on any machine (a communicator from a malformed unique id), in
# a fresh process: if the throw crashes it, this one survives to say so.
_ERROR_PROBE = """
import torch, ulysses_kernels._C
try:
    torch.classes.ulysses_kernels.NcclCommunicator(torch.zeros(5, dtype=torch.uint8), 1, 0, 0, 1.0, False)
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
"""


def error_path_problem(timeout_s: float = 120.0) -> Optional[str]:
    """Why an error raised by the extension's C++ code does NOT reach Python as a
    RuntimeError (None when it does). On the first GPU run an extension linked by a GCC
    whose libstdc++ was not torch's loaded fine and segfaulted on its first TORCH_CHECK;
    setup.py now picks a matching compiler, and this probe (doctor, gpu_check) tells."""
    if load_extension()[0] is None:
        return "the extension is not loaded"
    try:
        proc = subprocess.run([sys.executable, "-c", _ERROR_PROBE], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the probe did not finish in {timeout_s:g} s"
    if proc.returncode == 0 and "raised:" in proc.stdout:
        return None
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    return (f"a C++ error of the extension ended the process ({how}): rebuild with a compiler "
            f"whose libstdc++ is torch's (ULYSSES_KERNELS_HOST_COMPILER, setup.py); "
            f"{(proc.stderr.strip().splitlines() or [''])[-1][:200]}")


def build_info(name: str, default=None):
    """A value recorded by setup.py in `ulysses_kernels/_build_info.py` (absent in a
    source tree that was never installed)."""
    try:
        # By name: a generated, git-ignored file (an import statement would make the
        # import-linter graph depend on whether the package was installed).
        module = importlib.import_module("ulysses_kernels._build_info")
    except ImportError:
        return default
    return getattr(module, name, default)


@functools.lru_cache(maxsize=None)
def triton_kernels() -> Tuple[Optional[object], Optional[str]]:
    """Import the Triton attention kernels once; returns (module, None) or (None, why not)."""
    try:
        # Lazy: the package imports without Triton; every use of the kernels goes through here.
        from . import triton as module
    except Exception as exc:  # noqa: BLE001 - triton missing, or incompatible
        return None, f"{type(exc).__name__}: {exc}"
    if not hasattr(module, "flash_attention"):
        return None, "ulysses_kernels.triton has no flash_attention kernels in this build"
    return module, None


def require_triton_kernels():
    """The Triton attention kernels, or a RuntimeError saying why they cannot be used."""
    module, reason = triton_kernels()
    if module is None:
        raise RuntimeError(f"the Triton kernels cannot be used: {reason}")
    return module
