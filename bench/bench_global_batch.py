#!/usr/bin/env python
"""Wall time of one global batch on CPU (world 4, gloo): a fixed layout (SP 4 for every
document, packed in order) against the planner's placement with an SP size per micro-batch
(ulysses_kernels/global_batch.py, hf/training/global_batch.py; docs/global_batch.md).

The long-tail mix scaled down to the machine: lengths lognormal with median 256 and sigma 1.0,
clipped to [16, 4096], 16K tokens a global batch, 2,048 tokens a rank at once; a tiny Llama
(hidden 128, 2 layers, 4 / 2 heads of 32) in float32 with the "ulysses" attention on the
reference path (torch SDPA). Each layout: one warm-up global batch, then the median of
--reps timed ones (forward, backward and the gradients summed over the world), and the
planner's makespan estimate from the same cost model for comparison.

    python bench/bench_global_batch.py [--out DIR] [--reps 3] [--smoke]
"""

import argparse
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from _results import write_results  # noqa: E402


def lengths(total, seed, median, high):
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(int(min(high, max(16, rng.lognormvariate(math.log(median), 1.0)))))
    return out


def ranks(rank, world, setting):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    docs_lengths = lengths(setting["tokens"], 0, setting["median"], setting["high"])
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in docs_lengths]
    plans = {"fixed SP 4, in order": uk.naive_plan(docs_lengths, world=world, token_budget=setting["budget"], sp=world),
             "planner": uk.plan_global_batch(docs_lengths, world=world, token_budget=setting["budget"])}
    ukhf.register(uk.init_sequence_parallel(world))
    config = transformers.LlamaConfig(hidden_size=setting["hidden"], intermediate_size=2 * setting["hidden"],
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, max_position_embeddings=1 << 16, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses").float()
    sizes = sorted({s for p in plans.values() for s in p.sp_sizes()})
    dynamic = ukhf.DynamicSequenceParallel(model, sizes)
    out = dict(documents=len(docs), tokens=sum(docs_lengths))
    for name, plan in plans.items():
        times = []
        for rep in range(setting["reps"] + 1):
            model.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ukhf.train_global_batch(model, docs, plan, dynamic)
            torch.distributed.barrier()
            if rep:   # the first is a warm-up
                times.append(time.perf_counter() - t0)
        out[name] = dict(seconds=sorted(times)[len(times) // 2], imbalance=plan.imbalance,
                         micro_batches=len(plan.micro_batches), sp_sizes=plan.sp_sizes())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a tiny global batch (the script end to end; numbers mean nothing)")
    args = p.parse_args()
    setting = dict(tokens=16384, median=256, high=4096, budget=2048, hidden=128, reps=args.reps)
    if args.smoke:
        setting.update(tokens=512, median=32, high=256, budget=128, hidden=32, reps=1)
    from ulysses_kernels.launch import spawn

    result = spawn(ranks, 4, args=(setting,), timeout=1200)[0]
    fixed, planned = result["fixed SP 4, in order"], result["planner"]
    lines = ["# One global batch on CPU: a fixed layout against the planner", "",
             f"World 4 (gloo), {result['documents']} documents, {result['tokens']} tokens (lognormal, median "
             f"{setting['median']}, clipped to [16, {setting['high']}]), {setting['budget']} tokens a rank at once, "
             f"a Llama of hidden {setting['hidden']} in float32; median of {setting['reps']} global batches.", "",
             "| layout | seconds | micro-batches | SP sizes | cost model's makespan / ideal |", "|---|---|---|---|---|"]
    for name in ("fixed SP 4, in order", "planner"):
        r = result[name]
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['micro_batches']} | {r['sp_sizes']} | {r['imbalance']:.2f} |")
    lines += ["", f"Planner over fixed layout: {planned['seconds'] / fixed['seconds']:.2f}x the wall time."]
    write_results(args.out, "global_batch_cpu" + ("_smoke" if args.smoke else ""), "\n".join(lines) + "\n",
                  dict(setting=setting, result=result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
