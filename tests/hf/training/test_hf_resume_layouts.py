"""A Trainer run saved at one sequence-parallel layout and resumed at another continues
exactly (CPU, gloo): saved after step 2 at SP 4 (world 4, DP 1), resumed at SP 2 (world 2):
steps 3-4 are the uninterrupted SP 2 run's; saved at SP 2 x DP 2 (world 4), resumed at SP 2
x DP 1 with 2 gradient-accumulation steps (the same global batch): steps 3-4 are the
uninterrupted SP 2 x DP 2 run's. Losses and every parameter's update (SGD without clipping,
trainer_cases.py). A ZeRO-3 checkpoint resumed at another world size is refused by DeepSpeed. Trainer's own checkpoint holds what a layout does not change (weights,
optimizer, scheduler, step); the mixin's data order depends only on the DP rank and the
global batch, and its loss is normalised over the whole step, so neither the SP size nor
how the global batch is split into DP ranks and micro-batches changes the curve."""

import os

import pytest

pytest.importorskip("transformers")

from helpers import SLOW_SPAWN_TIMEOUT, SpawnedRuns  # noqa: E402
from trainer_cases import STEPS, compare, finish, launch_env, run_sp, shared_dir  # noqa: E402

pytestmark = pytest.mark.slow


def _losses_per_step(losses, accumulation):
    """The per-optimizer-step losses of a run whose training_step ran `accumulation` times a
    step: each micro-batch returns its share of the step's token-weighted loss."""
    return losses.view(-1, accumulation).sum(1)


def zero3():
    """examples/_deepspeed.py's ZeRO-3 config for Trainer."""
    from _deepspeed import trainer_config

    return trainer_config(3)


def saved_jobs(rank, world):
    launch_env(rank, world)
    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {}
    for name, sp in (("sp4", 4), ("sp2_dp2", 2)):
        trainer = run_sp("trainer", sp, shared_dir(f"layout_{name}"), save_strategy="steps", save_steps=2)
        trainer.train()
        out[name] = finish(trainer)
    trainer = run_sp("trainer", 4, shared_dir("layout_zero3_sp4"), deepspeed=zero3(), save_strategy="steps",
                     save_steps=2)
    trainer.train()
    return out


def _zero3_resumed_at_sp2():
    """A ZeRO-3 checkpoint of world 4 (SP 4) resumed at world 2 (SP 2): the result, or the
    error the rank raised."""
    trainer = run_sp("trainer", 2, shared_dir("layout_zero3_from_sp4"), deepspeed=zero3())
    try:
        trainer.train(resume_from_checkpoint=os.path.join(shared_dir("layout_zero3_sp4"), "checkpoint-2"))
    except Exception as exc:  # noqa: BLE001 - what DeepSpeed says is the result
        return f"{type(exc).__name__}: {exc}"
    return finish(trainer)


def resumed_jobs(rank, world):
    launch_env(rank, world)
    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {}
    trainer = run_sp("trainer", 2, shared_dir("layout_sp2_full"))
    trainer.train()
    out["sp2_full"] = finish(trainer)
    trainer = run_sp("trainer", 2, shared_dir("layout_sp2_from_sp4"))
    trainer.train(resume_from_checkpoint=os.path.join(shared_dir("layout_sp4"), "checkpoint-2"))
    out["sp2_from_sp4"] = finish(trainer)
    trainer = run_sp("trainer", 2, shared_dir("layout_dp1_from_dp2"), gradient_accumulation_steps=2)
    trainer.train(resume_from_checkpoint=os.path.join(shared_dir("layout_sp2_dp2"), "checkpoint-2"))
    losses, params = finish(trainer)
    out["dp1_from_dp2"] = (_losses_per_step(losses, 2), params)
    out["zero3_from_sp4"] = _zero3_resumed_at_sp2()   # last: a DeepSpeed run leaves its config registered
    return out


_run = SpawnedRuns(lambda world: (saved_jobs if world == 4 else resumed_jobs, ()), timeout=SLOW_SPAWN_TIMEOUT)


def _resumed_errors(resumed, full, what):
    (losses, params), (full_losses, full_params) = resumed, full
    if losses.shape != (STEPS - 2,):
        return [f"{what}: resumed for {tuple(losses.shape)} steps, want {STEPS - 2}"]
    return compare((losses, params), (full_losses[2:], full_params), what)


def test_saved_at_sp4_resumed_at_sp2_continues_the_sp2_run():
    _run(4)   # the checkpoints first
    errors = []
    for rank, result in enumerate(_run(2)):
        errors += _resumed_errors(result["sp2_from_sp4"], result["sp2_full"], f"SP 4 -> SP 2 rank {rank}")
    assert not errors, "\n".join(errors)


def test_saved_at_dp2_resumed_at_dp1_with_accumulation_continues_the_run():
    saved = _run(4)
    errors = []
    for rank, result in enumerate(_run(2)):
        errors += _resumed_errors(result["dp1_from_dp2"], saved[0]["sp2_dp2"], f"DP 2 -> DP 1 rank {rank}")
    assert not errors, "\n".join(errors)


def test_sp4_and_sp2_runs_are_one_curve():
    """What the resume relies on: the uninterrupted SP 4 and SP 2 runs (DP 1) are equal."""
    errors = compare(_run(4)[0]["sp4"], _run(2)[0]["sp2_full"], "SP 4 vs SP 2")
    assert not errors, "\n".join(errors)


def test_a_zero3_checkpoint_resumed_at_another_world_size_is_refused_by_deepspeed():
    """DeepSpeed's ZeRO-3 checkpoint is partitioned over its world: saved at world 4 (SP 4),
    resumed at world 2 (SP 2), DeepSpeed itself raises on every rank, naming both sizes
    (docs/hf_training.md, "LoRA, Liger and resuming at another layout")."""
    _run(4)
    outcomes = {result["zero3_from_sp4"] for result in _run(2)}
    assert len(outcomes) == 1, outcomes
    outcome = outcomes.pop()
    print("ZeRO-3 at another world size:", outcome)
    assert isinstance(outcome, str) and "DP world size of 4 but the current world size is 2" in outcome, outcome
