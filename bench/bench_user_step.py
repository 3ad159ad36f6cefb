#!/usr/bin/env python
"""The attention of the shapes users run, on every candidate kernel, and what the kernel
choice's `auto` picks (ulysses_kernels/kernel_choice/; docs/architecture.md, "The kernel
choice").

Rows: per-rank shapes at SP 8, batch 1, causal, bfloat16:
  Llama-3-8B          Hq 4 / Hkv 1, D 128
  Qwen3-32B           Hq 8 / Hkv 1, D 128
  GPT-OSS-20B full    Hq 8 / Hkv 1, D 64, sinks
  GPT-OSS-20B sliding Hq 8 / Hkv 1, D 64, sinks, a 128-token window (half the layers)
at S = 128K, 64K, 32K, one document or 8 equal packed documents, forward and forward +
backward. Each row times every candidate whose capability table covers the class and that
is installed here, then asks `kernel_choice.choose` with an empty cache (so it times on its
own representative shape, at most 32K tokens) and reports its pick, the pick's time in this
benchmark and the ratio best / auto (1.00: auto is the best; the goal: >= 0.98 on every row).
FLOPs count the visible (query, key) pairs exactly (causal, window, documents): forward
4 * Hq * D per pair, forward + backward 3.5x that. Timing: the median of CUDA-event times
after a warm-up call (gpu_timer), fresh random inputs (never zeros).

Writes user_step_results.json and user_step_results.md into --out (default: $OUT, else
bench/results). Needs a CUDA GPU; --smoke runs tiny shapes on CPU in the Triton
interpreter (the numbers mean nothing), --dry-run prints the plan.

    python bench/bench_user_step.py [--out DIR] [--budget-s 120] [--lengths 131072,65536]
"""

import argparse
import os
import sys
import tempfile
import time

from _attention_bench import refuse
from _results import write_results

MODELS = (  # name, Hq, Hkv, D, sinks, window (left) or None
    ("Llama-3-8B", 4, 1, 128, False, None),
    ("Qwen3-32B", 8, 1, 128, False, None),
    ("GPT-OSS-20B full", 8, 1, 64, True, None),
    ("GPT-OSS-20B sliding", 8, 1, 64, True, 128),
)
LENGTHS = (131072, 65536, 32768)
DOCUMENTS = (1, 8)
MODES = ("fwd_bwd", "fwd")
GOAL = 0.98  # best / auto


def gpu_timer(fn) -> float:
    """Median milliseconds of `fn` (CUDA events per call) after one warm-up call (it compiles):
    3 to 20 calls, as many as fit in about 0.15 s, so a 128K forward + backward costs a
    second, not do_bench's estimate rounds."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(3, min(20, int(0.15 / max(time.perf_counter() - t0, 1e-4))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cpu_timer(fn) -> float:
    """Smoke mode: one timed call after a warm-up (the numbers mean nothing)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--lengths", type=str, default=None, help="comma-separated sequence lengths (default 128K,64K,32K)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="do not start a row predicted to end after this many seconds (results so far are kept)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script (TRITON_INTERPRET=1, tiny shapes)")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit (GPU_CHECK_DRY_RUN)")
    return p.parse_args()


def visible_pairs(length: int, documents: int, window) -> int:
    """(query, key) pairs a causal call sees: per document of L tokens, row i sees
    min(i, window) + 1 keys (window None: i + 1)."""
    bounds = [round(i * length / documents) for i in range(documents + 1)]
    total = 0
    for lo, hi in zip(bounds, bounds[1:]):
        n = hi - lo
        w = n if window is None else min(window, n)
        total += (w + 1) * w // 2 + (n - w) * (w + 1) if n > w else n * (n + 1) // 2
    return total


def rows(lengths):
    for length in lengths:
        for documents in DOCUMENTS:
            for model in MODELS:
                for mode in MODES:
                    yield model, length, documents, mode


def _inputs(model, length, documents, device, dtype):
    import torch

    _, hq, hkv, d, sinks, window = model
    q = torch.randn(1, length, hq, d, device=device, dtype=dtype)
    k = torch.randn(1, length, hkv, d, device=device, dtype=dtype)
    v = torch.randn(1, length, hkv, d, device=device, dtype=dtype)
    cu = None
    if documents > 1:
        cu = torch.tensor([round(i * length / documents) for i in range(documents + 1)], dtype=torch.int32,
                          device=device)
    s = torch.randn(hq, device=device, dtype=torch.float32) if sinks else None
    return q, k, v, cu, s


def _call_fn(name, q, k, v, cu, sinks, variant, grad):
    import torch

    from ulysses_kernels import kernel_choice

    leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    sink_leaf = sinks.detach().requires_grad_(grad) if sinks is not None else None
    do = torch.randn_like(q)

    def fn():
        with torch.enable_grad() if grad else torch.no_grad():
            out = kernel_choice.run(name, *leaves, causal=True, cu_seqlens=cu, variant=variant, sinks=sink_leaf)
            if grad:
                torch.autograd.grad(out, leaves + ([sink_leaf] if sink_leaf is not None else []), do)
    return fn


def measure(model, length, documents, mode, device, dtype, timed):
    """One row: every eligible candidate's ms and TFLOP/s, auto's pick and the ratio."""
    from ulysses_kernels import kernel_choice
    from ulysses_kernels.variants import make_variant

    name, hq, _, d, _, window = model
    grad = mode == "fwd_bwd"
    q, k, v, cu, sinks = _inputs(model, length, documents, device, dtype)
    variant = make_variant((window if window is not None else -1, -1), 0.0, causal=True)
    call = kernel_choice.call_of(q, k, v, causal=True, packed=cu is not None, variant=variant,
                                 sinks=sinks is not None, grad=grad)
    eligible, reasons = kernel_choice.choice.consider(call)
    flops = 4 * hq * d * visible_pairs(length, documents, window) * (3.5 if grad else 1.0)
    row = dict(model=name, S=length, documents=documents, mode=mode, D=d, Hq=hq, call=call.text(), candidates={},
               excluded=reasons)
    for candidate in eligible:
        try:
            ms = timed(_call_fn(candidate, q, k, v, cu, sinks, variant, grad))
            row["candidates"][candidate] = dict(ms=ms, tflops=flops / ms / 1e9)
        except Exception as exc:  # noqa: BLE001 - a failing kernel is a result, not a crash
            row["candidates"][candidate] = dict(error=f"{type(exc).__name__}: {str(exc)[:160]}")
    kernel_choice.clear_memory_cache()
    decision = kernel_choice.choose(call, device=q.device)
    row["auto"], row["auto_how"] = decision.choice, decision.how
    timings = {n: r["ms"] for n, r in row["candidates"].items() if "ms" in r}
    if timings:
        best = min(timings, key=timings.get)
        row["best"] = best
        # auto's pick failing at this row's full length (out of memory at 128K) is the worst outcome,
        # not a row left out of the verdict
        row["best_over_auto"] = timings[best] / timings[decision.choice] if decision.choice in timings else 0.0
    return row


def markdown(results, meta):
    names = sorted({n for r in results for n in r["candidates"]}, key=lambda n: (n != "triton", n))
    lines = ["# Attention at the shapes users run: every candidate and auto's pick", "",
             f"{meta['device']}, torch {meta['torch']}, {meta['when']}. TFLOP/s (visible pairs; fwd+bwd = 3.5x fwd);",
             f"best/auto = the best candidate's time over auto's pick's (goal >= {GOAL}). Per-rank shapes at SP 8, "
             "B 1, causal, bf16.", "",
             "| model | S | docs | mode | " + " | ".join(names) + " | best | auto | best/auto |",
             "|---|---|---|---|" + "---|" * len(names) + "---|---|---|"]
    for r in results:
        cells = []
        for n in names:
            c = r["candidates"].get(n)
            cells.append("-" if c is None else (f"{c['tflops']:.0f}" if "tflops" in c else "error"))
        ratio = r.get("best_over_auto")
        flag = "" if ratio is None or ratio >= GOAL else " **below goal**"
        size = f"{r['S'] // 1024}K" if r["S"] >= 1024 else str(r["S"])
        lines.append(f"| {r['model']} | {size} | {r['documents']} | {r['mode']} | " + " | ".join(cells)
                     + f" | {r.get('best', '-')} | {r['auto']} | "
                     + (f"{ratio:.3f}{flag}" if ratio is not None else "-") + " |")
    if meta.get("skipped"):
        lines += ["", f"Incomplete: {meta['skipped']} rows not started (time budget)."]
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    from ulysses_kernels import env

    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else LENGTHS
    if args.smoke:
        lengths = (64,)
    if args.dry_run or env.flag("GPU_CHECK_DRY_RUN"):
        import torch  # noqa: F401

        from ulysses_kernels import kernel_choice  # noqa: F401
        print(f"bench_user_step: dry run, would run {len(list(rows(lengths)))} rows with {vars(args)}")
        return 0
    if refuse("bench_user_step", args.smoke):
        return 2
    import torch

    os.environ[env.CACHE_DIR.name] = tempfile.mkdtemp(prefix="bench_user_step_")  # auto times afresh
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    timed = cpu_timer if args.smoke else gpu_timer
    results, start, skipped, last = [], time.time(), 0, 0.0
    for model, length, documents, mode in rows(lengths):
        if args.budget_s is not None and time.time() - start + last > args.budget_s:
            skipped += 1
            continue
        t0 = time.time()
        results.append(measure(model, length, documents, mode, device, dtype, timed))
        last = time.time() - t0
        print(f"bench_user_step: {results[-1]['model']} S {length} docs {documents} {mode}: auto "
              f"{results[-1]['auto']}, best {results[-1].get('best')} ({last:.1f}s)", flush=True)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
                torch=torch.__version__, when=time.strftime("%Y-%m-%d %H:%M"), skipped=skipped,
                complete=skipped == 0, goal=GOAL)
    write_results(args.out, "user_step_results", markdown(results, meta), dict(meta=meta, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
