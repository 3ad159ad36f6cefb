"""A global batch trained with the planner's placement and an SP size per micro-batch
(docs/global_batch.md; the placement: ulysses_kernels/global_batch.py).

    plan = uk.plan_global_batch([len(d) for d in documents], world=world, token_budget=budget)
    dynamic = ukhf.DynamicSequenceParallel(model, sizes=plan.sp_sizes())   # every rank, once
    loss = ukhf.train_global_batch(model, documents, plan, dynamic)       # then optimizer.step()

Every rank holds the whole list of documents (token tensors, or `Document`s with targets and
positions of their own: `global_batch_documents` of a collated batch) and the same plan. In
each micro-batch the model runs on the SP groups of that micro-batch's size (consecutive
ranks, `init_sequence_parallel`'s): this rank's group packs its documents into one row (each
token keeps its position and target; positions restart per document, so no token attends
across documents), `shard_batch` gives the rank its slice, and the rank's summed token loss
is divided by the label count of the WHOLE global batch before its backward. Summing every
rank's gradients over the world then gives the gradient of the global batch's token mean,
whatever the placement and the SP sizes: each token's loss is counted once, on the rank that
holds it, with the attention's exchange carrying the other ranks' part. A group without
documents in a micro-batch does nothing.

`GlobalBatchSteps` is the same inside transformers' `Trainer` (the mixin's
``global_batches=BalancedGlobalBatches(...)``): every rank reads the whole global batch,
plans it, and runs its micro-batches over Trainer's accumulation steps.
"""

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.groups import ParallelGroups, init_sequence_parallel
from ...global_batch import LLAMA3_8B, Cost, CostModel, GlobalBatchPlan, MicroBatch, plan_global_batch, sp_sizes_for
from ..context import SequenceParallelContext, context_of
from ..core.attach import attach_context
from ..core.batch import IGNORE_INDEX, given_positions, packed_row, padding_from_mask, shard_batch, shift_targets
from ..families.vision.vision_shard import has_images, vision_inputs
from .loss import causal_lm_loss
from .parallel import allreduce_gradients


class DynamicSequenceParallel:
    """The SP groups and the model's context of each SP size a plan may use. Built on every
    rank in the same order (creating process groups is collective); the model is checked at
    every size here (`attach_context`: the same ValueError on every rank for a size its
    heads or layers cannot take), not in the middle of a step.

    Each size is a ring x Ulysses grid by `init_sequence_parallel(ring_size="auto")`'s rule:
    the largest Ulysses degree the model's heads take that keeps each Ulysses group inside a
    node of `gpus_per_node` ranks (default the launcher's LOCAL_WORLD_SIZE), the rest a ring;
    a group inside one node whose heads split runs Ulysses alone."""

    def __init__(self, model: nn.Module, sizes: Sequence[int], *, gpus_per_node: Optional[int] = None):
        self.model = model
        heads = _head_counts(model)
        ring = dict(ring_size="auto", num_heads=heads[0], num_kv_heads=heads[1],
                    gpus_per_node=gpus_per_node) if heads else {}
        self.groups: Dict[int, ParallelGroups] = {s: init_sequence_parallel(s, **ring) for s in sorted(set(sizes))}
        self.contexts = {s: SequenceParallelContext(g) for s, g in self.groups.items()}
        previous = context_of(model)
        for context in self.contexts.values():
            attach_context(model, context=context)
        if previous is not None:
            attach_context(model, context=previous)

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


def _head_counts(model: nn.Module):
    """(query heads, key/value heads) of a transformers model's (text) config, or None."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    return heads, getattr(text, "num_key_value_heads", None) or heads


# ------------------------------------------------------------------ documents

@dataclass(frozen=True)
class Document:
    """One document of a global batch: its tokens `[n]`, each token's target `[n]` (what the
    token must predict; IGNORE_INDEX where nothing) and its positions `[n]` (None: 0 to n-1)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: Optional[torch.Tensor] = None

    @classmethod
    def of_tokens(cls, input_ids: torch.Tensor) -> "Document":
        """A document whose every token predicts the next (the last predicts nothing)."""
        targets = torch.full_like(input_ids, IGNORE_INDEX)
        targets[:-1] = input_ids[1:]
        return cls(input_ids, targets)

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def positions(self) -> torch.Tensor:
        return self.position_ids if self.position_ids is not None else torch.arange(len(self))

    @property
    def label_count(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def as_document(document: Union[Document, torch.Tensor]) -> Document:
    return document if isinstance(document, Document) else Document.of_tokens(document.reshape(-1))


def global_batch_documents(batch: Mapping) -> List[Document]:
    """The documents of a collated batch (a data collator's dict: `input_ids` `[B, S]`, and
    `attention_mask`, `position_ids`, `labels` or `shift_labels` as the collator gives
    them), each token with the position and target the mixin's sequence-parallel loss gives
    it (`shard_batch`'s rules): every row a document, padding dropped (a row's last token
    predicts nothing), rows of packed documents cut where their positions restart. Images
    are refused: a vision-language batch cannot be cut into documents apart from its images."""
    if has_images(vision_inputs(batch)):
        raise ValueError("global_batch_documents: the batch carries images; balanced global batches take text "
                         "documents only (train a vision-language model with the mixin's fixed SP groups)")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"global_batch_documents: input_ids must be [batch, seq], got {tuple(ids.shape)}")
    B, S = ids.shape
    shifted = batch.get("shift_labels") is not None
    labels = batch["shift_labels"] if shifted else batch.get("labels")
    labels = ids if labels is None else labels
    positions = given_positions(batch.get("position_ids"), B, S)
    padding = padding_from_mask(batch.get("attention_mask"), (B, S))
    if padding is not None:   # one packed row, each row a document at least (shard_batch's rules)
        ids, positions, targets, bounds = packed_row(ids, positions, labels, padding, shifted, IGNORE_INDEX)
        rows = [(ids[0], positions[0], targets[0], bounds.tolist() if bounds is not None else [0, ids.shape[1]])]
    else:
        targets = shift_targets(labels, labels_shifted=shifted)
        positions = positions if positions is not None else torch.arange(S, device=ids.device).expand(B, S)
        rows = [(ids[b], positions[b], targets[b], _document_bounds(positions[b])) for b in range(B)]
    documents = [Document(row_ids[a:b], row_targets[a:b], row_positions[a:b])
                 for row_ids, row_positions, row_targets, bounds in rows for a, b in zip(bounds[:-1], bounds[1:])]
    # Packed again in any order, a document is told from its neighbour by its positions
    # restarting: one that starts elsewhere could run on from the one before it.
    late = next((d for d in documents if len(d) and int(d.positions[0]) != 0), None)
    if late is not None:
        raise ValueError(f"global_batch_documents: a document starts at position {int(late.positions[0])}, not 0; "
                         "balanced global batches need every document's positions to start at 0 (packed next to "
                         "another document, one that continues a stream would run on from it)")
    return documents


def _document_bounds(positions: torch.Tensor) -> List[int]:
    """Where the documents of one row start (a position that does not follow the one before,
    transformers' rule), and its end."""
    p = positions.detach().cpu()
    starts = (torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1).tolist()
    return [0] + starts + [int(p.numel())]


def label_count(documents: Sequence[Union[Document, torch.Tensor]]) -> int:
    """The targets of the global batch (a token tensor's: its tokens but the first)."""
    return sum(as_document(d).label_count for d in documents)


def _packed(documents: List[Document]):
    """One row of the documents, each token with its own position and target."""
    ids = torch.cat([d.input_ids for d in documents]).unsqueeze(0)
    positions = torch.cat([d.positions.to(ids.device) for d in documents]).unsqueeze(0)
    targets = torch.cat([d.targets.to(ids.device) for d in documents]).unsqueeze(0)
    return ids, positions, targets


# ------------------------------------------------------------------ training

def run_micro_batch(model: nn.Module, documents: Sequence[Document], mb: MicroBatch, dynamic: DynamicSequenceParallel,
                    *, rank: int, count: int, device=None, backward=None) -> Optional[torch.Tensor]:
    """This rank's part of one micro-batch: forward and backward of its group's row (its
    token loss over the global batch's `count`). Returns the group's share of the global
    mean loss on the group's first rank, 0 on the others, None when the group has nothing.
    backward: how to run the backward (default `loss.backward()`)."""
    mine = mb.groups[rank // mb.sp]
    if not mine:
        return None
    ids, positions, targets = _packed([documents[d] for d in mine])
    if device is not None:
        ids, positions, targets = ids.to(device), positions.to(device), targets.to(device)
    with dynamic.size(mb.sp) as groups:
        batch = shard_batch(ids, groups, labels=targets, labels_shifted=True, position_ids=positions)
        local = (batch.labels != IGNORE_INDEX).sum()
        # The group's token mean, whose gradient is this rank's token sum over the group's
        # count (global_mean_from_sum): scaled to this rank's token sum over the batch's count.
        mean = causal_lm_loss(model, batch, groups)
        group_count = _group_count(local, groups)
        loss = mean * (group_count / count)
        (backward or torch.Tensor.backward)(loss)
        return loss.detach().double().cpu() if groups.sp_rank == 0 else torch.zeros((), dtype=torch.float64)


def train_global_batch(model: nn.Module, documents: Sequence[Union[Document, torch.Tensor]], plan: GlobalBatchPlan,
                       dynamic: DynamicSequenceParallel, *, count: int = None) -> torch.Tensor:
    """Forward and backward of the whole global batch (module doc), then the gradients summed
    over the world. Returns the global batch's mean token loss (the same on every rank, no
    gradient). `count`: the label count the losses are divided by (default: this batch's;
    give the count of every accumulated batch to accumulate several before one step)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if plan.world != world:
        raise ValueError(f"train_global_batch: the plan is for {plan.world} ranks, the world has {world}")
    documents = [as_document(d) for d in documents]
    count = max(1, label_count(documents) if count is None else int(count))   # no target: a zero loss, not 0 / 0
    total = torch.zeros((), dtype=torch.float64)
    for mb in plan.micro_batches:
        share = run_micro_batch(model, documents, mb, dynamic, rank=rank, count=count)
        if share is not None:
            total += share
    allreduce_gradients(model, sp_group=None, dp_group=None)   # SUM over the world
    if world > 1:
        dist.all_reduce(total)
    return total


def _group_count(local: torch.Tensor, groups: ParallelGroups) -> float:
    counted = local.detach().to(torch.float64).reshape(1).clone()
    if groups.sp_size > 1:
        dist.all_reduce(counted, group=groups.sp_group)
    return float(counted)


# ------------------------------------------------------------------ inside Trainer

@dataclass(frozen=True)
class BalancedGlobalBatches:
    """The Trainer mixin's option for balanced global batches (docs/global_batch.md):
    `token_budget` the tokens a rank holds in one micro-batch; `cost` the planner's cost
    model (default: `CostModel.for_model` from the model's config, Llama-3-8B's for a
    config without a dense decoder's sizes); `sp_sizes` the SP sizes allowed (default:
    every divisor of the world); `gpus_per_node` the ranks of a node (default the
    launcher's LOCAL_WORLD_SIZE): a larger group runs Ulysses inside each node and a ring
    across them (`DynamicSequenceParallel`), and the cost model knows it."""

    token_budget: int
    cost: Optional[Cost] = None
    sp_sizes: Optional[Sequence[int]] = None
    gpus_per_node: Optional[int] = None


def cost_model_of(config, node: int = 8) -> Cost:
    """`CostModel.for_model` from a transformers config (its text config for a VLM), or
    Llama-3-8B's when it lacks a dense decoder's sizes; `node` the ranks of a node."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = {name: getattr(text, name, None) for name in
             ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")}
    if any(not isinstance(v, int) for v in sizes.values()):
        return dataclasses.replace(LLAMA3_8B, node=node)
    heads = sizes["num_attention_heads"]
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or sizes["hidden_size"] // heads
    return CostModel.for_model(hidden=sizes["hidden_size"], layers=sizes["num_hidden_layers"], heads=heads,
                               kv_heads=kv_heads, head_dim=head_dim, intermediate=sizes["intermediate_size"],
                               node=node)


class PlannedMicroStep(dict):
    """One of Trainer's accumulation steps of a planned global batch: the micro-batches this
    step runs, in the plan's order. As a dict it holds `input_ids`, this rank's tokens in
    them, from which Trainer counts FLOPs and the tokens seen."""

    def __init__(self, documents: List[Document], micro_batches: List[MicroBatch], count: int, last: bool,
                 input_ids: torch.Tensor):
        super().__init__(input_ids=input_ids)
        self.documents, self.micro_batches, self.count, self.last = documents, micro_batches, count, last


class GlobalBatchSteps:
    """The mixin's side of balanced global batches: each optimizer step's batches (read by
    every rank whole) cut into documents and planned, the plan's micro-batches spread in
    order over Trainer's accumulation steps, each run on the model's SP groups of its size,
    the gradients summed over the world after the last."""

    def __init__(self, model: nn.Module, options: BalancedGlobalBatches, *, world: int, rank: int):
        if not isinstance(options, BalancedGlobalBatches):
            raise ValueError(f"global_batches= takes ulysses_kernels.hf.BalancedGlobalBatches(token_budget=...), got "
                             f"{type(options).__name__}")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
            raise ValueError("global_batches=: not with a mixture of experts' router loss yet (output_router_logits "
                             "with router_aux_loss_coef): the planned route weighs each micro-batch's by its tokens, "
                             "where Trainer and TRL weigh each rank's batch; set output_router_logits=False or train "
                             "without the option")
        self.options, self.world, self.rank, self.model = options, world, rank, model
        self.sizes = tuple(sorted(options.sp_sizes or sp_sizes_for(world)))
        node = options.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or world
        self.cost = options.cost or cost_model_of(model.config, node=node)
        self.dynamic = DynamicSequenceParallel(model, sizes=self.sizes, gpus_per_node=node)
        self.last_plan: Optional[GlobalBatchPlan] = None
        self.last_tokens = 0

    def plan(self, batches: List[Mapping]) -> List[PlannedMicroStep]:
        """One optimizer step's batches (every rank the same) -> one item per batch."""
        documents = [d for b in batches for d in global_batch_documents(b)]
        plan = plan_global_batch([len(d) for d in documents], world=self.world,
                                 token_budget=self.options.token_budget, sp_sizes=self.sizes, cost=self.cost)
        self.last_plan, self.last_tokens = plan, sum(len(d) for d in documents)
        count = max(1, label_count(documents))   # a step without targets: a zero loss, not 0 / 0
        # in the plan's order (the largest SP size first), as evenly as they go over the steps
        cuts = [round(i * len(plan.micro_batches) / len(batches)) for i in range(len(batches) + 1)]
        parts = [plan.micro_batches[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        return [PlannedMicroStep(documents, part, count, i == len(parts) - 1, self._local_tokens(documents, part))
                for i, part in enumerate(parts)]

    def _local_tokens(self, documents, micro_batches) -> torch.Tensor:
        pieces = []
        for mb in micro_batches:
            mine = mb.groups[self.rank // mb.sp]
            if mine:
                row = torch.cat([documents[d].input_ids for d in mine])
                pieces.append(torch.tensor_split(row, mb.sp)[self.rank % mb.sp])
        return torch.cat(pieces).unsqueeze(0) if pieces else torch.empty(1, 0, dtype=torch.long)

    def run(self, item: PlannedMicroStep, *, device, backward) -> torch.Tensor:
        """Trainer's training step of one item: its micro-batches, then (after the last item)
        the gradients summed over the world. Returns the value Trainer logs: `world` times
        this rank's share, so that its mean over the ranks is the global batch's mean loss."""
        total = torch.zeros((), dtype=torch.float64)
        for mb in item.micro_batches:
            share = run_micro_batch(self.model, item.documents, mb, self.dynamic, rank=self.rank, count=item.count,
                                    device=device, backward=backward)
            if share is not None:
                total += share
        if item.last:
            allreduce_gradients(self.model, sp_group=None, dp_group=None)   # SUM over the world
        return (total * self.world).to(device=device, dtype=torch.float32)
