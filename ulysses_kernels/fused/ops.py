"""The CUDA extension's pack/unpack ops as the fused path calls them, their fake (meta)
implementations for torch.compile, and the op table that tests can replace.

Ops (torch.ops.ulysses_kernels, csrc/pack_kernels.cu and csrc/nccl_engine.cpp):
  pack_into(Tensor[] srcs, Tensor(a!) send, int[] offsets, int[] counts,
            int[] local_heads, int[] replicas, Tensor? cos=None, Tensor? sin=None,
            int[] rotary=[]) -> ()
  unpack_into(Tensor recv, Tensor(a!)[] outs, int[] offsets, int[] counts,
              int[] local_heads, int[] replicas) -> ()
  nccl_unique_id() -> Tensor
  nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, int[] send_counts, int[] recv_counts) -> ()
and the class torch.classes.ulysses_kernels.NcclCommunicator (the communicator; transport.py).

The kernels do not decide where a head goes: `pack_into` / `unpack_into` below compute
each tensor's placement with `ulysses_kernels.layout.place_heads` and pass it as
(`local_heads`, `replicas`) per tensor (docs/architecture.md, "Layout rules").

The op table is the CUDA extension unless `use_ops` installed stand-ins (the pure-torch
ones of `ulysses_kernels.testing` run the whole fused pipeline on CPU); a stand-in table
names the device types it runs on in `device_types`.
"""

import threading
from typing import List, Sequence

import torch

from ..extensions import load_extension
from ..layout import place_heads

FUSED_OPS = ("pack_into", "unpack_into", "nccl_unique_id", "nccl_all_to_all")
FUSED_CLASSES = ("NcclCommunicator",)
EXTENSION_DEVICE_TYPES = ("cuda",)

_lock = threading.Lock()
_fakes_registered = False
_extension_supported = False  # the extension's answer never changes within a process
_stand_ins = None


def use_ops(table=None):
    """Install `table` (an object with `pack_into`, `unpack_into` taking the ops'
    arguments and a `device_types` tuple) in place of the CUDA extension's ops; None
    restores the extension. Returns the table that was active (None: the extension)."""
    global _stand_ins
    previous, _stand_ins = _stand_ins, table
    return previous


def table():
    """The active pack/unpack ops: stand-ins if installed, else torch.ops.ulysses_kernels."""
    return _stand_ins if _stand_ins is not None else torch.ops.ulysses_kernels


def device_types() -> tuple:
    """The device types the active ops run on."""
    return tuple(_stand_ins.device_types) if _stand_ins is not None else EXTENSION_DEVICE_TYPES


def _placement_args(tensors: Sequence[torch.Tensor], world: int):
    placements = [place_heads(t.shape[2], world) for t in tensors]
    return [p.local for p in placements], [p.replicas for p in placements]


def pack_into(srcs: Sequence[torch.Tensor], send: torch.Tensor, offsets, counts, rotary=None) -> None:
    """Write local heads `[offsets[t], offsets[t] + counts[t])` of every destination of each
    source `[B, S_p, H_t, D]` into `send` `[P, B, S_p, sum(counts), D]`.

    rotary: None, or (cos, sin, flags): the sources with a true flag get the rotary
    embedding (rotary.py's convention; cos/sin `[B, S_p, D]` in the sources' dtype)
    applied while they are packed, in fp32 with one rounding."""
    local, replicas = _placement_args(srcs, send.shape[0])
    if rotary is None:
        table().pack_into(list(srcs), send, list(offsets), list(counts), local, replicas)
        return
    cos, sin, flags = rotary
    table().pack_into(list(srcs), send, list(offsets), list(counts), local, replicas, cos, sin,
                      [int(bool(f)) for f in flags])


def unpack_into(recv: torch.Tensor, outs: Sequence[torch.Tensor], offsets, counts) -> None:
    """Inverse of `pack_into` from a receive buffer `[P, B, S_p, C, D]` into outputs
    `[B, S_p, H_t, D]`; replicated heads are the fp32 sum of their replicas."""
    local, replicas = _placement_args(outs, recv.shape[0])
    table().unpack_into(recv, list(outs), list(offsets), list(counts), local, replicas)


def pack(srcs: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Every local head of every source in one new send buffer (tests, benchmarks)."""
    local, _ = _placement_args(srcs, world)
    x0 = srcs[0]
    send = x0.new_empty((world, x0.shape[0], x0.shape[1], sum(local), x0.shape[3]))
    pack_into(srcs, send, [0] * len(srcs), local)
    return send


def unpack(recv: torch.Tensor, num_heads: Sequence[int]) -> List[torch.Tensor]:
    """Inverse of `pack`: new tensors `[B, S_p, H_t, D]` (tests, benchmarks)."""
    _, B, S, _, D = recv.shape
    outs = [recv.new_empty((B, S, h, D)) for h in num_heads]
    unpack_into(recv, outs, [0] * len(outs), [place_heads(h, recv.shape[0]).local for h in num_heads])
    return outs


def _fake_mutating(*args):
    return None


def is_supported() -> bool:
    """True when the active ops have everything the fused path needs: stand-ins, or the
    CUDA extension with every fused op (then their fake implementations are registered)."""
    global _extension_supported
    if _stand_ins is not None or _extension_supported:
        return True
    module, _ = load_extension()
    if module is None:
        return False
    try:
        register_fakes()
    except Exception:  # noqa: BLE001 - a broken build must read as "not supported"
        return False
    _extension_supported = (all(hasattr(torch.ops.ulysses_kernels, name) for name in FUSED_OPS)
                            and all(_has_class(name) for name in FUSED_CLASSES))
    return _extension_supported


def _has_class(name: str) -> bool:
    try:
        getattr(torch.classes.ulysses_kernels, name)
    except (RuntimeError, AttributeError):
        return False
    return True


def register_fakes() -> bool:
    """Register the fake implementations once, for fake-tensor shape propagation
    (torch.compile tracing, FakeTensorMode); needs the extension loaded. Returns False
    when the ops are not there. The communicator itself (a class) and nccl_unique_id (a CPU
    tensor) take no device tensors and are never traced."""
    global _fakes_registered
    with _lock:
        if _fakes_registered:
            return True
        module, _ = load_extension()
        if module is None:
            return False
        for name in ("pack_into", "unpack_into", "nccl_all_to_all"):
            if hasattr(torch.ops.ulysses_kernels, name):
                torch.library.register_fake(f"ulysses_kernels::{name}", _fake_mutating)
        _fakes_registered = True
        return True
