"""PEFT adapters (LoRA, DoRA, LoRA on the embeddings) in TRL's trainers with and without the
sequence-parallel mixins (test_hf_peft.py): SFT, GRPO with its reference pass through the
disabled adapters, DPO with ``ref_model=None`` (the same), and a reward model's LoRA with
its score head saved whole. Spawned ranks import this module by name.

Every run draws its adapters' initial values from the same seed right before the trainer
(TRL wraps the model with `get_peft_model` in its __init__), so the SP x DP run and the
DP-only run start from the same adapters; SGD without clipping (trainer_cases.OPTIMIZER).
"""

import torch
from rl_trainer_cases import (
    _sequence_parallel_setup,
    dpo_args,
    grpo_args,
    preference_pairs,
    prompts,
    reward_args,
    reward_tokens,
    saved_and_loaded,
    scored_pairs,
    stubbed,
)
from trainer_cases import (
    finish,
    forget_deepspeed,
    initial_parameters,
    make_model,
    recording,
    sft_dataset,
    start_from_initial,
    tiny_tokenizer,
    trainer_args,
)

ADAPTER_SEED = 1234


def lora(kind="lora", task_type="CAUSAL_LM"):
    """The adapters of a run: LoRA on the attention and MLP projections; "dora" the same with
    DoRA's magnitudes; "embedding" LoRA on the token embeddings too."""
    from peft import LoraConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if kind == "embedding":
        targets = targets + ["embed_tokens"]
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, use_dora=kind == "dora",
                      task_type=task_type)


def _seeded(cls, **kwargs):
    torch.manual_seed(ADAPTER_SEED)   # the adapters' initial values, the same in every run
    return cls(**kwargs)


def adapters_and_base(trainer):
    """(losses, {name: parameter}) of a PEFT run, with the trainable (adapter) and frozen
    parameter names apart: ({...}, trainable names, frozen names)."""
    losses, params = finish(trainer)
    model = trainer.accelerator.unwrap_model(trainer.model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return (losses, params), sorted(trainable), sorted(set(params) - trainable)


def merged(trainer):
    """The base model's weights after `merge_and_unload()` (in place: the run is over)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.merge_and_unload().named_parameters()}


def run_sft(out, sp=None, kind="lora", tiled=False, **extra):
    """SFT with adapters of `kind`; `tiled`: the package's tiled MLPs and tiled loss
    (`patch_model`) on the model TRL then wraps (activation checkpointing stays on: SFTConfig's
    default)."""
    from trl import SFTTrainer

    forget_deepspeed()
    initial_parameters()
    args = trainer_args(out, sft=True, max_steps=2, **extra)
    kwargs = dict(args=args, train_dataset=sft_dataset(), processing_class=tiny_tokenizer(), peft_config=lora(kind))
    base, attention = _sequence_parallel_setup(SFTTrainer, "SequenceParallelTrainerMixin", sp, 1, kwargs)
    model = start_from_initial(make_model(attention))
    if tiled:
        from ulysses_kernels import hf as ukhf

        ukhf.patch_model(model, mlp_tile_tokens=4, loss_tile_tokens=4)
    trainer = _seeded(recording(base), model=model, **kwargs)
    trainer.train()
    return trainer


def run_grpo(out, sp=None, stub=True, **extra):
    from trl import GRPOTrainer

    forget_deepspeed()
    initial_parameters()
    args = grpo_args(out, beta=0.04, loss_type="grpo", **extra)   # the reference: the adapters disabled
    kwargs = dict(reward_funcs=reward_tokens, args=args, train_dataset=prompts(), processing_class=tiny_tokenizer(),
                  peft_config=lora())
    base, attention = _sequence_parallel_setup(GRPOTrainer, "SequenceParallelGRPOMixin", sp, 1, kwargs)
    model = saved_and_loaded(start_from_initial(make_model(attention)), out, attention)
    trainer = _seeded(recording(stubbed(base) if stub else base), model=model, **kwargs)
    trainer.train()
    return trainer


def run_dpo(out, sp=None, **extra):
    from trl import DPOTrainer

    forget_deepspeed()
    initial_parameters()
    args = dpo_args(out, **extra)
    kwargs = dict(args=args, train_dataset=preference_pairs(), processing_class=tiny_tokenizer(), peft_config=lora())
    base, attention = _sequence_parallel_setup(DPOTrainer, "SequenceParallelDPOMixin", sp, 1, kwargs)
    model = start_from_initial(make_model(attention))
    trainer = _seeded(recording(base), model=model, ref_model=None, **kwargs)   # the reference: adapters disabled
    trainer.train()
    return trainer


def run_reward(out, sp=None, **extra):
    from _tiny import tiny_reward_model
    from trl import RewardTrainer

    forget_deepspeed()
    args = reward_args(out, **extra)
    kwargs = dict(args=args, train_dataset=scored_pairs(), processing_class=tiny_tokenizer(),
                  peft_config=lora(task_type="SEQ_CLS"))
    base, attention = _sequence_parallel_setup(RewardTrainer, "SequenceParallelRewardMixin", sp, 1, kwargs)
    trainer = _seeded(recording(base), model=tiny_reward_model(attention).double(), **kwargs)
    trainer.train()
    return trainer


RUNS = {"sft": run_sft, "grpo": run_grpo, "dpo": run_dpo, "reward": run_reward}


def result(trainer, with_merge=False):
    """What a rank sends back: losses, parameters, which are trainable, the merged weights."""
    (losses, params), trainable, frozen = adapters_and_base(trainer)
    out = dict(losses=losses, params=params, trainable=trainable, frozen=frozen)
    if with_merge:
        out["merged"] = merged(trainer)
    return out
