"""Fake (meta) implementations of the CUDA extension's ops, for fake-tensor shape
propagation (torch.compile tracing, FakeTensorMode). The real kernels live in csrc/.

Ops (torch.ops.ulysses_kernels), see csrc/pack_kernels.cu and csrc/nccl_engine.cpp:
  pack(Tensor[] srcs, int world) -> Tensor
  pack_into(Tensor[] srcs, Tensor(a!) send, int[] offsets, int[] counts) -> ()
  unpack(Tensor recv, int[] num_heads) -> Tensor[]
  unpack_into(Tensor recv, Tensor(a!)[] outs, int[] offsets, int[] counts) -> ()
  nccl_unique_id() -> Tensor
  nccl_comm_create(Tensor unique_id, int world, int rank, int device, float timeout_s) -> int
  nccl_comm_destroy(int comm) -> ()
  nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, int[] send_counts, int[] recv_counts) -> ()
  nccl_comm_wait(int comm, float timeout_s) -> ()
The communicator-management ops take no device tensors and are never traced; they have
no fake implementation (nccl_unique_id returns a CPU tensor and works under fake mode as is).
"""

import threading

import torch

_lock = threading.Lock()
_registered = False


def _local_heads(heads: int, world: int) -> int:
    if heads % world == 0:
        return heads // world
    if world % heads == 0:
        return 1
    raise ValueError(f"{heads} heads can be neither split over nor replicated to {world} ranks")


def _fake_pack(srcs, world):
    x0 = srcs[0]
    channels = sum(_local_heads(x.shape[2], world) for x in srcs)
    return x0.new_empty((world, x0.shape[0], x0.shape[1], channels, x0.shape[3]))


def _fake_pack_into(srcs, send, offsets, counts):
    return None


def _fake_unpack(recv, num_heads):
    _, B, S, _, D = recv.shape
    return [recv.new_empty((B, S, h, D)) for h in num_heads]


def _fake_unpack_into(recv, outs, offsets, counts):
    return None


def _fake_all_to_all(comm, send, recv, send_counts, recv_counts):
    return None


def register_fakes() -> bool:
    """Register the fake implementations once; needs the extension to be loaded first.
    Returns False when the ops are not there (extension missing)."""
    global _registered
    with _lock:
        if _registered:
            return True
        from ._backend import load_extension
        module, _ = load_extension()
        if module is None:
            return False
        for name, fn in (("pack", _fake_pack), ("pack_into", _fake_pack_into), ("unpack", _fake_unpack),
                         ("unpack_into", _fake_unpack_into), ("nccl_all_to_all", _fake_all_to_all)):
            if hasattr(torch.ops.ulysses_kernels, name):
                torch.library.register_fake(f"ulysses_kernels::{name}", fn)
        _registered = True
        return True
