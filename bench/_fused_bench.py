"""Shared by bench_a2a.py and bench_layer.py (run as scripts from bench/, so a plain
import finds this module).

Smoke mode (`--smoke`, used by tests/bench/test_bench_smoke.py on CPU): every code path of a
benchmark runs once at tiny shapes on the CPU, with the stand-ins of
`ulysses_kernels.testing` (the torch versions of the CUDA ops and the host transport,
installed through the fused path's declared interface) and the Triton interpreter, so CI
catches a script that would crash on the GPU. Its numbers mean nothing.
"""

import os
import sys
import time

SMOKE = False


def add_smoke_flag(parser):
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of the script at tiny shapes (needs TRITON_INTERPRET=1); numbers mean nothing")
    add_dry_run_flag(parser)


def add_dry_run_flag(parser):
    parser.add_argument("--dry-run", action="store_true",
                        help="check the arguments and the imports, print what would run, exit (GPU_CHECK_DRY_RUN)")


def dry_run_requested(args) -> bool:
    """--dry-run, or GPU_CHECK_DRY_RUN set by `GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh`."""
    from ulysses_kernels import env
    return args.dry_run or env.flag("GPU_CHECK_DRY_RUN")


def dry_run(script: str, args) -> int:
    """--dry-run: the arguments parsed; import what a real run imports; say so."""
    import torch  # noqa: F401

    import ulysses_kernels  # noqa: F401
    from ulysses_kernels import fused, testing  # noqa: F401
    print(f"{script}: dry run, would run with {vars(args)}")
    return 0


def fused_device(script: str, smoke: bool = False):
    """The device to benchmark on, or None (after printing why to stderr) when there is no
    GPU or the extension lacks the fused path's ops. In smoke mode: the CPU, set up as the
    module docstring says."""
    global SMOKE
    import torch

    from ulysses_kernels import fused
    if smoke:
        from ulysses_kernels import testing
        SMOKE = True
        testing.enable_fused_stand_ins()  # for the rest of this process
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU", file=sys.stderr)
        return None
    why = fused.problem(torch.device("cuda"), ())
    if why:
        print(f"{script}: the fused path {why}", file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def start(script: str, args):
    """Common start of a fused-path benchmark: the output folder, the device (None when
    the script cannot run: it then exits 2), the dtype (bf16; fp32 in smoke mode, where
    the interpreter is exact) and the metadata every result file carries."""
    os.makedirs(args.out, exist_ok=True)
    dev = fused_device(script, smoke=args.smoke)
    if dev is None:
        return None
    import torch
    dtype = torch.float32 if args.smoke else torch.bfloat16
    meta = dict(device_meta(torch), torch=torch.__version__, dtype=str(dtype))
    return dev, dtype, meta


def ops():
    """The pack/unpack ops (`ulysses_kernels.fused.ops`: the CUDA kernels, or their torch
    stand-ins in smoke mode), called with the placements of `ulysses_kernels.layout`."""
    from ulysses_kernels.fused import ops as fused_ops
    return fused_ops


def bench(fn, warmup: int, rep: int) -> float:
    """Median milliseconds of `fn` (triton.testing.do_bench: `warmup` and `rep` in ms);
    one timed call in smoke mode."""
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def device_meta(torch) -> dict:
    if SMOKE:
        return dict(device="cpu (smoke run: numbers mean nothing)", nccl=None)
    return dict(device=torch.cuda.get_device_name(), nccl=".".join(map(str, torch.cuda.nccl.version())))
