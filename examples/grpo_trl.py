"""TRL GRPOTrainer with Ulysses sequence parallelism: a plain GRPO script plus the lines
marked `# SP`.

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/grpo_trl.py --sp 2
    torchrun --nproc-per-node 4 examples/grpo_trl.py --sp 2

CPU (gloo) or GPUs. The model is a tiny random Llama unless --model points at a local
checkpoint; the prompts are synthetic and the reward is a toy (the share of even tokens).
Every SP group of --sp ranks takes the same prompts, generates the same completions
(`ukhf.generate`: the prompt's prefill split along the sequence, one sampling stream per
group) and scores them with the sequence-parallel forward; DP groups take different
prompts. Long prompts and completions are what it is for: each rank holds 1/SP of every
sequence's activations and never the `[tokens, vocab]` logits of its shard.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def even_token_share(completions, **kwargs):
    """A toy reward: the share of the completion's tokens with an even id."""
    words = [text.split() for text in completions]
    return [sum(int(w[1:]) % 2 == 0 for w in ws if w[1:].isdigit()) / max(1, len(ws)) for ws in words]


def synthetic_prompts(count, min_len, max_len, seed=0):
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g)
    return Dataset.from_dict({"prompt": [" ".join(f"t{int(t)}" for t in torch.randint(0, 200, (int(n),), generator=g))
                                         for n in lengths]})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel size (divides the world size)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--completion-length", type=int, default=16)
    p.add_argument("--model", default=None, help="local HF checkpoint (default: tiny random Llama)")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    import tempfile

    from _tiny import causal_lm_and_tokenizer
    from trl import GRPOConfig, GRPOTrainer

    import ulysses_kernels as uk  # SP
    from ulysses_kernels import hf as ukhf  # SP

    config = GRPOConfig(output_dir=args.output_dir or tempfile.mkdtemp(), max_steps=args.steps,
                        per_device_train_batch_size=args.num_generations, num_generations=args.num_generations,
                        max_completion_length=args.completion_length, learning_rate=1e-3, logging_steps=1,
                        save_strategy="no", report_to=[], bf16=False, use_cpu=not _cuda(), disable_tqdm=True)
    groups = uk.init_sequence_parallel(args.sp)                             # SP
    ukhf.register(groups)                                                   # SP: attn_implementation="ulysses"
    model, tokenizer = causal_lm_and_tokenizer(args.model)                 # SP: attn_implementation="ulysses"

    class SPGRPOTrainer(ukhf.SequenceParallelGRPOMixin, GRPOTrainer):      # SP
        pass

    trainer = SPGRPOTrainer(model=model, reward_funcs=even_token_share, args=config, processing_class=tokenizer,
                            train_dataset=synthetic_prompts(64, 8, 64), sp_groups=groups)  # SP: sp_groups
    result = trainer.train()
    if trainer.is_world_process_zero():
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
        print(f"done: {result.global_step} GRPO steps at SP {groups.sp_size} x DP {groups.dp_size}, "
              f"mean reward per step {[round(r, 3) for r in rewards]}")
    return result


def _cuda():
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
