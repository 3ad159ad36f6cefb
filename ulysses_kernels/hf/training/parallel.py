"""Gradient reduction for DP x SP training: SUM over the SP group, MEAN over DP (by hand,
with DDP, or with FSDP2)."""

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.groups import ParallelGroups, collective_device, resolve_group
from ..model import wrapped_blocks


def allreduce_gradients(model_or_params, sp_group=None, dp_group=None) -> None:
    """Reduce gradients of replicated parameters after `backward` without DDP/FSDP:
    SUM over the SP group (each rank holds the gradient of its own tokens) and MEAN over
    the DP group (each DP rank had its own batch). Gradients are flattened into one
    buffer per dtype (one collective per group and dtype), after one small all-reduce that
    agrees which parameters any rank holds a gradient for (`_used_on_some_rank`). `sp_group`
    may be `init_sequence_parallel`'s groups: its SP group (the whole Ulysses x Ring grid)
    and DP group.
    """
    if isinstance(sp_group, ParallelGroups):
        sp_group, dp_group = sp_group.sp_group, dp_group if dp_group is not None else sp_group.dp_group
    if isinstance(model_or_params, nn.Module) and _fsdp_sharded(model_or_params):
        raise ValueError("allreduce_gradients: the model is sharded by FSDP (apply_fsdp / fully_shard), which "
                         "reduces its gradients itself; reducing them again would sum different shards")
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    params = [p for p in params if p.requires_grad]
    todo = []
    for group, average in [(sp_group, False)] + ([(dp_group, True)] if dp_group is not None else []):
        group, world, _ = resolve_group(group)   # sp_group None = the default group (package convention)
        if group is not None and world > 1:
            todo.append((group, world, average))
    if not todo or not params:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = []
    for p, used in zip(params, _used_on_some_rank(params, todo)):
        if used and p.grad is None:   # used by another rank's tokens only: this rank's gradient is zero
            p.grad = torch.zeros_like(p)
        if used:
            grads.append(_local(p.grad))
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group, world, average in todo:
        for gs in by_dtype.values():
            flat = _flatten_dense_tensors(gs)
            dist.all_reduce(flat, group=group)
            if average:
                flat.div_(world)
            for g, r in zip(gs, _unflatten_dense_tensors(flat, gs)):
                g.copy_(r)


def _fsdp_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `grad`: a DTensor's (tensor parallelism beside SP: the
    ranks of an SP group hold the same shard, so its local tensors are summed like any
    gradient), written in place through it; any other tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def _used_on_some_rank(params: Sequence[nn.Parameter], todo) -> List[bool]:
    """Per parameter: whether any rank of the groups holds a gradient for it (one small
    all-reduce per group and one read). A parameter only some ranks' tokens reached (a rank
    without tokens, an expert no token of this rank chose) must still be reduced on every
    rank, or the ranks would reduce buffers of different layouts; one no rank reached keeps
    no gradient, as on one device."""
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                        device=collective_device(todo[0][0]))
    for group, _, _ in todo:
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    return [bool(u) for u in used.tolist()]


def apply_ddp(model: nn.Module, groups, **ddp_kwargs):
    """Wrap `model` in DDP over the whole DP x SP world, reducing gradients as
    SUM over SP and MEAN over DP (a comm hook that sums and divides by dp_size instead of
    DDP's default division by the world size). `groups` is `init_sequence_parallel(...)`'s
    result. Call `causal_lm_loss(ddp_model, ...)` as usual.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, **ddp_kwargs)
    dp_size = groups.dp_size

    def hook(state, bucket):
        buf = bucket.buffer()
        buf.div_(dp_size)
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    return ddp


def apply_fsdp(model: nn.Module, groups, *, shard: str = "world", reshard_after_forward: bool = True,
               mp_policy=None, layers: Optional[Sequence[nn.Module]] = None) -> nn.Module:
    """Shard `model` with FSDP2 (`fully_shard`) for DP x SP training.

    shard="world": parameters sharded across the DP x SP ranks of `groups` (torchtitan's
    `dp_shard_cp`; every such rank holds 1/(DP x SP) of each weight, as DeepSpeed combines
    Ulysses with ZeRO-3; a mesh's other dimensions, tensor or expert parallel, are left to
    the user). shard="sp": HSDP, sharded inside each SP group and replicated across DP.
    Each decoder layer becomes an FSDP unit, then the root. FSDP reduces the gradients:
    do not also call `allreduce_gradients`.

    Gradient reduction is set to SUM with a post-division by dp_size (not the world size):
    the SP ranks of a group see one batch and their gradients add up, the DP ranks see
    different batches and are averaged. (FSDP's default AVG over the mesh would make the
    gradient sp_size times too small; scaling the loss by sp_size is the equivalent
    alternative.) Sum-only collectives also work on gloo, which has no PREMUL_SUM.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = groups.mesh
    device_type = mesh.device_type if mesh is not None else "cpu"
    if shard == "world" and (mesh is None or mesh.size() == dist.get_world_size()):
        fmesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp_sp",))
    elif shard == "world":   # a user's mesh with other dimensions: its DP x SP ranks only
        fmesh = mesh._flatten("dp_sp") if mesh.ndim > 1 else mesh
    elif shard == "sp":
        fmesh = mesh  # (dp, sp): replicate over dp, shard over sp
    else:
        raise ValueError(f"apply_fsdp: shard must be 'world' or 'sp', got {shard!r}")
    kw = dict(mesh=fmesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    units = list(layers) if layers is not None else wrapped_blocks(model)
    for layer in units:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for m in [*units, model]:
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(float(groups.dp_size))
    return model
