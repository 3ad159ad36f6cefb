"""Balanced global batches inside Trainer (the mixin's ``global_batches=`` option,
ulysses_kernels/hf/training/global_batch.py, GlobalBatchSteps): world 4 on CPU (gloo), TRL's
SFTTrainer (padding-free rows, the examples' tiny model, float32, SGD without clipping) with
gradient accumulation 2 over 2 optimizer steps of 32 documents of 5 to 19 tokens, at a budget
of 8 tokens a rank (documents take SP 1, 2 or 4), against plain SFTTrainer at DP 4 on the same
global batches: every step's loss and every parameter's update equal (trainer_cases' float32
tolerances). The monitor logs each step's planned costs, imbalance and SP sizes, the same on
every rank. Every rank runs both (the plain run first), then examples/global_batch_sft.py's
main() (what `accelerate launch` runs)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

from helpers import SLOW_SPAWN_TIMEOUT, SpawnedRuns  # noqa: E402
from trainer_cases import compare, finish, launch_env, run_plain, run_sp, shared_dir  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, ACCUMULATION, BUDGET = 2, 2, 8


def runs(rank, world):
    from ulysses_kernels import hf as ukhf

    launch_env(rank, world)
    common = dict(max_steps=STEPS, gradient_accumulation_steps=ACCUMULATION)
    plain = run_plain("sft", shared_dir("global_batch_plain"), **common)
    trainer = run_sp("sft", 2, shared_dir("global_batch_planned"), monitor=True,
                     global_batches=ukhf.BalancedGlobalBatches(token_budget=BUDGET), **common)
    trainer.train()
    plans = [h for h in trainer.state.log_history if "plan_imbalance" in h]
    return dict(plain=plain, planned=finish(trainer), logs=plans, line=trainer.monitor.last_record.line(),
                sizes=sorted({mb.sp for mb in trainer.global_batch_steps.last_plan.micro_batches}),
                example=_example())


def _example():
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import global_batch_sft

    return global_batch_sft.main(["--steps", "1", "--token-budget", "64", "--output-dir",
                                  shared_dir("global_batch_example")])


_run = SpawnedRuns(lambda world: (runs, ()), timeout=SLOW_SPAWN_TIMEOUT)


def per_step(result):
    """(each optimizer step's loss: the sum of its accumulation steps' logged values, params)."""
    losses, params = result
    return losses.reshape(STEPS, ACCUMULATION).sum(dim=1), params


def test_sft_trainer_with_balanced_global_batches_equals_plain_sft_trainer():
    per_rank = _run(4)
    errors = []
    for rank, result in enumerate(per_rank):
        errors += compare(per_step(result["planned"]), per_step(result["plain"]), f"planned rank {rank}")
    assert not errors, "\n".join(errors)
    assert per_rank[0]["sizes"] == [1, 2, 4], per_rank[0]["sizes"]


def test_the_monitor_logs_every_planned_step():
    per_rank = _run(4)
    logs = per_rank[0]["logs"]
    print(per_rank[0]["line"])
    assert len(logs) == STEPS and all(r["logs"] == logs for r in per_rank)
    for log in logs:
        assert 1.0 <= log["plan_imbalance"] < 2.0 and log["plan_sp_min"] == 1 and log["plan_sp_max"] == 4, log
        # no rank above the makespan; the busiest at least at the ideal (the mean rank's cost)
        assert log["plan_rank_cost_min"] <= log["plan_rank_cost_max"] <= log["plan_imbalance"] + 1e-3, log
        assert log["plan_rank_cost_max"] >= 1.0 - 1e-3, log
    assert "planned: makespan" in per_rank[0]["line"] and "SP sizes 1, 2, 4" in per_rank[0]["line"]


def test_the_example_trains():
    per_rank = _run(4)
    example = per_rank[0]["example"]
    assert all(r["example"] == example for r in per_rank)
    assert example["steps"] == 1 and 1.0 <= example["imbalance"] < 1.5 and max(example["sp_sizes"]) > 1, example
