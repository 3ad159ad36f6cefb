#!/usr/bin/env python
"""Benchmark the Hopper kernel features (ulysses_kernels/triton/features.py): our attention with the
measured kernels ("before") and with each feature list ("after"), next to SDPA cuDNN, SDPA
flash and flash_attn when it is installed, in one run.

bf16, forward and forward+backward TFLOP/s, D = 128 and 64, causal and not, S = 4k..64k
with B*S about constant (--tokens, default 64k), 16 heads at D = 128 and 32 at D = 64.
FLOPs: forward 4*B*H*S^2*D (halved when causal), forward+backward 3.5x that (as
bench/bench_attention.py). Timing: triton.testing.do_bench (median) after a warm-up call
(which compiles), random inputs. Every implementation reads the same values; ours and
flash_attn take [B, S, H, D], SDPA contiguous [B, H, S, D]. The features are set through
ULYSSES_KERNELS_HOPPER_FEATURES around each timed call.

The targets of the issue (D = 128, S >= 16k): forward >= 1.0x cuDNN and forward+backward
>= 0.9x cuDNN, by the best feature list of each shape; the table says which lists met them.
The target shapes run first, so a time budget (--budget-s) cuts the least important ones.

Writes hopper_results.json and hopper_results.md into --out (default: $OUT, else
bench/results). Needs a CUDA GPU; `--dry-run` (or GPU_CHECK_DRY_RUN=1) checks the imports
and arguments, `--smoke` runs the script on CPU in the Triton interpreter (numbers mean
nothing).

    python bench/bench_hopper.py [--seqlens 16384,65536] [--features "desc,fma_scale;hopper"] [--budget-s 60] [--sweep]
    TRITON_INTERPRET=1 python bench/bench_hopper.py --smoke --out /tmp/h   # tests/bench/
"""

import argparse
import contextlib
import json
import os
import sys
import time

from _attention_bench import flash_attn_func, refuse, timer

# ';'-separated feature lists ("after"); "" (the measured kernels, "before") always runs.
# (hopper = desc,fma_scale,warp_specialize + dq_reduce: next to the third, it isolates dq_reduce.)
DEFAULT_FEATURES = ("desc,fma_scale;desc,fma_scale,lazy_rescale;desc,fma_scale,warp_specialize;hopper;"
                    "desc,fma_scale,warp_specialize,bwd_warp_specialize")
TARGET_FWD_VS_CUDNN = 1.0
TARGET_FWD_BWD_VS_CUDNN = 0.9
VARIABLE = "ULYSSES_KERNELS_HOPPER_FEATURES"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--seqlens", type=str, default="16384,32768,65536,4096")
    p.add_argument("--head-dims", type=str, default="128,64")
    p.add_argument("--tokens", type=int, default=64 * 1024, help="B*S per configuration (B >= 1)")
    p.add_argument("--features", type=str, default=DEFAULT_FEATURES, help="';'-separated feature lists")
    p.add_argument("--modes", type=str, default="fwd,fwd_bwd")
    p.add_argument("--budget-s", type=float, default=None, help="do not start a new shape after this many seconds")
    p.add_argument("--sweep", action="store_true",
                   help="after the shapes (budget allowing): time every candidate tile config of the features "
                        "(the forward's with desc,fma_scale and with warp_specialize; the atomic backward's with "
                        "dq_reduce; the warp-specialized dK/dV and dQ kernels', each with the other at its default) at D = 128 "
                        "and 64, S = 16k, to pick their defaults from")
    p.add_argument("--dry-run", action="store_true", help="check imports and arguments only")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes in the Triton interpreter on CPU (TRITON_INTERPRET=1): exercises the "
                        "script, its numbers mean nothing")
    return p.parse_args()


@contextlib.contextmanager
def hopper_features(spec):
    """ULYSSES_KERNELS_HOPPER_FEATURES = spec inside the block (restored after)."""
    old = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = spec
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = old


def _shapes(args):
    """(D, S, causal) in priority order: D = 128 first, then S >= 16k ascending, then the
    shorter ones; non-causal before causal."""
    seqlens = sorted((int(x) for x in args.seqlens.split(",")), key=lambda s: (s < 16384, s))
    head_dims = sorted((int(x) for x in args.head_dims.split(",")), key=lambda d: d != 128)
    return [(D, S, causal) for D in head_dims for S in seqlens for causal in (False, True)]


def main():
    args = parse_args()
    from ulysses_kernels import env
    from ulysses_kernels.triton import features as kernel_features

    lists = [spec.strip() for spec in args.features.split(";")]
    for spec in lists:
        kernel_features.parse(spec)  # a bad list fails before any GPU work
    if args.dry_run or env.flag("GPU_CHECK_DRY_RUN"):
        import torch  # noqa: F401

        print(f"bench_hopper: dry run, would run {len(_shapes(args))} shapes x {len(lists) + 1} kernels with "
              f"{vars(args)}")
        return 0
    import torch
    import triton

    if refuse("bench_hopper", args.smoke):
        return 2
    if args.smoke:
        args.seqlens, args.head_dims, args.tokens = "64", "32", 64
        lists = lists[:2] + [lists[-1]]
    os.makedirs(args.out, exist_ok=True)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    flash = None if args.smoke else flash_attn_func()
    timed = timer(args.smoke, warmup=10, rep=40)
    meta = dict(gpu="smoke (CPU, Triton interpreter)" if args.smoke else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, flash_attn=flash is not None,
                dtype=str(dtype).replace("torch.", ""), tokens=args.tokens, features=lists,
                autotune=os.environ.get("ULYSSES_KERNELS_TRITON_AUTOTUNE", "1"), complete=True)
    rows, t_start = [], time.time()

    def write():
        meta["targets"] = targets(rows)
        with open(os.path.join(args.out, "hopper_results.json"), "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        with open(os.path.join(args.out, "hopper_results.md"), "w") as f:
            f.write(table(rows, meta))

    for D, S, causal in _shapes(args):
        if args.budget_s is not None and time.time() - t_start > args.budget_s:
            print(f"bench_hopper: budget spent, skipping D={D} S={S} causal={causal}", flush=True)
            meta["complete"] = False
            meta.setdefault("skipped", []).append(dict(D=D, S=S, causal=causal))
            continue
        rows += time_shape(args, torch, timed, flash, device, dtype, lists, D=D, S=S, causal=causal)
        write()
    if args.sweep:
        meta["sweep"] = sweep_configs(args, torch, timed, device, dtype, t_start, write)
    meta["seconds"] = round(time.time() - t_start, 1)
    write()
    print(table(rows, meta))
    return 0


def sweep_configs(args, torch, timed, device, dtype, t_start, write):
    """[{kernel, features, config, causal, D, tflops | error}]: each candidate config of the
    features' kernels, forced through the launchers' forced() (forward alone; the backward
    alone, from the forward's out and LSE)."""
    from ulysses_kernels.triton import (
        flash_attention_backward,
        flash_attention_forward,
        flash_bwd_dkdv,
        flash_bwd_dq,
        flash_fwd,
    )
    from ulysses_kernels.triton.configs import CONFIGS

    entries = []
    S = 64 if args.smoke else 16384
    for D in (32,) if args.smoke else (128, 64):
        H = 2 if args.smoke else (16 if D >= 128 else 32)
        B = max(1, args.tokens // S)
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(B, S, H, D, device=device, dtype=dtype) for _ in range(4))
            out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=None)
            flops_fwd = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
            block_d = max(16, 1 << (D - 1).bit_length())
            plans = [("fwd", flash_fwd._launch, "desc,fma_scale", CONFIGS["fwd"].plain[block_d]),
                     ("fwd", flash_fwd._launch, "desc,fma_scale,warp_specialize", CONFIGS["fwd"].warp_specialize[block_d]),
                     ("bwd_atomic", flash_bwd_dkdv._launch_atomic, "dq_reduce",
                      CONFIGS["dkdv_atomic"].plain[block_d]),
                     ("bwd_dkdv_ws", flash_bwd_dkdv._launch, "bwd_warp_specialize",
                      CONFIGS["dkdv"].warp_specialize[block_d]),
                     ("bwd_dq_ws", flash_bwd_dq._launch, "bwd_warp_specialize", CONFIGS["dq"].warp_specialize[block_d])]
            for kernel, launch, spec, configs in plans:
                for config in configs[:1] if args.smoke else configs:
                    entry = dict(kernel=kernel, features=spec, config=list(config), causal=causal, D=D, S=S)
                    if args.budget_s is not None and time.time() - t_start > args.budget_s:
                        entries.append(dict(entry, skipped="budget"))
                        continue
                    try:
                        with hopper_features(spec), launch.forced(config):
                            if kernel == "fwd":
                                ms = timed(lambda: flash_attention_forward(
                                    q, k, v, causal=causal, softmax_scale=None))
                                entry["tflops"] = flops_fwd / (ms * 1e-3) / 1e12
                            else:
                                ms = timed(lambda: flash_attention_backward(
                                    do, q, k, v, out, lse, causal=causal, softmax_scale=None, deterministic=False))
                                entry["tflops"] = 2.5 * flops_fwd / (ms * 1e-3) / 1e12
                        entry["ms"] = ms
                    except Exception as exc:  # noqa: BLE001 - a config that fails to build is a result
                        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    entries.append(entry)
                    print(f"sweep D={D} causal={causal} {kernel} [{spec}] {tuple(config)}: "
                          + (f"{entry['tflops']:.1f} TFLOP/s" if "tflops" in entry else entry["error"]), flush=True)
                    write()
            q = k = v = do = out = lse = None
            if device == "cuda":
                torch.cuda.empty_cache()
    return entries


def time_shape(args, torch, timed, flash, device, dtype, lists, *, D, S, causal):
    """One row per (mode, implementation) of one shape: ms, TFLOP/s (or the error)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ulysses_kernels.triton import flash_attention

    H = 2 if args.smoke else (16 if D >= 128 else 32)
    B = max(1, args.tokens // S)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device=device, dtype=dtype) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa_leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    sdpa_do = do.transpose(1, 2).contiguous()
    impls = {f"triton[{spec}]": (lambda spec=spec: flash_attention(*leaves, causal=causal), leaves, do, spec)
             for spec in [""] + lists}
    if not args.smoke:
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*sdpa_leaves, is_causal=causal)
            impls[name] = (sdpa, sdpa_leaves, sdpa_do, "")
    if flash is not None:
        impls["flash_attn"] = (lambda: flash(*leaves, causal=causal), leaves, do, "")
    flops_fwd = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)

    rows = []
    for mode in args.modes.split(","):
        for name, (fn, inputs, grad, spec) in impls.items():
            def step(fn=fn, inputs=inputs, grad=grad):
                if mode == "fwd":
                    with torch.no_grad():
                        return fn()
                for t in inputs:
                    t.grad = None
                fn().backward(grad)

            row = dict(D=D, S=S, B=B, H=H, causal=causal, mode=mode, impl=name)
            try:
                with hopper_features(spec):
                    ms = timed(step)
                row.update(ms=ms, tflops=flops_fwd * (3.5 if mode == "fwd_bwd" else 1.0) / (ms * 1e-3) / 1e12)
            except Exception as exc:  # noqa: BLE001 - a feature that fails to build is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(f"D={D} S={S} causal={causal} {mode} {name}: "
                  + (f"{row['tflops']:.1f} TFLOP/s" if "tflops" in row else row["error"]), flush=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _by_shape(rows):
    shapes = {}
    for r in rows:
        shapes.setdefault((r["D"], r["S"], r["causal"], r["mode"]), {})[r["impl"]] = r
    return shapes


def targets(rows):
    """Per target shape (D = 128, S >= 16k): the best feature list's ratio to cuDNN, and
    whether it meets the target of its mode."""
    out = []
    for (D, S, causal, mode), by in sorted(_by_shape(rows).items()):
        cudnn = by.get("sdpa_cudnn", {}).get("tflops")
        ours = {name: r["tflops"] for name, r in by.items() if name.startswith("triton[") and r.get("tflops")}
        if D != 128 or S < 16384 or not cudnn or not ours:
            continue
        best = max(ours, key=ours.get)
        target = TARGET_FWD_VS_CUDNN if mode == "fwd" else TARGET_FWD_BWD_VS_CUDNN
        out.append(dict(D=D, S=S, causal=causal, mode=mode, best=best, ratio=ours[best] / cudnn,
                        before=ours.get("triton[]", 0.0) / cudnn, target=target,
                        met=ours[best] / cudnn >= target))
    return out


def table(rows, meta) -> str:
    """Markdown: TFLOP/s of every implementation per shape, each feature list's speed-up
    over the measured kernels and its ratio to cuDNN, then the targets."""
    impls = []
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    lines = [f"# Hopper kernel features ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']})", "",
             f"{meta['dtype']}; TFLOP/s (forward 4*B*H*S^2*D, halved causal; fwd+bwd 3.5x); do_bench median; "
             f"autotune={meta['autotune']}. triton[] is the measured kernels (before); triton[list] the "
             "feature list (after), its speed-up over triton[] and ratio to cuDNN in brackets.", "",
             "| D | S | B | causal | mode | " + " | ".join(impls) + " |", "|" + "---|" * (5 + len(impls))]
    for (D, S, causal, mode), by in sorted(_by_shape(rows).items()):
        before = by.get("triton[]", {}).get("tflops")
        cudnn = by.get("sdpa_cudnn", {}).get("tflops")
        cells = []
        for name in impls:
            r = by.get(name)
            if r is None or "tflops" not in r:
                cells.append("error" if r else "-")
                continue
            cell = f"{r['tflops']:.1f}"
            if name.startswith("triton[") and name != "triton[]" and before:
                cell += f" ({r['tflops'] / before:.2f}x" + (f", {r['tflops'] / cudnn:.2f} cuDNN)" if cudnn else ")")
            cells.append(cell)
        B = next(iter(by.values()))["B"]
        lines.append(f"| {D} | {S} | {B} | {causal} | {mode} | " + " | ".join(cells) + " |")
    if meta.get("targets"):
        lines += ["", f"Targets (D = 128, S >= 16k): forward >= {TARGET_FWD_VS_CUDNN}x cuDNN, forward+backward >= "
                  f"{TARGET_FWD_BWD_VS_CUDNN}x cuDNN:", "",
                  "| S | causal | mode | best | ratio to cuDNN | before | met |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {t['S']} | {t['causal']} | {t['mode']} | {t['best']} | {t['ratio']:.2f} | {t['before']:.2f} "
                  f"| {t['met']} |" for t in meta["targets"]]
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "Errors:"] + [f"- D={r['D']} S={r['S']} causal={r['causal']} {r['mode']} {r['impl']}: "
                                    f"{r['error']}" for r in errors]
    if meta.get("skipped"):
        lines += ["", f"Incomplete: {len(meta['skipped'])} shapes skipped (time budget)."]
    if meta.get("sweep"):
        lines += ["", "Config sweep ((BLOCK_M, BLOCK_N, num_warps, num_stages); forward or backward alone):", "",
                  "| D | causal | kernel | features | config | TFLOP/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {e['D']} | {e['causal']} | {e['kernel']} | {e['features']} | {tuple(e['config'])} | "
                  + (f"{e['tflops']:.1f}" if "tflops" in e else e.get("error") or e.get("skipped", "")) + " |"
                  for e in meta["sweep"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
