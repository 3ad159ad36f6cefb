"""Optional compiled pieces, loaded on demand: the CUDA extension (`ulysses_kernels._C`,
built from csrc/) and the Triton attention kernels (`ulysses_kernels.triton`, from
triton_kernels/).

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

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


# An op that raises in C++ on any machine (an unknown communicator handle), in a fresh
# process: if the throw crashes it, this one survives to say so.
_ERROR_PROBE = """
import torch, ulysses_kernels._C
try:
    torch.ops.ulysses_kernels.nccl_comm_wait(-424242, 1.0)
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
        # By name: the kernels live in triton_kernels/ (installed as ulysses_kernels.triton),
        # outside the folder that the import-linter graph covers.
        module = importlib.import_module("ulysses_kernels.triton")
    except Exception as exc:  # noqa: BLE001 - triton missing, or incompatible
        return None, f"{type(exc).__name__}: {exc}"
    if not hasattr(module, "flash_attention"):
        return None, "ulysses_kernels.triton has no flash_attention kernels in this build"
    return module, None


def kernel_input_problem(path: str, tensors) -> Optional[str]:
    """Why the Triton attention kernels (run by the Triton and the fused path) cannot
    take these q, k, v (None when they can): one dtype among fp16/bf16/fp32 and a head
    dim that is a multiple of 16 up to 256."""
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        return None  # malformed inputs are reported by the shape checks
    q = tensors[0]
    if any(t.dtype != q.dtype for t in tensors) or q.dtype not in KERNEL_DTYPES:
        return (f"the {path} kernels take float16/bfloat16/float32 inputs of one dtype, got "
                f"{'/'.join(str(t.dtype).replace('torch.', '') for t in tensors)}")
    d = q.shape[-1]
    if d % 16 or d > 256 or d == 0:
        return f"the {path} kernels need a head dim that is a multiple of 16 up to 256, got {d}"
    return None
