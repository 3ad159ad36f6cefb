"""Shared by bench_attention.py, bench_window.py and bench_hopper.py (run as scripts from
bench/, so a plain import finds this module): where a Triton attention benchmark may run,
flash_attn's optional import, and the timer."""

import sys
import time


def run_problem(name: str, smoke: bool):
    """Why benchmark `name` cannot run here (printed, exit code 2), or None: `--smoke` runs
    the kernels in Triton's interpreter on CPU (TRITON_INTERPRET=1); otherwise a CUDA GPU
    is needed and the interpreter must be off."""
    import torch

    from ulysses_kernels import env

    if smoke:
        if not env.interpreting():
            return f"{name}: --smoke runs the kernels in the interpreter: set TRITON_INTERPRET=1"
        return None
    if not torch.cuda.is_available():
        return f"{name}: no CUDA GPU available; this benchmark needs one (nothing to do)."
    if env.interpreting():
        return f"{name}: TRITON_INTERPRET=1 is set; unset it to benchmark real kernels."
    return None


def refuse(name: str, smoke: bool) -> bool:
    """Print run_problem's reason to stderr; True when the benchmark must stop."""
    problem = run_problem(name, smoke)
    if problem:
        print(problem, file=sys.stderr)
    return problem is not None


def flash_attn_func():
    """flash_attn's `flash_attn_func`, or None when it is not installed (or built for
    another torch)."""
    try:
        from flash_attn import flash_attn_func as func
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return func


def timer(smoke: bool, warmup: int, rep: int):
    """fn -> milliseconds. One untimed call first (it compiles, so do_bench's estimate of
    the repetitions does not include the compile); then do_bench's median on a GPU, or one
    timed call in smoke mode (the numbers mean nothing there)."""
    def timed(fn):
        fn()
        if smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    return timed
