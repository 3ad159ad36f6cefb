"""transformers Trainer with Ulysses sequence parallelism: a plain Trainer script plus the
lines marked `# SP`.

    torchrun --nproc-per-node 4 examples/train_trainer.py --sp 2
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/train_trainer.py --sp 4
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 4 examples/train_trainer.py --sp 2 --zero 3

CPU (gloo) or GPUs. Rows of --seq-len tokens, each packing documents of random lengths
(position ids restart per document; a document's first token has no target), from a tiny
random Llama unless --model is a local checkpoint. Also evaluates (sequence-parallel too)
and saves a checkpoint at the end (--output-dir).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class PackedRows(torch.utils.data.Dataset):
    def __init__(self, rows, seq_len, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
        self.positions, self.labels = [], []
        for row in self.ids:
            cuts = sorted(torch.randint(1, seq_len, (3,), generator=g).tolist())
            starts = [0] + cuts
            pos = torch.cat([torch.arange(b - a) for a, b in zip(starts, cuts + [seq_len])])
            labels = row.clone()
            labels[starts] = -100
            self.positions.append(pos)
            self.labels.append(labels)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return dict(input_ids=self.ids[i], position_ids=self.positions[i], labels=self.labels[i])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=257)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default=None)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--zero", type=int, choices=[2, 3], default=None, help="DeepSpeed ZeRO stage (default: none)")
    args = p.parse_args(argv)

    import tempfile

    from _deepspeed import built_under_zero_init, communicator_on_cpu, describe, trainer_config
    from _tiny import VOCAB, tiny_model
    from transformers import Trainer, TrainingArguments

    import ulysses_kernels as uk  # SP
    from ulysses_kernels import hf as ukhf  # SP

    out = args.output_dir or tempfile.mkdtemp()
    config = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=1, per_device_eval_batch_size=1,
                               learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                               use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                               deepspeed=trainer_config(args.zero) if args.zero else None)
    # ^ creates the process group; before the model (a ZeRO-3 config builds it under zero.Init)
    communicator_on_cpu(config)   # DeepSpeed on CPU only (docs/deepspeed.md)
    groups = uk.init_sequence_parallel(args.sp)                             # SP
    ukhf.register(groups)                                                   # SP
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="ulysses")
        vocab = model.config.vocab_size
    else:
        model, vocab = tiny_model("ulysses"), VOCAB

    class SPTrainer(ukhf.SequenceParallelTrainerMixin, Trainer):           # SP
        pass

    zero_init = built_under_zero_init(model)
    trainer = SPTrainer(model=model, args=config, sp_groups=groups, monitor=True,   # SP: sp_groups; the monitor
                        train_dataset=PackedRows(64, args.seq_len, vocab, seed=1),
                        eval_dataset=PackedRows(8, args.seq_len, vocab, seed=2))
    result = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "final"))
    if trainer.is_world_process_zero():
        print(f"done: {result.global_step} steps at SP {groups.sp_size} x DP {groups.dp_size}, "
              f"train loss {result.training_loss:.4f}, eval loss {metrics['eval_loss']:.4f} "
              f"({describe(trainer, zero_init)})")
    return result, metrics, zero_init


if __name__ == "__main__":
    main()
