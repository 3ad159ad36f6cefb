"""What the Trainer tests (test_hf_trainer.py, test_hf_deepspeed.py) share: the packed
and the padded datasets, the examples' tiny model, the runs with and without sequence
parallelism, and the comparison. Spawned ranks import this module by name.

The optimizer is SGD without gradient clipping: its update is linear in the gradient, so
a gradient scaled by a wrong factor (a loss normalised over the wrong ranks or tokens)
changes the parameters instead of hiding behind Adam's normalisation or the clip; runs
are compared on their losses and on their parameter *updates* (final minus initial).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from helpers import ROOT, rel_err

TOL = 1e-5
# Parameter updates are compared at 1e-4: a layer norm's weight (about 1.0) moves by about
# 1e-3 per step, and float32 rounds it to about 6e-8, so 1e-5 of its update is below the
# parameter's own resolution. A wrongly scaled gradient is off by tens of percent.
UPDATE_TOL = 1e-4
SEQ, N_SEQ, STEPS = 29, 12, 4
# The padded runs: 3 rows a device (every batch has padding); 4 steps at DP 2 read 24 rows.
N_PADDED, PADDED_BATCH = 24, 3
OPTIMIZER = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant")

# The examples' tiny model, tokenizer and documents (examples/_tiny.py): the tests train
# what the examples train.
sys.path.insert(0, str(ROOT / "examples"))
from _deepspeed import built_under_zero_init, communicator_on_cpu  # noqa: E402, F401 (re-exported)
from _tiny import VOCAB, synthetic_documents, tiny_tokenizer  # noqa: E402
from _tiny import tiny_model as make_model  # noqa: E402


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


class PaddedRows(torch.utils.data.Dataset):
    """Rows of 5 to 19 random tokens, which `padded_collator` pads on the right to the
    longest row of each batch (labels -100 at the padding): an ordinary padded batch."""

    def __init__(self):
        g = torch.Generator().manual_seed(13)
        lengths = torch.randint(5, 20, (N_PADDED,), generator=g)
        self.rows = [torch.randint(0, VOCAB - 2, (int(n),), generator=g).tolist() for n in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return dict(input_ids=self.rows[i])


def padded_collator():
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tiny_tokenizer(), mlm=False)


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


def parameters(model):
    """{name: a copy of the whole parameter}, gathered when DeepSpeed ZeRO-3 partitions them."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def finish(trainer):
    """(per-step loss as the mean over the world of the returned losses, which is what
    Trainer logs, {name: parameter})."""
    losses = torch.stack(trainer.recorded)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    params = parameters(trainer.accelerator.unwrap_model(trainer.model))
    if hasattr(trainer, "eval_loss"):
        params["eval_loss"] = torch.tensor(trainer.eval_loss, dtype=torch.float64)   # compared like a parameter
    return losses, params


def trainer_args(out, sft=False, padded=False, **extra):
    common = dict(output_dir=out, per_device_train_batch_size=1, per_device_eval_batch_size=1, max_steps=STEPS,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                  ddp_backend="gloo" if dist.is_initialized() else None, **OPTIMIZER)
    common.update(extra)
    if padded:
        common.update(per_device_train_batch_size=PADDED_BATCH, per_device_eval_batch_size=PADDED_BATCH)
    if sft:
        from trl import SFTConfig

        # bf16=False: SFTConfig defaults to bf16 autocast, whose rounding differs between a
        # sharded and an unsharded run (both about 3e-5 from float32); the parity is in float32.
        common.update(per_device_train_batch_size=4, padding_free=True, packing=False, max_length=None, bf16=False)
        args = SFTConfig(**common)
    else:
        from transformers import TrainingArguments

        args = TrainingArguments(**common)
    communicator_on_cpu(args)   # as examples/train_trainer.py (DeepSpeed on CPU)
    return args


def launch_env(rank, world):
    """What `torchrun` / `accelerate launch` would set (accelerate reads it; the process group
    exists already, so nothing binds the port, which still differs per test process of
    pytest-xdist)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29561 + worker))


def forget_deepspeed() -> None:
    """Runs in one process follow each other: a ZeRO-3 config an earlier run's arguments
    registered with transformers (a global weak reference, kept by reference cycles) must
    not make the next model be built under zero.Init."""
    import gc

    gc.collect()
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:
        return
    unset_hf_deepspeed_config()


def run_plain(kind, out, **extra):
    """A run without sequence parallelism; the arguments come before the model, as in a
    script (with a ZeRO-3 config transformers then builds the model under zero.Init)."""
    from transformers import Trainer

    forget_deepspeed()
    initial_parameters()   # before the arguments: built outside zero.Init
    args = trainer_args(out, sft=kind == "sft", padded=kind == "padded", **extra)
    model = start_from_initial(make_model("eager"))
    if kind == "sft":
        from trl import SFTTrainer

        trainer = recording(SFTTrainer)(model=model, args=args, train_dataset=sft_dataset(),
                                        processing_class=tiny_tokenizer())
    else:
        trainer = recording(Trainer)(model=model, args=args, **trainer_data(kind))
    trainer.train()
    if kind != "sft":
        trainer.eval_loss = trainer.evaluate(eval_dataset=eval_dataset(kind))["eval_loss"]
    return finish(trainer)


def trainer_data(kind):
    """Trainer's data arguments for a run of `kind` ("trainer": packed rows, "padded":
    padded batches)."""
    if kind == "padded":
        return dict(train_dataset=PaddedRows(), data_collator=padded_collator())
    return dict(train_dataset=PackedDocuments())


def eval_dataset(kind):
    return PaddedRows() if kind == "padded" else PackedDocuments()


def run_sp(kind, sp, out, monitor=False, global_batches=None, **extra):
    """A sequence-parallel run (SP `sp` x DP world / sp), not yet trained; arguments before
    the model as in run_plain. global_batches: the mixin's option (BalancedGlobalBatches)."""
    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    forget_deepspeed()
    initial_parameters()   # before the arguments: built outside zero.Init
    args = trainer_args(out, sft=kind == "sft", padded=kind == "padded", **extra)
    groups = uk.init_sequence_parallel(sp)
    ukhf.register(groups)
    model = start_from_initial(make_model("ulysses"))
    if monitor == "instance":   # the caller's own monitor (no model: no planner expectation)
        monitor = uk.StepMonitor(device="cpu")
    if kind == "sft":
        from trl import SFTTrainer

        cls = recording(type("SPSFTTrainer", (ukhf.SequenceParallelTrainerMixin, SFTTrainer), {}))
        trainer = cls(model=model, args=args, train_dataset=sft_dataset(), processing_class=tiny_tokenizer(),
                      sp_groups=groups, monitor=monitor, global_batches=global_batches)
    else:
        from transformers import Trainer

        cls = recording(type("SPTrainer", (ukhf.SequenceParallelTrainerMixin, Trainer), {}))
        trainer = cls(model=model, args=args, sp_groups=groups, monitor=monitor, global_batches=global_batches,
                      **trainer_data(kind))
    trainer.built_under_zero_init = built_under_zero_init(model)
    return trainer


_INITIAL = {}


def initial_parameters():
    """The parameters every run starts from: the seeded tiny model built outside zero.Init."""
    if not _INITIAL:
        model = make_model("eager")
        if built_under_zero_init(model):
            raise RuntimeError("initial_parameters() was first called under a live ZeRO-3 config (zero.Init)")
        _INITIAL.update(parameters(model))
    return _INITIAL


def start_from_initial(model):
    """`model` with initial_parameters()' weights. Under zero.Init the same seed draws other
    values (DeepSpeed initialises each partitioned parameter on its own), which would shift
    every parameter's update by the difference of the two starting points and hide a wrong
    gradient behind it; the runs compared must start from the same weights."""
    import contextlib

    initial = initial_parameters()
    params = dict(model.named_parameters())
    gather = contextlib.nullcontext()
    if built_under_zero_init(model):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0)
    with torch.no_grad(), gather:
        for name, p in params.items():
            p.copy_(initial[name])
    return model


def differences(got, want, initial=None):
    """How far a run `got` is from the reference `want`, both (losses, {name: value}),
    relative: the per-step losses, every parameter's update from `initial` (default
    initial_parameters()) with the worst (name, error), and the values that are no
    parameter of `initial` (the eval loss and other metrics) as they are, where both runs
    have them."""
    (losses, params), (ref_losses, ref_params) = got, want
    initial = initial_parameters() if initial is None else initial
    updates = {name: rel_err(params[name] - initial[name], ref - initial[name])
               for name, ref in ref_params.items() if name in initial}
    metrics = {name: rel_err(params[name], ref) for name, ref in ref_params.items()
               if name not in initial and name in params}   # a run that did not evaluate has none
    worst = max(updates, key=updates.get)
    return dict(losses=rel_err(losses, ref_losses), worst_update=(worst, updates[worst]), updates=updates,
                metrics=metrics)


def compare(got, want, what, tol=TOL, update_tol=UPDATE_TOL, initial=None):
    """Differences of a run `got` from the reference `want` above the tolerances: the
    per-step losses and the metrics above `tol` and every parameter's update above
    `update_tol`, relative (see differences). The measured values are printed (shown with
    pytest -s)."""
    (losses, _), (ref_losses, _) = got, want
    found = differences(got, want, initial)
    name, worst = found["worst_update"]
    print(f"{what}: losses rel err {found['losses']:.2e}, worst update rel err {worst:.2e} ({name})"
          + "".join(f", {m} rel err {e:.2e}" for m, e in found["metrics"].items()))
    errors = []
    if not found["losses"] < tol:
        errors.append(f"{what}: losses {losses.tolist()} vs {ref_losses.tolist()}")
    errors += [f"{what}: {m} rel err {e:.2e}" for m, e in found["metrics"].items() if not e < tol]
    errors += [f"{what}: {n} update rel err {e:.2e}" for n, e in found["updates"].items() if not e < update_tol]
    return errors


def compare_ranks(per_rank, job, reference, **tolerances):
    """compare() of every rank's result `job` (a (losses, params) pair, or a dict holding
    one under "result") with `reference`: all the differences, each naming job and rank."""
    errors = []
    for rank, result in enumerate(per_rank):
        got = result[job]["result"] if isinstance(result[job], dict) else result[job]
        errors += compare(got, reference, f"{job} rank {rank}", **tolerances)
    return errors


def resumed_errors(resumed, full, what):
    """compare() of a run resumed from its step-2 checkpoint with steps 3.. of the
    uninterrupted run (both (losses, params)): the same losses and parameters."""
    (losses, params), (full_losses, full_params) = resumed, full
    if losses.shape != (STEPS - 2,):
        return [f"{what}: resumed for {tuple(losses.shape)} steps, want {STEPS - 2}"]
    return compare((losses, params), (full_losses[2:], full_params), what)


def check_example(per_rank):
    """An example's main() in a spawned group (per rank: its steps, eval loss and optional
    zero_init flag): 2 steps, a finite eval loss, the same on every rank."""
    for example in per_rank:
        assert example["steps"] == 2 and 0 < example["eval_loss"] < 10, example
        assert example["eval_loss"] == per_rank[0]["eval_loss"], per_rank
        assert example.get("zero_init", True), example


def mixin_run(rank, world, sp, build, name):
    """Trainer + SequenceParallelTrainerMixin on `build(vocab_size)` (a family's tiny model,
    made float32 here) over packed rows of two documents, at SP `sp` x DP world / sp:
    (per-step losses, every parameter's update). What the families' Trainer tests share."""
    from transformers import Trainer

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    launch_env(rank, world)
    groups = uk.init_sequence_parallel(sp)
    ukhf.register(groups)
    model = build(VOCAB).float()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    cls = recording(type("SPTrainer", (ukhf.SequenceParallelTrainerMixin, Trainer), {}))
    trainer = cls(model=model, args=trainer_args(shared_dir(f"{name}_sp{sp}")), sp_groups=groups,
                  train_dataset=PackedDocuments())
    trainer.train()
    losses, params = finish(trainer)
    return losses, {n: p - initial[n] for n, p in params.items()}


def check_mixin_sp2_dp2(worker, timeout):
    """`worker(rank, world, sp)` (a `mixin_run`) at SP 2 x DP 2 against DP 2: per-step losses
    and every parameter's update on every rank."""
    from ulysses_kernels.launch import spawn

    preload = ["torch", "transformers", "ulysses_kernels.hf"]
    reference = spawn(worker, 2, args=(1,), timeout=timeout, start_method="forkserver", preload=preload)[0]
    per_rank = spawn(worker, 4, args=(2,), timeout=timeout, start_method="forkserver", preload=preload)
    for rank, (losses, updates) in enumerate(per_rank):
        assert rel_err(losses, reference[0]) < TOL, (rank, losses, reference[0])
        worst = max((rel_err(u, reference[1][n]), n) for n, u in updates.items())
        assert worst[0] < UPDATE_TOL, (rank, worst)
