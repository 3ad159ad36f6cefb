"""Peak memory of one training step of a HF causal LM with and without tiling (CPU or GPU).

    python bench/bench_tiling.py [--seq-len 4096 --hidden 256 --intermediate 4096 --vocab 32000]

Each variant runs in a fresh subprocess (peak RSS, `ru_maxrss`, is a process-lifetime
maximum). Printed per variant: the process's peak RSS, the RSS right before the step
(imports, model, optimizer-free weights and the batch), and their difference = the
step's peak activation + gradient memory. On CUDA, `torch.cuda.max_memory_allocated`
is reported instead. Single process (SP = 1): under Ulysses SP each rank runs the same
code on S/P tokens, so these numbers are the per-rank ones for S = P * seq_len.
Attention uses "sdpa" (memory-efficient on CPU), so the MLP and the LM head dominate.
"""

import argparse
import json
import os
import resource
import subprocess
import sys

VARIANTS = {
    "plain": dict(tiled_mlp=False, tiled_loss=False, ckpt=False),
    "tiled_loss": dict(tiled_mlp=False, tiled_loss=True, ckpt=False),
    "tiled_mlp": dict(tiled_mlp=True, tiled_loss=False, ckpt=False),
    "tiled_mlp+loss": dict(tiled_mlp=True, tiled_loss=True, ckpt=False),
    "checkpointing": dict(tiled_mlp=False, tiled_loss=False, ckpt=True),
    "checkpointing+tiled": dict(tiled_mlp=True, tiled_loss=True, ckpt=True),
}


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args, variant):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ulysses_kernels import hf as ukhf

    torch.set_num_threads(args.threads)
    v = VARIANTS[variant]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab,
                      max_position_embeddings=args.seq_len, attention_dropout=0.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().to(dev).train()
    if v["tiled_mlp"] or v["tiled_loss"]:
        ukhf.patch_model(model, tiled_mlp=v["tiled_mlp"], tiled_loss=v["tiled_loss"])
    if v["ckpt"]:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids = torch.randint(0, args.vocab, (1, args.seq_len), device=dev)
    batch = ukhf.shard_batch(ids, None)
    # one warm-up step on a short sequence so lazy allocations are not counted
    ukhf.causal_lm_loss(model, ukhf.shard_batch(ids[:, :32], None)).backward()
    model.zero_grad(set_to_none=False)
    before = _rss_mib()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    loss = ukhf.causal_lm_loss(model, batch)
    loss.backward()
    out = dict(variant=variant, loss=loss.item())
    if dev.type == "cuda":
        out.update(peak_mib=torch.cuda.max_memory_allocated() / 2**20, before_mib=base)
    else:
        out.update(peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, before_mib=before)
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args, args.child)
    logits_mib = args.seq_len * args.vocab * 4 / 2**20
    mlp_mib = args.layers * args.seq_len * args.intermediate * 4 / 2**20
    print(f"seq_len {args.seq_len}, hidden {args.hidden}, intermediate {args.intermediate}, layers {args.layers}, "
          f"vocab {args.vocab}, float32: full logits {logits_mib:.0f} MiB, MLP intermediates "
          f"{mlp_mib:.0f} MiB per [S, intermediate] tensor summed over layers")
    print(f"{'variant':<22}{'peak MiB':>10}{'before MiB':>12}{'step MiB':>10}{'loss':>10}")
    results = []
    for name in args.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name] + \
              [a for a in sys.argv[1:] if not a.startswith("--variants")]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{name:<22} failed:\n{res.stderr[-2000:]}")
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{name:<22}{r['peak_mib']:>10.0f}{r['before_mib']:>12.0f}{r['peak_mib'] - r['before_mib']:>10.0f}"
              f"{r['loss']:>10.4f}", flush=True)
    return results


if __name__ == "__main__":
    main()
