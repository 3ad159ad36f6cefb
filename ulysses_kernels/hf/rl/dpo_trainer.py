"""Sequence parallelism inside TRL's `DPOTrainer` (docs/hf_rl.md, "RL").

    from trl import DPOConfig, DPOTrainer
    from ulysses_kernels.hf import SequenceParallelDPOMixin

    class SPDPOTrainer(SequenceParallelDPOMixin, DPOTrainer):
        pass

    groups = ulysses_kernels.init_sequence_parallel(sp_size)   # after the process group exists
    trainer = SPDPOTrainer(model=model, ref_model=ref_model, args=DPOConfig(...), train_dataset=pairs,
                           processing_class=tokenizer, sp_groups=groups)

Both models are loaded with ``attn_implementation="ulysses"`` (``ukhf.register(groups)``
first). A run at SP x DP is the DP-only run. TRL 1.16's DPOTrainer scores a batch with
`model(..., labels=, fused_lm_head=True)`, a forward that returns per-token fields (log-probs,
entropy, mean logits, top-1 hits) of the `[chosen; rejected]` rows; while the loss is
computed, the mixin gives the policy and the reference model a forward that returns the
same fields from the sequence-parallel forward:

* the padded rows are sharded along the sequence (`shard_batch`: unpadded into one packed
  row, each row a document, positions as the unsharded forward gives them);
* `token_fields` runs the tiled LM head on this rank's shard;
* `gather_tokens` brings each field back to `[rows, S - 1]` (TRL's layout). The gather's
  backward sums the gradient every rank sends to each shard, so TRL's own loss, the same
  on every rank of a group, with DDP / DeepSpeed averaging over the world gives the
  DP-only gradient.

The data is sharded over the DP dimension only and TRL's metrics gather over it
(`DataParallelView`). Refused with a ValueError: precomputed reference log-probs,
WPO weighting (`use_weighting`), MoE auxiliary losses, image inputs, `compute_metrics` (TRL
would run the model unsharded for its logits), Liger's loss kernels (`check_liger`). PEFT
models (TRL's `peft_config=`) train their adapters: the scoring forward is the transformers
model's under PEFT's wrappers, so with ``ref_model=None`` TRL's reference pass, with the
adapters disabled, is scored sequence-parallel too (prompt learning is refused, `peft_problem`).
"""

import contextlib
from typing import Optional

import torch

from ...distributed.groups import ParallelGroups
from ..core.attach import sequence_parallel_model
from ..core.attention import register
from ..core.batch import IGNORE_INDEX, gather_tokens, shard_batch
from ..model import forward_replaced, unwrap
from ..training.data_parallel import DataParallelData, check_groups
from ..training.experts import check_experts_train
from ..training.liger import check_liger
from .logprobs import token_fields

MIXIN = "SequenceParallelDPOMixin"
# The fields TRL's DPO loss and metrics read.
DPO_FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1")


def _dpo_module():
    """TRL's dpo_trainer module (for its accelerate helpers)."""
    import trl.trainer.dpo_trainer as module

    return module


def _check_arguments(config) -> None:
    refused = [(getattr(config, "precompute_ref_log_probs", False), "precompute_ref_log_probs=True"),
               (getattr(config, "use_weighting", False), "use_weighting=True (WPO)"),
               (getattr(config, "padding_free", False), "padding_free=True")]
    for on, what in refused:
        if on:
            raise ValueError(f"{MIXIN}: {what} is not supported")


class SequenceParallelDPOMixin(DataParallelData):
    """Put before `DPOTrainer` in the bases; pass ``sp_groups=`` (the groups of
    `ulysses_kernels.init_sequence_parallel`) and a ``ref_model``. See the module doc."""

    def __init__(self, *args, sp_groups: Optional[ParallelGroups] = None, **kwargs):
        check_groups(MIXIN, sp_groups)
        self.sp_groups = sp_groups
        config = kwargs.get("args") if kwargs.get("args") is not None else (args[2] if len(args) > 2 else None)
        if config is None:
            raise ValueError(f"{MIXIN} needs args=DPOConfig(...)")
        _check_arguments(config)
        register(sp_groups)   # the attention's groups (idempotent)
        super().__init__(*args, **kwargs)
        sequence_parallel_model(self.model, sp_groups)   # the models' contexts, checked (guard.py)
        if self.ref_model is not None:
            sequence_parallel_model(self.ref_model, sp_groups)
        self.check_world(MIXIN)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(f"{MIXIN}: the MoE auxiliary loss (router_aux_loss_coef) is not supported")
        if self.compute_metrics is not None:   # TRL would call the model unsharded for its logits
            raise ValueError(f"{MIXIN}: compute_metrics is not supported")
        check_liger(MIXIN, self.args)
        check_experts_train(MIXIN, self.model)
        columns = getattr(self.train_dataset, "column_names", None) or []   # the same on every rank
        if {"image", "images"} & set(columns):
            raise ValueError(f"{MIXIN}: image inputs are not supported (the dataset has {sorted(columns)})")

    def _compute_loss(self, model, inputs, return_outputs):
        models = [self.model] + ([self.ref_model] if self.ref_model is not None else [])
        with self._as_data_parallel(_dpo_module()), contextlib.ExitStack() as stack:
            for m in models:
                stack.enter_context(_sequence_parallel_scoring(unwrap(m), self.sp_groups))
            return super()._compute_loss(model, inputs, return_outputs)


def _sequence_parallel_scoring(inner, groups):
    """Within: `inner.forward` answers `fused_lm_head=True` calls from the sequence-parallel
    forward (module doc; its tiled head calls the backbone, never `inner.forward`); other
    calls go to the forward it had."""
    previous = inner.forward

    def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        if fused_lm_head:
            return _scored(inner, groups, labels, args, kwargs)
        return previous(*args, labels=labels, **kwargs) if labels is not None else previous(*args, **kwargs)

    return forward_replaced(inner, forward, reads_labels=True)


def _scored(inner, groups, labels, args, kwargs):
    """TRL's fused-head output of a `[rows, S]` batch (its fields `[rows, S - 1]`, position t
    scoring token t + 1) from the sequence-parallel forward."""
    if args:
        raise ValueError(f"{MIXIN}: the scoring forward takes keyword inputs only")
    input_ids, attention_mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask", None)
    kwargs.pop("use_cache", None)
    if any(v is not None for v in kwargs.values()):
        raise ValueError(f"{MIXIN}: model inputs {sorted(k for k, v in kwargs.items() if v is not None)} are not "
                         "supported (image inputs, router logits)")
    S = input_ids.shape[1]
    positions = torch.arange(S, device=input_ids.device).expand_as(input_ids)   # as the unsharded forward
    batch = shard_batch(input_ids, groups, labels=labels, attention_mask=attention_mask, position_ids=positions)
    fields = token_fields(inner, batch, groups, fields=DPO_FIELDS)
    full = {name: gather_tokens(value.float() if value.dtype == torch.bool else value, batch, groups)[:, :S - 1]
            for name, value in fields.items()}
    # TRL's own output class: DDP finds the tensors a forward returns in it (with
    # find_unused_parameters=True, tensors it cannot see would leave every parameter "unused"
    # and the backward would mark them ready a second time).
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput(loss=None, log_probs=full["log_probs"], entropy=full["entropy"],
                               mean_logits=full["mean_logits"], is_top1=full["is_top1"].bool(),
                               log_sum_sq_probs=None, label_mask=labels[:, 1:] != IGNORE_INDEX, aux_loss=None)
