"""TRL RewardTrainer with Ulysses sequence parallelism: a plain reward-model script plus the
lines marked `# SP`.

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/reward_trl.py --sp 2
    torchrun --nproc-per-node 4 examples/reward_trl.py --sp 2

CPU (gloo) or GPUs. The reward model is a tiny random Llama with a one-score
sequence-classification head unless --model points at a local checkpoint; the preference
pairs are synthetic. Every SP group of --sp ranks takes the same pairs and scores the chosen
and rejected rows with the sequence-parallel forward (each rank 1/SP of every row, each row's
score at its last token wherever that token sits); DP groups take different pairs.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel size (divides the world size)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-pairs", type=int, default=4)
    p.add_argument("--model", default=None, help="local HF checkpoint (default: tiny random Llama)")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    import tempfile

    from _tiny import tiny_reward_model, tiny_tokenizer
    from dpo_trl import synthetic_pairs
    from trl import RewardConfig, RewardTrainer

    import ulysses_kernels as uk  # SP
    from ulysses_kernels import hf as ukhf  # SP

    config = RewardConfig(output_dir=args.output_dir or tempfile.mkdtemp(), max_steps=args.steps,
                          per_device_train_batch_size=args.batch_pairs, learning_rate=1e-3, logging_steps=1,
                          save_strategy="no", report_to=[], bf16=False, use_cpu=not _cuda(), disable_tqdm=True)
    groups = uk.init_sequence_parallel(args.sp)                             # SP
    ukhf.register(groups)                                                   # SP: attn_implementation="ulysses"
    if args.model:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1,
                                                                   attn_implementation="ulysses")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        model, tokenizer = tiny_reward_model("ulysses"), tiny_tokenizer()

    class SPRewardTrainer(ukhf.SequenceParallelRewardMixin, RewardTrainer):    # SP
        pass

    trainer = SPRewardTrainer(model=model, args=config, processing_class=tokenizer,
                              train_dataset=synthetic_pairs(64), sp_groups=groups)    # SP: sp_groups
    result = trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"done: {result.global_step} reward-model steps at SP {groups.sp_size} x DP {groups.dp_size}, "
              f"loss per step {[round(x, 4) for x in losses]}")
    return result


def _cuda():
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
