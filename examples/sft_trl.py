"""TRL SFTTrainer with Ulysses sequence parallelism: a plain padding-free SFT script plus
the lines marked `# SP`.

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/sft_trl.py --sp 2
    accelerate launch --config_file examples/accelerate_deepspeed_cpu.yaml examples/sft_trl.py --sp 2
    torchrun --nproc-per-node 4 examples/sft_trl.py --sp 2

CPU (gloo) or GPUs. The model is a tiny random Llama unless --model points at a local
checkpoint; the data are synthetic documents packed padding-free (position ids restart
per document, so attention never crosses them). Every SP group of --sp ranks trains on
the same packed batch, split along the sequence; DP groups take different batches.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel size (divides the world size)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-docs", type=int, default=8, help="documents packed into one row per DP rank")
    p.add_argument("--model", default=None, help="local HF checkpoint (default: tiny random Llama)")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    import tempfile

    from _deepspeed import built_under_zero_init, describe
    from _tiny import causal_lm_and_tokenizer, synthetic_documents
    from trl import SFTConfig, SFTTrainer

    import ulysses_kernels as uk  # SP
    from ulysses_kernels import hf as ukhf  # SP

    config = SFTConfig(output_dir=args.output_dir or tempfile.mkdtemp(), max_steps=args.steps,
                       per_device_train_batch_size=args.batch_docs, padding_free=True, max_length=None,
                       learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], bf16=False,
                       use_cpu=not _cuda(), disable_tqdm=True)          # creates the process group
    groups = uk.init_sequence_parallel(args.sp)                             # SP
    ukhf.register(groups)                                                   # SP: attn_implementation="ulysses"
    model, tokenizer = causal_lm_and_tokenizer(args.model)                 # SP: attn_implementation="ulysses"
    zero_init = built_under_zero_init(model)   # a ZeRO-3 config: built partitioned

    class SPSFTTrainer(ukhf.SequenceParallelTrainerMixin, SFTTrainer):      # SP
        pass

    trainer = SPSFTTrainer(model=model, args=config, processing_class=tokenizer, sp_groups=groups,  # SP: sp_groups
                           train_dataset=synthetic_documents(64, 16, 200))
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"done: {result.global_step} steps at SP {groups.sp_size} x DP {groups.dp_size}, "
              f"final loss {trainer.state.log_history[-2]['loss']} ({describe(trainer, zero_init)})")
    return result


def _cuda():
    import torch

    return torch.cuda.is_available()


def _close_process_group():
    """Every rank done before any tears its process group down: a rank that exits while
    another still shuts down can abort its launcher's whole run."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    _close_process_group()
