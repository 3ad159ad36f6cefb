"""The small collectives every part of the package shares (docs/architecture.md, "Around
the call"): a few int64 values from every rank, tensors gathered from every rank, an OR
over the ranks, one message per rank, and the flat all-to-all the torch exchanges run.

The small ones run on the device the group's backend can use (`groups.collective_device`:
the CPU for gloo, the current GPU for NCCL); tensors are gathered where they live when the
backend runs there (`groups.tensor_collective_device`) and handed back there. A group of
None is a single process (`groups.resolve_group` gives None only without
torch.distributed): every function degenerates to the identity.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .groups import collective_device, tensor_collective_device


def _world(group) -> int:
    if group is None:
        if dist.is_available() and dist.is_initialized():   # None here would be one rank's view of many
            raise ValueError("ulysses_kernels: a collective got group=None with torch.distributed initialised; "
                             "resolve it first (distributed.groups.resolve_group gives the WORLD group)")
        return 1
    return dist.get_world_size(group)


def gather_ints(values: Sequence[int], group) -> List[List[int]]:
    """Every rank's `values` (the same count on every rank), in rank order: one
    all-gather of int64."""
    if _world(group) == 1:
        return [[int(v) for v in values]]
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=collective_device(group))
    got = [torch.empty_like(mine) for _ in range(_world(group))]
    dist.all_gather(got, mine, group=group)
    return [g.tolist() for g in got]


def all_gather_tensor(t: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's `t` (the same shape and dtype on every rank), in rank order, on t's device."""
    if _world(group) == 1:
        return [t]
    dev = tensor_collective_device(group, t)
    parts = [torch.empty(t.shape, dtype=t.dtype, device=dev) for _ in range(_world(group))]
    dist.all_gather(parts, t.contiguous().to(dev), group=group)
    return [p.to(t.device) for p in parts]


def any_rank(flag: bool, group) -> bool:
    """True when `flag` is True on any rank of `group` (one tiny all-reduce)."""
    if _world(group) == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def max_over_ranks(value: int, group) -> int:
    """The largest of every rank's int `value` over `group` (one tiny all-reduce)."""
    if _world(group) == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def gather_objects(value, group) -> list:
    """Every rank's picklable `value`, in rank order (one object all-gather)."""
    if _world(group) == 1:
        return [value]
    values = [None] * _world(group)
    dist.all_gather_object(values, value, group=group)
    return values


def first_message(message: Optional[str], group) -> Optional[Tuple[int, str]]:
    """(rank, message) of the lowest rank that has a message, the same on every rank, or
    None (every rank passes its own message or None)."""
    messages = [message]
    if _world(group) > 1:
        messages = [None] * _world(group)
        dist.all_gather_object(messages, message, group=group)
    return next(((r, m) for r, m in enumerate(messages) if m), None)


def broadcast_tensor(t: torch.Tensor, src: int, group) -> torch.Tensor:
    """Group rank `src`'s `t` on every rank (a new tensor on t's device)."""
    if _world(group) == 1:
        return t
    dev = tensor_collective_device(group, t)
    buf = t.contiguous().to(dev, copy=True)
    dist.broadcast(buf, src=dist.get_global_rank(group, src), group=group)
    return buf.to(t.device)


def all_to_all(send: torch.Tensor, send_splits: List[int], recv_splits: List[int], group) -> torch.Tensor:
    """Flat `all_to_all_single` with element split sizes; returns the flat receive buffer
    (a copy of `send` for one rank: a single process, or a group of one, such as the Ulysses
    group of a pure ring, where a collective would only copy)."""
    send = send.reshape(-1)
    recv = send.new_empty(sum(recv_splits))
    if len(send_splits) == 1 or (group is None and _world(group) == 1):  # (raises for an unresolved None)
        recv.copy_(send)
        return recv
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return recv
