"""Process groups: which group a call runs on, and the data x sequence parallel mesh."""

from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ..layout import choose_ring_size


def resolve_group(group):
    """(group, world, rank) for `group` (None = the default group), or (None, 1, 0) when
    torch.distributed is not initialised and no group was given: a single process."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was passed but torch.distributed is not initialized")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the given process group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the given process group")
    return group, dist.get_world_size(group), rank


def collective_device(group) -> torch.device:
    """Device on which this group's backend can run a small collective."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def tensor_collective_device(group, t: torch.Tensor) -> torch.device:
    """Where `t` is gathered or broadcast over `group`: on its own device when the group's
    backend runs there (NCCL for a CUDA tensor, gloo for a CPU one; a "cpu:gloo,cuda:nccl"
    group does both), else where the backend can (`collective_device`), through a copy."""
    backend = str(dist.get_backend(group)).lower()
    if t.is_cuda and "nccl" in backend:
        return t.device
    if t.device.type == "cpu" and ("gloo" in backend or "nccl" not in backend):
        return t.device
    return collective_device(group)


class ParallelGroups(NamedTuple):
    """The groups a rank belongs to on a `(dp, sp)` mesh of the world, the SP dimension
    itself a `(ring, ulysses)` grid.

    Ranks `[d * sp_size, (d + 1) * sp_size)` form SP group d (consecutive ranks, so an SP
    group stays inside a node when sp_size divides the GPUs per node); ranks with the same
    SP rank form a DP group. Inside an SP group, SP rank `i * ulysses_size + u` is Ulysses
    rank u of ring rank i: Ulysses groups are consecutive ranks (the all-to-all stays on
    the fast intra-node links), ring groups are strided (the ring's point-to-point
    transfers cross nodes). With ring_size 1 the Ulysses group is the SP group and
    ring_group is None.
    """

    sp_group: object
    dp_group: object
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int
    mesh: Optional[object]  # torch DeviceMesh with dims ("dp", "sp"), for FSDP2 / DTensor
    ulysses_group: object = None
    ring_group: object = None
    ulysses_rank: int = 0
    ulysses_size: int = 1
    ring_rank: int = 0
    ring_size: int = 1
    usp_mesh: Optional[object] = None  # DeviceMesh ("dp", "ring", "ulysses") when ring_size > 1


def init_sequence_parallel(sp_size: int, *, ring_size: Union[int, str] = 1, num_heads: Optional[int] = None,
                           num_kv_heads: Optional[int] = None,
                           device_type: Optional[str] = None) -> ParallelGroups:
    """Split the initialised world into DP x SP groups, each SP group a ring x Ulysses grid
    (collective: every rank must call it).

    ring_size: the ring degree R (the Ulysses degree is sp_size / R); "auto" picks the
    smallest R for which the model's `num_heads` / `num_kv_heads` fit the Ulysses degree
    (`layout.choose_ring_size`: 28 query / 4 KV heads on sp_size 8 -> Ulysses 4 x ring 2).
    device_type: "cuda" or "cpu" for the DeviceMesh; default from the default group's
    backend (NCCL -> cuda, otherwise cpu).
    """
    if not dist.is_initialized():
        raise ValueError("init_sequence_parallel: torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size != 0:
        raise ValueError(f"init_sequence_parallel: sp_size={sp_size} must be >= 1 and divide the "
                         f"world size {world}")
    if ring_size == "auto":
        if num_heads is None:
            raise ValueError("init_sequence_parallel: ring_size='auto' needs num_heads (and num_kv_heads for GQA)")
        ring_size = choose_ring_size(sp_size, num_heads, num_kv_heads)
    if not isinstance(ring_size, int) or ring_size < 1 or sp_size % ring_size:
        raise ValueError(f"init_sequence_parallel: ring_size={ring_size!r} must be 'auto' or an int >= 1 "
                         f"dividing sp_size={sp_size}")
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    dp_size = world // sp_size
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
    rank = dist.get_rank()
    sp_rank = rank % sp_size
    groups = ParallelGroups(sp_group=mesh.get_group("sp"), dp_group=mesh.get_group("dp"),
                            sp_rank=sp_rank, sp_size=sp_size, dp_rank=rank // sp_size, dp_size=dp_size,
                            mesh=mesh, ulysses_group=mesh.get_group("sp"), ulysses_rank=sp_rank,
                            ulysses_size=sp_size)
    if ring_size == 1:
        return groups
    ulysses_size = sp_size // ring_size
    usp_mesh = init_device_mesh(device_type, (dp_size, ring_size, ulysses_size),
                                mesh_dim_names=("dp", "ring", "ulysses"))
    return groups._replace(ulysses_group=usp_mesh.get_group("ulysses"), ring_group=usp_mesh.get_group("ring"),
                           ulysses_rank=sp_rank % ulysses_size, ulysses_size=ulysses_size,
                           ring_rank=sp_rank // ulysses_size, ring_size=ring_size, usp_mesh=usp_mesh)
