"""Stand-ins for tests and the benchmarks' smoke mode; never imported by the package
itself (an import-linter contract in pyproject.toml enforces it).

- `ReferenceOps` (reference_ops.py): the pure-torch pack/unpack ops, bitwise what the CUDA
  kernels must do.
- `HostTransport` (host_transport.py): exchanges through host memory over gloo, so several
  ranks can share one GPU (NCCL refuses that) or run on CPU.
- `fused_stand_ins()`: both installed, so the whole fused pipeline (chunking, buffer views,
  GQA replication, the Triton attention in the interpreter) runs on CPU tensors with
  `backend="fused"`.
- `kernel_stand_in()` (kernel_stand_in.py): a candidate kernel computed by the reference in
  torch, registered and forced, so the paths' plumbing for external kernels runs on CPU.
- `bench.py`: entry points the benchmarks time.
"""

import contextlib

from .. import fused
from .host_transport import HostTransport
from .kernel_stand_in import kernel_stand_in
from .reference_ops import ReferenceOps

__all__ = ["ReferenceOps", "HostTransport", "fused_stand_ins", "enable_fused_stand_ins", "kernel_stand_in"]


def enable_fused_stand_ins(group=None):
    """Install `ReferenceOps` and `HostTransport` (for `group`, None = the default group);
    returns a function that restores what was there."""
    previous_ops = fused.use_ops(ReferenceOps)
    previous_transport = fused.use_transport(group, HostTransport)

    def restore():
        fused.use_ops(previous_ops)
        fused.use_transport(group, previous_transport)
    return restore


@contextlib.contextmanager
def fused_stand_ins(group=None):
    """`enable_fused_stand_ins` for the duration of a `with` block."""
    restore = enable_fused_stand_ins(group)
    try:
        yield
    finally:
        restore()
