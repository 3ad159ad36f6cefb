"""Sequence parallelism inside a model transformers distributed itself
(`from_pretrained(..., distributed_config=DistributedConfig(...))`;
ulysses_kernels/hf/training/distributed_config.py): world 4 on CPU (gloo), float32, the
package's usual recipe (`sequence_parallel_groups`, `register`, `shard_batch`,
`causal_lm_loss`, `loss.backward()`), every rank against one process:

- a tiny Qwen3-MoE with `output_router_logits` under `DistributedConfig(fsdp_size=4,
  ep_size=4)` at SP 2 x DP 2 on documents of 13 and 17 tokens: each rank's loss (the router's
  load-balancing loss included) equals its DP batch's one-process loss, every gradient the
  one-process gradient of the mean of the DP batches' losses, each rank holding 2 of the 8
  experts; one SGD step, `save_pretrained`, reloaded in one process: the one-process step;
- Mixtral at EP 2 and SP 4; a dense Llama under `DistributedConfig(tp_size=2, fsdp_size=2)`
  at SP 2 (each TP rank's 2 query heads split over the SP group);
- two mutations fail: FSDP's plain average (gradients half the right ones) and the router
  loss computed on each rank's shard alone;
- an SP size that does not divide the fsdp dimension, and the Trainer mixin on such a model
  with groups other than `sequence_parallel_groups`': the same ValueError on every rank;
- examples/moe_distributed_config.py trains and its checkpoint loads in one process.
Mesh layouts and error paths without a process group: test_hf_distributed_config_errors.py.
"""

import os
import tempfile

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers import SLOW_SPAWN_TIMEOUT, SpawnedRuns, rel_err  # noqa: E402

pytestmark = pytest.mark.slow

LENGTHS = (13, 17)   # one document per DP group, uneven
CASES = {
    "qwen3_moe": dict(config=dict(fsdp_size=4, ep_size=4), sp=2, local_experts=2),
    "mixtral": dict(config=dict(fsdp_size=4, ep_size=2), sp=4, local_experts=2),
    "llama": dict(config=dict(tp_size=2, fsdp_size=2), sp=2, local_experts=None),
}
LR = 0.5
TOL = 1e-5   # float32: the runs add the same terms in another order (measured about 1e-6)


def tiny_config(family):
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, head_dim=8, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=32, num_attention_heads=8, num_key_value_heads=4,
                                          num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                          router_aux_loss_coef=0.5, **common)
    return transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                                       num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                       output_router_logits=True, router_aux_loss_coef=0.5, **common)


def documents():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (1, n), generator=g) for n in LENGTHS]


def save_seeds(folder):
    """Each family's tiny model, its router drawn away from zero (routing that depends on the
    tokens), saved where every rank loads it."""
    from transformers import AutoModelForCausalLM

    for family in CASES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(family))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "gate.weight" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(os.path.join(folder, family))


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_case(folder, family, case, mutants=False):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from ulysses_kernels import hf as ukhf
    from ulysses_kernels.hf.training import distributed_config as dc
    from ulysses_kernels.hf.training import loss as loss_module

    ukhf.register()   # the "ulysses" attention exists before the model is built
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, family), attn_implementation="ulysses",
                                                 distributed_config=DistributedConfig(**case["config"]))
    model.train()
    groups = ukhf.sequence_parallel_groups(model, case["sp"])
    ukhf.register(groups)
    ids = documents()[groups.dp_rank]
    batch = ukhf.shard_batch(ids, groups, labels=ids)
    out = dict(dp=groups.dp_rank, sp_rank=groups.sp_rank)
    if mutants:
        out["refused"] = _refusal(model, 3)
        out["trainer_refused"] = _trainer_refusal(model, folder)
        original = loss_module.router_aux_loss   # the router loss of this rank's shard alone
        loss_module.router_aux_loss = lambda logits, e, k, group=None: original(logits, e, k, local=True)
        try:
            out["shard_aux_loss"] = float(ukhf.causal_lm_loss(model, batch, groups))
        finally:
            loss_module.router_aux_loss = original
        dc._divide_gradients(model, dp_size=4, sp_size=1)   # FSDP's plain mean over the fsdp ranks
        ukhf.causal_lm_loss(model, batch, groups).backward()
        out["mean_grads"] = {n: full(p.grad) for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        dc._divide_gradients(model, dp_size=4, sp_size=case["sp"])
    loss = ukhf.causal_lm_loss(model, batch, groups)
    loss.backward()
    out.update(loss=float(loss), grads={n: full(p.grad) for n, p in model.named_parameters()})
    experts = getattr(model.model.layers[0].mlp, "experts", None)
    out["local_experts"] = getattr(experts, "num_experts", None)
    if mutants:   # one SGD step, then the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        model.save_pretrained(os.path.join(folder, f"{family}_stepped"))
    return out


def _trainer_refusal(model, folder):
    """The Trainer mixin on the model with groups of its own (init_sequence_parallel's, which
    leave the model's FSDP reduction a mean): the error each rank raised."""
    from transformers import Trainer, TrainingArguments

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    groups = uk.init_sequence_parallel(2)

    cls = type("SPTrainer", (ukhf.SequenceParallelTrainerMixin, Trainer), {})
    args = TrainingArguments(output_dir=os.path.join(folder, "trainer"), use_cpu=True, report_to=[],
                             ddp_backend="gloo", max_steps=1, save_strategy="no")
    try:
        cls(model=model, args=args, train_dataset=[], sp_groups=groups)
    except ValueError as exc:
        return str(exc)
    return None


def _refusal(model, sp):
    from ulysses_kernels import hf as ukhf

    try:
        ukhf.sequence_parallel_groups(model, sp)
    except ValueError as exc:
        return str(exc)
    return None


def jobs(rank, world, folder):
    out = {family: run_case(folder, family, case, mutants=family == "qwen3_moe") for family, case in CASES.items()}
    out["example"] = _example(folder)
    return out


def _example(folder):
    """examples/moe_distributed_config.py's main() in the spawned group (what torchrun runs)."""
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import moe_distributed_config

    return moe_distributed_config.main(["--sp", "2", "--steps", "2", "--seq-len", "64", "--output-dir",
                                        os.path.join(folder, "example")])


_FOLDER = tempfile.mkdtemp(prefix="uk_distributed_config_")


def _jobs(world):
    save_seeds(_FOLDER)
    return jobs, (_FOLDER,)


_run = SpawnedRuns(_jobs, timeout=SLOW_SPAWN_TIMEOUT)


def reference(family, n_dp):
    """One process: each DP batch's loss, the gradient of their mean, and the model after one
    SGD step with it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(_FOLDER, family), attn_implementation="eager")
    model.train()
    losses = []
    for ids in documents()[:n_dp]:
        loss = model(input_ids=ids, labels=ids).loss
        (loss / n_dp).backward()
        losses.append(float(loss))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(CASES))
def test_sequence_parallel_inside_distributed_config_equals_one_process(family):
    per_rank = _run(4)
    case = CASES[family]
    n_dp = 4 // case["sp"] // case["config"].get("tp_size", 1)
    losses, grads, _ = reference(family, n_dp)
    errors = []
    for rank, result in enumerate(per_rank):
        got = result[family]
        loss_err = abs(got["loss"] - losses[got["dp"]]) / abs(losses[got["dp"]])
        worst = max((rel_err(got["grads"][n], g), n) for n, g in grads.items())
        print(f"{family} rank {rank} (DP {got['dp']}, SP {got['sp_rank']}): loss rel err {loss_err:.1e}, worst "
              f"gradient rel err {worst[0]:.1e} ({worst[1]}), local experts {got['local_experts']}")
        if not loss_err < TOL:
            errors.append(f"rank {rank}: loss {got['loss']} vs {losses[got['dp']]}")
        if not worst[0] < TOL:
            errors.append(f"rank {rank}: gradient {worst[1]} rel err {worst[0]:.2e}")
        if got["local_experts"] != case["local_experts"]:
            errors.append(f"rank {rank}: {got['local_experts']} local experts, want {case['local_experts']}")
    assert not errors, "\n".join(errors)
    assert sorted({r[family]["dp"] for r in per_rank}) == list(range(n_dp))


def test_the_step_saved_by_save_pretrained_loads_in_one_process():
    from transformers import AutoModelForCausalLM

    _run(4)
    _, _, stepped = reference("qwen3_moe", 2)
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(_FOLDER, "qwen3_moe_stepped"))
    params = dict(loaded.named_parameters())
    assert set(params) == set(stepped)
    worst = max((rel_err(params[n], p), n) for n, p in stepped.items())
    print(f"saved step: worst parameter rel err {worst[0]:.1e} ({worst[1]})")
    assert worst[0] < TOL, worst


def test_the_mutations_fail():
    """FSDP's own mean over the fsdp ranks gives half the gradient at SP 2; the router loss of
    each rank's shard alone misses the whole sequence's loss."""
    per_rank = _run(4)
    losses, grads, _ = reference("qwen3_moe", 2)
    for result in per_rank:
        got = result["qwen3_moe"]
        mean_err = max(rel_err(got["mean_grads"][n], g) for n, g in grads.items())
        assert mean_err > 0.4, mean_err
        shard_err = abs(got["shard_aux_loss"] - losses[got["dp"]]) / losses[got["dp"]]
        print(f"DP group {got['dp']}: FSDP's mean: gradient rel err {mean_err:.2f}; router loss of the shard alone: "
              f"loss rel err {shard_err:.1e}")
        assert shard_err > 10 * TOL


def test_an_sp_size_that_does_not_divide_fsdp_is_refused_on_every_rank():
    per_rank = _run(4)
    messages = {r["qwen3_moe"]["refused"] for r in per_rank}
    assert len(messages) == 1 and "sp_size 3 must divide the model's fsdp dimension (4" in messages.pop()


def test_the_trainer_mixin_refuses_groups_other_than_sequence_parallel_groups_on_every_rank():
    """init_sequence_parallel's groups would leave the model's FSDP reduction a mean over the
    fsdp ranks: half the gradient at SP 2 (the Trainer route itself: test_hf_moe_trainer.py)."""
    per_rank = _run(4)
    messages = {r["qwen3_moe"]["trainer_refused"] for r in per_rank}
    assert len(messages) == 1 and "pass sp_groups=ukhf.sequence_parallel_groups(model, sp_size)" in messages.pop()


def test_the_example_trains_and_its_checkpoint_loads_in_one_process():
    from transformers import AutoModelForCausalLM

    per_rank = _run(4)
    example = per_rank[0]["example"]
    by_dp = {}
    for r in per_rank:   # the ranks of an SP group report their DP group's loss
        by_dp.setdefault(r["example"]["dp_rank"], set()).add(r["example"]["loss"])
    assert sorted(by_dp) == [0, 1] and all(len(losses) == 1 for losses in by_dp.values()), by_dp
    assert example["local_experts"] == 2 and 0 < example["loss"] < 10, example
    loaded = AutoModelForCausalLM.from_pretrained(example["saved"])
    assert loaded.model.layers[0].mlp.experts.num_experts == 8
