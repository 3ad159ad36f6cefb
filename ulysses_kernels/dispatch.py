"""Which execution path runs a call (docs/architecture.md, "Dispatch").

Paths: "reference" (torch ops + torch.distributed, always available), "triton" (Triton
attention kernels; on CPU tensors only under TRITON_INTERPRET=1), "fused" (CUDA
extension: pack kernels + NCCL engine + Triton attention). `backend=None` means
`ULYSSES_KERNELS_BACKEND` if set, else automatic: fused on CUDA in a process group, else
Triton on CUDA, else reference, each only when it can run the inputs.

This module decides; it does not know how to check a path. Its caller (api.py) passes,
for each faster path, a function that says why that path cannot run these inputs on this
device (None when it can), so dispatch imports nothing of the package and the paths
never import each other to ask.
"""

import os
from typing import Callable, Mapping, Optional

import torch

BACKENDS = ("reference", "triton", "fused")
ENV_VAR = "ULYSSES_KERNELS_BACKEND"

# path -> () -> why it cannot run (a phrase that follows "backend='<path>' "), or None
Problems = Mapping[str, Callable[[], Optional[str]]]


def requested_backend(backend: Optional[str]) -> str:
    """The backend asked for: the argument, else the environment, else "auto"."""
    name = backend if backend is not None else os.environ.get(ENV_VAR, "").strip() or "auto"
    if name not in BACKENDS + ("auto",):
        source = "backend" if backend is not None else ENV_VAR
        raise ValueError(f"{source}={name!r} is not a backend; choose one of "
                         f"{', '.join(BACKENDS)} (or None / 'auto')")
    return name


def resolve_backend(backend: Optional[str], device: torch.device, *, distributed: bool,
                    problems: Problems) -> str:
    """Pick the path for tensors on `device`; a forced path that cannot run raises
    RuntimeError. Automatic choice takes the fastest path whose problem is None, so e.g.
    float64 CUDA inputs quietly use the reference path."""
    name = requested_backend(backend)
    if name == "auto":
        if device.type != "cuda":
            return "reference"
        if distributed and problems["fused"]() is None:
            return "fused"
        if problems["triton"]() is None:
            return "triton"
        return "reference"
    if name != "reference":
        problem = problems[name]()
        if problem:
            raise RuntimeError(f"backend={name!r} {problem}")
    return name
