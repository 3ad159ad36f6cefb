#!/usr/bin/env python
"""Benchmark the Triton flash attention against PyTorch SDPA (flash and cuDNN backends).

Forward and forward+backward TFLOP/s, bf16, head dims 64 and 128, causal and not, over
sequence lengths 4k..128k with B*S about constant (128k tokens). FLOPs: forward
4*B*H*Sq*Sk*D (halved when causal); backward 2.5x forward, so fwd+bwd = 3.5x. Timing:
triton.testing.do_bench (median) after warm-up, random inputs.

Writes results.json, results.md and (if matplotlib is installed) tflops.png into --out
(default: $OUT if set, else bench/results). Needs a CUDA GPU.

    python bench/bench_attention.py [--quick] [--out DIR]
"""

import argparse
import json
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--quick", action="store_true", help="short run: fewer lengths, shorter timing")
    p.add_argument("--seqlens", type=str, default=None, help="comma-separated sequence lengths")
    p.add_argument("--head-dims", type=str, default="128,64")
    p.add_argument("--tokens", type=int, default=128 * 1024, help="B*S per configuration")
    p.add_argument("--modes", type=str, default="fwd,fwd_bwd")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baselines")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new configurations after this many seconds (results so far are kept)")
    return p.parse_args()


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    try:
        import torch
    except ImportError:
        print("bench_attention: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU available; this benchmark needs one (nothing to do).",
              file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("bench_attention: TRITON_INTERPRET=1 is set; unset it to benchmark real kernels.",
              file=sys.stderr)
        return 2
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from ulysses_kernels.triton import flash_attention

    if args.seqlens:
        seqlens = [int(x) for x in args.seqlens.split(",")]
    elif args.quick:
        seqlens = [4096, 16384]
    else:
        seqlens = [4096, 16384, 65536, 131072]
    head_dims = [int(x) for x in args.head_dims.split(",")]
    modes = args.modes.split(",")
    rep = 30 if args.quick else 100
    warmup = 10 if args.quick else 25

    dev = torch.cuda.get_device_name()
    print(f"# Attention benchmark on {dev}, torch {torch.__version__}, triton {triton.__version__}")
    print(HEADER)
    rows = []
    t_start = time.time()
    meta = {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "tokens": args.tokens,
            "complete": False}

    def write():
        with open(os.path.join(args.out, "attention_results.json"), "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        with open(os.path.join(args.out, "attention_results.md"), "w") as f:
            f.write(_table_md(rows, meta))

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    for D in head_dims:
        H = 16 if D >= 128 else 32
        for S in seqlens:
            B = max(1, args.tokens // S)
            for causal in (False, True):
                if args.budget_s is not None and time.time() - t_start > args.budget_s:
                    print(f"bench_attention: time budget of {args.budget_s:.0f}s used up; "
                          f"skipping D={D} S={S} causal={causal}", flush=True)
                    meta.setdefault("skipped", []).append({"D": D, "S": S, "causal": causal})
                    continue
                torch.manual_seed(0)
                q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                do = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
                qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
                dot = do.transpose(1, 2).contiguous()
                flops_fwd = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
                impls = {"triton": lambda: flash_attention(q, k, v, causal=causal)}
                if not args.no_sdpa:
                    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                        def run(backend=backend):
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        impls[name] = run
                for mode in modes:
                    result = {"D": D, "H": H, "B": B, "S": S, "causal": causal, "mode": mode}
                    for name, fn in impls.items():
                        grad = do if name == "triton" else dot
                        leaves = (q, k, v) if name == "triton" else (qt, kt, vt)
                        try:
                            if mode == "fwd":
                                with torch.no_grad():
                                    fn()
                                    ms = timed(lambda: fn())
                                flops = flops_fwd
                            else:
                                def step():
                                    for t in leaves:
                                        t.grad = None
                                    fn().backward(grad)
                                step()
                                ms = timed(step)
                                flops = 3.5 * flops_fwd
                            result[f"{name}_ms"] = ms
                            result[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
                        except Exception as exc:  # a backend may not support this shape
                            result[f"{name}_ms"] = None
                            result[f"{name}_tflops"] = None
                            result[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    for base in ("sdpa_flash", "sdpa_cudnn"):
                        if result.get("triton_tflops") and result.get(f"{base}_tflops"):
                            result[f"ratio_vs_{base}"] = result["triton_tflops"] / result[f"{base}_tflops"]
                    rows.append(result)
                    print(_row_md(result), flush=True)
                    write()
                del q, k, v, do, qt, kt, vt, dot
                torch.cuda.empty_cache()

    meta["complete"] = "skipped" not in meta
    meta["seconds"] = round(time.time() - t_start, 1)
    write()
    print()
    print(_table_md(rows, meta))
    _plot(rows, args.out)
    return 0


HEADER = ("| mode | D | H | B | S | causal | triton TFLOP/s | sdpa flash TFLOP/s | sdpa cuDNN TFLOP/s "
          "| triton/flash | triton/cuDNN |")


def _fmt(x, digits=1):
    return "n/a" if x is None else f"{x:.{digits}f}"


def _row_md(r):
    return (f"| {r['mode']} | {r['D']} | {r['H']} | {r['B']} | {r['S']} | {r['causal']} "
            f"| {_fmt(r.get('triton_tflops'))} | {_fmt(r.get('sdpa_flash_tflops'))} "
            f"| {_fmt(r.get('sdpa_cudnn_tflops'))} | {_fmt(r.get('ratio_vs_sdpa_flash'), 2)} "
            f"| {_fmt(r.get('ratio_vs_sdpa_cudnn'), 2)} |")


def _table_md(rows, meta):
    lines = [f"# Attention TFLOP/s ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})",
             "", "bf16; FLOPs 4*B*H*S^2*D forward (halved causal), fwd+bwd 3.5x; do_bench median.", ""]
    if meta.get("skipped"):
        lines += [f"Incomplete: {len(meta['skipped'])} configurations skipped (time budget).", ""]
    lines += [HEADER, "|" + "---|" * 11]
    lines += [_row_md(r) for r in rows]
    errors = [(r, k, v) for r in rows for k, v in r.items() if k.endswith("_error")]
    if errors:
        lines += ["", "Errors:"]
        lines += [f"- {r['mode']} D={r['D']} S={r['S']} causal={r['causal']} {k}: {v}" for r, k, v in errors]
    return "\n".join(lines) + "\n"


def _plot(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_attention: matplotlib not installed; skipping the plot")
        return
    combos = sorted({(r["mode"], r["D"]) for r in rows})
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    for ax, (mode, D) in zip(axes[0], combos):
        for causal in (False, True):
            sel = sorted([r for r in rows if r["mode"] == mode and r["D"] == D and r["causal"] == causal],
                         key=lambda r: r["S"])
            for impl, style in (("triton", "-o"), ("sdpa_flash", "--s"), ("sdpa_cudnn", ":^")):
                xs = [r["S"] for r in sel if r.get(f"{impl}_tflops")]
                ys = [r[f"{impl}_tflops"] for r in sel if r.get(f"{impl}_tflops")]
                if xs:
                    ax.plot(xs, ys, style, label=f"{impl}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{mode}, D={D}, bf16")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "attention_tflops.png")
    fig.savefig(path, dpi=120)
    print(f"bench_attention: plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())
