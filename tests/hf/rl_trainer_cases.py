"""What the TRL RL trainer tests (test_hf_rl_trainers.py) share: prompts of unequal lengths,
a reward, completions made identical in every run (the stubbed generation), and the GRPO
runs with and without sequence parallelism. Spawned ranks import this module by name.

SGD without clipping (trainer_cases.OPTIMIZER): a gradient scaled by a wrong factor moves
the parameters instead of hiding behind Adam's normalisation or the clip.
"""

import torch
from trainer_cases import (
    OPTIMIZER,
    finish,
    forget_deepspeed,
    initial_parameters,
    make_model,
    parameters,
    recording,
    start_from_initial,
    tiny_tokenizer,
)

EOS = 255                      # the tiny tokenizer's <eos>
N_PROMPTS, NUM_GENERATIONS = 8, 4
GRPO_STEPS = 2


def prompts():
    """Text prompts of 3 to 9 tokens (left-padded together by TRL)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 10, (N_PROMPTS,), generator=g)
    rows = [" ".join(f"t{int(t)}" for t in torch.randint(0, 200, (int(n),), generator=g)) for n in lengths]
    return Dataset.from_dict({"prompt": rows})


def reward_tokens(completions, **kwargs):
    """A reward with spread inside each prompt's group: the completion's share of even tokens."""
    rewards = []
    for text in completions:
        words = text.split()
        rewards.append(sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(1, len(words)))
    return rewards


def stub_completions(prompt_ids):
    """Completions that depend only on the prompt and its place in the local batch (the same
    in a DP-only run and at SP x DP): 2 to 7 tokens, every other one ending with EOS (right
    padding of unequal lengths follows)."""
    out = []
    for i, p in enumerate(prompt_ids):
        length = 2 + (sum(p) + 3 * i) % 6
        tokens = [(sum(p) * 7 + 13 * i + 5 * k) % 200 for k in range(length)]
        out.append(tokens[:-1] + [EOS] if i % 2 else tokens)
    return out


def stubbed(base):
    """`base` (a GRPOTrainer class) generating `stub_completions`."""
    class Stubbed(base):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            return stub_completions(prompt_ids), None
    return Stubbed


def saved_and_loaded(model, out, attention):
    """`model` saved by rank 0 under `out` and loaded back on every rank (its config then
    names a path, from which TRL builds the reference model)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    path = f"{out}/initial"
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).float()


def _common_args(out, options, extra):
    """What every RL run's TRL config shares (one step a log line, no saving, CPU, SGD
    without clipping: trainer_cases.OPTIMIZER), then the trainer's `options`, then the
    test's `extra` (each may override what comes before)."""
    import torch.distributed as dist

    return {**dict(output_dir=out, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                   disable_tqdm=True, bf16=False, ddp_backend="gloo" if dist.is_initialized() else None, **OPTIMIZER),
            **options, **extra}


def _sequence_parallel_setup(trl_class, mixin: str, sp, ring, kwargs):
    """(trainer class, attention implementation) of a run: TRL's class with eager attention
    when `sp` is None, else the package's `mixin` before it on SP `sp` (`ring` ring ranks)
    with the "ulysses" attention; `kwargs` gets the groups."""
    if sp is None:
        return trl_class, "eager"
    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    groups = uk.init_sequence_parallel(sp, ring_size=ring)
    ukhf.register(groups)
    kwargs["sp_groups"] = groups
    return type(f"SP{trl_class.__name__}", (getattr(ukhf, mixin), trl_class), {}), "ulysses"


def grpo_args(out, **extra):
    from trl import GRPOConfig

    return GRPOConfig(**_common_args(out, dict(per_device_train_batch_size=NUM_GENERATIONS,
                                               num_generations=NUM_GENERATIONS, steps_per_generation=2,
                                               max_completion_length=8, max_steps=GRPO_STEPS, temperature=0.7),
                                     extra))


def run_grpo(out, sp=None, stub=True, ring=1, **extra):
    """A GRPO run (DP only when `sp` is None, else SP `sp` (of which `ring` ring ranks) x
    DP world / sp), trained: (losses, params) as trainer_cases.finish, and the trainer."""
    from trl import GRPOTrainer

    forget_deepspeed()
    initial_parameters()
    args = grpo_args(out, **extra)
    kwargs = dict(reward_funcs=reward_tokens, args=args, train_dataset=prompts(), processing_class=tiny_tokenizer())
    base, attention = _sequence_parallel_setup(GRPOTrainer, "SequenceParallelGRPOMixin", sp, ring, kwargs)
    model = start_from_initial(make_model(attention))
    if args.beta != 0.0:   # TRL builds the reference model from the policy's path
        model = saved_and_loaded(model, out, attention)
    cls = recording(stubbed(base) if stub else base)
    trainer = cls(model=model, **kwargs)
    trainer.train()
    return finish(trainer), trainer


def preference_pairs():
    """Text preference pairs: prompts of 2 to 7 tokens, chosen and rejected completions of 1
    to 6 (the text collator right-pads every row of [chosen; rejected] together)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)

    def text(low, high):
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        return " ".join(f"t{int(t)}" for t in torch.randint(0, 200, (n,), generator=g))

    rows = [dict(prompt=text(2, 7), chosen=text(1, 6), rejected=text(1, 6)) for _ in range(N_PAIRS)]
    return Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})


N_PAIRS = 8


def dpo_args(out, **extra):
    from trl import DPOConfig

    return DPOConfig(**_common_args(out, dict(per_device_train_batch_size=2, max_steps=2, beta=0.5,
                                              loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5]), extra))


def run_dpo(out, sp=None, **extra):
    """A DPO run (sigmoid + 0.5 IPO; DP only when `sp` is None, else SP `sp` x DP world / sp),
    trained: (losses, params) as trainer_cases.finish, and the trainer."""
    from trl import DPOTrainer

    forget_deepspeed()
    initial_parameters()
    args = dpo_args(out, **extra)
    kwargs = dict(args=args, train_dataset=preference_pairs(), processing_class=tiny_tokenizer())
    base, attention = _sequence_parallel_setup(DPOTrainer, "SequenceParallelDPOMixin", sp, 1, kwargs)
    model = start_from_initial(make_model(attention))
    ref_model = start_from_initial(make_model(attention))
    trainer = recording(base)(model=model, ref_model=ref_model, **kwargs)
    trainer.train()
    return finish(trainer), trainer


def scored_pairs():
    """`preference_pairs` with a margin per pair (TRL's reward loss subtracts it)."""
    g = torch.Generator().manual_seed(9)
    return preference_pairs().add_column("margin", (torch.rand(N_PAIRS, generator=g) - 0.5).tolist())


def reward_args(out, **extra):
    from trl import RewardConfig

    # learning_rate: the LM tests' 0.5 makes the scores diverge
    return RewardConfig(**_common_args(out, dict(per_device_train_batch_size=2, per_device_eval_batch_size=3,
                                                 max_steps=2, center_rewards_coefficient=0.1, learning_rate=0.05),
                                       extra))


# The eval metrics a reward run is compared on (trainer_cases.compare: values that are no
# parameter).
REWARD_EVAL = ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward")
_REWARD_INITIAL = {}


def reward_initial_parameters():
    """The parameters every reward run starts from (the seeded tiny reward model): what
    compare measures the updates from."""
    from _tiny import tiny_reward_model

    if not _REWARD_INITIAL:
        _REWARD_INITIAL.update(parameters(tiny_reward_model("eager")))
    return _REWARD_INITIAL


def run_reward(out, sp=None, ring=1, **extra):
    """A RewardTrainer run (margins, centred rewards; DP only when `sp` is None, else SP `sp`
    (of which `ring` ring ranks) x DP world / sp), trained, then evaluated on 8 pairs in
    batches of 3 a rank (the last one uneven at DP 2): (losses, params) as trainer_cases.finish,
    with REWARD_EVAL among the params, and the trainer."""
    from _tiny import tiny_reward_model
    from trl import RewardTrainer

    forget_deepspeed()
    args = reward_args(out, **extra)
    kwargs = dict(args=args, train_dataset=scored_pairs(), processing_class=tiny_tokenizer())
    base, attention = _sequence_parallel_setup(RewardTrainer, "SequenceParallelRewardMixin", sp, ring, kwargs)
    trainer = recording(base)(model=tiny_reward_model(attention).double(), **kwargs)
    trainer.train()
    metrics = trainer.evaluate(eval_dataset=scored_pairs())
    losses, params = finish(trainer)
    params.update({name: torch.tensor(metrics[name], dtype=torch.float64) for name in REWARD_EVAL})
    return (losses, params), trainer
