"""The exact global mean loss over the valid tokens of the whole SP group."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...distributed.groups import ParallelGroups
from ..core.attach import sequence_parallel_model
from ..core.batch import IGNORE_INDEX, SequenceParallelBatch
from ..groups import sum_over_group
from .experts import check_experts_train
from .patch import is_loss_patched
from .router_loss import router_aux_loss, router_loss_of


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Logits for a loss: float64 stays float64, anything narrower becomes float32."""
    return x if x.dtype == torch.float64 else x.float()


def global_mean_from_sum(local_sum: torch.Tensor, local_count, group=None) -> torch.Tensor:
    """Exact global mean from this rank's differentiable `local_sum` over its
    `local_count` valid tokens: returns a tensor whose *value* is
    ``sum_r local_sum_r / sum_r local_count_r`` on every rank and whose *gradient* flows
    only through this rank's `local_sum` (scaled by 1 / global count).

    One all-reduce of [sum, count] (a constant for autograd). Because each rank's
    backward covers its own tokens (the attention all-to-all carries the cross-rank
    terms), the full gradient of a replicated parameter is the SUM of the ranks'
    gradients over the SP group: see `allreduce_gradients` / `apply_ddp` / `apply_fsdp`.
    Ranks with zero valid tokens return the global mean too (gradient 0) and must still
    call backward. A group with no valid token at all gives 0. `group`: the SP group, or
    `init_sequence_parallel`'s groups (with a ring: the whole Ulysses x Ring grid).
    """
    count = torch.as_tensor(local_count, dtype=local_sum.dtype, device=local_sum.device).reshape(())
    total_sum, total_count = sum_over_group(torch.stack([local_sum, count]), group)
    return total_sum / torch.clamp(total_count, min=1.0)


def sequence_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, group=None, *,
                           ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy averaged over the valid tokens of the whole SP group (exact global mean).

    logits `[B, S_local, V]` and *already shifted* labels `[B, S_local]` (from
    `shard_batch`). Computed in float32 (float64 logits in float64). Differentiable (see
    `global_mean_from_sum`).
    """
    local_sum = F.cross_entropy(at_least_float32(logits).reshape(-1, logits.shape[-1]),
                                labels.reshape(-1).to(logits.device),
                                ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum()
    return global_mean_from_sum(local_sum, count, group)


def causal_lm_loss(model: nn.Module, batch: SequenceParallelBatch, group=None, *,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Run `model` on this rank's shard and return the global mean loss (all ranks).

    Uses the tiled LM head + loss when `patch_model(..., tiled_loss=True)` was applied
    (no `[S, vocab]` logits), the model's logits otherwise (what the model applies to its
    logits, e.g. Gemma 2's final softcap, is in them; the tiled head applies it too). A
    mixture-of-experts model that returns router logits (`output_router_logits=True`) gets
    its load-balancing loss over the whole SP group's tokens (`router_aux_loss`), as on
    one device.
    """
    sequence_parallel_model(model, group)   # the first time: the model's context and its checks (guard.py)
    if torch.is_grad_enabled():
        check_experts_train("causal_lm_loss", model)
    inputs = batch.model_inputs()
    count = (batch.labels != ignore_index).sum()
    if is_loss_patched(model):
        out = model(**inputs, ulysses_labels=batch.labels)
        local_sum = out["loss"] if isinstance(out, dict) else out.loss
        loss = global_mean_from_sum(local_sum, count, group)
    else:
        out = model(**inputs)
        logits = out["logits"] if isinstance(out, dict) else out.logits
        loss = sequence_parallel_loss(logits, batch.labels, group, ignore_index=ignore_index)
    router_logits = out.get("router_logits") if isinstance(out, dict) else getattr(out, "router_logits", None)
    terms = router_loss_of(model) if router_logits is not None else None
    if terms is not None:
        loss = loss + terms.coefficient * router_aux_loss(router_logits, terms.num_experts, terms.top_k, group)
    return loss


def loss_for_world_average(loss: torch.Tensor, groups, engine=None) -> torch.Tensor:
    """The loss to backpropagate through an engine that averages gradients over the whole
    world: DeepSpeed's `engine.backward` (every ZeRO stage, no `mpu`), DDP without
    `apply_ddp`'s hook, FSDP's default. `loss` is the global mean of `causal_lm_loss` /
    `sequence_parallel_loss` over this DP group's batch (log that one); this returns it
    times the SP size, so that the engine's mean over the world is the SUM over each SP
    group (whose ranks hold disjoint tokens of one batch) and the MEAN over the DP groups
    (each DP group's mean weighted equally, where the Trainer mixin weights every token
    equally: the same when the DP groups' batches hold as many targets; docs/deepspeed.md).

    groups: `init_sequence_parallel`'s groups. engine: a DeepSpeed engine, checked to
    average over the whole world (`dp_world_size`; an `mpu` or DeepSpeed's own
    `sequence_parallel_size` would change that and make this scale wrong). The
    `SequenceParallelTrainerMixin` scales its loss the same way itself."""
    if not isinstance(groups, ParallelGroups):
        raise TypeError("loss_for_world_average needs init_sequence_parallel(...)'s groups (its sp_size), got "
                        f"{type(groups).__name__}")
    if engine is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        dp_world = getattr(engine, "dp_world_size", world)
        engine_sp = getattr(engine, "sequence_parallel_size", 1)
        if dp_world != world or engine_sp != 1:
            raise ValueError(f"loss_for_world_average: the engine averages gradients over {dp_world} of the "
                             f"{world} ranks (sequence_parallel_size {engine_sp}); the scale assumes all of "
                             "them. Call deepspeed.initialize without mpu= and without sequence_parallel_size.")
    return loss * groups.sp_size


class _GradientTimes(torch.autograd.Function):
    """`x` unchanged; its gradient times `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def gradient_for_world_average(values: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """`values` as they are, their gradient times the SP size. For values that are global on
    every rank of an SP group with a gradient through this rank's tokens only (the pooled
    scores of heads.py, `rl.row_sums`) that feed a loss computed the same on every rank and
    a backward through an engine that averages gradients over the whole world (DDP,
    DeepSpeed): that mean then gives the SUM over each SP group and the MEAN over the DP
    groups, while the loss value (what a trainer logs) stays the true one. The counterpart of
    `loss_for_world_average`, which scales the loss value itself."""
    if not isinstance(groups, ParallelGroups):
        raise TypeError("gradient_for_world_average needs init_sequence_parallel(...)'s groups (its sp_size), got "
                        f"{type(groups).__name__}")
    return values if groups.sp_size == 1 else _GradientTimes.apply(values, float(groups.sp_size))
