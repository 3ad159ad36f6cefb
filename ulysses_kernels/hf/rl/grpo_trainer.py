"""Sequence parallelism inside TRL's `GRPOTrainer` (docs/hf_rl.md, "RL").

    from trl import GRPOConfig, GRPOTrainer
    from ulysses_kernels.hf import SequenceParallelGRPOMixin

    class SPGRPOTrainer(SequenceParallelGRPOMixin, GRPOTrainer):
        pass

    groups = ulysses_kernels.init_sequence_parallel(sp_size)   # after the process group exists
    trainer = SPGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                            sp_groups=groups)

The model is loaded with ``attn_implementation="ulysses"`` (``ukhf.register(groups)`` first).
A run at SP x DP is the DP-only run: what the mixin changes, through GRPOTrainer's own
methods (tested with TESTED_VERSIONS):

* **Prompts.** The SP ranks of a group take the same prompts (the data is sharded over
  the DP dimension only) and `generation_batch_size` is
  `per_device_train_batch_size x DP x steps_per_generation`, the DP-only run's.
* **Completions.** Generated with `ukhf.generate` (a long prompt's prefill is sequence
  parallel; sampling draws from one RNG stream per SP group, so a group's ranks hold the
  same completions), one call per run of identical prompts (GRPO's `num_generations`
  copies of a prompt: an unpadded batch). Not with vLLM or continuous batching.
* **Log-probs.** `_get_per_token_logps_and_entropies` shards the prompt+completion batch
  along the sequence (`shard_batch`; left-padded prompts and right-padded completions
  unpadded into one packed row, each row a document, positions as the unsharded forward
  gives them), runs `token_logprobs` (tiled LM head, TRL's temperature) and gathers the
  completion positions (`gather_tokens`). The gather's backward sums the gradient every
  rank sends to each shard, so TRL's own loss, the same on every rank of a group, with
  DDP / DeepSpeed averaging over the world gives the DP-only gradient.
* **Advantages, token counts, metrics** are TRL's, computed with gathers over the DP
  dimension (`DataParallelView`): a gather over the world would repeat each group's rows.

Set `steps_per_generation`, not `generation_batch_size`: TRL derives one from the other over
the whole world before the mixin sees them. Refused with a ValueError on every rank: vLLM,
continuous batching, `rollout_func`, tools and environments (each SP rank would run them on
its own), image inputs, MoE auxiliary losses, `cast_lm_head_to_fp32`, Liger's loss kernels
(`check_liger`). PEFT models train their adapters (the reference pass with the adapters
disabled is scored sequence-parallel too; prompt learning is refused). The old
and reference log-probs of a generation batch run as one packed forward (TRL chunks them by
`per_device_train_batch_size`).
"""

import contextlib
from typing import Optional

import torch
from transformers import set_seed

from ...distributed.collectives import broadcast_tensor
from ...distributed.groups import ParallelGroups
from ..core.attach import sequence_parallel_model
from ..core.attention import register
from ..core.batch import IGNORE_INDEX, gather_tokens, shard_batch
from ..inference.generation import generate as sp_generate
from ..training.data_parallel import DataParallelData, check_groups
from ..training.experts import check_experts_train
from ..training.liger import check_liger
from .logprobs import token_logprobs

MIXIN = "SequenceParallelGRPOMixin"


def _trl_module():
    """TRL's grpo_trainer module (it calls accelerate's `gather` / `gather_object` directly)."""
    import trl.trainer.grpo_trainer as module

    return module


def _training_arguments(args, kwargs):
    """GRPOTrainer's `args` (keyword, or its third positional argument)."""
    if kwargs.get("args") is not None:
        return kwargs["args"]
    if len(args) > 2 and args[2] is not None:
        return args[2]
    raise ValueError(f"{MIXIN} needs args=GRPOConfig(...) (its generation batch is set for the DP groups)")


def _check_arguments(config, groups: ParallelGroups) -> None:
    """What the mixin does not make sequence parallel, refused on every rank alike; the
    generation batch set to the DP-only run's."""
    if getattr(config, "use_vllm", False):
        raise ValueError(f"{MIXIN}: use_vllm=True is not supported (completions come from ukhf.generate)")
    if getattr(config, "use_transformers_continuous_batching", False):
        raise ValueError(f"{MIXIN}: continuous batching is not supported (completions come from ukhf.generate)")
    if getattr(config, "cast_lm_head_to_fp32", False):
        raise ValueError(f"{MIXIN}: cast_lm_head_to_fp32=True is not supported (the tiled head computes its "
                         "softmax in float32 from the model's own head)")
    config.generation_batch_size = config.per_device_train_batch_size * groups.dp_size * config.steps_per_generation
    if config.generation_batch_size % config.num_generations:
        raise ValueError(f"{MIXIN}: the generation batch (per_device_train_batch_size x DP x steps_per_generation "
                         f"= {config.generation_batch_size}) must be a multiple of num_generations "
                         f"({config.num_generations})")
    evaluates = getattr(config, "do_eval", False) and getattr(config, "eval_strategy", "no") != "no"
    eval_generations = getattr(config, "num_generations_eval", None) or config.num_generations
    if evaluates and (config.per_device_eval_batch_size * groups.dp_size) % eval_generations:
        raise ValueError(f"{MIXIN}: the eval batch (per_device_eval_batch_size x DP = "
                         f"{config.per_device_eval_batch_size * groups.dp_size}) must be a multiple of the eval "
                         f"generations ({eval_generations})")


def _identical_runs(prompts):
    """(start, end) of each run of equal consecutive prompts (token lists)."""
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            runs.append((start, i))
            start = i
    return runs


def completion_until_eos(tokens: torch.Tensor, eos_token_ids) -> list:
    """The tokens up to and including the first EOS (TRL's trimming of a generated row)."""
    ids = tokens.tolist()
    for i, t in enumerate(ids):
        if t in eos_token_ids:
            return ids[:i + 1]
    return ids


class SequenceParallelGRPOMixin(DataParallelData):
    """Put before `GRPOTrainer` in the bases; pass ``sp_groups=`` (the groups of
    `ulysses_kernels.init_sequence_parallel`). See the module doc."""

    def __init__(self, *args, sp_groups: Optional[ParallelGroups] = None, **kwargs):
        check_groups(MIXIN, sp_groups)
        self.sp_groups = sp_groups
        _check_arguments(_training_arguments(args, kwargs), sp_groups)
        register(sp_groups)   # the attention's groups (idempotent)
        super().__init__(*args, **kwargs)
        sequence_parallel_model(self.model, sp_groups)   # the model's context, checked (guard.py)
        self.check_world(MIXIN)
        # One RNG stream per SP group, the DP-only run's for its DP rank (GRPOTrainer seeds
        # each process with seed + process index).
        set_seed(self.args.seed + sp_groups.dp_rank)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(f"{MIXIN}: the MoE auxiliary loss (output_router_logits) is not supported")
        # Every rank has the same dataset and options: refused here, the same on every rank.
        columns = getattr(self.train_dataset, "column_names", None) or []
        if {"image", "images"} & set(columns):
            raise ValueError(f"{MIXIN}: image inputs are not supported (the dataset has {sorted(columns)})")
        # Each SP rank would run these on its own: its completions could differ from its group's.
        for name, what in (("rollout_func", "a rollout_func"), ("tools", "tools"),
                           ("environment_factories", "environment_factory")):
            if getattr(self, name, None):
                raise ValueError(f"{MIXIN}: {what} is not supported (an SP group's ranks must hold the same "
                                 "completions)")
        check_liger(MIXIN, self.args)
        check_experts_train(MIXIN, self.model)

    # ------------------------------------------------------------------ DP-only gathers

    def _generate_and_score_completions(self, inputs):
        with self._as_data_parallel(_trl_module()):
            out = super()._generate_and_score_completions(inputs)
        # TRL shuffles the generation batch next (torch's default generator): the SP ranks
        # of a group must draw the same permutation, whatever their forwards drew (dropout
        # over shards of different lengths).
        torch.set_rng_state(broadcast_tensor(torch.get_rng_state(), 0, self.sp_groups.sp_group))
        return out

    def _compute_loss(self, model, inputs):
        with self._as_data_parallel(_trl_module()):
            return super()._compute_loss(model, inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards, then the SP group's first rank's on every rank of the group: a
        reward function that is not deterministic (a judge model, a sandbox timeout) must not
        give the ranks of a group different advantages."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return broadcast_tensor(rewards, 0, self.sp_groups.sp_group)

    # ------------------------------------------------------------------ generation

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completions of `prompt_ids` (token lists), the same on every rank of the SP group:
        `ukhf.generate` on each run of identical prompts."""
        if images is not None or multimodal_fields:
            raise ValueError(f"{MIXIN}: image inputs are not supported")
        from trl.models import unwrap_model_for_generation

        device = self.accelerator.device
        completions = []
        with contextlib.ExitStack() as stack:
            model = stack.enter_context(unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs))
            stack.enter_context(torch.no_grad())
            stack.enter_context(self._dist.summon_full_params(self.model_wrapped, recurse=False))   # FSDP, as TRL
            for start, end in _identical_runs(prompt_ids):
                prompt = torch.tensor(prompt_ids[start:end], device=device)
                out = sp_generate(model, prompt, self.sp_groups, generation_config=self.generation_config)
                completions += [completion_until_eos(row, self.eos_token_ids)
                                for row in out[:, prompt.shape[1]:].cpu()]
        return completions, None

    # ------------------------------------------------------------------ log-probs

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's `[B, logits_to_keep]` log-probs (and entropies) of the completion tokens,
        from the sequence-parallel forward of this rank's shard (module doc)."""
        if any(v is not None for v in multimodal.values()):
            raise ValueError(f"{MIXIN}: image inputs are not supported")
        S = input_ids.shape[1]
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        labels[:, :S - logits_to_keep] = IGNORE_INDEX          # only the completion is scored
        positions = torch.arange(S, device=input_ids.device).expand_as(input_ids)   # as the unsharded forward
        batch = shard_batch(input_ids, self.sp_groups, labels=labels, attention_mask=attention_mask,
                            position_ids=positions)
        with self.accelerator.autocast():
            out = token_logprobs(model, batch, self.sp_groups, temperature=self.temperature,
                                 with_entropy=compute_entropy)
        logp, entropy = out if compute_entropy else (out, None)
        # labels[t] is token t + 1's: the completion's tokens S - K .. S - 1 are positions S - K - 1 .. S - 2
        keep = slice(S - logits_to_keep - 1, S - 1)
        logp = gather_tokens(logp, batch, self.sp_groups)[:, keep]
        if entropy is not None:
            entropy = gather_tokens(entropy, batch, self.sp_groups)[:, keep]
        return logp, entropy, None
