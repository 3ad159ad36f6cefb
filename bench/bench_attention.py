#!/usr/bin/env python
"""Benchmark the Triton flash attention against PyTorch SDPA (flash and cuDNN backends).

Forward and forward+backward TFLOP/s, bf16, head dims 128 and 64, causal and not, over
sequence lengths 4k..32k (more with --seqlens) with B*S about constant (--tokens, default 32k). FLOPs: forward
4*B*H*Sq*Sk*D (halved when causal); backward 2.5x forward, so fwd+bwd = 3.5x. Timing:
triton.testing.do_bench (median) after warm-up, random inputs. All implementations read
the same values; Triton gets [B, S, H, D] (its native layout), SDPA contiguous
[B, H, S, D] (its native layout). Ours is timed with both backward modes: the default
(dQ by fp32 atomics, 5 GEMMs) and deterministic=True (separate dQ kernel, 7 GEMMs).

The target shapes run first (D=128, S >= 16k), so a time budget (--budget-s) cuts the
least important ones. With time left, a config sweep (D=128, S=16k) times every
candidate tile config of each Triton kernel, to choose defaults from (kernels run with
their default configs unless --autotune).

Writes attention_results.json, attention_results.md and attention_tflops.png (with
matplotlib when installed, else a plain built-in renderer) into --out (default: $OUT if
set, else bench/results). Needs a CUDA GPU; works offline.

    python bench/bench_attention.py [--quick] [--out DIR] [--budget-s 90]
"""

import argparse
import json
import os
import struct
import sys
import time
import zlib

from _attention_bench import refuse, timer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--quick", action="store_true", help="short run: fewer lengths, shorter timing")
    p.add_argument("--seqlens", type=str, default=None, help="comma-separated sequence lengths")
    p.add_argument("--head-dims", type=str, default="128,64")
    p.add_argument("--tokens", type=int, default=32 * 1024, help="B*S per configuration (B >= 1)")
    p.add_argument("--modes", type=str, default="fwd,fwd_bwd")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baselines")
    p.add_argument("--autotune", action="store_true",
                   help="autotune the Triton kernels (compiles every candidate config; slow)")
    p.add_argument("--no-sweep", action="store_true", help="skip the per-kernel config sweep")
    p.add_argument("--budget-s", type=float, default=None,
                   help="do not start work predicted to end after this many seconds (results so far are kept)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script (TRITON_INTERPRET=1, tiny shapes, fp32, no SDPA, one timed call, "
                        "one sweep config per kernel); numbers mean nothing (tests/bench/test_bench_smoke.py)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the arguments and the imports, print what would run, exit (GPU_CHECK_DRY_RUN)")
    return p.parse_args()


# Targets (H100/H200, bf16, D=128, S >= 16k).
TARGET_FWD = 550.0
TARGET_FWD_BWD = 400.0
TARGET_CAUSAL_RATIO = 0.85


def main():
    args = parse_args()
    from ulysses_kernels import env
    if args.dry_run or env.flag("GPU_CHECK_DRY_RUN"):
        import torch  # noqa: F401

        import ulysses_kernels.triton  # noqa: F401
        print(f"bench_attention: dry run, would run with {vars(args)}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    # Must be decided before the kernels are imported (the launchers read it once).
    os.environ["ULYSSES_KERNELS_TRITON_AUTOTUNE"] = "1" if args.autotune else "0"
    try:
        import torch
    except ImportError:
        print("bench_attention: torch is not installed", file=sys.stderr)
        return 2
    if refuse("bench_attention", args.smoke):
        return 2
    if args.smoke:
        args.no_sdpa, args.seqlens, args.head_dims, args.tokens = True, "32", "128", 32
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ulysses_kernels.triton import (
        flash_attention,
        flash_attention_backward,
        flash_attention_forward,
        flash_bwd_dkdv,
        flash_bwd_dq,
        flash_fwd,
    )

    if args.seqlens:
        seqlens = [int(x) for x in args.seqlens.split(",")]
    elif args.quick:
        seqlens = [16384, 4096]
    else:
        seqlens = [16384, 32768, 4096]
    # Targets first: S >= 16k ascending, then the shorter ones.
    seqlens = sorted(seqlens, key=lambda s: (s < 16384, s))
    head_dims = [int(x) for x in args.head_dims.split(",")]
    head_dims = sorted(head_dims, key=lambda d: d != 128)
    modes = args.modes.split(",")
    rep = 30 if args.quick else 100
    warmup = 10 if args.quick else 25

    dev = "cpu (smoke run: numbers mean nothing)" if args.smoke else torch.cuda.get_device_name()
    print(f"# Attention benchmark on {dev}, torch {torch.__version__}, triton {triton.__version__}")
    print(HEADER)
    rows, sweep = [], []
    t_start = time.time()
    meta = {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "tokens": args.tokens,
            "autotune": args.autotune, "complete": False,
            "default_configs": {"fwd": flash_fwd._launch.default(128), "dq": flash_bwd_dq._launch.default(128),
                                "dkdv": flash_bwd_dkdv._launch.default(128),
                                "bwd_atomic": flash_bwd_dkdv._launch_atomic.default(128)}}

    def write():
        meta["targets"] = _targets(rows)
        if args.autotune:
            meta["tuned_configs"] = {name: launch.tuned_configs() for name, launch in
                                     (("fwd", flash_fwd._launch), ("dq", flash_bwd_dq._launch),
                                      ("dkdv", flash_bwd_dkdv._launch), ("bwd_atomic", flash_bwd_dkdv._launch_atomic))}
        with open(os.path.join(args.out, "attention_results.json"), "w") as f:
            json.dump({"meta": meta, "results": rows, "sweep": sweep}, f, indent=1)
        with open(os.path.join(args.out, "attention_results.md"), "w") as f:
            f.write(_table_md(rows, meta, sweep))

    timed = timer(args.smoke, warmup, rep)

    # Budget: predict a configuration's wall time from the last one, scaled by FLOPs
    # (compilation of a new kernel variant adds a fixed ~10 s guess).
    last = {"sec_per_flop": None}

    def fits(flops, new_kernels):
        if args.budget_s is None:
            return True
        elapsed = time.time() - t_start
        guess = (last["sec_per_flop"] or 0.0) * flops + (10.0 if new_kernels else 0.0)
        return elapsed + guess <= args.budget_s

    seen_variants = set()

    def run_head_dim(D):
        H = 2 if args.smoke else (16 if D >= 128 else 32)  # smoke: interpreter time is per head
        for S in seqlens:
            B = max(1, args.tokens // S)
            for causal in (False, True):
                flops_fwd = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
                variant = (D, causal)
                if not fits(flops_fwd, variant not in seen_variants):
                    print(f"bench_attention: time budget of {args.budget_s:.0f}s would be exceeded; "
                          f"skipping D={D} S={S} causal={causal}", flush=True)
                    meta.setdefault("skipped", []).append({"D": D, "S": S, "causal": causal})
                    continue
                t_cfg = time.time()
                torch.manual_seed(0)
                q = torch.randn(B, S, H, D, device=device, dtype=dtype, requires_grad=True)
                k = torch.randn(B, S, H, D, device=device, dtype=dtype, requires_grad=True)
                v = torch.randn(B, S, H, D, device=device, dtype=dtype, requires_grad=True)
                do = torch.randn(B, S, H, D, device=device, dtype=dtype)
                qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
                dot = do.transpose(1, 2).contiguous()
                # triton: the default backward (dQ by fp32 atomics, 5 GEMMs); triton_det: the
                # deterministic one (separate dQ kernel, 7 GEMMs), timed fwd+bwd only.
                impls = {"triton": lambda: flash_attention(q, k, v, causal=causal, deterministic=False),
                         "triton_det": lambda: flash_attention(q, k, v, causal=causal, deterministic=True)}
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
                        if mode == "fwd" and name == "triton_det":
                            continue  # the same forward
                        ours = name.startswith("triton")
                        grad = do if ours else dot
                        leaves = (q, k, v) if ours else (qt, kt, vt)
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
                q = k = v = do = qt = kt = vt = dot = None  # free before the next shape (not del: closures read them)
                if device == "cuda":
                    torch.cuda.empty_cache()
                dt = time.time() - t_cfg
                if variant in seen_variants or last["sec_per_flop"] is None:
                    last["sec_per_flop"] = dt / flops_fwd
                seen_variants.add(variant)

    # D=128 (the targets), then the config sweep (data to pick defaults from), then the rest.
    for D in head_dims:
        run_head_dim(D)
        if D == 128 and not args.no_sweep:
            _sweep(args, sweep, t_start, torch, timed, flash_attention_forward, flash_attention_backward,
                   flash_fwd, flash_bwd_dq, flash_bwd_dkdv, write, device, dtype)

    meta["complete"] = "skipped" not in meta
    meta["seconds"] = round(time.time() - t_start, 1)
    write()
    print()
    print(_table_md(rows, meta, sweep))
    _plot(rows, args.out)
    return 0


def _sweep(args, sweep, t_start, torch, timed, fwd_fn, bwd_fn, flash_fwd, flash_bwd_dq, flash_bwd_dkdv, write,
           device, dtype):
    """Time every candidate config of each kernel at D=128, S=16k (non-default ones compile).
    Smoke mode: S = 32, the first config of each kernel."""
    from ulysses_kernels.triton.configs import CONFIGS

    D, H, S = 128, (2 if args.smoke else 16), (32 if args.smoke else 16384)
    B = max(1, args.tokens // S)
    per_compile = 8.0  # seconds; a guess for one new kernel variant (compile + timing)
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(B, S, H, D, device=device, dtype=dtype) for _ in range(4))
        out, lse = fwd_fn(q, k, v, causal=causal, softmax_scale=None)
        flops_fwd = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
        # (kernel, its launcher, candidates, backward mode the timing runs)
        for kname, launch, cfgs, determ in (
                ("fwd", flash_fwd._launch, CONFIGS["fwd"].plain[D], None),
                ("bwd_atomic", flash_bwd_dkdv._launch_atomic, CONFIGS["dkdv_atomic"].plain[D], False),
                ("dq", flash_bwd_dq._launch, CONFIGS["dq"].plain[D], True),
                ("dkdv", flash_bwd_dkdv._launch, CONFIGS["dkdv"].plain[D], True)):
            for cfg in (cfgs[:1] if args.smoke else cfgs):
                if args.budget_s is not None and time.time() - t_start + per_compile > args.budget_s:
                    sweep.append({"kernel": kname, "config": list(cfg), "causal": causal, "skipped": "budget"})
                    continue
                entry = {"kernel": kname, "config": list(cfg), "causal": causal,
                         "default": cfg == launch.default(D)}
                try:
                    with launch.forced(cfg):
                        if kname == "fwd":
                            ms = timed(lambda: fwd_fn(q, k, v, causal=causal, softmax_scale=None))
                            entry["what"] = "forward"
                            entry["tflops"] = flops_fwd / (ms * 1e-3) / 1e12
                        else:
                            ms = timed(lambda: bwd_fn(do, q, k, v, out, lse, causal=causal, softmax_scale=None,
                                                      deterministic=determ))
                            entry["what"] = ("backward (preprocess + dK/dV + dQ), this kernel's config varied"
                                             if determ else "backward (preprocess + 5-GEMM dK/dV/dQ), config varied")
                            entry["tflops"] = 2.5 * flops_fwd / (ms * 1e-3) / 1e12
                    entry["ms"] = ms
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                sweep.append(entry)
                print(f"sweep {kname} causal={causal} {cfg}: "
                      f"{entry.get('tflops', float('nan')):.1f} TFLOP/s {entry.get('error', '')}", flush=True)
                write()
        q = k = v = do = out = lse = None  # free (not del: closures read them)
        if device == "cuda":
            torch.cuda.empty_cache()


def _targets(rows):
    """Target checks on D=128, S >= 16k rows (None when not measured)."""
    sel = [r for r in rows if r["D"] == 128 and r["S"] >= 16384 and r.get("triton_tflops")]
    out = {}
    for mode, target in (("fwd", TARGET_FWD), ("fwd_bwd", TARGET_FWD_BWD)):
        vals = [r["triton_tflops"] for r in sel if r["mode"] == mode and not r["causal"]]
        out[f"{mode}_min_tflops_noncausal"] = min(vals) if vals else None
        out[f"{mode}_meets_{target:.0f}"] = (min(vals) >= target) if vals else None
    ratios = []
    for r in sel:
        if r["causal"]:
            nc = [x for x in sel if not x["causal"] and x["mode"] == r["mode"] and x["S"] == r["S"]]
            if nc:
                ratios.append(r["triton_tflops"] / nc[0]["triton_tflops"])
    out["causal_over_noncausal_min"] = min(ratios) if ratios else None
    out["causal_meets_0.85"] = (min(ratios) >= TARGET_CAUSAL_RATIO) if ratios else None
    vs = [r.get("ratio_vs_sdpa_flash") for r in sel if r.get("ratio_vs_sdpa_flash")]
    out["min_ratio_vs_sdpa_flash"] = min(vs) if vs else None
    out["faster_than_sdpa_flash"] = (min(vs) > 1.0) if vs else None
    return out


HEADER = ("| mode | D | H | B | S | causal | triton TFLOP/s | triton deterministic TFLOP/s | sdpa flash TFLOP/s "
          "| sdpa cuDNN TFLOP/s | triton/flash | triton/cuDNN |")


def _fmt(x, digits=1):
    return "n/a" if x is None else f"{x:.{digits}f}"


def _row_md(r):
    return (f"| {r['mode']} | {r['D']} | {r['H']} | {r['B']} | {r['S']} | {r['causal']} "
            f"| {_fmt(r.get('triton_tflops'))} | {_fmt(r.get('triton_det_tflops'))} "
            f"| {_fmt(r.get('sdpa_flash_tflops'))} "
            f"| {_fmt(r.get('sdpa_cudnn_tflops'))} | {_fmt(r.get('ratio_vs_sdpa_flash'), 2)} "
            f"| {_fmt(r.get('ratio_vs_sdpa_cudnn'), 2)} |")


def _table_md(rows, meta, sweep=()):
    lines = [f"# Attention TFLOP/s ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})",
             "", "bf16; FLOPs 4*B*H*S^2*D forward (halved causal), fwd+bwd 3.5x; do_bench median; "
             f"Triton {'autotuned' if meta.get('autotune') else 'default configs'}.", ""]
    if meta.get("skipped"):
        lines += [f"Incomplete: {len(meta['skipped'])} configurations skipped (time budget).", ""]
    lines += [HEADER, "|" + "---|" * 11]
    lines += [_row_md(r) for r in rows]
    t = meta.get("targets") or {}
    if t:
        lines += ["", "Targets (D=128, S>=16k): "
                  f"fwd >= {TARGET_FWD:.0f}: {t.get('fwd_meets_550')} (min {_fmt(t.get('fwd_min_tflops_noncausal'))}); "
                  f"fwd+bwd >= {TARGET_FWD_BWD:.0f}: {t.get('fwd_bwd_meets_400')} "
                  f"(min {_fmt(t.get('fwd_bwd_min_tflops_noncausal'))}); "
                  f"causal/non-causal >= {TARGET_CAUSAL_RATIO}: {t.get('causal_meets_0.85')} "
                  f"(min {_fmt(t.get('causal_over_noncausal_min'), 2)}); "
                  f"faster than SDPA flash: {t.get('faster_than_sdpa_flash')} "
                  f"(min ratio {_fmt(t.get('min_ratio_vs_sdpa_flash'), 2)})"]
    errors = [(r, k, v) for r in rows for k, v in r.items() if k.endswith("_error")]
    if errors:
        lines += ["", "Errors:"]
        lines += [f"- {r['mode']} D={r['D']} S={r['S']} causal={r['causal']} {k}: {v}" for r, k, v in errors]
    if sweep:
        lines += ["", "Config sweep (D=128, S=16k; (BLOCK_M, BLOCK_N, num_warps, num_stages)):", "",
                  "| kernel | causal | config | default | TFLOP/s | ms |", "|---|---|---|---|---|---|"]
        for e in sweep:
            lines.append(f"| {e['kernel']} | {e['causal']} | {tuple(e['config'])} | {e.get('default', '')} "
                         f"| {_fmt(e.get('tflops'))} | {_fmt(e.get('ms'), 3)} "
                         f"{e.get('error', '') or e.get('skipped', '')} |")
    return "\n".join(lines) + "\n"


IMPLS = (("triton", (31, 119, 180)), ("sdpa_flash", (255, 127, 14)), ("sdpa_cudnn", (44, 160, 44)))


def _plot(rows, out):
    path = os.path.join(out, "attention_tflops.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_builtin(rows, path)
        print(f"bench_attention: matplotlib not installed; simple plot written to {path}")
        return
    combos = sorted({(r["mode"], r["D"]) for r in rows})
    if not combos:
        return
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
    fig.savefig(path, dpi=120)
    print(f"bench_attention: plot written to {path}")


# 3x5 pixel font for the built-in renderer (rows top to bottom, 3 bits each).
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "111100100100111", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "H": "101101111101101", "I": "111010010010111", "K": "101101110101101", "L": "100100100100111",
    "N": "111101101101101", "O": "111101101101111", "P": "111101111100100", "R": "110101110101101",
    "S": "111100111001111", "T": "111010010010010", "U": "101101101101111", "W": "101101101111101",
    "M": "101111111101101", "X": "101101010101101", "G": "111100101101111", "Y": "101101010010010",
    "=": "000111000111000", "-": "000000111000000", "+": "000010111010000", " ": "000000000000000",
    ".": "000000000000010", "/": "001001010100100",
}


def _plot_builtin(rows, path):
    """Horizontal bar chart (TFLOP/s per implementation, one group per row) as a PNG,
    written with zlib only. Label per group: mode D S(k) C(ausal)/N; legend at the top:
    triton (blue), SDPA flash (orange), SDPA cuDNN (green); grid line every 100 TFLOP/s."""
    scale, bar_h, gap, left, width = 2, 6, 6, 112, 520
    vmax = max([r.get(f"{i}_tflops") or 0 for r in rows for i, _ in IMPLS] + [1.0])
    vmax = 100.0 * (int(vmax / 100.0) + 1)
    height = 30 + len(rows) * (3 * bar_h + gap) + 10
    W = left + width + 20
    img = bytearray(b"\xff" * (W * height * 3))

    def px(x, y, c):
        if 0 <= x < W and 0 <= y < height:
            i = (y * W + x) * 3
            img[i:i + 3] = bytes(c)

    def rect(x0, y0, w, h, c):
        for y in range(y0, y0 + h):
            for x in range(x0, x0 + w):
                px(x, y, c)

    def text(x, y, s, c=(0, 0, 0)):
        for ch in s.upper():
            g = _FONT.get(ch, _FONT[" "])
            for r in range(5):
                for col in range(3):
                    if g[r * 3 + col] == "1":
                        rect(x + col * scale, y + r * scale, scale, scale, c)
            x += 4 * scale

    x = 4
    for name, color in IMPLS:
        rect(x, 6, 10, 10, color)
        label = {"triton": "TRITON", "sdpa_flash": "FLASH", "sdpa_cudnn": "CUDNN"}[name]
        text(x + 14, 6, label)
        x += 14 + len(label) * 8 + 16
    text(x, 6, f"MAX {int(vmax)} TFLOP/S")
    y = 30
    for t in range(0, int(vmax) + 1, 100):
        gx = left + int(width * t / vmax)
        for yy in range(26, height - 6):
            px(gx, yy, (200, 200, 200))
    for r in rows:
        mode = "FB" if r["mode"] == "fwd_bwd" else "F"
        text(2, y + 4, f"{mode} {r['D']} {r['S'] // 1024}K {'C' if r['causal'] else 'N'}")
        for j, (name, color) in enumerate(IMPLS):
            val = r.get(f"{name}_tflops") or 0.0
            rect(left, y + j * bar_h, max(1, int(width * val / vmax)), bar_h - 1, color)
        y += 3 * bar_h + gap
    raw = b"".join(b"\x00" + bytes(img[yy * W * 3:(yy + 1) * W * 3]) for yy in range(height))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


if __name__ == "__main__":
    sys.exit(main())
