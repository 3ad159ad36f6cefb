"""A plain DeepSpeed engine loop (`deepspeed.initialize`, `engine.backward`, `engine.step`)
with Ulysses sequence parallelism: a plain engine script plus the lines marked `# SP`.

    torchrun --nproc-per-node 4 examples/train_deepspeed.py --sp 2 --zero 3
    deepspeed --num_gpus 4 examples/train_deepspeed.py --sp 2 --zero 3

CPU (gloo; set DS_ACCELERATOR=cpu) or GPUs. Rows of --seq-len tokens packing documents of
random lengths (position ids restart per document) from a tiny random Llama; the model is
built under `deepspeed.zero.Init` with --zero 3 (what `from_pretrained` does once a ZeRO-3
config exists). DeepSpeed averages gradients over the whole world, so the loss handed to
`engine.backward` is the global mean times the SP size (`ukhf.loss_for_world_average`):
the SP ranks' gradients then add up and the DP ranks' are averaged (docs/deepspeed.md).
Every step prints its loss and the monitor's line (tokens/s, peak memory per rank, the
planner's largest activation).

Also callable in-process for tests: `run(rank, world, argv)` with torch.distributed
already initialised; returns the per-step losses and the monitor's records.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def deepspeed_config(zero: int, lr: float) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": lr}}, "zero_allow_untested_optimizer": True,
            # every parameter partitioned, however small (the tiny model's would all stay whole)
            "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0}}


def packed_row(seq_len, vocab, seed):
    """One row of documents of random lengths: input ids, position ids restarting per
    document, labels without a target at a document's first token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    cuts = sorted(torch.randint(1, seq_len, (2,), generator=g).tolist())
    starts = [0] + cuts
    pos = torch.cat([torch.arange(b - a) for a, b in zip(starts, cuts + [seq_len])]).unsqueeze(0)
    labels = ids.clone()
    labels[0, starts] = -100
    return ids, pos, labels


def build_model(zero: int, config: dict):
    """The tiny model, built partitioned under zero.Init with ZeRO-3 (what from_pretrained
    does once a ZeRO-3 config exists)."""
    import deepspeed
    from _tiny import tiny_model

    with deepspeed.zero.Init(config_dict_or_path=config, enabled=zero == 3):
        return tiny_model("ulysses")


def train_step(engine, groups, ids, pos, labels):
    """One step of the recipe on one row (the same on every rank of an SP group); returns
    the loss, the global mean over the row's targets."""
    from ulysses_kernels import hf as ukhf

    batch = ukhf.shard_batch(ids, groups, position_ids=pos, labels=labels)             # SP
    loss = ukhf.causal_lm_loss(engine, batch, groups)                                  # SP: the global mean
    engine.backward(ukhf.loss_for_world_average(loss, groups, engine=engine))          # SP: x sp_size
    engine.step()
    return loss


def run(rank, world, argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=3)
    p.add_argument("--seq-len", type=int, default=257)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = p.parse_args(argv)

    import deepspeed
    from _tiny import VOCAB

    import ulysses_kernels as uk  # SP
    from ulysses_kernels import hf as ukhf  # SP

    groups = uk.init_sequence_parallel(args.sp)                             # SP
    ukhf.register(groups)                                                   # SP: attn_implementation="ulysses"
    config = deepspeed_config(args.zero, args.lr)
    model = build_model(args.zero, config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    monitor = uk.StepMonitor(model=engine.module, sp_size=groups.sp_size)    # the per-step monitor
    losses, records = [], []
    for step in range(args.steps):
        # every SP group takes the same row, DP groups different ones
        ids, pos, labels = packed_row(args.seq_len, VOCAB, seed=step * groups.dp_size + groups.dp_rank)
        monitor.begin()
        loss = train_step(engine, groups, ids, pos, labels)
        records.append(monitor.end(tokens=ids.numel() * groups.dp_size, seq_len=ids.numel()))
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f} | {records[-1].line()}", flush=True)
    if rank == 0:
        print(f"done: {args.steps} steps at SP {groups.sp_size} x DP {groups.dp_size}, ZeRO-{args.zero}")
    return losses, records


def main():
    from ulysses_kernels.launch import torchrun_main

    torchrun_main(run, "torchrun --nproc-per-node 4 examples/train_deepspeed.py --sp 2")


if __name__ == "__main__":
    main()
