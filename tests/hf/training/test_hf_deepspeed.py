"""DeepSpeed with Ulysses sequence parallelism, on CPU with gloo (DS_ACCELERATOR=cpu):
transformers Trainer and TRL SFTTrainer with the mixin under ZeRO-2 and ZeRO-3 (models
built under zero.Init), gradient accumulation, save and resume from a DeepSpeed
checkpoint, `accelerate launch` with a DeepSpeed config file, and a plain DeepSpeed
engine loop (examples/train_deepspeed.py's recipe).

Every sequence-parallel run (SP 2 x DP 2, SP 4) must match the run without sequence
parallelism with the same ZeRO stage (DP 2, or one process), step for step: the losses
below 1e-5 and every parameter update below 1e-4, with SGD and no clipping
(trainer_cases.py), so a wrongly scaled gradient cannot hide. The engine loop without
its loss scale is run too and must be caught by the same comparison.
"""

import importlib.util
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
if importlib.util.find_spec("deepspeed") is None:  # not imported here: only the spawned ranks run it
    pytest.skip("DeepSpeed is not installed (pip install '.[deepspeed]')", allow_module_level=True)

from helpers import ROOT, SLOW_SPAWN_TIMEOUT, SpawnedRuns, free_port, launch_script  # noqa: E402
from trainer_cases import (  # noqa: E402
    STEPS,
    PackedDocuments,
    built_under_zero_init,
    check_example,
    compare_ranks,
    finish,
    forget_deepspeed,
    initial_parameters,
    launch_env,
    parameters,
    resumed_errors,
    run_plain,
    run_sp,
    shared_dir,
    start_from_initial,
    trainer_args,
)

pytestmark = pytest.mark.slow  # DeepSpeed Trainer runs in spawned groups


def zero(stage: int) -> dict:
    """examples/_deepspeed.py's config for Trainer (what examples/train_trainer.py --zero uses)."""
    from _deepspeed import trainer_config

    return trainer_config(stage)


def _deepspeed_env(rank, world):
    launch_env(rank, world)
    os.environ["DS_ACCELERATOR"] = "cpu"


def _trained(trainer, evaluate=False):
    trainer.train()
    if evaluate:
        trainer.eval_loss = trainer.evaluate(eval_dataset=PackedDocuments())["eval_loss"]
    result = finish(trainer)
    return dict(result=result, zero_init=trainer.built_under_zero_init,
                stage=trainer.accelerator.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
                log=[entry for entry in trainer.state.log_history if "loss" in entry],
                eval_log=[entry for entry in trainer.state.log_history if "eval_loss" in entry],
                record=trainer.monitor.last_record if trainer.monitor is not None else None)


# ------------------------------------------------------------------ the plain engine loop

def engine_loop(rank, world, stage, sp, scaled=True):
    """examples/train_deepspeed.py's model and train_step; without SP (sp None) the same
    rows through the model's own loss, each DP rank its own; `scaled=False` hands the
    unscaled loss to engine.backward (wrong)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from _tiny import VOCAB, tiny_model
    from train_deepspeed import build_model, deepspeed_config, packed_row, train_step

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    forget_deepspeed()
    initial_parameters()   # built outside zero.Init
    config = deepspeed_config(stage, 0.5)
    if sp:
        groups = uk.init_sequence_parallel(sp)
        ukhf.register(groups)
        dp_rank, dp_size = groups.dp_rank, groups.dp_size
        model = build_model(stage, config)
    else:
        dp_rank, dp_size = rank, world
        with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
            model = tiny_model("eager")
    start_from_initial(model)   # before deepspeed.initialize: its optimizer copies the weights
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for step in range(STEPS):
        ids, pos, labels = packed_row(29, VOCAB, seed=step * dp_size + dp_rank)
        if sp and scaled:
            loss = train_step(engine, groups, ids, pos, labels)
        else:
            if sp:
                loss = ukhf.causal_lm_loss(engine, ukhf.shard_batch(ids, groups, position_ids=pos, labels=labels),
                                           groups)
            else:
                loss = engine(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
            engine.backward(loss)
            engine.step()
        value = loss.detach().double().clone()
        dist.all_reduce(value)
        losses.append(value / world)   # each rank's loss is its DP group's mean: the mean over the world
    return torch.stack(losses), parameters(engine.module)


# ----------------------------------------------------------------------------- spawned

def sp_jobs(rank, world):
    _deepspeed_env(rank, world)
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import train_trainer

    out = {}
    # First in the fresh processes, as in a script: examples/train_trainer.py --zero 3 builds
    # its model under zero.Init before anything else has set DeepSpeed up.
    result, metrics, zero_init = train_trainer.main(["--sp", "2", "--zero", "3", "--steps", "2",
                                                     "--output-dir", shared_dir("trainer_example")])
    out["trainer_example"] = dict(steps=result.global_step, eval_loss=metrics["eval_loss"], zero_init=zero_init)
    # --model: a checkpoint of the plain tiny model, loaded by from_pretrained under
    # zero.Init (its weights go into partitioned parameters), by the example and directly.
    import torch.distributed as dist
    from _tiny import tiny_model
    from transformers import AutoModelForCausalLM

    forget_deepspeed()
    saved = shared_dir("tiny_checkpoint")
    if rank == 0:
        tiny_model("eager").save_pretrained(saved)
    dist.barrier()
    result, metrics, zero_init = train_trainer.main(["--sp", "2", "--zero", "3", "--steps", "2", "--model", saved,
                                                     "--output-dir", shared_dir("trainer_example_pretrained")])
    out["trainer_example_pretrained"] = dict(steps=result.global_step, eval_loss=metrics["eval_loss"],
                                             zero_init=zero_init)
    forget_deepspeed()
    initial_parameters()
    args = trainer_args(shared_dir("load"), deepspeed=zero(3))   # a ZeRO-3 config first, as in a script
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    out["loaded"] = dict(zero_init=built_under_zero_init(loaded), params=parameters(loaded))
    del args, loaded
    out["zero2_sp2"] = _trained(run_sp("trainer", 2, shared_dir("ds2"), deepspeed=zero(2), monitor=True), True)
    out["zero3_sp2"] = _trained(run_sp("trainer", 2, shared_dir("ds3"), deepspeed=zero(3), save_strategy="steps",
                                       save_steps=2), True)
    resumed = run_sp("trainer", 2, shared_dir("ds3"), deepspeed=zero(3), save_strategy="steps", save_steps=2)
    checkpoint = os.path.join(shared_dir("ds3"), "checkpoint-2")
    resumed.train(resume_from_checkpoint=checkpoint)
    out["zero3_resumed"] = dict(result=finish(resumed), deepspeed_checkpoint=sorted(
        d for d in os.listdir(checkpoint) if d.startswith("global_step")))
    out["zero3_sp2_ga2"] = _trained(run_sp("trainer", 2, shared_dir("ds3ga"), deepspeed=zero(3),
                                           gradient_accumulation_steps=2, max_steps=2))
    out["zero3_sp4"] = _trained(run_sp("trainer", 4, shared_dir("ds3sp4"), deepspeed=zero(3)), True)
    try:   # the mixin and accelerate's own (DeepSpeed ALST) sequence parallelism together
        from accelerate import ParallelismConfig

        run_sp("trainer", 2, shared_dir("both_sp"), deepspeed=zero(2), parallelism_config=ParallelismConfig(sp_size=2))
        out["both_sp"] = None
    except ValueError as error:
        out["both_sp"] = str(error)
    out["sft_zero3_sp2"] = _trained(run_sp("sft", 2, shared_dir("ds3sft"), deepspeed=zero(3)))
    out["engine_zero3_sp2"] = engine_loop(rank, world, 3, 2)
    out["engine_zero2_sp2"] = engine_loop(rank, world, 2, 2)
    out["engine_zero3_sp2_unscaled"] = engine_loop(rank, world, 3, 2, scaled=False)
    # examples/train_deepspeed.py's run() in this process group (what torchrun runs)
    import train_deepspeed

    losses, records = train_deepspeed.run(rank, world, ["--sp", "2", "--zero", "3", "--steps", "2"])
    out["example"] = dict(losses=losses, records=records)
    return out


def reference_jobs(rank, world):
    _deepspeed_env(rank, world)
    out = {}
    if world == 2:
        out["zero2"] = run_plain("trainer", shared_dir("ref_ds2"), deepspeed=zero(2))
        out["zero3"] = run_plain("trainer", shared_dir("ref_ds3"), deepspeed=zero(3))
        out["zero3_ga2"] = run_plain("trainer", shared_dir("ref_ds3ga"), deepspeed=zero(3),
                                     gradient_accumulation_steps=2, max_steps=2)
        out["sft_zero3"] = run_plain("sft", shared_dir("ref_ds3sft"), deepspeed=zero(3))
        out["engine_zero3"] = engine_loop(rank, world, 3, None)
        out["engine_zero2"] = engine_loop(rank, world, 2, None)
    else:   # one process: the reference of SP 4 (DP 1)
        out["zero3"] = run_plain("trainer", shared_dir("ref1_ds3"), deepspeed=zero(3))
    return out


_run = SpawnedRuns(lambda world: (sp_jobs if world == 4 else reference_jobs, ()), timeout=2 * SLOW_SPAWN_TIMEOUT)


def _compare_ranks(job, reference, **tolerances):
    return compare_ranks(_run(4), job, reference, **tolerances)


# ------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_zero_sp2_dp2_matches_dp_only_run(stage):
    """Trainer + the mixin + DeepSpeed ZeRO-2 / ZeRO-3 at SP 2 x DP 2 against DP 2 with the
    same stage: losses, parameter updates, eval loss. ZeRO-3 models are built under
    zero.Init (the arguments come first, as with from_pretrained)."""
    errors = _compare_ranks(f"zero{stage}_sp2", _run(2)[0][f"zero{stage}"])
    assert not errors, "\n".join(errors)
    for result in _run(4):
        assert result[f"zero{stage}_sp2"]["stage"] == stage
        assert result[f"zero{stage}_sp2"]["zero_init"] is (stage == 3)


def test_trainer_zero3_sp4_matches_one_process():
    errors = _compare_ranks("zero3_sp4", _run(1)[0]["zero3"])
    assert not errors, "\n".join(errors)


def test_the_mixin_with_accelerates_own_sequence_parallelism_is_refused():
    """TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2)) under DeepSpeed with
    the mixin: the same ValueError on every rank (it was accepted, the sequence sharded by
    both and Trainer's step count scaled by sp_size)."""
    messages = {out["both_sp"] for out in _run(4)}
    assert len(messages) == 1 and None not in messages, messages
    assert "accelerate's own sequence parallelism is set too (ParallelismConfig sp_size=2)" in messages.pop()


def test_trainer_zero3_gradient_accumulation_matches_dp_only_run():
    errors = _compare_ranks("zero3_sp2_ga2", _run(2)[0]["zero3_ga2"])
    assert not errors, "\n".join(errors)


def test_trainer_zero3_resumes_from_its_deepspeed_checkpoint():
    """Saved at step 2 (a DeepSpeed checkpoint: partitioned parameters and optimizer
    states), resumed: steps 3-4 are the uninterrupted run's."""
    errors = []
    for rank, result in enumerate(_run(4)):
        assert result["zero3_resumed"]["deepspeed_checkpoint"] == ["global_step2"]   # DeepSpeed's own format
        errors += resumed_errors(result["zero3_resumed"]["result"], result["zero3_sp2"]["result"],
                                 f"zero3_resumed rank {rank}")
    assert not errors, "\n".join(errors)


def test_sft_trainer_zero3_sp2_dp2_matches_dp_only_run():
    pytest.importorskip("trl")
    errors = _compare_ranks("sft_zero3_sp2", _run(2)[0]["sft_zero3"])
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_loop_matches_dp_only_run(stage):
    """deepspeed.initialize + engine.backward(ukhf.loss_for_world_average(loss, groups))."""
    errors = _compare_ranks(f"engine_zero{stage}_sp2", _run(2)[0][f"engine_zero{stage}"])
    assert not errors, "\n".join(errors)


def test_engine_loop_without_the_loss_scale_is_caught():
    """The same loop handing the unscaled global mean to engine.backward: the engine's mean
    over the world then halves the SP sum, and the comparison says so (so the tests above
    can fail)."""
    errors = _compare_ranks("engine_zero3_sp2_unscaled", _run(2)[0]["engine_zero3"])
    assert any("update rel err" in e for e in errors), errors
    losses = _run(4)[0]["engine_zero3_sp2_unscaled"][0]
    assert abs(losses[0].item() - _run(2)[0]["engine_zero3"][0][0].item()) < 1e-5  # the first step still agrees


def test_trainer_example_with_zero3_builds_under_zero_init():
    """examples/train_trainer.py --sp 2 --zero 3, first thing in fresh processes (`DS_ACCELERATOR=cpu
    torchrun --nproc-per-node 4 ...` runs the same): the model is built partitioned under
    zero.Init for the 4 ranks, trains 2 steps and evaluates to the same loss on every rank."""
    check_example([r["trainer_example"] for r in _run(4)])


def test_from_pretrained_under_zero3_loads_the_checkpoint():
    """A ZeRO-3 config, then from_pretrained (what examples/train_trainer.py --model does):
    the model is built partitioned under zero.Init and holds exactly the saved weights;
    the example trains and evaluates it (the same eval loss on every rank)."""
    want = initial_parameters()
    for result in _run(4):
        loaded = result["loaded"]
        assert loaded["zero_init"]
        worst = max((loaded["params"][n] - p).abs().max().item() for n, p in want.items())
        assert worst == 0.0, worst
    check_example([r["trainer_example_pretrained"] for r in _run(4)])


def test_monitor_logs_every_step():
    """monitor=True at SP 2 x DP 2: every logged training step carries tokens/s, the peak
    memory of the ranks and the planner's expectation, and counts the 2 DP groups' rows of
    29 tokens once; evaluation logs carry none of it. The example loop's records: its
    rows of 257 tokens, every rank's peak."""
    from trainer_cases import SEQ

    for result in _run(4):
        log = result["zero2_sp2"]["log"]
        assert len(log) == STEPS
        for entry in log:
            assert entry["tokens_per_s"] > 0 and entry["peak_mem_gib"] >= entry["peak_mem_gib_min"] > 0
            assert 0 <= entry["peak_mem_rank"] < 4 and entry["planner_activation_gib"] > 0
        record = result["zero2_sp2"]["record"]
        assert (record.step, record.steps, record.tokens) == (STEPS, 1, 2 * SEQ), record
        assert result["zero2_sp2"]["eval_log"] and not any("tokens_per_s" in e for e in result["zero2_sp2"]["eval_log"])
    records = _run(4)[0]["example"]["records"]
    assert [r.step for r in records] == [1, 2] and all(r.tokens == 2 * 257 for r in records)
    assert all(len(r.peak_bytes) == 4 and r.expected_activation_bytes > 0 for r in records)
    print("\n" + "\n".join(r.line() for r in records))   # shown with -s


def test_accelerate_launch_with_a_deepspeed_config():
    """`accelerate launch` with examples/accelerate_deepspeed_cpu.yaml (ZeRO-3, zero.Init,
    4 CPU processes) runs the TRL example at SP 2 x DP 2 on DeepSpeed."""
    import sys

    out = launch_script([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         "examples/accelerate_deepspeed_cpu.yaml", "--main_process_port", str(free_port()),
                         "examples/sft_trl.py", "--sp", "2", "--steps", "3"], timeout=300, DS_ACCELERATOR="cpu")
    assert "done: 3 steps at SP 2 x DP 2" in out and "DeepSpeed ZeRO-3, built under zero.Init" in out, out[-3000:]
