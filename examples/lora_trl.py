"""LoRA fine-tuning with Ulysses sequence parallelism: TRL's SFTTrainer, then GRPOTrainer on
the SFT adapters' merged model, both with a LoRA `peft_config=`, plus the lines marked `# SP`.

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/lora_trl.py --sp 2
    torchrun --nproc-per-node 4 examples/lora_trl.py --sp 2

CPU (gloo) or GPUs. The model is a tiny random Llama unless --model points at a local
checkpoint; the documents and prompts are synthetic, the reward a toy. PEFT's LoRA layers
live inside the transformers model, so the sequence-parallel attention, loss and scoring
see them; GRPO's reference pass (beta > 0) runs with the adapters disabled, scored
sequence-parallel too. `merge_and_unload()` gives the weights the run without SP gives.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel size (divides the world size)")
    p.add_argument("--steps", type=int, default=2, help="steps of each stage (SFT, then GRPO)")
    p.add_argument("--model", default=None, help="local HF checkpoint (default: tiny random Llama)")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    import tempfile

    from _tiny import causal_lm_and_tokenizer, synthetic_documents
    from grpo_trl import even_token_share, synthetic_prompts
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    import ulysses_kernels as uk  # SP
    from ulysses_kernels import hf as ukhf  # SP

    out = args.output_dir or tempfile.mkdtemp()
    common = dict(max_steps=args.steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                  bf16=False, use_cpu=not _cuda(), disable_tqdm=True)
    sft_config = SFTConfig(output_dir=f"{out}/sft", per_device_train_batch_size=8, padding_free=True,
                           max_length=None, **common)                      # creates the process group
    groups = uk.init_sequence_parallel(args.sp)                             # SP
    ukhf.register(groups)                                                   # SP: attn_implementation="ulysses"
    model, tokenizer = causal_lm_and_tokenizer(args.model)                 # SP: attn_implementation="ulysses"

    class SPSFTTrainer(ukhf.SequenceParallelTrainerMixin, SFTTrainer):      # SP
        pass

    sft = SPSFTTrainer(model=model, args=sft_config, processing_class=tokenizer, peft_config=lora_config(),
                       train_dataset=synthetic_documents(64, 16, 200), sp_groups=groups)   # SP: sp_groups
    sft.train()
    merged = sft.model.merge_and_unload()   # the SFT adapters folded into the weights

    class SPGRPOTrainer(ukhf.SequenceParallelGRPOMixin, GRPOTrainer):      # SP
        pass

    grpo_config = GRPOConfig(output_dir=f"{out}/grpo", per_device_train_batch_size=4, num_generations=4,
                             max_completion_length=8, beta=0.04, **common)
    grpo = SPGRPOTrainer(model=merged, reward_funcs=even_token_share, args=grpo_config, processing_class=tokenizer,
                         peft_config=lora_config(), train_dataset=synthetic_prompts(32, 8, 48),
                         sp_groups=groups)                                 # SP: sp_groups
    result = grpo.train()
    if grpo.is_world_process_zero():
        trainable = sum(p.numel() for p in grpo.model.parameters() if p.requires_grad)
        print(f"done: {args.steps} SFT and {result.global_step} GRPO steps with LoRA ({trainable} trainable "
              f"parameters) at SP {groups.sp_size} x DP {groups.dp_size}")
    return sft.state.global_step, result.global_step


def _cuda():
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
