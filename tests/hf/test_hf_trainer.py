"""transformers Trainer and TRL SFTTrainer with SequenceParallelTrainerMixin, on CPU with gloo.

A sequence-parallel run (SP 2 x DP 2, SP 4) must match, step for step, the loss and the
parameter updates of the same run without sequence parallelism (DP only, the same global
batches), below 1e-5 relative in float32, with packed documents (SGD without clipping:
trainer_cases.py); a run resumed from its step-2 checkpoint must continue the
uninterrupted run's steps 3-4.
"""

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import ROOT, SLOW_SPAWN_TIMEOUT, free_port, rel_err  # noqa: E402
from trainer_cases import (  # noqa: E402
    STEPS,
    TOL,
    PackedDocuments,
    compare,
    finish,
    launch_env,
    run_plain,
    run_sp,
    shared_dir,
)

from ulysses_kernels.launch import spawn  # noqa: E402

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
    trainer = run_sp("trainer", 2, shared_dir("sp2ga"), gradient_accumulation_steps=2, max_steps=2)
    trainer.train()
    out["sp2_ga2"] = finish(trainer)
    trainer = run_sp("trainer", 4, shared_dir("sp4"))
    trainer.train()
    trainer.eval_loss = trainer.evaluate(eval_dataset=PackedDocuments())["eval_loss"]
    out["sp4"] = finish(trainer)
    trainer = run_sp("sft", 2, shared_dir("sft"))
    trainer.train()
    out["sft_sp2"] = finish(trainer)
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
            "trainer_ga2": run_plain("trainer", shared_dir("ref_ga"), gradient_accumulation_steps=2, max_steps=2)}


_RESULTS = {}


def _run(world):
    if world not in _RESULTS:
        try:
            fn = sp_jobs if world == 4 else dp_reference_jobs
            _RESULTS[world] = spawn(fn, world, timeout=SLOW_SPAWN_TIMEOUT)
        except Exception as exc:  # report the same failure in every test that needs it
            _RESULTS[world] = exc
    if isinstance(_RESULTS[world], Exception):
        raise _RESULTS[world]
    return _RESULTS[world]


def test_trainer_sp2_dp2_matches_dp_only_run():
    reference = _run(2)[0]["trainer"]
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += compare(result["sp2"], reference, f"rank {rank}")
    assert not errors, "\n".join(errors)


def test_trainer_gradient_accumulation_matches_dp_only_run():
    """Two micro-batches per step: the loss is normalised by the tokens of the whole step
    (Trainer's own token weighting across the accumulation window and the DP ranks)."""
    reference = _run(2)[0]["trainer_ga2"]
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += compare(result["sp2_ga2"], reference, f"rank {rank}")
    assert not errors, "\n".join(errors)


def test_trainer_resumes_on_the_same_curve():
    for rank, result in enumerate(_run(4)):
        losses, params = result["resumed"]
        full_losses, full_params = result["sp2"]
        assert losses.shape == (STEPS - 2,), losses
        assert rel_err(losses, full_losses[2:]) < TOL, (rank, losses.tolist(), full_losses.tolist())
        assert all(rel_err(params[n], p) < TOL for n, p in full_params.items() if n != "eval_loss"), rank


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_sp4_matches_single_process_run(kind, tmp_path):
    """Trainer and padding-free SFTTrainer at SP 4 (DP 1) against one process."""
    if kind == "sft":
        pytest.importorskip("trl")
    reference = run_plain(kind, str(tmp_path))
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += compare(result["sp4" if kind == "trainer" else "sft_sp4"], reference, f"rank {rank}")
    assert not errors, "\n".join(errors)


def test_sft_trainer_padding_free_sp2_dp2_matches_dp_only_run():
    pytest.importorskip("trl")
    reference = _run(2)[0]["sft"]
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += compare(result["sft_sp2"], reference, f"rank {rank}")
    assert not errors, "\n".join(errors)


def _launch(cmd, timeout=150):
    import subprocess

    root = str(ROOT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_accelerate_launch_runs_the_trl_example():
    """`accelerate launch` (4 CPU processes) runs examples/sft_trl.py at SP 2 x DP 2."""
    import sys

    pytest.importorskip("trl")
    out = _launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate_cpu.yaml",
                   "--main_process_port", str(free_port()), "examples/sft_trl.py", "--sp", "2", "--steps", "3"])
    assert "done: 3 steps at SP 2 x DP 2" in out, out[-2000:]


def test_trainer_example_trains_evaluates_and_saves():
    """examples/train_trainer.py's main() at SP 4 (in the spawned group; `torchrun
    --nproc-per-node 4 examples/train_trainer.py --sp 4` runs the same): 2 steps, an eval
    loss, a saved model."""
    results = [r["example"] for r in _run(4)]
    assert results[0]["saved"], results[0]   # rank 0 writes (no barrier after save_model)
    for example in results:
        assert example["steps"] == 2 and 0 < example["eval_loss"] < 10, example
        assert example["eval_loss"] == results[0]["eval_loss"]
