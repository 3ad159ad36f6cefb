"""The fused engine's NCCL communicator beside torch's (docs/architecture.md, "The engine
beside torch's NCCL groups").

The NCCL transport keeps its own communicator per SP group. DDP, FSDP2 and DeepSpeed run
torch's ProcessGroupNCCL communicators on their own streams at the same time (FSDP's
prefetch, DDP's bucketed all-reduce). NCCL's rule for communicators used concurrently on a
device: before NCCL 2.26 their operations had to be serialized into one global order by
the application, or kernels of two communicators could deadlock (each GPU's SMs held by one
communicator's kernel waiting for peers that run the other). Since 2.26,
`NCCL_LAUNCH_ORDER_IMPLICIT=1` makes NCCL order the operations of every communicator of a
device by host launch order (overlapped on CUDA >= 12.3, serialized before), which is
safe as long as every rank issues its NCCL calls in the same host order from one thread:
the SPMD order of a training step.

NCCL reads the variable once, at the process's first NCCL kernel launch, and it is off by
default; torch never sets it. So the package sets it to 1 when it is imported, unless the
user set it, and records whether torch.distributed was already initialized then (torch's
communicators may have launched before the setting could take effect).
`problem(nccl_version)` is why a multi-rank NCCL engine must not be created in this
process (None when it may); `NcclTransport` asks every rank and raises the same error on
all of them. The symmetric-memory transport uses no NCCL communicator of its own.
"""

import os
from typing import Optional, Tuple

from . import env

LAUNCH_ORDER = env.NCCL_LAUNCH_ORDER.name
FIRST_NCCL_WITH_LAUNCH_ORDER = (2, 26, 0)

# What `order_nccl_launches` found when the package was imported.
_state = {"set_by_package": False, "distributed_was_initialized": False}


def order_nccl_launches() -> None:
    """Set NCCL_LAUNCH_ORDER_IMPLICIT=1 unless the environment names a value (import time)."""
    if os.environ.get(LAUNCH_ORDER, "").strip():
        return
    os.environ[LAUNCH_ORDER] = "1"
    _state["set_by_package"] = True
    try:
        import torch.distributed as dist

        _state["distributed_was_initialized"] = dist.is_available() and dist.is_initialized()
    except Exception:  # noqa: BLE001 - a torch without distributed: nothing launched NCCL
        pass


def problem(nccl_version: Optional[Tuple[int, ...]]) -> Optional[str]:
    """Why this process must not run a multi-rank NCCL engine beside torch's communicators
    (None when it may). `nccl_version`: the NCCL torch loaded (the engine links the same one)."""
    fix = (f"export {LAUNCH_ORDER}=1 before the processes start (torchrun inherits it), or "
           "ULYSSES_KERNELS_TRANSPORT=symm inside a node, or backend='triton'")
    if nccl_version is not None and tuple(nccl_version) < FIRST_NCCL_WITH_LAUNCH_ORDER:
        have = ".".join(str(x) for x in nccl_version)
        return (f"the fused path's NCCL communicator beside torch's needs NCCL >= 2.26 ({LAUNCH_ORDER}: operations "
                f"of several communicators ordered on the device), and torch loaded NCCL {have}; use "
                "ULYSSES_KERNELS_TRANSPORT=symm inside a node, or backend='triton'")
    value = os.environ.get(LAUNCH_ORDER, "").strip()
    if value != "1":
        return (f"{LAUNCH_ORDER}={value or '(unset)'}: the fused path's NCCL communicator beside torch's (DDP, FSDP, "
                "ZeRO) can deadlock unless NCCL orders the communicators' operations by launch; " + fix)
    if _state["set_by_package"] and _state["distributed_was_initialized"]:
        return (f"ulysses_kernels set {LAUNCH_ORDER}=1 when it was imported, after torch.distributed was "
                "initialized: NCCL reads it once, at the process's first launch, which may have come before; " + fix +
                " (or import ulysses_kernels before init_process_group)")
    return None


def describe() -> str:
    """The doctor's line."""
    value = os.environ.get(LAUNCH_ORDER, "").strip() or "(unset)"
    who = "set by ulysses_kernels at import" if _state["set_by_package"] else "from the environment"
    late = "; set after torch.distributed was initialized: the NCCL engine refuses" \
        if _state["set_by_package"] and _state["distributed_was_initialized"] else ""
    return f"{LAUNCH_ORDER}={value} ({who}{late})"
