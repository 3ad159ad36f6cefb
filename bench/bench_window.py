#!/usr/bin/env python
"""Benchmark windowed (sliding-window) attention: our Triton kernels against flash_attn's
windowed kernel when it is installed, and against our own full causal attention of the
same shape (the speed-up a window buys).

bf16, D = 128, causal, window W (default 4096: `window_size=(W - 1, 0)`), S = 32k..128k,
B = 1, 16 heads. FLOPs count only the visible (query, key) pairs, so TFLOP/s compare
kernels and the ratio to full attention is the real saving: forward 4 * H * D * pairs,
pairs = sum over queries of min(i + 1, W); forward+backward 3.5x forward (as
bench_attention.py). Timing: triton.testing.do_bench (median), random inputs.

Writes window_results.json and window_results.md into --out (default: $OUT, else
bench/results). Needs a CUDA GPU; `--dry-run` (or GPU_CHECK_DRY_RUN=1) only checks the
imports and arguments.

    python bench/bench_window.py [--seqlens 32768,65536,131072] [--window 4096] [--budget-s 40]
    TRITON_INTERPRET=1 python bench/bench_window.py --smoke --out /tmp/w   # the script on CPU (tests/bench/)
"""

import argparse
import json
import os
import sys
import time

from _attention_bench import flash_attn_func, refuse, timer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--seqlens", type=str, default="32768,65536,131072")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--modes", type=str, default="fwd,fwd_bwd")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new lengths after this")
    p.add_argument("--dry-run", action="store_true", help="check imports and arguments only")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes in the Triton interpreter on CPU (TRITON_INTERPRET=1): exercises the "
                        "script, its numbers mean nothing")
    return p.parse_args()


def visible_pairs(S: int, W: int) -> int:
    """(query, key) pairs of causal attention with a window of the last W keys."""
    full = min(S, W)
    return full * (full + 1) // 2 + (S - full) * W


def main():
    args = parse_args()
    from ulysses_kernels import env

    if args.dry_run or env.flag("GPU_CHECK_DRY_RUN"):
        import ulysses_kernels.triton  # noqa: F401

        print(f"bench_window: dry run, would run with {vars(args)}; visible pairs at 32k: "
              f"{visible_pairs(32768, args.window)}")
        return 0
    import torch
    import triton

    if refuse("bench_window", args.smoke):
        return 2
    if args.smoke:
        args.seqlens, args.window, args.heads, args.head_dim = "96", 16, 1, 16
    from ulysses_kernels.triton import flash_attention

    os.makedirs(args.out, exist_ok=True)
    flash = None if args.smoke else flash_attn_func()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    timed = timer(args.smoke, warmup=5, rep=30)

    W, H, D = args.window, args.heads, args.head_dim
    window_size = (W - 1, 0)  # the last W keys, the query included (flash_attn's convention)
    rows, t_start = [], time.time()
    for S in (int(x) for x in args.seqlens.split(",")):
        if args.budget_s is not None and time.time() - t_start > args.budget_s:
            print(f"bench_window: budget spent, skipping S={S}", flush=True)
            continue
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, S, H, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        impls = {"triton_window": lambda: flash_attention(q, k, v, causal=True, window_size=window_size),
                 "triton_full": lambda: flash_attention(q, k, v, causal=True)}
        if flash is not None:
            impls["flash_attn_window"] = lambda: flash(q, k, v, causal=True, window_size=window_size)
        pairs = {"triton_window": visible_pairs(S, W), "flash_attn_window": visible_pairs(S, W),
                 "triton_full": S * (S + 1) // 2}
        for mode in args.modes.split(","):
            for name, fn in impls.items():
                def run(fn=fn):
                    out = fn()
                    if mode == "fwd_bwd":
                        torch.autograd.grad(out, (q, k, v), do)
                ms = timed(run)
                flops = 4.0 * H * D * pairs[name] * (3.5 if mode == "fwd_bwd" else 1.0)
                rows.append(dict(S=S, W=W, mode=mode, impl=name, ms=ms, tflops=flops / ms / 1e9))
                print(f"S={S} W={W} {mode} {name}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
    gpu = "smoke (CPU, Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                flash_attn=flash is not None, heads=H, head_dim=D, dtype=str(dtype).replace("torch.", ""))
    with open(os.path.join(args.out, "window_results.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    with open(os.path.join(args.out, "window_results.md"), "w") as f:
        f.write(_table(rows, meta))
    return 0


def _table(rows, meta) -> str:
    """Markdown: one line per (S, mode) with each implementation's TFLOP/s and the window's
    speed-up over full causal attention (same-run times)."""
    lines = [f"# Windowed attention ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']})", "",
             "TFLOP/s over the visible pairs; speed-up = full causal time / windowed time.", "",
             "| S | W | mode | triton window | flash_attn window | triton full | speed-up |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["S"], r["W"], r["mode"]) for r in rows})
    for S, W, mode in keys:
        by = {r["impl"]: r for r in rows if (r["S"], r["W"], r["mode"]) == (S, W, mode)}
        cell = lambda n: f"{by[n]['tflops']:.1f}" if n in by else "-"  # noqa: E731
        speedup = by["triton_full"]["ms"] / by["triton_window"]["ms"] if {"triton_full", "triton_window"} <= set(by) else 0
        lines.append(f"| {S} | {W} | {mode} | {cell('triton_window')} | {cell('flash_attn_window')} | "
                     f"{cell('triton_full')} | {speedup:.1f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
