"""Which execution path runs a call, and optional loading of the compiled extension.

Paths (DESIGN.md): "reference" (torch ops + torch.distributed, always available),
"triton" (Triton attention kernels; on CPU tensors only under TRITON_INTERPRET=1),
"fused" (CUDA extension: pack kernels + NCCL engine + Triton attention).
`backend=None` means `ULYSSES_KERNELS_BACKEND` if set, else automatic: fused on CUDA when
the extension is built, else Triton on CUDA, else reference.
"""

import functools
import importlib
import os
from typing import Optional, Tuple

import torch

BACKENDS = ("reference", "triton", "fused")
ENV_VAR = "ULYSSES_KERNELS_BACKEND"


@functools.lru_cache(maxsize=None)
def load_extension() -> Tuple[Optional[object], Optional[str]]:
    """Import `ulysses_kernels._C` once; returns (module, None) or (None, why not).

    Like xformers, a missing or broken build never breaks `import ulysses_kernels`: the
    reason is kept for `ulysses-kernels doctor` and for the error of a forced fused path.
    """
    try:
        module = importlib.import_module("ulysses_kernels._C")
    except ImportError as exc:
        reason = str(exc)
        try:
            from . import _build_info
            if _build_info.CUDA_EXTENSION_SKIPPED_REASON:
                reason = f"not built: {_build_info.CUDA_EXTENSION_SKIPPED_REASON}"
        except ImportError:
            pass
        if "undefined symbol" in reason or "cannot open shared object" in reason:
            reason = (f"built against a different torch/CUDA than the one installed "
                      f"(torch {torch.__version__}); rebuild with "
                      f"`pip install --no-build-isolation -e .`: {reason}")
        return None, reason
    return module, None


def extension_has(op_name: str) -> bool:
    module, _ = load_extension()
    return module is not None and hasattr(torch.ops.ulysses_kernels, op_name)


@functools.lru_cache(maxsize=None)
def triton_kernels() -> Tuple[Optional[object], Optional[str]]:
    """Import the Triton attention kernels; returns (module, None) or (None, why not)."""
    try:
        module = importlib.import_module("ulysses_kernels.triton")
    except Exception as exc:  # triton missing, or incompatible
        return None, f"{type(exc).__name__}: {exc}"
    if not hasattr(module, "flash_attention"):
        return None, "ulysses_kernels.triton has no flash_attention kernels in this build"
    return module, None


def fused_available() -> Tuple[bool, Optional[str]]:
    module, reason = load_extension()
    if module is None:
        return False, f"the CUDA extension is unavailable ({reason})"
    try:
        from . import fused  # noqa: F401  (Python side of the fused path)
    except ImportError as exc:
        return False, f"the fused path is not in this build ({exc})"
    if not fused.is_supported():
        return False, "the CUDA extension was built without the fused exchange ops"
    return True, None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested_backend(backend: Optional[str]) -> str:
    name = backend if backend is not None else os.environ.get(ENV_VAR, "").strip() or "auto"
    if name not in BACKENDS + ("auto",):
        source = "backend" if backend is not None else ENV_VAR
        raise ValueError(f"{source}={name!r} is not a backend; choose one of "
                         f"{', '.join(BACKENDS)} (or None / 'auto')")
    return name


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_input_problem(path: str, tensors) -> Optional[str]:
    """Why the Triton / fused kernels cannot take these q, k, v (None when they can)."""
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        return None  # malformed inputs are reported by the shape checks
    q = tensors[0]
    if any(t.dtype != q.dtype for t in tensors) or q.dtype not in _KERNEL_DTYPES:
        return f"the {path} kernels take float16/bfloat16/float32 inputs, got {q.dtype}"
    d = q.shape[-1]
    if d % 16 or d > 256 or d == 0:
        return f"the {path} kernels need a head dim that is a multiple of 16 up to 256, got {d}"
    if path == "fused":
        from . import fused
        return fused.unsupported_reason(*tensors)
    return None


def resolve_backend(backend: Optional[str], device: torch.device, *, distributed: bool,
                    tensors=None) -> str:
    """Pick the path for tensors on `device`; a forced path that cannot run raises.

    Automatic choice takes the fastest path that is available and supports `tensors`
    (dtype, head dim), so e.g. float64 CUDA inputs quietly use the reference path.
    """
    name = requested_backend(backend)
    if name == "auto":
        if device.type != "cuda":
            return "reference"
        if distributed and fused_available()[0] and not kernel_input_problem("fused", tensors):
            return "fused"
        if triton_kernels()[0] is not None and not kernel_input_problem("triton", tensors):
            return "triton"
        return "reference"
    if name == "triton":
        # Check before importing: kernels imported without the interpreter cannot run on CPU.
        if device.type != "cuda" and not interpreter_enabled():
            raise RuntimeError("backend='triton' on CPU tensors needs the Triton interpreter: set "
                               "TRITON_INTERPRET=1 before importing ulysses_kernels")
        module, reason = triton_kernels()
        if module is None:
            raise RuntimeError(f"backend='triton' requested but the Triton kernels cannot be used: {reason}")
    if name == "fused":
        if device.type != "cuda":
            raise RuntimeError(f"backend='fused' needs CUDA tensors, got tensors on {device}")
        ok, reason = fused_available()
        if not ok:
            raise RuntimeError(f"backend='fused' requested but {reason}")
    if name in ("triton", "fused"):
        problem = kernel_input_problem(name, tensors)
        if problem:
            raise RuntimeError(f"backend={name!r} cannot run these inputs: {problem}")
    return name
