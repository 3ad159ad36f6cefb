"""The data side every sequence-parallel trainer mixin shares (the Trainer mixin, and the RL
mixins for GRPO, DPO and reward training): the dataloaders sharded over the DP dimension only,
so the SP ranks of a group see the same batches, counts summed over the DP groups, and an
`Accelerator` view whose gathers and process index are a DP-only run's."""

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from ...distributed.collectives import all_gather_tensor, gather_objects, max_over_ranks
from ...distributed.groups import ParallelGroups, collective_device, tensor_collective_device
from .distributed_config import check_transformers_distributed, is_transformers_distributed


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

    def check_world(self, mixin: str, *, transformers_distributed: bool = False) -> None:
        """The world the mixin can train in, or the same ValueError on every rank.
        transformers_distributed: the mixin trains a model transformers distributed
        (`distributed_config=`) on `ukhf.sequence_parallel_groups`' groups."""
        if is_transformers_distributed(self.model):
            if not transformers_distributed:
                raise ValueError(f"{mixin}: the model was distributed by transformers (from_pretrained(..., "
                                 "distributed_config=...)); this mixin does not train such a model yet (its loss is "
                                 "scaled for DDP's and DeepSpeed's mean over the world, not for the model's FSDP "
                                 "modules): use SequenceParallelTrainerMixin, or ukhf.sequence_parallel_groups and "
                                 "causal_lm_loss in a loop of your own (docs/hf_training.md, \"MoE and "
                                 "transformers' DistributedConfig\")")
            check_transformers_distributed(mixin, self.model, self.sp_groups)
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
    def _shard_over_dp(self, num_processes: Optional[int] = None, process_index: Optional[int] = None):
        """Within: `accelerator.prepare(dataloader)` shards over the DP dimension only (or
        over `num_processes`, this rank being `process_index`)."""
        from accelerate.data_loader import prepare_data_loader

        acc = self.accelerator
        original = acc.prepare
        num_processes = self.sp_groups.dp_size if num_processes is None else num_processes
        process_index = self.sp_groups.dp_rank if process_index is None else process_index

        def prepare(*objects, **kwargs):
            if len(objects) != 1 or not isinstance(objects[0], torch.utils.data.DataLoader):
                return original(*objects, **kwargs)
            loader = prepare_data_loader(
                objects[0], acc.device, num_processes=num_processes, process_index=process_index,
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
        steps = getattr(self, "global_batch_steps", None)
        if steps is None:
            with self._shard_over_dp():
                return super().get_train_dataloader()
        # Balanced global batches: every rank reads every rank's batches (one batch of
        # `world` times the size per accumulation step: the samples the DP ranks of a plain
        # run read in that step), so that each rank can plan the whole global batch.
        size = self._train_batch_size
        self._train_batch_size = size * steps.world
        try:
            with self._shard_over_dp(num_processes=1, process_index=0):
                return super().get_train_dataloader()
        finally:
            self._train_batch_size = size

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
