"""Balanced global batches with TRL's SFTTrainer: long-tailed documents placed across the
ranks by their attention cost, each micro-batch at the SP size its longest document needs
(docs/global_batch.md), plus the lines marked `# SP`.

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/global_batch_sft.py
    torchrun --nproc-per-node 4 examples/global_batch_sft.py --token-budget 256

CPU (gloo) or GPUs. The model is a tiny random Llama unless --model points at a local
checkpoint; the documents are synthetic, their lengths lognormal (median 64 tokens, a few
ten times longer). Every rank reads the whole global batch (per_device_train_batch_size x
gradient_accumulation_steps x the world, as the ranks of a plain run read together), plans
it, and trains its part; the loss is the mean over the global batch's tokens, as plain
SFTTrainer's with `average_tokens_across_devices`. The monitor prints every step's planned
makespan over the ideal, the SP sizes used and each rank's cost.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def long_tail_documents(count, median, longest, seed=0):
    """`count` documents of lognormal lengths (sigma 1), clipped to [8, longest]."""
    import random

    from _tiny import VOCAB
    from datasets import Dataset

    rng = random.Random(seed)
    lengths = [int(min(longest, max(8, rng.lognormvariate(math.log(median), 1.0)))) for _ in range(count)]
    return Dataset.from_dict({"input_ids": [[rng.randrange(VOCAB - 2) for _ in range(n)] for n in lengths]})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--token-budget", type=int, default=256, help="tokens a rank holds in one micro-batch")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--model", default=None, help="local HF checkpoint (default: tiny random Llama)")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    import tempfile

    from _tiny import causal_lm_and_tokenizer
    from trl import SFTConfig, SFTTrainer

    import ulysses_kernels as uk  # SP
    from ulysses_kernels import hf as ukhf  # SP

    config = SFTConfig(output_dir=args.output_dir or tempfile.mkdtemp(), per_device_train_batch_size=4,
                       gradient_accumulation_steps=2, padding_free=True, max_length=None, max_steps=args.steps,
                       learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], bf16=False,
                       use_cpu=not _cuda(), disable_tqdm=True)                 # creates the process group
    groups = uk.init_sequence_parallel(1)                                    # SP: evaluation's groups
    ukhf.register(groups)                                                    # SP: attn_implementation="ulysses"
    model, tokenizer = causal_lm_and_tokenizer(args.model)                  # SP: attn_implementation="ulysses"

    class SPSFTTrainer(ukhf.SequenceParallelTrainerMixin, SFTTrainer):       # SP
        pass

    trainer = SPSFTTrainer(model=model, args=config, processing_class=tokenizer,
                           train_dataset=long_tail_documents(256, 64, 4 * args.token_budget),
                           sp_groups=groups, monitor=True,                   # SP
                           global_batches=ukhf.BalancedGlobalBatches(token_budget=args.token_budget))   # SP
    result = trainer.train()
    record = trainer.monitor.last_record
    if trainer.is_world_process_zero():
        print(record.line())
        print(f"done: {result.global_step} steps, loss {result.training_loss:.4f}")
    return dict(steps=result.global_step, imbalance=record.plan_imbalance, sp_sizes=record.plan_sp_sizes)


def _cuda():
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
