"""A global batch trained with the planner's placement and an SP size per micro-batch
(docs/global_batch.md; the placement: ulysses_kernels/global_batch.py).

    plan = uk.plan_global_batch([len(d) for d in documents], world=world, token_budget=budget)
    dynamic = ukhf.DynamicSequenceParallel(model, sizes=plan.sp_sizes())   # every rank, once
    loss = ukhf.train_global_batch(model, documents, plan, dynamic)       # then optimizer.step()

Every rank holds the whole list of documents (token tensors) and the same plan. In each
micro-batch the model runs on the SP groups of that micro-batch's size (consecutive ranks,
`init_sequence_parallel`'s): this rank's group packs its documents into one row (positions
restart per document, so no token attends across documents), `shard_batch` gives the rank
its slice, and the rank's summed token loss is divided by the label count of the WHOLE
global batch before its backward. Summing every rank's gradients over the world then gives
the gradient of the global batch's token mean, whatever the placement and the SP sizes: each
token's loss is counted once, on the rank that holds it, with the attention's exchange
carrying the other ranks' part. A group without documents in a micro-batch does nothing.
"""

import contextlib
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.groups import ParallelGroups, init_sequence_parallel
from ...global_batch import GlobalBatchPlan
from ..context import SequenceParallelContext, context_of
from ..core.attach import attach_context
from ..core.batch import IGNORE_INDEX, shard_batch
from .loss import causal_lm_loss
from .parallel import allreduce_gradients


class DynamicSequenceParallel:
    """The SP groups and the model's context of each SP size a plan may use. Built on every
    rank in the same order (creating process groups is collective)."""

    def __init__(self, model: nn.Module, sizes: Sequence[int]):
        self.model = model
        self.groups: Dict[int, ParallelGroups] = {s: init_sequence_parallel(s) for s in sorted(set(sizes))}
        self.contexts = {s: SequenceParallelContext(g) for s, g in self.groups.items()}

    @contextlib.contextmanager
    def size(self, sp: int):
        """Within: the model runs on the SP groups of size `sp`; after: the context it had."""
        if sp not in self.contexts:
            raise ValueError(f"DynamicSequenceParallel: no groups of SP size {sp} (built: {sorted(self.groups)})")
        previous = context_of(self.model)
        attach_context(self.model, context=self.contexts[sp])
        try:
            yield self.groups[sp]
        finally:
            if previous is not None and previous is not self.contexts[sp]:
                attach_context(self.model, context=previous)


def label_count(documents: Sequence[torch.Tensor]) -> int:
    """The targets of the global batch: each document's tokens but its first (a packed row's
    labels are its next tokens within the document)."""
    return sum(max(0, int(d.numel()) - 1) for d in documents)


def _packed(documents: List[torch.Tensor]):
    """One row of the documents, positions restarting per document, the first token of each
    without a target."""
    ids = torch.cat(documents).unsqueeze(0)
    positions = torch.cat([torch.arange(d.numel()) for d in documents]).unsqueeze(0)
    labels = ids.clone()
    start = 0
    for d in documents:
        labels[0, start] = IGNORE_INDEX   # shard_batch shifts: the target of the token before is dropped
        start += d.numel()
    return ids, positions.to(ids.device), labels


def train_global_batch(model: nn.Module, documents: Sequence[torch.Tensor], plan: GlobalBatchPlan,
                       dynamic: DynamicSequenceParallel, *, count: int = None) -> torch.Tensor:
    """Forward and backward of the whole global batch (module doc), then the gradients summed
    over the world. Returns the global batch's mean token loss (the same on every rank, no
    gradient). `count`: the label count the losses are divided by (default: this batch's;
    give the count of every accumulated batch to accumulate several before one step)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if plan.world != world:
        raise ValueError(f"train_global_batch: the plan is for {plan.world} ranks, the world has {world}")
    count = label_count(documents) if count is None else int(count)
    total = torch.zeros((), dtype=torch.float64)
    for mb in plan.micro_batches:
        mine = mb.groups[rank // mb.sp]
        if not mine:
            continue
        ids, positions, labels = _packed([documents[d] for d in mine])
        with dynamic.size(mb.sp) as groups:
            batch = shard_batch(ids, groups, labels=labels, position_ids=positions)
            local = (batch.labels != IGNORE_INDEX).sum()
            # The group's token mean, whose gradient is this rank's token sum over the group's
            # count (global_mean_from_sum): scaled to this rank's token sum over the batch's count.
            mean = causal_lm_loss(model, batch, groups)
            group_count = _group_count(local, groups)
            (mean * (group_count / count)).backward()
            if groups.sp_rank == 0:
                total += mean.detach().double().cpu() * group_count / count
    allreduce_gradients(model, sp_group=None, dp_group=None)   # SUM over the world
    if world > 1:
        dist.all_reduce(total)
    return total


def _group_count(local: torch.Tensor, groups: ParallelGroups) -> float:
    counted = local.detach().to(torch.float64).reshape(1).clone()
    if groups.sp_size > 1:
        dist.all_reduce(counted, group=groups.sp_group)
    return float(counted)
