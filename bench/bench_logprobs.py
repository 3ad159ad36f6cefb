"""Peak memory of per-token log-probs and entropy at one long shard: `ukhf.token_logprobs`
(the LM head tiled, `[tile, vocab]` logits at a time) against the usual computation from the
model's full logits (`model(...).logits`, float32 `log_softmax`, gather, entropy: what TRL's
GRPO trainer does per rank), forward and backward (docs/hf_rl.md, "RL").

Each variant runs in a fresh process on CPU; the number is the growth of the peak resident
set (`ru_maxrss`) over the process's resident set after the model and inputs exist, so both
variants pay the same backbone activations. A tiny Llama (one layer) with a real vocabulary
makes the LM head dominate, as at long context.

    python bench/bench_logprobs.py [--tokens 8192] [--vocab 32000] [--hidden 256] [--out DIR]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _results import write_results  # noqa: E402 (bench/ is the script's folder)


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _run_variant(args):
    import torch
    import transformers

    from ulysses_kernels import hf as ukhf

    torch.set_num_threads(1)
    ukhf.register(None)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=1, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=args.hidden // 64, max_position_embeddings=args.tokens + 1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ulysses").float().train()
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    batch = ukhf.shard_batch(ids, None)
    before = _rss_mb()
    start = time.perf_counter()
    if args.variant == "tiled":
        logp, entropy = ukhf.token_logprobs(model, batch, None, with_entropy=True)
    else:
        logits = model(**batch.model_inputs()).logits.float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, batch.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp.sum() + 0.01 * entropy.sum()).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"variant": args.variant, "peak_growth_mb": peak - before, "seconds": seconds,
                      "logits_mb": args.tokens * args.vocab * 4 / 2**20}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--variant", choices=["tiled", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the bench smoke test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.vocab, args.hidden = 256, 1000, 64
    if args.variant:
        _run_variant(args)
        return 0
    rows = []
    for variant in ("full", "tiled"):
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    full, tiled = rows
    md = (f"# Per-token log-probs and entropy at one shard: peak memory (CPU, resident set)\n\n"
          f"Llama, 1 layer, hidden {args.hidden}, vocab {args.vocab}, {args.tokens} tokens, float32, forward + "
          f"backward; one float32 `[tokens, vocab]` logits tensor is {full['logits_mb']:.0f} MiB.\n\n"
          "| variant | peak growth MiB | seconds |\n|---|---|---|\n"
          f"| model logits + log_softmax (TRL's way) | {full['peak_growth_mb']:.0f} | {full['seconds']:.2f} |\n"
          f"| `ukhf.token_logprobs` (tiled) | {tiled['peak_growth_mb']:.0f} | {tiled['seconds']:.2f} |\n\n"
          f"Ratio: {full['peak_growth_mb'] / max(tiled['peak_growth_mb'], 1e-9):.1f}x less peak growth tiled.\n")
    write_results(args.out, "logprobs_memory", md, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
