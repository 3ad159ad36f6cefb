"""TRL's GRPOTrainer, DPOTrainer and RewardTrainer with their sequence-parallel mixins on CPU
with gloo.

GRPO at SP 2 x DP 2 must match, step for step, the DP-only run (2 ranks, the same prompts
and completions: the generation is stubbed in both), in the losses and the parameter
updates (SGD without clipping, rl_trainer_cases.py): left-padded prompts, right-padded
completions of unequal lengths, a temperature != 1, old log-probs recomputed
(steps_per_generation 2). Without the stub, completions come from ukhf.generate and are
the same on the ranks of an SP group. GRPO at SP 4 as a 2 x 2 ring equals one process; DPO
at SP 2 x DP 2 matches its DP-only run. RewardTrainer (margins, centred rewards, an
evaluation with an uneven last batch) at SP 2 x DP 2 matches its DP-only run, and at SP 4 as
a 2 x 2 ring one process.
"""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

from helpers import ROOT, SLOW_SPAWN_TIMEOUT, SpawnedRuns  # noqa: E402
from rl_trainer_cases import reward_initial_parameters, run_dpo, run_grpo, run_reward  # noqa: E402
from trainer_cases import compare_ranks, launch_env, shared_dir  # noqa: E402

slow = pytest.mark.slow  # TRL trainers in spawned groups
# GRPO with the KL to a reference model TRL builds from the policy's path, loss_type grpo
GRPO_KL = dict(beta=0.04, loss_type="grpo")


def sp_jobs(rank, world):
    import torch.distributed as dist

    launch_env(rank, world)
    out = {}
    out["grpo_sp2"], _ = run_grpo(shared_dir("grpo_sp2"), sp=2)
    _, trainer = run_grpo(shared_dir("grpo_generate"), sp=2, stub=False, max_steps=1, log_completions=False)
    completions = trainer._buffered_inputs[0]["completion_ids"]
    gathered = [None] * world
    dist.all_gather_object(gathered, completions.tolist())
    out["generated"] = gathered
    out["dpo_sp2"], _ = run_dpo(shared_dir("dpo_sp2"), sp=2)
    out["grpo_ring"], _ = run_grpo(shared_dir("grpo_ring"), sp=4, ring=2)
    out["grpo_kl_sp2"], _ = run_grpo(shared_dir("grpo_kl_sp2"), sp=2, **GRPO_KL)
    out["reward_sp2"], _ = run_reward(shared_dir("reward_sp2"), sp=2)
    out["reward_ring"], _ = run_reward(shared_dir("reward_ring"), sp=4, ring=2)
    # the examples' main() in this process group (what `accelerate launch` runs)
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import dpo_trl
    import grpo_trl
    import reward_trl

    out["examples"] = [grpo_trl.main(["--sp", "2", "--steps", "1", "--completion-length", "4",
                                      "--output-dir", shared_dir("grpo_example")]).global_step,
                       dpo_trl.main(["--sp", "2", "--steps", "1", "--output-dir", shared_dir("dpo_example")]).global_step,
                       reward_trl.main(["--sp", "2", "--steps", "1",
                                        "--output-dir", shared_dir("reward_example")]).global_step]
    return out


def dp_reference_jobs(rank, world):
    launch_env(rank, world)
    if world == 1:   # the reference of SP 4 (a 2 x 2 ring) x DP 1
        return {"grpo": run_grpo(shared_dir("grpo_ref1"))[0], "reward": run_reward(shared_dir("reward_ref1"))[0]}
    return {"grpo": run_grpo(shared_dir("grpo_ref"))[0], "dpo": run_dpo(shared_dir("dpo_ref"))[0],
            "grpo_kl": run_grpo(shared_dir("grpo_kl_ref"), **GRPO_KL)[0],
            "reward": run_reward(shared_dir("reward_ref"))[0]}


_run = SpawnedRuns(lambda world: (sp_jobs if world == 4 else dp_reference_jobs, ()), timeout=SLOW_SPAWN_TIMEOUT)


@slow
def test_grpo_sp2_dp2_matches_dp_only_run():
    reference = _run(2)[0]["grpo"]
    errors = compare_ranks(_run(4), "grpo_sp2", reference)
    assert not errors, "\n".join(errors)


@slow
def test_grpo_with_a_reference_model_matches_dp_only_run():
    """beta 0.04, loss_type grpo: the reference model TRL loads from the policy's path (with
    the policy's "ulysses" attention) is scored sequence-parallel too."""
    reference = _run(2)[0]["grpo_kl"]
    errors = compare_ranks(_run(4), "grpo_kl_sp2", reference)
    assert not errors, "\n".join(errors)


@slow
def test_grpo_with_a_ring_matches_one_process():
    """SP 4 as Ulysses 2 x ring 2 (DP 1) equals the one-process run on the same prompts."""
    reference = _run(1)[0]["grpo"]
    errors = compare_ranks(_run(4), "grpo_ring", reference)
    assert not errors, "\n".join(errors)


@slow
def test_grpo_generation_gives_an_sp_group_the_same_completions():
    """ukhf.generate: ranks 0, 1 (SP group 0) hold the same completions, ranks 2, 3 likewise;
    the two DP groups' prompts differ, so their completions do."""
    generated = _run(4)[0]["generated"]
    assert generated[0] == generated[1] and generated[2] == generated[3], generated
    assert generated[0] != generated[2], generated


@slow
def test_dpo_sp2_dp2_matches_dp_only_run():
    """DPO (sigmoid + 0.5 IPO, beta 0.5) with a reference model: left-padded prompts and
    right-padded completions of unequal lengths, [chosen; rejected] rows sharded together."""
    reference = _run(2)[0]["dpo"]
    errors = compare_ranks(_run(4), "dpo_sp2", reference)
    assert not errors, "\n".join(errors)


@slow
def test_reward_sp2_dp2_matches_dp_only_run():
    """A reward model (Llama's generic one-score head) trained with margins and centred
    rewards, then evaluated on 8 pairs in batches of 3 a rank: the losses, every parameter
    and the eval loss, accuracy, margin and mean reward are the DP-only run's."""
    reference = _run(2)[0]["reward"]
    errors = compare_ranks(_run(4), "reward_sp2", reference, initial=reward_initial_parameters())
    assert not errors, "\n".join(errors)


@slow
def test_reward_with_a_ring_matches_one_process():
    """SP 4 as Ulysses 2 x ring 2: rows whose last token sits on any of the 4 ranks."""
    reference = _run(1)[0]["reward"]
    errors = compare_ranks(_run(4), "reward_ring", reference, initial=reward_initial_parameters())
    assert not errors, "\n".join(errors)


@slow
def test_rl_examples_train():
    """examples/grpo_trl.py, dpo_trl.py and reward_trl.py's main() at SP 2 x DP 2 in the
    spawned group (`accelerate launch --config_file examples/accelerate_cpu.yaml
    examples/grpo_trl.py --sp 2` runs the same): a step each."""
    assert all(result["examples"] == [1, 1, 1] for result in _run(4)), [r["examples"] for r in _run(4)]


def test_mixins_refuse_what_they_do_not_make_sequence_parallel():
    """The options the mixins do not make sequence parallel raise a ValueError naming them
    (before any process group work: every rank raises the same), and GRPO's generation batch
    is the DP-only run's (per device x DP x steps per generation)."""
    import types

    from trl import DPOConfig, GRPOConfig

    from ulysses_kernels.hf.rl import dpo_trainer, grpo_trainer

    groups = types.SimpleNamespace(dp_size=3)
    common = dict(output_dir="/tmp/uk_unused", use_cpu=True, report_to=[], per_device_train_batch_size=4,
                  num_generations=4)
    for option, match in ((dict(use_vllm=True), "use_vllm"),
                          (dict(use_transformers_continuous_batching=True), "continuous batching"),
                          (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32")):
        with pytest.raises(ValueError, match=match):
            grpo_trainer._check_arguments(GRPOConfig(**{**common, **option}), groups)
    config = GRPOConfig(**common, do_eval=True, eval_strategy="steps", per_device_eval_batch_size=2,
                        num_generations_eval=2)
    config.num_generations_eval = 4   # TRL checked 2 x world (here 1); at DP 3 an eval batch is 6 rows
    with pytest.raises(ValueError, match=r"the eval batch \(per_device_eval_batch_size x DP = 6\)"):
        grpo_trainer._check_arguments(config, groups)
    config = GRPOConfig(**common)
    config.num_generations = 8     # TRL checked it against 4 x world (here 1); at DP 3: 12 prompts
    with pytest.raises(ValueError, match="multiple of num_generations"):
        grpo_trainer._check_arguments(config, groups)
    config = GRPOConfig(**common, steps_per_generation=2)
    grpo_trainer._check_arguments(config, groups)
    assert config.generation_batch_size == 4 * 3 * 2
    for option, match in ((dict(precompute_ref_log_probs=True), "precompute_ref_log_probs"),
                          (dict(use_weighting=True), "use_weighting"), (dict(padding_free=True), "padding_free")):
        with pytest.raises(ValueError, match=match):
            dpo_trainer._check_arguments(DPOConfig(output_dir="/tmp/uk_unused", use_cpu=True, report_to=[], **option))
    with pytest.raises(ValueError, match="needs sp_groups"):
        type("T", (grpo_trainer.SequenceParallelGRPOMixin, object), {})(sp_groups=None)


def test_reward_mixin_refuses_inputs_it_does_not_shard():
    """The reward mixin needs its groups, and its scoring forward takes the collator's tokens,
    mask and positions only: token types, embeddings or images raise a ValueError naming them
    before any collective (every rank of the group is handed the same batch, so all raise)."""
    import torch
    from _tiny import tiny_reward_model

    from ulysses_kernels.hf.rl import reward_trainer

    with pytest.raises(ValueError, match="needs sp_groups"):
        type("T", (reward_trainer.SequenceParallelRewardMixin, object), {})(sp_groups=None)
    model = tiny_reward_model("eager")
    ids = torch.randint(0, 200, (2, 5))
    with reward_trainer._sequence_parallel_scores(model, groups=None):
        for extra, match in ((dict(token_type_ids=torch.zeros_like(ids)), "token_type_ids"),
                             (dict(input_ids=None, inputs_embeds=torch.randn(2, 5, 64)), "inputs_embeds"),
                             (dict(pixel_values=torch.randn(2, 3, 4, 4)), "pixel_values")):
            with pytest.raises(ValueError, match=match):
                model(**{"input_ids": ids, "attention_mask": torch.ones_like(ids), **extra})
    assert "forward" not in vars(model)   # the model's own forward again
