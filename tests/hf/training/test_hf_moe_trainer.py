"""TRL's SFTTrainer with the sequence-parallel mixin on a mixture of experts whose router loss
is on (`output_router_logits`, `router_aux_loss_coef`): a tiny Qwen3-MoE, world 4 on CPU
(gloo), float32, SGD without clipping, 2 steps, at SP 2 x DP 2 against plain SFTTrainer at DP 2
on the same global batches: every step's loss and every parameter's update equal
(trainer_cases' tolerances), twice:

- under DDP (the model as usual): the mixin adds the router loss of each DP group's batch,
  over its whole sequence (it used to drop it);
- on a model transformers distributed (`DistributedConfig(fsdp_size=4, ep_size=4)`, the
  reference at `fsdp_size=2, ep_size=2`) with `sp_groups=ukhf.sequence_parallel_groups(model,
  2)`: the mixin's loss scaled for the model's own FSDP reduction (ulysses_kernels/hf/training/
  distributed_config.py).

and with transformers' Trainer (packed rows) under DDP. TRL's SFTTrainer averages each rank's
router loss over the ranks and the accumulation steps; transformers' Trainer adds it to each
rank's loss, which its token-mean scaling multiplies by the world (summed over the ranks); the
mixin gives each trainer's own weighting."""

import os
import tempfile

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

import torch  # noqa: E402
from helpers import SLOW_SPAWN_TIMEOUT, SpawnedRuns, rel_err  # noqa: E402
from trainer_cases import TOL, UPDATE_TOL, launch_env, recording, sft_dataset, shared_dir, trainer_args  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 2
DISTRIBUTED = {2: dict(fsdp_size=2, ep_size=2), 4: dict(fsdp_size=4, ep_size=4)}
_FOLDER = tempfile.mkdtemp(prefix="uk_moe_trainer_")


def save_seed(folder):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=8, num_experts_per_tok=2, output_router_logits=True,
                                         router_aux_loss_coef=0.5, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate.weight" in name:   # routing that depends on the tokens
                p.normal_(0, 0.5)
    model.save_pretrained(os.path.join(folder, "seed"))


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run(world, folder, *, sp, distributed, trl=True):
    """(per-step losses: the mean over the world of each step's logged values, {name: parameter}).
    trl: TRL's SFTTrainer on padding-free documents, else transformers' Trainer on packed rows."""
    import torch.distributed as dist
    from _tiny import tiny_tokenizer
    from trainer_cases import trainer_data
    from transformers import AutoModelForCausalLM, Trainer
    from transformers.distributed import DistributedConfig
    from trl import SFTTrainer

    from ulysses_kernels import hf as ukhf

    name = f"moe_{'dc' if distributed else 'ddp'}_{'trl' if trl else 'trainer'}_{world}_{sp}"
    args = trainer_args(shared_dir(name), sft=trl, max_steps=STEPS)
    base = SFTTrainer if trl else Trainer
    data = (dict(train_dataset=sft_dataset(), processing_class=tiny_tokenizer()) if trl
            else trainer_data("trainer"))
    extra = dict(distributed_config=DistributedConfig(**DISTRIBUTED[world])) if distributed else {}
    if sp:
        ukhf.register()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "seed"),
                                                 attn_implementation="ulysses" if sp else "eager", **extra)
    if sp:
        groups = ukhf.sequence_parallel_groups(model, sp) if distributed else __import__(
            "ulysses_kernels").init_sequence_parallel(sp)
        ukhf.register(groups)
        cls = recording(type("SPTrainer", (ukhf.SequenceParallelTrainerMixin, base), {}))
        trainer = cls(model=model, args=args, sp_groups=groups, **data)
    else:
        trainer = recording(base)(model=model, args=args, **data)
    trainer.train()
    losses = torch.stack(trainer.recorded)
    dist.all_reduce(losses)
    losses /= dist.get_world_size()
    params = {n: full(p) for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    return losses.reshape(STEPS, -1).sum(dim=1), params


def experts_refusals(folder):
    """The model with experts_implementation="deepgemm" (no backward; set on the loaded
    config, as CPU has no DeepGEMM kernel): what the mixin and causal_lm_loss raise, and that
    without gradients the package lets the forward reach transformers' kernel (which, on CPU,
    refuses float32 itself)."""
    import torch.distributed as dist
    from _tiny import tiny_tokenizer
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from ulysses_kernels import hf as ukhf
    from ulysses_kernels import init_sequence_parallel

    groups = init_sequence_parallel(2)
    ukhf.register(groups)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "seed"), attn_implementation="ulysses")
    model.config._experts_implementation = "deepgemm"
    raised = {}
    cls = type("SPTrainer", (ukhf.SequenceParallelTrainerMixin, SFTTrainer), {})
    try:
        cls(model=model, args=trainer_args(shared_dir("moe_refused"), sft=True, max_steps=1), sp_groups=groups,
            train_dataset=sft_dataset(), processing_class=tiny_tokenizer())
    except ValueError as exc:
        raised["mixin"] = str(exc)
    ids = torch.arange(12).reshape(1, 12) + 3
    batch = ukhf.shard_batch(ids, groups, labels=ids)
    try:
        ukhf.causal_lm_loss(model, batch, groups)
    except ValueError as exc:
        raised["loss"] = str(exc)
    with torch.no_grad():   # inference keeps the kernel
        try:
            ukhf.causal_lm_loss(model, batch, groups)
        except ValueError as exc:
            raised["no_grad_loss"] = str(exc)
    dist.barrier()
    return raised


def jobs(rank, world, folder):
    launch_env(rank, world)
    sp = 2 if world == 4 else None
    return {"ddp": run(world, folder, sp=sp, distributed=False),
            "distributed": run(world, folder, sp=sp, distributed=True),
            "trainer": run(world, folder, sp=sp, distributed=False, trl=False),
            "refused": experts_refusals(folder) if sp else None}


def _jobs(world):
    if not os.path.exists(os.path.join(_FOLDER, "seed")):
        save_seed(_FOLDER)
    return jobs, (_FOLDER,)


_run = SpawnedRuns(_jobs, timeout=SLOW_SPAWN_TIMEOUT)


def _initial():
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(os.path.join(_FOLDER, "seed")).named_parameters())


@pytest.mark.parametrize("kind", ["ddp", "distributed", "trainer"])
def test_sft_trainer_on_a_moe_with_its_router_loss_equals_the_dp_only_run(kind):
    reference = _run(2)[0][kind]
    initial = _initial()
    errors = []
    for rank, result in enumerate(_run(4)):
        losses, params = result[kind]
        loss_err = rel_err(losses, reference[0])
        worst = max((rel_err(params[n] - initial[n], reference[1][n] - initial[n]), n) for n in reference[1])
        print(f"{kind} rank {rank}: losses rel err {loss_err:.1e}, worst update rel err {worst[0]:.1e} ({worst[1]})")
        if not loss_err < TOL:
            errors.append(f"rank {rank}: losses {losses.tolist()} vs {reference[0].tolist()}")
        if not worst[0] < UPDATE_TOL:
            errors.append(f"rank {rank}: {worst[1]} update rel err {worst[0]:.2e}")
    assert not errors, "\n".join(errors)


def test_experts_without_backward_are_refused_on_every_rank():
    """experts_implementation="deepgemm" (its matmuls outside autograd: the experts would not
    train): the mixin and causal_lm_loss with gradients raise the same ValueError on all 4
    ranks, naming the setting to use; without gradients the forward reaches the kernel."""
    results = [r["refused"] for r in _run(4)]
    for where in ("mixin", "loss"):
        messages = {r.get(where) for r in results}
        assert len(messages) == 1 and None not in messages, messages
        message = messages.pop()
        assert "experts_implementation='deepgemm' cannot train" in message and "'grouped_mm'" in message, message
    assert results[0]["mixin"].startswith("SequenceParallelTrainerMixin: ")
    assert results[0]["loss"].startswith("causal_lm_loss: ")
    assert all("DeepGEMM experts path requires bfloat16" in r["no_grad_loss"] for r in results)


def test_the_two_reference_runs_agree():
    """Plain SFTTrainer under DDP and on the model transformers distributed give the same run:
    the two references are one."""
    (ddp_losses, ddp), (dc_losses, dc) = _run(2)[0]["ddp"], _run(2)[0]["distributed"]
    assert rel_err(ddp_losses, dc_losses) < TOL
    assert max(rel_err(dc[n], p) for n, p in ddp.items()) < TOL
