"""transformers Trainer and TRL SFTTrainer with SequenceParallelTrainerMixin, on CPU with gloo.

A sequence-parallel run (SP 2 x DP 2, SP 4) must match, step for step, the loss and the
parameter updates of the same run without sequence parallelism (DP only, the same global
batches), below 1e-5 relative in float32, with packed documents and with a padding
collator's batches (SGD without clipping: trainer_cases.py); a run resumed from its step-2 checkpoint must continue the
uninterrupted run's steps 3-4.
"""

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import ROOT, SLOW_SPAWN_TIMEOUT, SpawnedRuns, free_port, launch_script  # noqa: E402
from trainer_cases import (  # noqa: E402
    PackedDocuments,
    PaddedRows,
    check_example,
    compare_ranks,
    finish,
    launch_env,
    resumed_errors,
    run_plain,
    run_sp,
    shared_dir,
)

pytestmark = pytest.mark.slow  # Hugging Face Trainer runs in spawned groups


def sp_jobs(rank, world):
    launch_env(rank, world)
    out = {}
    trainer = run_sp("trainer", 2, shared_dir("sp2"), save_strategy="steps", save_steps=2)
    trainer.train()
    trainer.eval_loss = trainer.evaluate(eval_dataset=PackedDocuments())["eval_loss"]
    out["sp2"] = finish(trainer)
    resumed = run_sp("trainer", 2, shared_dir("sp2"), save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=os.path.join(shared_dir("sp2"), "checkpoint-2"))
    out["resumed"] = finish(resumed)
    trainer = run_sp("trainer", 2, shared_dir("sp2ga"), gradient_accumulation_steps=2, max_steps=2,
                     monitor="instance")
    trainer.train()
    out["sp2_ga2"] = finish(trainer)
    out["sp2_ga2_log"] = [entry for entry in trainer.state.log_history if "loss" in entry]
    out["sp2_ga2_record"] = trainer.monitor.last_record
    # the monitor's planner options as the model trains (Trainer turns checkpointing on in train())
    trainer = run_sp("trainer", 2, shared_dir("sp2ckpt"), max_steps=1, monitor=True, activation_checkpointing=True)
    trainer.train()
    out["checkpointing_monitor"] = dict(trainer.monitor.options, log=trainer.state.log_history[0])
    trainer = run_sp("trainer", 4, shared_dir("sp4"))
    trainer.train()
    trainer.eval_loss = trainer.evaluate(eval_dataset=PackedDocuments())["eval_loss"]
    out["sp4"] = finish(trainer)
    trainer = run_sp("sft", 2, shared_dir("sft"))
    trainer.train()
    out["sft_sp2"] = finish(trainer)
    trainer = run_sp("padded", 2, shared_dir("padded"))
    trainer.train()
    trainer.eval_loss = trainer.evaluate(eval_dataset=PaddedRows())["eval_loss"]
    out["padded_sp2"] = finish(trainer)
    trainer = run_sp("sft", 4, shared_dir("sft4"))
    trainer.train()
    out["sft_sp4"] = finish(trainer)
    # examples/train_trainer.py's main() in this process group (what torchrun runs)
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import train_trainer

    result, metrics, _ = train_trainer.main(["--sp", "4", "--steps", "2", "--output-dir", shared_dir("example")])
    out["example"] = dict(steps=result.global_step, eval_loss=metrics["eval_loss"],
                          saved=os.path.isdir(os.path.join(shared_dir("example"), "final")))
    return out


def dp_reference_jobs(rank, world):
    launch_env(rank, world)
    return {"trainer": run_plain("trainer", shared_dir("ref")), "sft": run_plain("sft", shared_dir("ref_sft")),
            "trainer_ga2": run_plain("trainer", shared_dir("ref_ga"), gradient_accumulation_steps=2, max_steps=2),
            "padded": run_plain("padded", shared_dir("ref_padded"))}


_run = SpawnedRuns(lambda world: (sp_jobs if world == 4 else dp_reference_jobs, ()), timeout=SLOW_SPAWN_TIMEOUT)


def test_trainer_sp2_dp2_matches_dp_only_run():
    reference = _run(2)[0]["trainer"]
    errors = compare_ranks(_run(4), "sp2", reference)
    assert not errors, "\n".join(errors)


def test_trainer_gradient_accumulation_matches_dp_only_run():
    """Two micro-batches per step: the loss is normalised by the tokens of the whole step
    (Trainer's own token weighting across the accumulation window and the DP ranks)."""
    reference = _run(2)[0]["trainer_ga2"]
    errors = compare_ranks(_run(4), "sp2_ga2", reference)
    assert not errors, "\n".join(errors)


def test_trainer_with_a_padding_collator_matches_dp_only_run():
    """DataCollatorForLanguageModeling's batches (3 rows of 5 to 19 tokens a device, padded
    on the right, labels -100 at the padding) at SP 2 x DP 2: the mixin unpads each batch
    into one packed row and counts its valid targets; losses, parameter updates and the
    eval loss equal the DP-only run on the same padded batches."""
    from trainer_cases import PADDED_BATCH, padded_collator

    rows = PaddedRows()
    batch = padded_collator()([rows[i] for i in range(PADDED_BATCH)])
    assert not bool(batch["attention_mask"].bool().all()), batch["attention_mask"]   # padding is there
    reference = _run(2)[0]["padded"]
    errors = compare_ranks(_run(4), "padded_sp2", reference)
    assert not errors, "\n".join(errors)


def test_trainer_resumes_on_the_same_curve():
    """Saved at step 2, resumed: steps 3-4 (losses, parameter updates) are the uninterrupted run's."""
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += resumed_errors(result["resumed"], result["sp2"], f"resumed rank {rank}")
    assert not errors, "\n".join(errors)


def test_monitor_counts_every_token_once():
    """A StepMonitor passed in (monitor=<instance>) under gradient accumulation 2 at SP 2 x
    DP 2: the last logged step counts the 2 DP groups' 2 micro-batches of 29 tokens once
    (116) and holds every rank's peak memory; without a model there is no planner
    expectation; every training step is logged with the monitor's keys."""
    from trainer_cases import SEQ

    records = [result["sp2_ga2_record"] for result in _run(4)]
    for result, record in zip(_run(4), records):
        assert (record.step, record.steps, record.tokens) == (2, 1, 2 * 2 * SEQ), record
        assert len(record.peak_bytes) == 4 and min(record.peak_bytes) > 0, record
        assert record == records[0]   # one record, the same on every rank
        log = result["sp2_ga2_log"]
        assert len(log) == 2 and all(e["tokens_per_s"] > 0 and "planner_activation_gib" not in e for e in log), log


def test_monitor_takes_the_planner_options_as_the_model_trains():
    """monitor=True with activation_checkpointing=True: Trainer turns checkpointing on in
    train(), and the monitor's planner options say so (with the model's float32 and the
    attention path); the logged step carries the planner's expectation."""
    for result in _run(4):
        options = result["checkpointing_monitor"]
        assert options["checkpointing"] is True and options["dtype_bytes"] == 4, options
        assert options["tiled_mlp"] is False and options["tiled_loss"] is False, options
        assert options["log"]["planner_activation_gib"] > 0, options["log"]


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_sp4_matches_single_process_run(kind, tmp_path):
    """Trainer and padding-free SFTTrainer at SP 4 (DP 1) against one process."""
    if kind == "sft":
        pytest.importorskip("trl")
    reference = run_plain(kind, str(tmp_path))
    errors = compare_ranks(_run(4), "sp4" if kind == "trainer" else "sft_sp4", reference)
    assert not errors, "\n".join(errors)


def test_sft_trainer_padding_free_sp2_dp2_matches_dp_only_run():
    pytest.importorskip("trl")
    reference = _run(2)[0]["sft"]
    errors = compare_ranks(_run(4), "sft_sp2", reference)
    assert not errors, "\n".join(errors)


def test_accelerate_launch_runs_the_trl_example():
    """`accelerate launch` (4 CPU processes) runs examples/sft_trl.py at SP 2 x DP 2."""
    import sys

    pytest.importorskip("trl")
    out = launch_script([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate_cpu.yaml",
                   "--main_process_port", str(free_port()), "examples/sft_trl.py", "--sp", "2", "--steps", "3"], timeout=150)
    assert "done: 3 steps at SP 2 x DP 2" in out, out[-2000:]


def test_trainer_example_trains_evaluates_and_saves():
    """examples/train_trainer.py's main() at SP 4 (in the spawned group; `torchrun
    --nproc-per-node 4 examples/train_trainer.py --sp 4` runs the same): 2 steps, an eval
    loss, a saved model."""
    results = [r["example"] for r in _run(4)]
    assert results[0]["saved"], results[0]   # rank 0 writes (no barrier after save_model)
    check_example(results)
