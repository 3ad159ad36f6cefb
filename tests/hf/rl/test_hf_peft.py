"""PEFT adapters under the sequence-parallel mixins (CPU, gloo, world 4 against world 2):
TRL's SFTTrainer (LoRA, DoRA, LoRA on the embeddings), GRPOTrainer (the KL to the reference
pass with the adapters disabled), DPOTrainer (``ref_model=None``: the same) and
RewardTrainer (LoRA with the score head saved whole) at SP 2 x DP 2 against the same
trainers without SP at DP 2: two steps, equal losses and every adapter parameter, the base
weights untouched on both, and `merge_and_unload()` giving the same weights. Prompt learning
is refused on every rank; Liger's loss kernels are refused, its layer kernels accepted."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("peft")

from helpers import SLOW_SPAWN_TIMEOUT, SpawnedRuns, rel_err  # noqa: E402
from trainer_cases import launch_env, shared_dir  # noqa: E402

JOBS = ("sft", "sft_dora", "sft_embedding", "grpo", "dpo", "reward")
# At SP 2 only, compared with the DP-only run of the job after the colon.
SP_ONLY = {"sft_tiled": "sft"}
TOL = 1e-5


def _job(name, out, sp):
    import peft_cases

    if name == "sft_tiled":
        return peft_cases.result(peft_cases.run_sft(out, sp=sp, tiled=True), with_merge=True)
    kind = name.split("_", 1)[1] if name.startswith("sft_") else "lora"
    if name.startswith("sft"):
        return peft_cases.result(peft_cases.run_sft(out, sp=sp, kind=kind), with_merge=True)
    return peft_cases.result(peft_cases.RUNS[name](out, sp=sp), with_merge=name == "dpo")


def peft_jobs(rank, world):
    launch_env(rank, world)
    sp = 2 if world == 4 else None
    results = {name: _job(name, shared_dir(f"peft_{name}_{world}"), sp) for name in JOBS}
    if sp is not None:
        results.update({name: _job(name, shared_dir(f"peft_{name}_{world}"), sp) for name in SP_ONLY})
    results["prompt_tuning"] = _prompt_tuning_refusal() if world == 4 else None
    results["generated"] = _generated(rank, world) if world == 4 else None
    results["example"] = _example() if world == 4 else None
    results["liger"] = _liger_refusal() if world == 4 else None
    return results


def _liger_refusal():
    """Trainer (Liger's fused linear cross-entropy on by default) under the mixin with
    use_liger_kernel=True: the error each rank raised, before Liger is applied (train())."""
    from trainer_cases import run_sp

    try:
        run_sp("trainer", 2, shared_dir("peft_liger"), use_liger_kernel=True)
    except ValueError as exc:
        return str(exc)
    return None


def _example():
    """examples/lora_trl.py's main() in the spawned group (what `accelerate launch` runs)."""
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import lora_trl

    return lora_trl.main(["--sp", "2", "--steps", "1", "--output-dir", shared_dir("peft_example")])


def _generated(rank, world):
    """One GRPO step with LoRA and real generation (`ukhf.generate` through PEFT's wrapper):
    every rank's completions."""
    import peft_cases
    import torch.distributed as dist

    trainer = peft_cases.run_grpo(shared_dir("peft_grpo_generate"), sp=2, stub=False, max_steps=1,
                                  log_completions=False)
    gathered = [None] * world
    dist.all_gather_object(gathered, trainer._buffered_inputs[0]["completion_ids"].tolist())
    return gathered


def _prompt_tuning_refusal():
    """SFT with a prompt-tuning adapter under the mixin: the error each rank raised."""
    from peft import PromptTuningConfig
    from rl_trainer_cases import _sequence_parallel_setup
    from trainer_cases import make_model, sft_dataset, tiny_tokenizer, trainer_args
    from trl import SFTTrainer

    kwargs = dict(args=trainer_args(shared_dir("peft_prompt"), sft=True, max_steps=1), train_dataset=sft_dataset(),
                  processing_class=tiny_tokenizer(),
                  peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    base, attention = _sequence_parallel_setup(SFTTrainer, "SequenceParallelTrainerMixin", 2, 1, kwargs)
    try:
        base(model=make_model(attention), **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


_run = SpawnedRuns(lambda world: (peft_jobs, ()), timeout=2 * SLOW_SPAWN_TIMEOUT)


def _base_name(name: str) -> str:
    """A frozen PEFT parameter's name in the plain model ("base_model.model." and LoRA's
    ".base_layer" dropped)."""
    return name.replace("base_model.model.", "", 1).replace(".base_layer", "")


def _errors(job, got, want, initial):
    errors = []
    if got["trainable"] == want["trainable"] and got["trainable"]:
        worst = max(rel_err(got["params"][n], want["params"][n]) for n in got["trainable"])
        print(f"{job}: losses rel err {rel_err(got['losses'], want['losses']):.2e}, worst adapter rel err "
              f"{worst:.2e} over {len(got['trainable'])} adapter tensors")
    if got["trainable"] != want["trainable"] or not got["trainable"]:
        return [f"{job}: trainable parameters {got['trainable'][:4]}... vs {want['trainable'][:4]}..."]
    if not rel_err(got["losses"], want["losses"]) < TOL:
        errors.append(f"{job}: losses {got['losses'].tolist()} vs {want['losses'].tolist()}")
    for name in got["trainable"]:
        if not rel_err(got["params"][name], want["params"][name]) < TOL:
            errors.append(f"{job}: adapter {name} rel err {rel_err(got['params'][name], want['params'][name]):.2e}")
    moved = [n for n in got["trainable"] if "lora_B" in n and float(got["params"][n].abs().max()) > 0]
    if not moved:
        errors.append(f"{job}: no lora_B moved from its zero start")
    for name in got["frozen"]:
        base = _base_name(name)
        if base in initial and not bool((got["params"][name] == initial[base]).all()):
            errors.append(f"{job}: frozen {name} changed")
    if "merged" in want:
        for name, ref in want["merged"].items():
            if not rel_err(got["merged"][name], ref) < TOL:
                errors.append(f"{job}: merged {name} rel err {rel_err(got['merged'][name], ref):.2e}")
    return errors


def _initial(job):
    from rl_trainer_cases import reward_initial_parameters
    from trainer_cases import initial_parameters

    return reward_initial_parameters() if job == "reward" else initial_parameters()


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS + tuple(SP_ONLY))
def test_peft_run_at_sp2_dp2_matches_the_dp_only_run(job):
    """`sft_tiled`: LoRA with the package's tiled MLPs and tiled loss and activation
    checkpointing, against the plain DP-only SFT run."""
    reference = _run(2)[0][SP_ONLY.get(job, job)]
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += [f"rank {rank}: {e}" for e in _errors(job, result[job], reference, _initial(job))]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.slow
def test_grpo_with_lora_generates_the_same_completions_in_an_sp_group():
    generated = _run(4)[0]["generated"]
    assert generated[0] == generated[1] and generated[2] == generated[3], generated
    assert generated[0] != generated[2], generated


@pytest.mark.slow
def test_the_lora_example_trains():
    """examples/lora_trl.py at SP 2 x DP 2: a step of SFT with LoRA, the adapters merged, a step
    of GRPO with new LoRA adapters (`accelerate launch --config_file examples/accelerate_cpu.yaml
    examples/lora_trl.py --sp 2` runs the same)."""
    assert all(result["example"] == (1, 1) for result in _run(4)), [r["example"] for r in _run(4)]


@pytest.mark.slow
def test_prompt_learning_is_refused_on_every_rank():
    messages = {result["prompt_tuning"] for result in _run(4)}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "prompt learning" in message and "PROMPT_TUNING" in message, message


@pytest.mark.slow
def test_liger_loss_kernels_are_refused_on_every_rank():
    messages = {result["liger"] for result in _run(4)}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "Liger's fused_linear_cross_entropy is not supported" in message, message


def test_liger_loss_kernels_are_refused_and_layer_kernels_accepted():
    from types import SimpleNamespace

    from ulysses_kernels.hf.training.trainer import check_liger

    check_liger("M", SimpleNamespace(use_liger_kernel=False, liger_kernel_config=None))
    layers_only = {"fused_linear_cross_entropy": False, "cross_entropy": False, "rms_norm": True}
    check_liger("M", SimpleNamespace(use_liger_kernel=True, liger_kernel_config=layers_only))
    for config, named in ((None, "fused_linear_cross_entropy"), ({"fused_linear_cross_entropy": False,
                                                                  "cross_entropy": True}, "cross_entropy")):
        with pytest.raises(ValueError, match=f"M: use_liger_kernel=True with Liger's {named}"):
            check_liger("M", SimpleNamespace(use_liger_kernel=True, liger_kernel_config=config))
