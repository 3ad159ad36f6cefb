"""Generate from a long prompt with sequence-parallel prefill and a head-sharded KV cache.

    torchrun --nproc-per-node 4 examples/generate_hf.py --prompt-len 4096 --new-tokens 32

Runs on CPU (gloo) or GPUs (NCCL, one per rank). No network is needed: the model is a
tiny random Llama-style config unless --model points at a local HF checkpoint directory;
the prompt is --prompt-len random token ids (a seeded draw, the same on every rank).
Prints time to first token (the sequence-parallel prefill and the first decode step),
decode tokens/s, and every rank's peak memory (GPU: max allocated; CPU: max RSS) and
KV-cache bytes. --check also runs single-device `model.generate` on rank 0 and
compares the tokens (small prompts only: that run holds the whole cache).

Also callable in-process for tests: `run(rank, world, argv)` with torch.distributed
already initialised; returns a dict of the measurements and the tokens.
"""

import argparse
import resource
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF model directory (default: tiny random Llama)")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--sample", action="store_true", help="sample (top-k 50) instead of greedy")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--check", action="store_true", help="compare with single-device generate on rank 0")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_model(args, device, attn="ulysses"):
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn, torch_dtype=dtype)
    else:
        torch.manual_seed(args.seed)
        config = transformers.LlamaConfig(
            hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=256,
            max_position_embeddings=max(4096, args.prompt_len + args.new_tokens), attention_dropout=0.0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(dtype)
    return model.to(device).eval()


def peak_memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(rank, world, argv=None):
    from ulysses_kernels import hf as ukhf

    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ukhf.register(dist.group.WORLD)
    model = load_model(args, device)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(args.seed + 1)).to(device)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=args.sample, top_k=50 if args.sample else None,
               min_new_tokens=args.new_tokens)   # a fixed count, so tokens/s compares runs

    _sync(device)
    t0 = time.perf_counter()
    first = ukhf.generate(model, prompt, max_new_tokens=1, min_new_tokens=1, do_sample=args.sample,
                          top_k=gen["top_k"])
    _sync(device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = ukhf.generate(model, prompt, **gen)
    _sync(device)
    total = time.perf_counter() - t0
    decode_s = max(total - ttft, 1e-9)
    logits, cache = ukhf.prefill(model, prompt)
    result = dict(ttft_s=ttft, decode_tokens_per_s=args.batch * (args.new_tokens - 1) / decode_s,
                  cache_bytes=cache.bytes_per_rank(), peak_bytes=peak_memory_bytes(device),
                  tokens=tokens.cpu(), first=first.cpu())
    stats = torch.tensor([result["peak_bytes"], result["cache_bytes"]], dtype=torch.float64,
                         device=device if device.type == "cuda" else "cpu")
    every = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(every, stats)
    if rank == 0:
        print(f"world {world}, prompt {args.batch} x {args.prompt_len} tokens, {args.new_tokens} new, "
              f"{'sampled' if args.sample else 'greedy'}, {args.dtype} on {device.type}")
        print(f"time to first token {ttft * 1e3:.1f} ms (sequence-parallel prefill + one decode step); "
              f"decode {result['decode_tokens_per_s']:.1f} tokens/s")
        for r, s in enumerate(every):
            print(f"  rank {r}: peak memory {s[0].item() / 2**20:.1f} MiB, KV cache {s[1].item() / 2**20:.3f} MiB")
        print("new tokens (row 0):", tokens[0, args.prompt_len:].tolist())
    if args.check and rank == 0 and not args.sample:
        reference = load_model(args, device, attn="eager")   # the same weights, no collectives
        same = torch.equal(reference.generate(prompt, **gen), tokens)
        result["matches_single_device"] = same
        print("matches single-device model.generate:", same)
    return result


def main():
    from ulysses_kernels.launch import torchrun_main

    torchrun_main(run, "torchrun --nproc-per-node 4 examples/generate_hf.py")


if __name__ == "__main__":
    main()
