"""Transports: how the fused path's exchanges cross ranks (docs/architecture.md, "Fused
path").

A transport is any object with
  name                                                  a short label (doctor, tests)
  all_to_all(send, recv, send_counts, recv_counts)      enqueue one exchange of element
                                                        counts on the current stream
  check()                                               optional host-side wait (debugging)
  close()                                               free what it holds
built as `factory(group, world, rank, device)`. The engine uses `NcclTransport` unless
`engine.use_transport(group, factory)` selected another one for a group
(`ulysses_kernels.testing` has a host-memory transport for several ranks on one GPU).

Errors. The NCCL communicator is non-blocking; init and enqueue are polled with a timeout
(`ULYSSES_KERNELS_NCCL_TIMEOUT`, seconds, default 600) and raise instead of hanging. With
`ULYSSES_KERNELS_NCCL_CHECK=1` every call also waits (host side, with the same timeout)
for its exchanges to finish, turning a hang inside NCCL into an exception.
`ULYSSES_KERNELS_NCCL_BLOCKING=1` selects NCCL's
blocking mode instead: launches stay in the calling thread (NCCL >= 2.19 launches every
non-blocking group from a helper thread), but init can then hang instead of timing out. The three are read when a communicator is
created.
"""

import torch
import torch.distributed as dist

from .. import env, nccl_order, streams
from ..distributed.collectives import gather_objects


def timeout() -> float:
    return env.number(env.NCCL_TIMEOUT, 600.0)


def _extension():
    """The communicator of the CUDA extension (never stand-ins: a transport that needs no
    extension is another transport): its class and its ops."""
    return torch.classes.ulysses_kernels.NcclCommunicator, torch.ops.ulysses_kernels


def nccl_version():
    """The NCCL torch loaded (the extension links the same library), or None when unknown."""
    try:
        return tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a CPU-only torch, or no NCCL
        return None


def refuse_on_every_rank(group, problem) -> None:
    """Raise the same RuntimeError on every rank of `group` when any rank has a problem
    (one small collective: every rank's answer, gathered)."""
    answers = gather_objects(problem, group)
    found = sorted({a for a in answers if a is not None})
    if found:
        ranks = [r for r, a in enumerate(answers) if a is not None]
        raise RuntimeError(f"ulysses_kernels: the NCCL transport is refused on rank(s) {ranks} of {len(answers)}: "
                           + " | ".join(found))


class NcclTransport:
    """Own NCCL communicator for one SP group, bootstrapped through that group. The
    communicator lives as long as this object (csrc/nccl_engine.cpp: `close()` or the
    object's destruction frees it)."""

    name = "nccl"

    def __init__(self, group, world: int, rank: int, device: torch.device):
        self.world, self.rank, self.device = world, rank, device
        # Read before any collective: a bad value raises here on every rank alike, not in
        # the middle of a call with work queued on the comm stream.
        self.check_each_call, blocking, self.timeout_s = env.flag(env.NCCL_CHECK), env.flag(env.NCCL_BLOCKING), timeout()
        if world > 1:
            refuse_on_every_rank(group, nccl_order.problem(nccl_version()))
        communicator, ops = _extension()
        uid = ops.nccl_unique_id() if rank == 0 else None
        if world > 1:
            obj = [bytes(uid.tolist()) if rank == 0 else None]
            src = dist.get_global_rank(group if group is not None else dist.group.WORLD, 0)
            bcast_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            dist.broadcast_object_list(obj, src=src, group=group, device=bcast_device)
            uid = torch.frombuffer(bytearray(obj[0]), dtype=torch.uint8).clone()
        self.communicator = communicator(uid, world, rank, device.index, self.timeout_s, blocking)
        self.handle = self.communicator.handle()

    def all_to_all(self, send, recv, send_counts, recv_counts):
        self._open()
        torch.ops.ulysses_kernels.nccl_all_to_all(self.handle, send, recv, send_counts, recv_counts)

    def check(self):
        if self.check_each_call and not streams.is_capturing():
            self._open().wait(self.timeout_s)

    def _open(self):
        if self.communicator is None:
            raise RuntimeError("ulysses_kernels: this NCCL transport is closed (fused.close() or an engine "
                               "rebuilt for a new group); its engine must not be used any more")
        return self.communicator

    def close(self):
        if self.communicator is not None:
            communicator, self.communicator, self.handle = self.communicator, None, 0
            communicator.close()
