"""Heads that pool over the sequence, made exact under sequence parallelism (docs/hf_training.md,
"Sequence classification and reward models").

transformers' sequence-classification head (`GenericForSequenceClassification`, the class
of Llama's, Qwen's, Mistral's and most decoder families') scores every token and keeps, per
row, the score of the rightmost token that is not the pad token (`config.pad_token_id`;
without one, the last token, and a batch of one row). On a sequence shard each rank would
keep the rightmost token of its own slice of the packed sequence: one score per rank.

Sequence-parallel: the backbone and the score run on this rank's tokens; the row of each
token comes with the batch (`ulysses_rows=`, `shard_batch`'s `BatchRows`: padded rows are
unpadded into one packed row, so the row's rightmost valid token is its last one that is
not the pad token, left or right padding alike); each row's pooled position is the largest
candidate position over the SP group (one all-reduce of `[B]` integers, the Ulysses then the
ring group), and its score comes from the rank that holds it, summed over the group with the
losses' convention (`loss.sum_over_group`): the value is global on every rank, the gradient
flows through this rank's tokens only, so the same loss on every rank followed by
`allreduce_gradients` gives the one-device gradients. `labels=` gives transformers' own loss
on the pooled scores (the one-device loss, on every rank).

`register()` gives transformers' generic class this forward (`make_sequence_classification_exact`:
every family that inherits it, before any model's first call); it runs transformers' own
forward for a call without `ulysses_rows=` on one rank (a plain batch, as transformers takes
it). A family whose head is its own class stays refused (guard.py, `head_problem`).

Token classification (`GenericForTokenClassification`, a critic's value head with
`num_labels=1` too) is per token: its logits are this rank's tokens' as they are. Its loss
with `labels=` (this rank's tokens' labels, `batch.shard_tokens(labels)`) would be this
rank's mean; `make_token_classification_exact` gives the class a forward that returns
transformers' loss over the whole batch instead: the cross-entropy sum (in float32, as
transformers computes it) and the count of labels that are not -100, each summed over the
SP grid with the same convention.
"""

import functools
import inspect
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.groups import collective_device
from ..context import context_of
from ..groups import sum_over_group
from ..model import EXACT_HEADS, READS_LABELS, refusal
from .patches import set_attribute


def _unadapted_head(name: str, marks) -> Optional[type]:
    """transformers' generic head class `name` (modeling_layers) whose forward is not among
    `marks` yet (model.py's ForwardMarks), or None (adapted already, or another transformers: no head is
    adapted, the guard refuses them)."""
    try:
        import transformers.modeling_layers as layers
    except ImportError:
        return None
    generic = getattr(layers, name, None)
    return None if generic is None or generic.forward in marks else generic


def make_sequence_classification_exact() -> None:
    """Give transformers' `GenericForSequenceClassification` the sequence-parallel forward
    (the module doc); idempotent."""
    generic = _unadapted_head("GenericForSequenceClassification", EXACT_HEADS)
    if generic is None:
        return
    original = generic.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        context = context_of(self)
        if kwargs.get("ulysses_rows") is None and (context is None or context.sp_size == 1):
            return original(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        extra = arguments.pop("kwargs", {})
        arguments.pop("self")
        return sequence_parallel_forward(self, **arguments, **extra)

    EXACT_HEADS.add(forward)    # guard.head_problem lets it through
    READS_LABELS.add(forward)   # its loss is on the whole batch's scores (attach._check_labels)
    set_attribute(generic, "forward", forward, f"transformers.{generic.__name__}.forward")


def make_token_classification_exact() -> None:
    """Give transformers' `GenericForTokenClassification` a forward whose `labels=` loss is
    the whole batch's mean (the module doc); idempotent."""
    generic = _unadapted_head("GenericForTokenClassification", READS_LABELS)
    if generic is None:
        return
    original = generic.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        context = context_of(self)
        if labels is None or context is None or context.sp_size == 1:
            return original(self, *args, **kwargs)
        bound.arguments["labels"] = None   # this rank's logits; the loss below
        out = original(*bound.args, **bound.kwargs)
        logits = out[0] if isinstance(out, tuple) else out.logits
        loss = token_classification_loss(logits, labels, self.config.num_labels, context)
        if isinstance(out, tuple):   # return_dict=False: transformers puts the loss first
            return (loss, *out)
        out.loss = loss
        return out

    READS_LABELS.add(forward)   # its loss is the whole batch's (attach._check_labels)
    set_attribute(generic, "forward", forward, f"transformers.{generic.__name__}.forward")


def token_classification_loss(logits: torch.Tensor, labels: torch.Tensor, num_labels: int, context,
                              ignore_index: int = -100) -> torch.Tensor:
    """transformers' token-classification loss (cross-entropy in float32, the mean over the
    labels that are not `ignore_index`) over the whole batch, from this rank's `logits`
    `[b, s, num_labels]` and `labels` `[b, s]`: value global, gradient through this rank's
    tokens."""
    flat = logits.reshape(-1, num_labels).float()
    targets = labels.reshape(-1).to(flat.device)
    local = torch.stack([nn.functional.cross_entropy(flat, targets, ignore_index=ignore_index, reduction="sum"),
                         (targets != ignore_index).sum().to(flat.dtype)])
    total, count = _sum_over_sp(context, local)
    return total / count.detach().clamp_min(1.0)


def sequence_parallel_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                              labels=None, **kwargs):
    """transformers' sequence-classification forward over the whole batch, from this rank's
    tokens (the module doc): `logits` `[B, num_labels]` on every rank."""
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    rows = kwargs.get("ulysses_rows")
    if rows is None:
        raise refusal(self, "its head pools each row's last token, but the call did not say which row each token "
                            "of this rank's shard belongs to",
                      "Call it with ulysses_kernels.hf.shard_batch(...).model_inputs().")
    if input_ids is None:
        raise refusal(self, "its head finds each row's last token from input_ids (the pad token), not from "
                            "inputs_embeds", "Pass input_ids.")
    out = getattr(self, self.base_model_prefix)(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                                inputs_embeds=inputs_embeds, **kwargs)
    context = context_of(self)   # attached at the model's first call (context.meet_models_at_their_first_call)
    if context is None:
        raise refusal(self, "the model has no sequence-parallel context", "Call ulysses_kernels.hf.register(groups) "
                            "first, or ulysses_kernels.hf.attach_context(model, groups).")
    logits = self.score(out.last_hidden_state)
    lens = kwargs.get("ulysses_seq_lens") or context.forward_inputs.get("ulysses_seq_lens")
    pooled = pooled_scores(logits, input_ids, rows, self.config.get_text_config().pad_token_id, context, lens, self)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled, config=self.config)
    return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, hidden_states=out.hidden_states,
                                            attentions=out.attentions)


def pooled_scores(logits: torch.Tensor, input_ids: torch.Tensor, rows, pad_token_id: Optional[int], context, lens,
                  model: nn.Module) -> torch.Tensor:
    """`[B, L]`: each row's score at its rightmost token that is not `pad_token_id` (any
    token without one), from this rank's `logits` `[b, s, L]`: value global, gradient through
    this rank's tokens (the module doc)."""
    count = rows.count
    if pad_token_id is None and count != 1:   # transformers' own rule, the same on every rank
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
    positions = _global_positions(context, lens, input_ids.device)   # [s]
    candidate = positions.expand_as(input_ids) + 1
    if pad_token_id is not None:
        candidate = candidate.masked_fill(input_ids == pad_token_id, 0)
    row_of = rows.rows.to(input_ids.device)
    best = torch.zeros(count, dtype=torch.int64, device=input_ids.device)
    best = best.scatter_reduce(0, row_of.reshape(-1), candidate.reshape(-1), reduce="amax")
    best = _max_over_sp(context, best)
    empty = (best == 0).nonzero().flatten().tolist()
    if empty:
        raise refusal(model, f"row(s) {empty} of the batch hold no token other than the pad token "
                             f"({pad_token_id}): transformers would pool their first position, a padding one",
                      "Drop rows without content from the batch.")
    own = (candidate > 0) & (candidate == best[row_of])
    local = logits.new_zeros(count, logits.shape[-1]).index_add(0, row_of[own], logits[own])
    return _sum_over_sp(context, local)


def _global_positions(context, lens, device) -> torch.Tensor:
    """The position along the (packed) global sequence of each of this rank's tokens
    (`lens`: every SP rank's length)."""
    if lens is None:
        raise ValueError("ulysses_kernels.hf: the sequence-classification head needs every rank's length "
                         "(ulysses_seq_lens=, from shard_batch(...).model_inputs())")
    return torch.cat([torch.arange(start, start + n, device=device) for start, n in context.token_ranges(lens)])


def _max_over_sp(context, values: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum over the SP grid (integers: no gradient)."""
    for group in context.reduction_groups():
        shared = values.to(collective_device(group))
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
        values = shared.to(values.device)
    return values


def _sum_over_sp(context, local: torch.Tensor) -> torch.Tensor:
    """The sum over the SP grid, value global, gradient through `local` (`sum_over_group`
    per group: each keeps the gradient on what it was given)."""
    for group in context.reduction_groups():
        local = sum_over_group(local, group)
    return local
