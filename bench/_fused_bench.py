"""Shared by bench_a2a.py and bench_layer.py (run as scripts from bench/, so a plain
import finds this module)."""

import sys


def fused_device(script: str):
    """The CUDA device to benchmark on, or None (after printing why to stderr) when there
    is no GPU or the extension lacks the fused path's ops."""
    import torch
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU", file=sys.stderr)
        return None
    from ulysses_kernels import _backend, fused
    module, reason = _backend.load_extension()
    if module is None or not fused.is_supported():
        print(f"{script}: the CUDA extension is unavailable: {reason or 'it lacks the fused ops'}", file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def bench(fn, warmup: int, rep: int) -> float:
    """Median milliseconds of `fn` (triton.testing.do_bench: `warmup` and `rep` in ms)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
