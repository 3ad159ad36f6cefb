"""transformers Trainer and TRL SFTTrainer with SequenceParallelTrainerMixin, on CPU with gloo.

A sequence-parallel run (SP 2 x DP 2, SP 4) must match, step for step, the loss and the
parameters of the same run without sequence parallelism (DP only, the same global
batches), below 1e-5 relative in float32, with packed documents; a run resumed from its
step-2 checkpoint must continue the uninterrupted run's steps 3-4.
"""

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import ROOT, SLOW_SPAWN_TIMEOUT, rel_err  # noqa: E402

from ulysses_kernels.launch import spawn  # noqa: E402

TOL = 1e-5
SEQ, N_SEQ, STEPS = 29, 12, 4


class PackedDocuments(torch.utils.data.Dataset):
    """Rows of two packed documents (position ids restart at 12), the first token of each
    document without a target, as a padding-free collator would give them."""

    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (N_SEQ, SEQ), generator=torch.Generator().manual_seed(11))

    def __len__(self):
        return N_SEQ

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[[0, 12]] = -100
        position_ids = torch.cat([torch.arange(12), torch.arange(SEQ - 12)])
        return dict(input_ids=self.ids[i], labels=labels, position_ids=position_ids)


# The examples' tiny model, tokenizer and documents (examples/_tiny.py): the tests train
# what the examples train.
sys.path.insert(0, str(ROOT / "examples"))
from _tiny import VOCAB, synthetic_documents, tiny_tokenizer  # noqa: E402
from _tiny import tiny_model as make_model  # noqa: E402

pytestmark = pytest.mark.slow  # Hugging Face Trainer runs in spawned groups


def sft_dataset():
    return synthetic_documents(32, 5, 19, seed=3)


def shared_dir(name):
    """The same folder on every rank of a spawn (their parent is the pytest process)."""
    path = os.path.join(tempfile.gettempdir(), f"uk_trainer_{os.getppid()}_{name}")
    os.makedirs(path, exist_ok=True)
    return path


def recording(base):
    """`base` recording every training step's returned loss."""
    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.recorded = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.recorded.append(loss.detach().double().clone())
            return loss
    return Recording


def finish(trainer):
    """(per-step loss as the mean over the world of the returned losses, which is what
    Trainer logs, {name: parameter})."""
    losses = torch.stack(trainer.recorded)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    if hasattr(trainer, "eval_loss"):
        params["eval_loss"] = torch.tensor(trainer.eval_loss, dtype=torch.float64)   # compared like a parameter
    return losses, params


def trainer_args(out, sft=False, **extra):
    common = dict(output_dir=out, per_device_train_batch_size=1, per_device_eval_batch_size=1, max_steps=STEPS,
                  learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                  ddp_backend="gloo" if dist.is_initialized() else None)
    common.update(extra)
    if sft:
        from trl import SFTConfig

        # bf16=False: SFTConfig defaults to bf16 autocast, whose rounding differs between a
        # sharded and an unsharded run (both about 3e-5 from float32); the parity is in float32.
        common.update(per_device_train_batch_size=4, padding_free=True, packing=False, max_length=None, bf16=False)
        return SFTConfig(**common)
    from transformers import TrainingArguments

    return TrainingArguments(**common)


def launch_env(rank, world):
    """What `torchrun` / `accelerate launch` would set (accelerate reads it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")


def run_plain(kind, out, **extra):
    from transformers import Trainer

    if kind == "sft":
        from trl import SFTTrainer

        trainer = recording(SFTTrainer)(model=make_model("eager"), args=trainer_args(out, sft=True),
                                        train_dataset=sft_dataset(), processing_class=tiny_tokenizer())
    else:
        trainer = recording(Trainer)(model=make_model("eager"), args=trainer_args(out, **extra),
                                     train_dataset=PackedDocuments())
    trainer.train()
    if kind != "sft":
        trainer.eval_loss = trainer.evaluate(eval_dataset=PackedDocuments())["eval_loss"]
    return finish(trainer)


def run_sp(kind, sp, out, **extra):
    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    groups = uk.init_sequence_parallel(sp)
    ukhf.register(groups)
    if kind == "sft":
        from trl import SFTTrainer

        cls = recording(type("SPSFTTrainer", (ukhf.SequenceParallelTrainerMixin, SFTTrainer), {}))
        trainer = cls(model=make_model("ulysses"), args=trainer_args(out, sft=True, **extra),
                      train_dataset=sft_dataset(), processing_class=tiny_tokenizer(), sp_groups=groups)
    else:
        from transformers import Trainer

        cls = recording(type("SPTrainer", (ukhf.SequenceParallelTrainerMixin, Trainer), {}))
        trainer = cls(model=make_model("ulysses"), args=trainer_args(out, **extra), train_dataset=PackedDocuments(),
                      sp_groups=groups)
    return trainer


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

    result, metrics = train_trainer.main(["--sp", "4", "--steps", "2", "--output-dir", shared_dir("example")])
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


def _compare(got, want, what):
    (losses, params), (ref_losses, ref_params) = got, want
    errors = []
    if not rel_err(losses, ref_losses) < TOL:
        errors.append(f"{what}: losses {losses.tolist()} vs {ref_losses.tolist()}")
    for name, ref in ref_params.items():
        if name == "eval_loss" and name not in params:   # a run that did not evaluate
            continue
        err = rel_err(params[name], ref)
        if not err < TOL:
            errors.append(f"{what}: {name} rel err {err:.2e}")
    return errors


def test_trainer_sp2_dp2_matches_dp_only_run():
    reference = _run(2)[0]["trainer"]
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += _compare(result["sp2"], reference, f"rank {rank}")
    assert not errors, "\n".join(errors)


def test_trainer_gradient_accumulation_matches_dp_only_run():
    """Two micro-batches per step: the loss is normalised by the tokens of the whole step
    (Trainer's own token weighting across the accumulation window and the DP ranks)."""
    reference = _run(2)[0]["trainer_ga2"]
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += _compare(result["sp2_ga2"], reference, f"rank {rank}")
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
        errors += _compare(result["sp4" if kind == "trainer" else "sft_sp4"], reference, f"rank {rank}")
    assert not errors, "\n".join(errors)


def test_sft_trainer_padding_free_sp2_dp2_matches_dp_only_run():
    pytest.importorskip("trl")
    reference = _run(2)[0]["sft"]
    errors = []
    for rank, result in enumerate(_run(4)):
        errors += _compare(result["sft_sp2"], reference, f"rank {rank}")
    assert not errors, "\n".join(errors)


def _launch(cmd, timeout=150):
    import subprocess

    root = str(ROOT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_launch_runs_the_trl_example():
    """`accelerate launch` (4 CPU processes) runs examples/sft_trl.py at SP 2 x DP 2."""
    import sys

    pytest.importorskip("trl")
    out = _launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate_cpu.yaml",
                   "--main_process_port", str(_free_port()), "examples/sft_trl.py", "--sp", "2", "--steps", "3"])
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
