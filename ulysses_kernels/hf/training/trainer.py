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
  Trainer logs, is the true global loss.
* **Vision-language models**: a VLM collator's images (`pixel_values`, `image_grid_thw`,
  `mm_token_type_ids`, ...) go to `shard_batch` with the tokens; ``sp_vision="split"``
  divides the vision tower's work over the SP group (vision.py).
* **Evaluation** runs the same sequence-parallel forward.
* **Checkpoints**: Trainer's own (model, optimizer, scheduler, RNG, data position); the
  data order depends only on the DP rank, so a resumed run continues the same curve.
* **DeepSpeed** (`TrainingArguments(deepspeed=...)`, ZeRO-2/3, also under `zero.Init`):
  the engine averages gradients over the whole world like DDP, so the same loss gives
  the SP sum and the DP mean (docs/deepspeed.md).
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

import contextlib
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...distributed.collectives import all_gather_tensor, gather_objects, max_over_ranks
from ...distributed.groups import ParallelGroups, collective_device, tensor_collective_device
from ...extensions import HF_INSTALL_HINT
from ...monitor import StepMonitor
from ..context import context_of
from ..core.attach import sequence_parallel_model
from ..core.attention import register
from ..core.batch import IGNORE_INDEX, count_targets, shard_batch
from ..families.vision_shard import check_vision_mode, vision_inputs
from .liger import check_liger
from .loss import at_least_float32
from .patch import is_loss_patched

# The minor versions of each integration the test suite ran on (pyproject.toml's `hf` extra
# spans them; tests/test_setup.py holds the two together).
TESTED_VERSIONS = {"transformers": ("5.24", "5.25"), "accelerate": ("1.15", "1.16"), "trl": ("1.16",), "peft": ("0.21",)}


def check_groups(mixin: str, sp_groups) -> None:
    """The groups a mixin needs, or a ValueError naming it."""
    if not isinstance(sp_groups, ParallelGroups):
        raise ValueError(f"{mixin} needs sp_groups=ulysses_kernels.init_sequence_parallel(sp) "
                         f"(got {type(sp_groups).__name__})")


class DataParallelData:
    """What every sequence-parallel trainer mixin shares: the data sharded over the DP
    dimension only, so the SP ranks of a group see the same batches (`sp_groups` set by the
    mixin), and counts summed over the DP groups."""

    sp_groups: ParallelGroups

    def check_world(self, mixin: str) -> None:
        if self.accelerator.num_processes != dist.get_world_size():
            raise ValueError(f"{mixin}: accelerate sees {self.accelerator.num_processes} "
                             f"processes, torch.distributed {dist.get_world_size()}")
        # accelerate's own sequence (DeepSpeed's ALST) or context parallelism on top of the
        # mixin's would shard the sequence twice and rescale the steps (Trainer.get_sp_size)
        config = getattr(self.accelerator, "parallelism_config", None)
        both = [f"{name}={getattr(config, name)}" for name in ("sp_size", "cp_size")
                if config is not None and (getattr(config, name, None) or 1) > 1]
        if both:
            raise ValueError(f"{mixin}: accelerate's own sequence parallelism is set too (ParallelismConfig "
                             f"{', '.join(both)}); the mixin shards the sequence itself: leave sp_size and cp_size "
                             "at 1 in the parallelism_config (or drop the mixin for accelerate's own)")

    @contextlib.contextmanager
    def _shard_over_dp(self):
        """Within: `accelerator.prepare(dataloader)` shards over the DP dimension only."""
        from accelerate.data_loader import prepare_data_loader

        acc = self.accelerator
        original = acc.prepare

        def prepare(*objects, **kwargs):
            if len(objects) != 1 or not isinstance(objects[0], torch.utils.data.DataLoader):
                return original(*objects, **kwargs)
            loader = prepare_data_loader(
                objects[0], acc.device, num_processes=self.sp_groups.dp_size, process_index=self.sp_groups.dp_rank,
                split_batches=acc.split_batches, put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(),
                dispatch_batches=acc.dispatch_batches, even_batches=acc.even_batches,
                use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
                non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader)
            acc._dataloaders.append(loader)   # as accelerate's own prepare does (state, skipping)
            return loader

        acc.prepare = prepare
        try:
            yield
        finally:
            acc.prepare = original

    def get_train_dataloader(self):
        with self._shard_over_dp():
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        with self._shard_over_dp():
            return super().get_eval_dataloader(eval_dataset)

    @contextlib.contextmanager
    def _as_data_parallel(self, module=None):
        """Within: `self.accelerator` is the `DataParallelView` (a DP-only run's gathers), and
        so are `module`'s own `gather` / `gather_object` (a trainer module that imported
        accelerate's functions, as TRL's do)."""
        accelerator = self.accelerator
        view = DataParallelView(accelerator, self.sp_groups)
        names = [n for n in ("gather", "gather_object") if module is not None and hasattr(module, n)]
        saved = {n: getattr(module, n) for n in names}
        self.accelerator = view
        for n in names:
            setattr(module, n, getattr(view, n))
        try:
            yield
        finally:
            self.accelerator = accelerator
            for n, f in saved.items():
                setattr(module, n, f)

    def _over_dp(self, *counts: int) -> torch.Tensor:
        """The sums of per-DP-group counts over the DP groups (every SP rank has them whole):
        one all-reduce."""
        t = torch.tensor(counts, dtype=torch.float64)
        group = self.sp_groups.dp_group
        if group is not None and dist.get_world_size(group) > 1:
            dev = collective_device(group)
            t = t.to(dev)
            dist.all_reduce(t, group=group)
        return t.cpu()


class DataParallelView:
    """An `Accelerator` as a DP-only run sees it: `gather`, `reduce` and the process index
    and count over the DP dimension (the SP ranks of a group hold the same rows, which a
    gather over the whole world would repeat); everything else is the accelerator's own.
    TRL's GRPO and DPO trainers compute advantages, token counts and metrics through these."""

    def __init__(self, accelerator, groups: ParallelGroups):
        self._accelerator, self._groups = accelerator, groups

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return self._groups.dp_rank

    @property
    def num_processes(self) -> int:
        return self._groups.dp_size

    def _group(self):
        group = self._groups.dp_group
        return group if group is not None and dist.get_world_size(group) > 1 else None

    def gather(self, tensor):
        """Every DP group's `tensor` concatenated on dim 0 (a scalar counts as `[1]`), as
        `Accelerator.gather` over a DP-only world; tensors in lists / dicts likewise."""
        def one(t):
            t = t.reshape(1) if t.dim() == 0 else t
            group = self._group()
            return t if group is None else torch.cat(all_gather_tensor(t, group), dim=0)
        return torch.utils._pytree.tree_map_only(torch.Tensor, one, tensor)

    def gather_for_metrics(self, tensor, use_gather_object: bool = False):
        """`Accelerator.gather_for_metrics` over the DP groups: the gather, then, on the last
        batch of a dataloader whose dataset does not divide into whole global batches, the
        samples the dataloader repeated to even the ranks dropped (the dataloaders are sharded
        over DP, so the remainder is a DP-only run's). Anything but tensors is gathered as
        objects, as accelerate does."""
        leaves = torch.utils._pytree.tree_leaves(tensor)
        use_gather_object = use_gather_object or not all(isinstance(t, torch.Tensor) for t in leaves)
        data = self.gather_object(tensor) if use_gather_object else self.gather(tensor)
        state = self._accelerator.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        if use_gather_object:
            return data[:state.remainder]
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t[:state.remainder], data)

    def gather_object(self, obj):
        """Every DP group's picklable `obj`, lists flattened (as `accelerate.utils.gather_object`)."""
        group = self._group()
        values = [obj] if group is None else gather_objects(obj, group)
        return [x for v in values for x in v] if isinstance(obj, list) else values

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """`Accelerator.reduce` over the DP groups: "sum" or "mean" (what TRL asks for)."""
        if reduction not in ("sum", "mean") or scale != 1.0:
            raise NotImplementedError(f"DataParallelView.reduce: reduction={reduction!r}, scale={scale} "
                                      "(only sum and mean, unscaled)")

        def one(t):
            group = self._group()
            out = t.clone()
            if group is not None:
                dev = tensor_collective_device(group, t)
                buf = out.to(dev)
                dist.all_reduce(buf, group=group)
                out = buf.to(t.device)
            return out / self.num_processes if reduction == "mean" else out
        return torch.utils._pytree.tree_map_only(torch.Tensor, one, tensor)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        """`tensor` padded along `dim` to the longest of the DP groups'."""
        group = self._group()
        if group is None:
            return tensor
        longest = max_over_ranks(tensor.shape[dim], group)
        missing = longest - tensor.shape[dim]
        if missing == 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        pad = tensor.new_full(shape, pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)


class SequenceParallelTrainerMixin(DataParallelData):
    """Put before `Trainer` / `SFTTrainer` in the bases; pass ``sp_groups=`` (the groups of
    `ulysses_kernels.init_sequence_parallel`). See the module doc."""

    def __init__(self, *args, sp_groups: Optional[ParallelGroups] = None, monitor: Union[bool, StepMonitor] = False,
                 sp_vision: str = "replicate", **kwargs):
        check_groups("SequenceParallelTrainerMixin", sp_groups)
        check_vision_mode(sp_vision)
        self.sp_groups = sp_groups
        self.sp_vision = sp_vision
        register(sp_groups)   # the attention's groups (idempotent)
        super().__init__(*args, **kwargs)
        sequence_parallel_model(self.model, sp_groups)   # the model's context, checked (guard.py)
        check_liger("SequenceParallelTrainerMixin", self.args)
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
        self.check_world("SequenceParallelTrainerMixin")
        self.step_tokens = self.step_seq_len = None
        self.monitor = monitor if isinstance(monitor, StepMonitor) else (self._make_monitor() if monitor else None)
        if self.monitor is not None:
            self.add_callback(monitor_callback(self, refresh_options=not isinstance(monitor, StepMonitor)))

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
        count = sum(self._count(b) for b in batch_samples)
        if self.monitor is None:
            return batch_samples, self._over_dp(count)[0]
        # with the monitor: also the step's tokens, each once, in the same all-reduce
        count, tokens = self._over_dp(count, sum(self._tokens(b) for b in batch_samples))
        self.step_tokens, self.step_seq_len = int(tokens), max(self._tokens(b) for b in batch_samples)
        return batch_samples, count

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
        loss = local_sum * (self.accelerator.num_processes / count).to(local_sum.dtype)
        return (loss, outputs) if return_outputs else loss


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
            trainer.monitor.step_done(trainer.step_tokens or 0, trainer.step_seq_len)

    return _StepMonitorCallback()
