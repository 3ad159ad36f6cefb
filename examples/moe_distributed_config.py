"""Ulysses sequence parallelism inside transformers' own distributed training: a
mixture-of-experts model loaded with `distributed_config=DistributedConfig(fsdp_size=...,
ep_size=...)` (FSDP2 for the dense weights, experts sharded over expert parallelism), SP
carved out of its fsdp dimension, the router's load-balancing loss over each whole sequence,
plus the lines marked `# SP`.

    torchrun --nproc-per-node 4 examples/moe_distributed_config.py --sp 2

CPU (gloo) or GPUs. The model is a tiny random Qwen3-MoE (8 experts, top 2, the router loss
on) unless --model points at a local checkpoint; the documents are synthetic. Each step
trains on one document per DP group; at the end the model is saved with `save_pretrained`
(every rank calls it; one process can load the folder).
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def tiny_moe(folder):
    """A tiny random Qwen3-MoE saved in `folder` (rank 0 writes it, every rank waits)."""
    import torch
    import torch.distributed as dist
    import transformers

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                             output_router_logits=True, router_aux_loss_coef=0.01,
                                             tie_word_embeddings=False)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    dist.barrier()
    return folder


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel size (divides the fsdp size)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--model", default=None, help="local MoE checkpoint (default: tiny random Qwen3-MoE)")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from ulysses_kernels import hf as ukhf  # SP

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    out = args.output_dir or tempfile.mkdtemp()
    path = args.model or tiny_moe(os.path.join(out, "seed"))
    ukhf.register()                                                           # SP: the "ulysses" attention
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ulysses",     # SP: "ulysses"
                                                 distributed_config=DistributedConfig(fsdp_size=world,
                                                                                      ep_size=args.ep or world))
    groups = ukhf.sequence_parallel_groups(model, args.sp)                   # SP: carved out of fsdp
    ukhf.register(groups)                                                     # SP
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(groups.dp_rank)    # each DP group its own documents
    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (1, args.seq_len), generator=g).to(device)
        batch = ukhf.shard_batch(ids, groups, labels=ids)                     # SP: this rank's slice
        loss = ukhf.causal_lm_loss(model, batch, groups)                     # SP: the router loss included
        loss.backward()                                                       # SP: SUM over SP, MEAN over DP
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {float(loss):.4f}")
    model.save_pretrained(os.path.join(out, "trained"))                      # collective; loads in one process
    experts = model.model.layers[0].mlp.experts.num_experts
    if dist.get_rank() == 0:
        print(f"done: {args.steps} steps at SP {groups.sp_size} x DP {groups.dp_size}, {experts} experts a rank, "
              f"saved to {out}/trained")
    return dict(loss=float(loss), dp_rank=groups.dp_rank, local_experts=experts, saved=os.path.join(out, "trained"))


if __name__ == "__main__":
    main()
