"""Sequence parallelism inside a model that transformers distributed itself
(``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=..., tp_size=...,
ep_size=...))``; docs/hf_training.md, "MoE and transformers' DistributedConfig").

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, attn_implementation="ulysses")
    groups = ukhf.sequence_parallel_groups(model, 2)       # every rank: carves SP out of the fsdp dimension
    ukhf.register(groups)
    loss = ukhf.causal_lm_loss(model, ukhf.shard_batch(ids, groups, labels=ids), groups)
    loss.backward()                                         # gradients: SUM over SP, MEAN over DP

transformers lays the world out as a ``("pp", "dp_replicate", "fsdp", "tp")`` mesh (ranks
row-major, tp fastest) and a matching expert mesh ``("pp", "dp_replicate", "efsdp", "ep")``.
Only the fsdp and dp_replicate ranks see different batches, so SP comes out of fsdp: each SP
group is `sp_size` consecutive coordinates of the fsdp dimension at one (pp, dp_replicate, tp)
coordinate, and the ranks with the same SP rank there form the DP group. TP and PP are left
alone: the attention sees the local heads of its TP rank and splits them over the SP group.

FSDP2 averages gradients over every fsdp x dp_replicate rank (experts: transformers sets the
same mean as a divide factor). The SP ranks of a group hold disjoint tokens of ONE batch, so
their gradients must be summed, and only the DP groups averaged: the gradient divide factor of
every FSDP module becomes `dp_size / sp_size` (its reductions summed, then divided once; torch's
`set_force_sum_reduction_for_comms`, which gloo needs too). The package's losses already give
each rank the gradient of its own tokens over the group's count (`global_mean_from_sum`), and
the router's load-balancing loss over the whole group's tokens (`router_aux_loss`).
"""

from typing import List

import torch.distributed as dist
from torch import nn

from ...distributed.groups import ParallelGroups
from ...layout import head_plan_error
from ..model import unwrap
from .experts import check_experts_train

DENSE_DIMS = ("pp", "dp_replicate", "fsdp", "tp")
GROUPS_ATTR = "_ulysses_sequence_parallel_groups"   # the groups sequence_parallel_groups gave the model


def is_transformers_distributed(model: nn.Module) -> bool:
    """The model was distributed by transformers (`from_pretrained(..., distributed_config=...)`)."""
    return getattr(unwrap(model), "_mesh_manager", None) is not None


def tp_size_of(model: nn.Module) -> int:
    """The tensor-parallel size transformers distributed the model with (1: none)."""
    return int(getattr(unwrap(model), "_tp_size", None) or 1)


def check_transformers_distributed(where: str, model: nn.Module, groups) -> None:
    """A trainer on a model transformers distributed: its groups must be the ones
    `sequence_parallel_groups` gave it (they made its FSDP reduction right for SP), and no
    PEFT adapters (Trainer averages their gradients over the whole world, which is wrong by
    the SP size). The same ValueError on every rank."""
    if getattr(unwrap(model), GROUPS_ATTR, None) is not groups:
        raise ValueError(f"{where}: the model was distributed by transformers; pass sp_groups="
                         "ukhf.sequence_parallel_groups(model, sp_size), which carves SP out of its fsdp dimension "
                         "and makes its FSDP reduction a sum over SP and a mean over DP")
    if unwrap(model) is not model and type(model).__name__.startswith("Peft"):
        raise ValueError(f"{where}: PEFT adapters on a model transformers distributed are not supported under SP: "
                         "Trainer averages their gradients over every rank, where the SP ranks' must be summed")


def sequence_parallel_groups(model: nn.Module, sp_size: int) -> ParallelGroups:
    """The SP and DP groups of a model transformers distributed with `distributed_config=`
    (module doc), and its FSDP modules' gradient reduction made a sum over SP and a mean over
    DP. A collective (every rank, the same `sp_size`); the same ValueError on every rank when
    the model was not distributed by transformers, when it runs transformers' pipeline
    parallelism (forward-only), when `sp_size` does not divide the fsdp dimension, or when the
    heads each TP rank holds cannot be split over `sp_size` ranks."""
    inner = unwrap(model)
    check_experts_train("sequence_parallel_groups", inner)
    ranks, tp_size = _dense_ranks(inner)
    pp, dr, fsdp, tp = ranks.shape
    if pp > 1:
        raise ValueError(f"sequence_parallel_groups: the model runs transformers' pipeline parallelism (pp_size {pp}), "
                         "whose schedule is forward-only in transformers 5.25 (pipeline_parallel_naive_forward sends "
                         "each stage's activations without autograd and broadcasts the logits from the last stage), "
                         "so no gradient reaches the earlier stages; train with pp_size 1 (fsdp, tp and ep sizes "
                         "with SP)")
    sp_size = int(sp_size)
    if sp_size < 1 or fsdp % sp_size:
        raise ValueError(f"sequence_parallel_groups: sp_size {sp_size} must divide the model's fsdp dimension "
                         f"({fsdp}; DistributedConfig fsdp_size): SP comes out of the ranks that see different "
                         "batches")
    _check_heads(inner, sp_size, tp_size)
    me = dist.get_rank()
    sp_groups, dp_groups = mesh_groups(ranks, sp_size)
    sp_group, sp_members = _new_groups(sp_groups, me)
    dp_group, dp_members = _new_groups(dp_groups, me)
    _divide_gradients(inner, dp_size=dr * fsdp, sp_size=sp_size)
    groups = ParallelGroups(sp_group=sp_group, dp_group=dp_group, sp_rank=sp_members.index(me), sp_size=sp_size,
                            dp_rank=dp_members.index(me), dp_size=len(dp_members), mesh=None,
                            ulysses_group=sp_group, ulysses_rank=sp_members.index(me), ulysses_size=sp_size)
    setattr(inner, GROUPS_ATTR, groups)
    return groups


def mesh_groups(ranks, sp_size: int):
    """The SP groups and the DP groups (lists of ranks) of transformers' dense mesh `ranks`
    (`[pp, dp_replicate, fsdp, tp]`): an SP group is `sp_size` consecutive fsdp coordinates
    at one (pp, dp_replicate, tp) coordinate; a DP group the ranks of one (pp, tp) coordinate
    and one SP rank, over dp_replicate and the SP groups."""
    pp, dr, fsdp, tp = ranks.shape
    sp_groups = [ranks[p, d, b * sp_size:(b + 1) * sp_size, t].tolist()
                 for p in range(pp) for d in range(dr) for t in range(tp) for b in range(fsdp // sp_size)]
    dp_groups = [ranks[p, :, s::sp_size, t].reshape(-1).tolist()
                 for p in range(pp) for t in range(tp) for s in range(sp_size)]
    return sp_groups, dp_groups


def _dense_ranks(model: nn.Module):
    """The `[pp, dp_replicate, fsdp, tp]` tensor of ranks of transformers' dense mesh, and tp."""
    manager = getattr(model, "_mesh_manager", None)
    mesh = getattr(manager, "_dense_mesh", None)
    if mesh is None:
        raise ValueError("sequence_parallel_groups: the model was not distributed by transformers (load it with "
                         "from_pretrained(..., distributed_config=transformers.distributed.DistributedConfig(...)); "
                         "for a model you distribute yourself, use ulysses_kernels.init_sequence_parallel)")
    names = tuple(mesh.mesh_dim_names or ())
    if names != DENSE_DIMS:
        raise ValueError(f"sequence_parallel_groups: transformers' dense mesh has dimensions {names}, expected "
                         f"{DENSE_DIMS} (tested with transformers 5.25)")
    ranks = mesh.mesh.cpu()
    return ranks, int(ranks.shape[3])


def _check_heads(model: nn.Module, sp_size: int, tp_size: int) -> None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int):
        return
    local, local_kv = heads // tp_size, max(1, kv_heads // tp_size)
    problem = head_plan_error(sp_size, local, local_kv)
    if problem:
        raise ValueError(f"sequence_parallel_groups: each TP rank holds {local} query and {local_kv} key/value heads "
                         f"(of {heads} and {kv_heads}, tp_size {tp_size}), which {sp_size} SP ranks cannot share: "
                         f"{problem}")


def _new_groups(members: List[List[int]], me: int):
    """Every group of `members` created on every rank in the same order (new_group is a
    collective); this rank's group and its members."""
    mine, mine_members = None, None
    for ranks in members:
        group = dist.new_group(ranks)
        if me in ranks:
            mine, mine_members = group, ranks
    return mine, mine_members


def _divide_gradients(model: nn.Module, *, dp_size: int, sp_size: int) -> None:
    """Every FSDP module's reduction: a sum over its shard group, divided by the number of DP
    groups' batches it covers (`dp_size / sp_size`) instead of `dp_size`."""
    from torch.distributed.fsdp import FSDPModule

    factor = dp_size / sp_size
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            if _shard_size(module) > 1:   # a sum on a group of one would divide twice (torch 2.14)
                module.set_force_sum_reduction_for_comms(True)


def _shard_size(module) -> int:
    state = module._get_fsdp_state()
    sizes = [g.mesh_info.shard_mesh_size for g in getattr(state, "_fsdp_param_groups", []) if g is not None]
    return max(sizes, default=1)
