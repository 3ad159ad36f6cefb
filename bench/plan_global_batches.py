#!/usr/bin/env python
"""The global-batch planner's balance from lengths alone (ulysses_kernels/global_batch.py;
docs/global_batch.md): for two length mixes and 8 and 64 ranks, the step's makespan (the
slowest rank's attention + linear + exchange cost, summed over micro-batches) over the
ideal (the documents' rank-work at their smallest SP sizes divided by the ranks), for a
fixed layout (one SP size that fits the longest document, documents dealt to the DP groups
in order) and for the planner (SP size per document, placement by cost). Llama-3-8B's cost
model, a budget of 64K tokens a rank, 5 global batches (seeds) each.

    python bench/plan_global_batches.py [--out DIR] [--seeds 5]

Runs on CPU in seconds (no torch needed); writes global_batch_balance.md and .json.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _results import write_results  # noqa: E402
from test_global_batch import long_context_mix, long_tail  # noqa: E402  (the mixes the tests use)

from ulysses_kernels import global_batch as gb  # noqa: E402

MIXES = (("long-tail SFT (lognormal, median 2K, sigma 1, 32-128K)", long_tail, 1 << 20),
         ("long-context mix (80% 1-8K, 20% 64-512K tokens)", long_context_mix, 4 << 20))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--budget", type=int, default=65536, help="tokens a rank holds in one micro-batch")
    args = p.parse_args()
    rows = []
    for name, mix, total in MIXES:
        for world in (8, 64):
            for seed in range(args.seeds):
                lengths = mix(total, seed)
                t0 = time.perf_counter()
                plan = gb.plan_global_batch(lengths, world=world, token_budget=args.budget)
                took = time.perf_counter() - t0
                naive = gb.naive_plan(lengths, world=world, token_budget=args.budget)
                rows.append(dict(mix=name, world=world, seed=seed, documents=len(lengths), tokens=sum(lengths),
                                 naive=naive.imbalance, naive_sp=naive.micro_batches[0].sp,
                                 naive_micro_batches=len(naive.micro_batches), planner=plan.imbalance,
                                 planner_sp=sorted({mb.sp for mb in plan.micro_batches}),
                                 planner_micro_batches=len(plan.micro_batches), plan_s=took))
    lines = ["# Global-batch balance: makespan over the ideal", "",
             f"Llama-3-8B's cost model, {args.budget} tokens a rank, {args.seeds} global batches per row "
             "(`python bench/plan_global_batches.py`).", "",
             "| mix | ranks | documents | fixed layout (SP size) | planner (SP sizes used) | planner time |",
             "|---|---|---|---|---|---|"]
    for name, _, _ in MIXES:
        for world in (8, 64):
            sel = [r for r in rows if r["mix"] == name and r["world"] == world]
            sizes = sorted({s for r in sel for s in r["planner_sp"]})
            lines.append(f"| {name} | {world} | {min(r['documents'] for r in sel)}-{max(r['documents'] for r in sel)} "
                         f"| {min(r['naive'] for r in sel):.3f}-{max(r['naive'] for r in sel):.3f} "
                         f"(SP {sorted({r['naive_sp'] for r in sel})}) "
                         f"| {min(r['planner'] for r in sel):.3f}-{max(r['planner'] for r in sel):.3f} (SP {sizes}) "
                         f"| {max(r['plan_s'] for r in sel) * 1e3:.0f} ms |")
    write_results(args.out, "global_batch_balance", "\n".join(lines) + "\n", dict(rows=rows, budget=args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
