"""The groups a model runs on, as every room reads them: the Ulysses and ring groups from a
process group or `init_sequence_parallel`'s `ParallelGroups`, the whole SP group, its size,
and THE cross-rank sum the losses and heads build on (docs/architecture.md, "The Hugging
Face layer")."""

import torch
import torch.distributed as dist

from ..distributed.groups import ParallelGroups, as_process_group, collective_device, resolve_group


def split_groups(group, ring_group=None):
    """(Ulysses group, ring group) from a process group (+ ring group), or from the
    `ParallelGroups` of `init_sequence_parallel` (its Ulysses and ring groups)."""
    if isinstance(group, ParallelGroups):
        if ring_group is not None:
            raise ValueError("pass either init_sequence_parallel's groups or a ring_group, not both")
        return group.ulysses_group, group.ring_group
    return as_process_group(group), as_process_group(ring_group)


def sp_group_of(group):
    """The whole SP group (for the loss and gradient sums) from a group or `ParallelGroups`."""
    return group.sp_group if isinstance(group, ParallelGroups) else as_process_group(group)


def sum_over_group(local: torch.Tensor, group=None) -> torch.Tensor:
    """THE cross-rank sum of the losses (`global_mean_from_sum`, `rl.row_sums`): the *value*
    is the sum of every rank's `local` (one all-reduce in float64), the *gradient* flows only
    through this rank's `local`. `group`: the SP group, or `init_sequence_parallel`'s groups
    (with a ring: the whole grid)."""
    group, world, _ = resolve_group(sp_group_of(group))
    total = local.detach().to(torch.float64)
    if group is not None and world > 1:
        shared = total.to(collective_device(group))
        dist.all_reduce(shared, group=group)
        total = shared.to(local.device)
    return local + (total - local.detach().to(torch.float64)).to(local.dtype)


def sp_size_of(groups) -> int:
    if isinstance(groups, ParallelGroups):
        return groups.sp_size
    return resolve_group(groups)[1]
