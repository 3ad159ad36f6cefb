"""Sequence parallelism inside TRL's `RewardTrainer` (docs/hf_rl.md, "TRL's RewardTrainer").

    from trl import RewardConfig, RewardTrainer
    from ulysses_kernels.hf import SequenceParallelRewardMixin

    class SPRewardTrainer(SequenceParallelRewardMixin, RewardTrainer):
        pass

    groups = ulysses_kernels.init_sequence_parallel(sp_size)   # after the process group exists
    trainer = SPRewardTrainer(model=model, args=RewardConfig(...), train_dataset=pairs,
                              processing_class=tokenizer, sp_groups=groups)

The model is a `*ForSequenceClassification` with ``num_labels=1`` loaded with
``attn_implementation="ulysses"`` (``ukhf.register(groups)`` first; a model path works too,
with ``RewardConfig(model_init_kwargs={"attn_implementation": "ulysses"})``). A run at
SP x DP is the DP-only run. TRL 1.16's RewardTrainer scores the right-padded
`[chosen; rejected]` rows with `model(**inputs).logits` and computes its loss (the margin,
`center_rewards_coefficient`) and metrics from those scores; while it does, the mixin
gives the model a forward that returns the same `[rows, 1]` scores from the
sequence-parallel forward:

* the padded rows are sharded along the sequence (`shard_batch`: unpadded into one packed
  row, each row a document, positions as the unsharded forward gives them);
* the model's head is transformers' generic sequence-classification head, which
  `register()` makes exact (heads.py): each row's score at its last token that is not the
  pad token, found over the whole sequence, the same value on every rank of the group,
  the gradient through this rank's tokens only; a family whose head is its own class is
  refused (guard.py, `head_problem`);
* the scores' gradient is multiplied by the SP size (`gradient_for_world_average`), so
  TRL's loss, the same on every rank of a group, with DDP / DeepSpeed averaging over the
  world gives the DP-only gradient, and the loss Trainer logs is the DP-only run's.

The data is sharded over the DP dimension only; TRL's metrics, and evaluation's losses and
scores (`compute_metrics` included), gather over it (`DataParallelView`). Refused with a
ValueError on every rank: model inputs other than the collator's `input_ids`,
`attention_mask`, `position_ids` and `margin` (images, token types), Liger's loss kernels
(`check_liger`), PEFT prompt learning. PEFT layer adapters (LoRA with the score head in
`modules_to_save`) train as without SP.
"""

import contextlib
import functools
from typing import Optional

import torch

from ...distributed.groups import ParallelGroups
from ..core.attach import sequence_parallel_model
from ..core.attention import register
from ..core.batch import shard_batch
from ..model import forward_replaced, unwrap
from ..training.data_parallel import DataParallelData, DataParallelView, check_groups
from ..training.experts import check_experts_train
from ..training.liger import check_liger
from ..training.loss import gradient_for_world_average

MIXIN = "SequenceParallelRewardMixin"
# What TRL's reward collator hands the model besides the tokens: the margin is read by the
# loss, not the model; the cache is off.
_NOT_MODEL_INPUTS = ("margin", "use_cache")


class SequenceParallelRewardMixin(DataParallelData):
    """Put before `RewardTrainer` in the bases; pass ``sp_groups=`` (the groups of
    `ulysses_kernels.init_sequence_parallel`). See the module doc."""

    def __init__(self, *args, sp_groups: Optional[ParallelGroups] = None, **kwargs):
        check_groups(MIXIN, sp_groups)
        self.sp_groups = sp_groups
        register(sp_groups)   # the attention's groups and the exact head (idempotent)
        super().__init__(*args, **kwargs)
        check_liger(MIXIN, self.args)
        check_experts_train(MIXIN, self.model)
        sequence_parallel_model(self.model, sp_groups)   # the model's context, checked (guard.py)
        self.check_world(MIXIN)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._as_data_parallel(), _sequence_parallel_scores(unwrap(model), self.sp_groups):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def evaluation_loop(self, *args, **kwargs):
        """Trainer's evaluation loop gathering losses and scores over the DP groups (every
        rank of an SP group holds the whole group's scores)."""
        view = DataParallelView(self.accelerator, self.sp_groups)
        gather = functools.partial(view.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object)
        saved, self.gather_function = self.gather_function, gather
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = saved


@contextlib.contextmanager
def _sequence_parallel_scores(inner, groups: ParallelGroups):
    """Within: `inner.forward` answers TRL's `model(**inputs)` (the padded `[rows, S]` batch)
    with the rows' scores from the sequence-parallel forward (the module doc)."""
    previous = inner.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        for name in _NOT_MODEL_INPUTS:
            kwargs.pop(name, None)
        # The output options a wrapper passes on (PEFT's passes its config's): the default ones
        # are what the forward below returns.
        for name, default in (("return_dict", True), ("output_attentions", False), ("output_hidden_states", False)):
            if kwargs.get(name) in (None, default):
                kwargs.pop(name, None)
        unsupported = sorted(k for k, v in kwargs.items() if v is not None)
        if unsupported or input_ids is None:
            raise ValueError(f"{MIXIN}: the reward model takes input_ids, attention_mask and position_ids here "
                             f"(got {unsupported or 'no input_ids'})")
        if position_ids is None:   # as the unsharded forward numbers them
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        batch = shard_batch(input_ids, groups, attention_mask=attention_mask, position_ids=position_ids)
        out = previous(**batch.model_inputs())
        out.logits = gradient_for_world_average(out.logits, groups)
        return out

    with forward_replaced(inner, forward, reads_labels=True):
        yield
