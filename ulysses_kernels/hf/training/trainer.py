"""Sequence parallelism inside transformers' `Trainer` and TRL's `SFTTrainer`.

    from ulysses_kernels.hf import SequenceParallelTrainerMixin

    class SPTrainer(SequenceParallelTrainerMixin, SFTTrainer):   # or Trainer
        pass

    groups = ulysses_kernels.init_sequence_parallel(sp_size)   # after the process group exists
    trainer = SPTrainer(model=model, args=args, train_dataset=ds, sp_groups=groups)

The model must be loaded with ``attn_implementation="ulysses"`` (``ukhf.register(groups)``
first). What the mixin changes, through Trainer's public hooks where they exist:

* **Data.** Every rank of an SP group must see the same batch and DP groups different
  ones. The dataloaders are built by Trainer as usual, then sharded by accelerate's
  `prepare_data_loader` over the DP dimension only (`num_processes = dp_size`,
  `process_index = dp_rank`), so a DP x SP run sees exactly the batches of a DP-only run.
* **Loss.** `compute_loss` shards the batch along the sequence (`shard_batch`: labels, or
  a collator's pre-shifted `shift_labels`, shifted before sharding; packed documents from
  `position_ids`; a padded batch, an `attention_mask` with zeros, unpadded into one packed
  row), runs the model and sums the cross-entropy of this rank's tokens. The
  token count of the whole optimizer step (every micro-batch of the gradient-accumulation
  window, every DP group) is counted once per step (`get_batch_samples`), so the loss is
  the token-weighted mean of Trainer's own loss with `average_tokens_across_devices`.
  Each rank returns ``world * local_sum / count``: DDP and FSDP average gradients over the
  world, which turns that into the sum over SP ranks (their tokens partition the
  sequence) and the mean over DP; the mean of the returned values over the world, which
  Trainer logs, is the true global loss. A model transformers distributed
  (`distributed_config=`, on `ukhf.sequence_parallel_groups`' groups) reduces its gradients
  itself, summed over SP and averaged over the DP groups: its gradient is scaled by the DP
  groups instead, its logged value the same (docs/hf_training.md, "MoE and transformers'
  DistributedConfig").
* **Vision-language models**: a VLM collator's images (`pixel_values`, `image_grid_thw`,
  `mm_token_type_ids`, ...) go to `shard_batch` with the tokens; ``sp_vision="split"``
  divides the vision tower's work over the SP group (vision.py).
* **Evaluation** runs the same sequence-parallel forward.
* **Checkpoints**: Trainer's own (model, optimizer, scheduler, RNG, data position); the
  data order depends only on the DP rank, so a resumed run continues the same curve.
* **DeepSpeed** (`TrainingArguments(deepspeed=...)`, ZeRO-2/3, also under `zero.Init`):
  the engine averages gradients over the whole world like DDP, so the same loss gives
  the SP sum and the DP mean (docs/deepspeed.md).
* **Balanced global batches** (``global_batches=BalancedGlobalBatches(token_budget=...)``):
  every rank reads the whole global batch, the planner places its documents across the
  world with an SP size per micro-batch, and the gradients are summed once per step
  (global_batch.py, `GlobalBatchSteps`; docs/global_batch.md).
* **Monitor** (`monitor=True`, or a `StepMonitor`): every logged training step also
  carries, for the optimizer steps since the last log, `tokens_per_s` (each token once),
  the peak memory of every rank (`peak_mem_gib`, its minimum and the rank of the maximum)
  and the activations the planner expects (ulysses_kernels/monitor.py).

Padded batches (`DataCollatorWithPadding`, `DataCollatorForLanguageModeling`, TRL without
``padding_free``) take the same path: `shard_batch` drops the padding and packs the rows
into one row, each row a document of its own, and the step's token count is the count of
its valid targets (`count_targets`), so the run equals a DP-only run's token-weighted
mean with right padding. With left padding, Trainer's own loss also gives the last pad
of a row a target (the row's first token); the unpadded batch has no such target.
"""

from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...distributed.groups import ParallelGroups
from ...extensions import HF_INSTALL_HINT
from ...monitor import StepMonitor
from ..context import context_of
from ..core.attach import sequence_parallel_model
from ..core.attention import register
from ..core.batch import IGNORE_INDEX, count_targets, shard_batch
from ..families.vision.vision_shard import check_vision_mode, vision_inputs
from .data_parallel import DataParallelData, check_groups
from .distributed_config import is_transformers_distributed, tp_size_of
from .experts import check_experts_train
from .global_batch import BalancedGlobalBatches, GlobalBatchSteps, PlannedMicroStep
from .liger import check_liger
from .loss import at_least_float32, router_aux_loss
from .patch import is_loss_patched
from .router_loss import router_loss_of

# The minor versions of each integration the test suite ran on (pyproject.toml's `hf` extra
# spans them; tests/test_setup.py holds the two together).
TESTED_VERSIONS = {"transformers": ("5.24", "5.25"), "accelerate": ("1.15", "1.16"), "trl": ("1.16",), "peft": ("0.21",)}


class SequenceParallelTrainerMixin(DataParallelData):
    """Put before `Trainer` / `SFTTrainer` in the bases; pass ``sp_groups=`` (the groups of
    `ulysses_kernels.init_sequence_parallel`). See the module doc."""

    def __init__(self, *args, sp_groups: Optional[ParallelGroups] = None, monitor: Union[bool, StepMonitor] = False,
                 sp_vision: str = "replicate", global_batches: Optional[BalancedGlobalBatches] = None, **kwargs):
        check_groups("SequenceParallelTrainerMixin", sp_groups)
        check_vision_mode(sp_vision)
        self.sp_groups = sp_groups
        self.sp_vision = sp_vision
        register(sp_groups)   # the attention's groups (idempotent)
        super().__init__(*args, **kwargs)
        sequence_parallel_model(self.model, sp_groups)   # the model's context, checked (guard.py)
        check_liger("SequenceParallelTrainerMixin", self.args)
        check_experts_train("SequenceParallelTrainerMixin", self.model)
        # Hooks this relies on beyond Trainer's documented overrides: a clear error on a
        # transformers / accelerate without them (tested: TESTED_VERSIONS).
        missing = [what for what, ok in (
            ("Trainer.loss_is_scaled_for_ga", hasattr(self, "loss_is_scaled_for_ga")),
            ("Trainer.get_batch_samples", hasattr(super(), "get_batch_samples")),
            ("Accelerator._dataloaders", isinstance(getattr(self.accelerator, "_dataloaders", None), list)))
            if not ok]
        if missing:
            raise RuntimeError(f"SequenceParallelTrainerMixin needs {', '.join(missing)}; tested with "
                               f"{TESTED_VERSIONS} ({HF_INSTALL_HINT})")
        # The loss is computed here, normalised over the whole step: Trainer must neither
        # pass num_items_in_batch to the model nor divide by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = True
        self.check_world("SequenceParallelTrainerMixin", transformers_distributed=True)
        # The loss is scaled for the gradients' reduction (compute_loss): DDP, FSDP and
        # DeepSpeed average over the world; a model transformers distributed, on
        # sequence_parallel_groups' groups, sums over SP and averages over the DP groups.
        distributed = is_transformers_distributed(self.model)
        self.gradient_scale = sp_groups.dp_size if distributed else self.accelerator.num_processes
        # Trainer logs the mean over the world of the returned values; TP ranks return the same one
        self.log_scale = self.accelerator.num_processes / (tp_size_of(self.model) if distributed else 1)
        self.step_tokens = self.step_seq_len = self.step_plan = None
        self.global_batch_steps = self._global_batch_steps(global_batches) if global_batches is not None else None
        self.monitor = monitor if isinstance(monitor, StepMonitor) else (self._make_monitor() if monitor else None)
        if self.monitor is not None:
            self.add_callback(monitor_callback(self, refresh_options=not isinstance(monitor, StepMonitor)))

    def _global_batch_steps(self, options) -> GlobalBatchSteps:
        """Balanced global batches (docs/global_batch.md, "Inside Trainer and TRL's
        SFTTrainer"): the same clear error on every rank where the run's setup cannot take them."""
        from accelerate.utils import DistributedType

        where = "SequenceParallelTrainerMixin(global_batches=...)"
        engine = self.accelerator.distributed_type
        if engine in (DistributedType.DEEPSPEED, DistributedType.FSDP) or getattr(self, "is_fsdp_enabled", False):
            raise ValueError(f"{where}: not under {engine.value} (it reduces gradients and steps itself, while a "
                             "planned step runs its micro-batches at several SP sizes and sums the gradients once); "
                             "use DDP or one process")
        if is_transformers_distributed(self.model):
            raise ValueError(f"{where}: not on a model transformers distributed (distributed_config=): its FSDP "
                             "modules gather parameters over every fsdp rank, while a planned micro-batch runs on "
                             "some ranks only")
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError(f"{where}: not with an IterableDataset: accelerate dispatches its batches rank by rank, "
                             "and every rank must read the same global batch to plan it")
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return GlobalBatchSteps(self.model, options, world=world, rank=rank)

    def _make_monitor(self) -> StepMonitor:
        return StepMonitor(model=self.accelerator.unwrap_model(self.model), sp_size=self.sp_groups.sp_size,
                           ring_size=self.sp_groups.ring_size, device=self.args.device, **self.monitor_plan_options())

    def monitor_plan_options(self) -> dict:
        """The planner options of the model as it trains: its dtype, activation checkpointing
        (which Trainer turns on in train()), the tiles of patch_model and the attention path."""
        from ...api import resolve_path
        from ...monitor import plan_defaults
        from .patch import is_mlp_tiled

        model = self.accelerator.unwrap_model(self.model)
        context = context_of(model)
        path = resolve_path(context.backend if context is not None else None, self.args.device, distributed=True)
        return dict(plan_defaults(model), tiled_mlp=is_mlp_tiled(model), tiled_loss=is_loss_patched(model),
                    attention="reference" if path == "reference" else "flash")

    def log(self, logs, *args, **kwargs):
        """Trainer's log; a logged training step (every rank logs it) also gets the monitor's
        record of the steps since the last one (a collective)."""
        if self.monitor is not None and "loss" in logs and self.monitor.pending():
            logs.update(self.monitor.record().as_logs())
        return super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ loss

    @staticmethod
    def _targets(inputs):
        """(labels, already shifted?) of a batch."""
        if inputs.get("shift_labels") is not None:
            return inputs["shift_labels"], True
        if inputs.get("labels") is not None:
            return inputs["labels"], False
        return inputs["input_ids"], False

    @staticmethod
    def _count(inputs) -> int:
        """The batch's targets as `shard_batch` keeps them (none at padding or row ends)."""
        labels, shifted = SequenceParallelTrainerMixin._targets(inputs)
        return count_targets(labels, attention_mask=inputs.get("attention_mask"), labels_shifted=shifted)

    @staticmethod
    def _tokens(inputs) -> int:
        """The batch's tokens, padding left out."""
        mask = inputs.get("attention_mask")
        return int(mask.bool().sum()) if mask is not None else inputs["input_ids"].numel()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, None
        steps = self.global_batch_steps
        if steps is not None:   # the whole global batch, planned: one item per accumulation step
            items = steps.plan(batch_samples)
            self.step_tokens, self.step_seq_len, self.step_plan = steps.last_tokens, None, steps.last_plan
            return items, items[0].count
        count = sum(self._count(b) for b in batch_samples)
        if self.monitor is None:
            return batch_samples, self._over_dp(count)[0]
        # with the monitor: also the step's tokens, each once, in the same all-reduce
        count, tokens = self._over_dp(count, sum(self._tokens(b) for b in batch_samples))
        self.step_tokens, self.step_seq_len = int(tokens), max(self._tokens(b) for b in batch_samples)
        return batch_samples, count

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(inputs, PlannedMicroStep):
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        with self.compute_loss_context_manager():
            return self.global_batch_steps.run(inputs, device=self.args.device, backward=self.accelerator.backward)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, shifted = self._targets(inputs)
        mask = inputs.get("attention_mask")
        batch = shard_batch(inputs["input_ids"], self.sp_groups, position_ids=inputs.get("position_ids"),
                            labels=labels, labels_shifted=shifted, attention_mask=mask,
                            vision=self.sp_vision, **vision_inputs(inputs))
        count = num_items_in_batch if num_items_in_batch is not None else self._over_dp(self._count(inputs))[0]
        model_inputs = batch.model_inputs()
        if is_loss_patched(self.accelerator.unwrap_model(model)):
            outputs = model(**model_inputs, ulysses_labels=batch.labels)
            local_sum = outputs["loss"] if isinstance(outputs, dict) else outputs.loss
        else:
            outputs = model(**model_inputs)
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
            local_sum = F.cross_entropy(at_least_float32(logits).reshape(-1, logits.shape[-1]),
                                        batch.labels.reshape(-1).to(logits.device),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
        count = torch.clamp(torch.as_tensor(count, dtype=torch.float64), min=1.0)
        share = local_sum * (1.0 / count).to(local_sum.dtype)   # this rank's part of the step's token mean
        world, aux = self.log_scale, self._router_loss(model, outputs)
        # The value Trainer logs (its mean over the world): the token mean, plus the router
        # loss of each DP group's batch, each counted once over its SP ranks and weighed as the
        # trainer weighs a DP-only rank's (_router_loss).
        value = share * world + (aux * (world / self.sp_groups.sp_size) if aux is not None else 0.0)
        # The gradient, for the reduction (gradient_scale): the router loss's flows through
        # this rank's router probabilities (router_aux_loss), summed over the SP ranks.
        scaled = (share + (aux if aux is not None else 0.0)) * self.gradient_scale
        loss = value.detach() + (scaled - scaled.detach())
        return (loss, outputs) if return_outputs else loss

    def _router_loss(self, model, outputs) -> Optional[torch.Tensor]:
        """A mixture of experts' load-balancing loss times its coefficient, over the whole
        sequence of the SP group (`router_aux_loss`), where the model returns router logits
        and weighs them (`output_router_logits`, `router_aux_loss_coef`); else None. Weighed
        as in a DP-only run of the trainer it joins: TRL's SFTTrainer averages each rank's
        over the ranks and the accumulation steps; transformers' Trainer adds it to each
        rank's loss, which its token-mean scaling multiplies by the world: summed over the
        ranks and the steps."""
        router_logits = outputs.get("router_logits") if isinstance(outputs, dict) else getattr(
            outputs, "router_logits", None)
        terms = router_loss_of(self.accelerator.unwrap_model(model)) if router_logits is not None else None
        if terms is None:
            return None
        aux = terms.coefficient * router_aux_loss(router_logits, terms.num_experts, terms.top_k, self.sp_groups)
        if getattr(self, "aux_loss_enabled", None) is not None:   # TRL's trainers
            aux = aux / (self.sp_groups.dp_size * max(1, getattr(self, "current_gradient_accumulation_steps", 1)))
        return aux


def monitor_callback(trainer, refresh_options: bool = True):
    """A transformers `TrainerCallback` that times every optimizer step of `trainer` (a
    SequenceParallelTrainerMixin) with its monitor (locally; the mixin's `log` gathers the
    record of a logging interval). refresh_options: take the planner options again when
    training begins (Trainer turns checkpointing on in train())."""
    from transformers import TrainerCallback

    class _StepMonitorCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if refresh_options:
                trainer.monitor.options.update(trainer.monitor_plan_options())

        def on_step_begin(self, args, state, control, **kwargs):
            trainer.monitor.begin()

        def on_step_end(self, args, state, control, **kwargs):
            trainer.monitor.step_done(trainer.step_tokens or 0, trainer.step_seq_len, plan=trainer.step_plan)

    return _StepMonitorCallback()
