"""Process groups: which group a call runs on, and the data x sequence parallel mesh."""

import logging
import os
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ..layout import choose_ring_size

logger = logging.getLogger("ulysses_kernels")

GROUP_KINDS = ("a torch.distributed ProcessGroup, a 1-D DeviceMesh (mesh['sp']) or the ParallelGroups of "
               "uk.init_sequence_parallel / uk.groups_from_mesh")


def as_process_group(group):
    """`group` as a ProcessGroup: a ProcessGroup or None as it is, a 1-D DeviceMesh its group,
    `ParallelGroups` without a ring its sequence-parallel group.
    Anything else raises a ValueError naming what to pass; the answer depends on the
    argument alone, so every rank raises the same."""
    if group is None or isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return group   # (a non-member's group: resolve_group says so)
    if isinstance(group, ParallelGroups):   # its sequence-parallel group; a ring is a second argument
        if group.ring_size > 1:
            raise ValueError(f"ParallelGroups with a ring ({group.ulysses_size} Ulysses x {group.ring_size} ring) were "
                             "passed as one group: pass group=groups.ulysses_group, ring_group=groups.ring_group")
        return group.sp_group
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            raise ValueError(f"a DeviceMesh of {group.ndim} dimensions {group.mesh_dim_names} was passed as a group: "
                             "pass its sequence-parallel dimension (mesh['sp']), or "
                             "uk.groups_from_mesh(mesh, sp=..., dp=...) where a call takes ParallelGroups")
        return group.get_group()
    raise ValueError(f"group must be {GROUP_KINDS} (or None), got {type(group).__name__}")


def _device_mesh_type():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:   # torch without device meshes
        return None
    return DeviceMesh


def resolve_group(group):
    """(group, world, rank) for `group` (None = the default group; a 1-D DeviceMesh: its
    group), or (None, 1, 0) when torch.distributed is not initialised and no group was
    given: a single process."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was passed but torch.distributed is not initialized")
    group = as_process_group(group)
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the given process group")
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
                           num_kv_heads: Optional[int] = None, device_type: Optional[str] = None,
                           gpus_per_node: Optional[int] = None) -> ParallelGroups:
    """Split the initialised world into DP x SP groups, each SP group a ring x Ulysses grid
    (collective: every rank must call it).

    ring_size: the ring degree R (the Ulysses degree is sp_size / R); "auto" picks the
    smallest R for which the model's `num_heads` / `num_kv_heads` fit the Ulysses degree
    (`layout.choose_ring_size`: 28 query / 4 KV heads on sp_size 8 -> Ulysses 4 x ring 2)
    and whose Ulysses groups stay inside a node when the world spans nodes.
    gpus_per_node: the ranks of a node (consecutive ranks, as torchrun numbers them);
    default the launcher's `LOCAL_WORLD_SIZE`. Only "auto" reads it.
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
        ring_size = _auto_ring_size(sp_size, num_heads, num_kv_heads, world, gpus_per_node)
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


def _node_size(world: int, gpus_per_node: Optional[int]) -> Optional[int]:
    """The ranks of one node when the world spans several (None: one node, or unknown)."""
    if gpus_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        gpus_per_node = int(local) if local.isdigit() and int(local) > 0 else None
    if gpus_per_node is None or gpus_per_node >= world:
        return None
    if world % gpus_per_node:
        raise ValueError(f"init_sequence_parallel: the world of {world} ranks is not whole nodes of "
                         f"{gpus_per_node} (gpus_per_node, or LOCAL_WORLD_SIZE)")
    return gpus_per_node


def _auto_ring_size(sp_size, num_heads, num_kv_heads, world, gpus_per_node) -> int:
    """ring_size="auto" (the docstring of init_sequence_parallel), said on rank 0."""
    if num_heads is None:
        raise ValueError("init_sequence_parallel: ring_size='auto' needs num_heads (and num_kv_heads for GQA)")
    node = _node_size(world, gpus_per_node)
    ring = choose_ring_size(sp_size, num_heads, num_kv_heads, gpus_per_node=node)
    if dist.get_rank() == 0:
        where = (f"each Ulysses group inside a node of {node} ranks, the ring across nodes" if node
                 else "one node")
        logger.info("init_sequence_parallel: ring_size='auto' -> Ulysses %d x ring %d (%s; %d query / %s key-value "
                    "heads)", sp_size // ring, ring, where, num_heads, num_kv_heads or num_heads)
    return ring


def groups_from_mesh(mesh, *, sp="sp", dp=None, ring=None) -> ParallelGroups:
    """`ParallelGroups` from the user's own DeviceMesh (collective: every rank of the mesh
    calls it, as it builds the flattened groups).

    sp: the name of the sequence-parallel dimension, or several names (flattened, in
    order, into one Ulysses group); ring: the name of an optional outer ring dimension (the
    SP group is then ring x Ulysses, SP rank ``ring_rank * ulysses_size + ulysses_rank``, as
    `init_sequence_parallel` numbers it); dp: the name(s) of the dimensions whose ranks hold
    different batches (None: every rank of the mesh outside the SP group holds the same
    batch, DP size 1). The other dimensions (tensor, expert, pipeline parallel) are left
    alone. `mesh` of the result: the `(dp, sp)` sub-mesh (FSDP2's HSDP mesh), or the SP
    mesh without dp.
    """
    mesh_type = _device_mesh_type()
    if mesh_type is None or not isinstance(mesh, mesh_type):
        raise ValueError(f"groups_from_mesh: mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    sp_dims, dp_dims, ring_dims = _dim_names(sp), _dim_names(dp), _dim_names(ring)
    if not sp_dims or len(ring_dims) > 1:
        raise ValueError(f"groups_from_mesh: sp names one or more dimensions and ring at most one (sp={sp!r}, "
                         f"ring={ring!r})")
    chosen = sp_dims + dp_dims + ring_dims
    unknown = [d for d in chosen if d not in names]
    if unknown or len(set(chosen)) != len(chosen):
        raise ValueError(f"groups_from_mesh: sp={sp!r}, dp={dp!r}, ring={ring!r} must name distinct dimensions of "
                         f"the mesh {names}")
    ulysses_mesh = _flat(mesh, sp_dims)
    sp_mesh = _flat(mesh, ring_dims + sp_dims)
    ulysses_rank, ulysses_size = ulysses_mesh.get_local_rank(), ulysses_mesh.size()
    groups = ParallelGroups(sp_group=sp_mesh.get_group(), dp_group=None, sp_rank=sp_mesh.get_local_rank(),
                            sp_size=sp_mesh.size(), dp_rank=0, dp_size=1, mesh=sp_mesh,
                            ulysses_group=ulysses_mesh.get_group(), ulysses_rank=ulysses_rank,
                            ulysses_size=ulysses_size)
    if dp_dims:
        dp_mesh = _flat(mesh, dp_dims)
        groups = groups._replace(dp_group=dp_mesh.get_group(), dp_rank=dp_mesh.get_local_rank(),
                                 dp_size=dp_mesh.size(), mesh=_root(mesh)[(_flat_name(dp_dims), _flat_name(ring_dims + sp_dims))])
    else:
        own, _ = dist.new_subgroups(group_size=1)   # DP size 1: this rank alone (a collective over the world)
        groups = groups._replace(dp_group=own)
    if ring_dims:
        ring_mesh = mesh[ring_dims[0]]
        groups = groups._replace(ring_group=ring_mesh.get_group(), ring_rank=ring_mesh.get_local_rank(),
                                 ring_size=ring_mesh.size())
    return groups


def _dim_names(arg):
    if arg is None:
        return ()
    return (arg,) if isinstance(arg, str) else tuple(arg)


def _flat_name(dims) -> str:
    return dims[0] if len(dims) == 1 else "_".join(dims)


def _root(mesh):
    """The mesh `mesh` was sliced from (itself for a root mesh): flattened dimensions are
    sliced from there."""
    return getattr(mesh, "_root_mesh", None) or mesh


def _flat(mesh, dims):
    """The 1-D mesh of `dims` (one dimension as it is; several flattened under their joined
    name, which torch keeps: flattening the same dimensions again returns that mesh)."""
    if len(dims) == 1:
        return mesh[dims[0]]
    return mesh[dims]._flatten(_flat_name(dims))
