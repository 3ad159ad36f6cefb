"""Command line: `ulysses-kernels doctor`, `demo`, `plan` and `env`."""

import argparse
import os
import shutil
import subprocess
import sys
from typing import Optional, Tuple


def _line(name, value):
    print(f"{name:<22} {value}")


def explain_call(args) -> int:
    """`doctor --explain`: what runs for one attention call class (ulysses_kernels/explain.py)."""
    from .explain import CallClass, explain

    call = CallClass(batch=args.batch, seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, head_dim_v=args.head_dim_v, dtype=args.dtype, causal=args.causal,
                     window=tuple(args.window), softcap=args.softcap, sinks=args.sinks, documents=args.documents,
                     world=args.world, deterministic=args.deterministic)
    try:
        lines = explain(call, sm_count=args.sm_count)
    except ValueError as exc:  # a call the package refuses: say so, as a call would
        print(f"ulysses-kernels doctor --explain: {exc}", file=sys.stderr)
        return 2
    for name, value in lines:
        _line(name, value)
    return 0


def doctor(args) -> int:
    """Print what this installation can do: versions, extension build, GPUs, backends;
    with --explain, what runs for one attention call class instead."""
    if getattr(args, "explain", False):
        return explain_call(args)
    import platform

    import torch

    from . import __version__, env, extensions, fused
    from .api import resolve_path
    from .kernel_choice import explain as kernel_choice_explain

    _line("ulysses-kernels", f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})")
    _line("python", platform.python_version())
    for name, value in stack_lines():
        _line(name, value)
    for problem in version_warnings():  # outside the tested range: said, not refused (exit code 0)
        print(f"WARNING: {problem}")
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        _line("nvcc", out.strip().splitlines()[-1] if out.strip() else nvcc)
    else:
        _line("nvcc", "not found")

    module, reason = extensions.load_extension()
    if module is not None:
        info = torch.ops.ulysses_kernels.build_info()
        arches = extensions.build_info("TORCH_CUDA_ARCH_LIST", "unknown") or "not recorded"
        # torch.ops namespaces resolve ops lazily, so ask the dispatcher for every name.
        ops = sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                      if n.startswith("ulysses_kernels::") and not n.split("::", 1)[1].startswith("triton_")})
        _line("CUDA extension", f"built ({info}; arches {arches})")
        _line("  ops", ", ".join(ops))
        why = fused.problem(torch.device("cuda"), ())
        _line("  fused path", "available" if why is None else f"unavailable: the fused path {why}")
        broken = extensions.error_path_problem()
        _line("  C++ errors", "raised as RuntimeError" if broken is None else f"BROKEN: {broken}")
        _line("  host compiler", extensions.build_info("HOST_COMPILER") or "not recorded")
    else:
        _line("CUDA extension", f"not available: {reason}")
    kernels, why = extensions.triton_kernels()
    interp = " (TRITON_INTERPRET=1: interpreter)" if env.interpreting() else ""
    _line("Triton attention", ("available" + interp) if kernels is not None else f"unavailable: {why}")
    if kernels is not None:
        _line("  Hopper features", hopper_features_line(kernels))
    for name, value in kernel_choice_explain.describe():  # the kernel choice: override, candidates, cache
        _line(name, value)

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        _line("GPUs", str(n))
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            _line(f"  cuda:{i}", f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB")
        smi = shutil.which("nvidia-smi")
        if smi and n > 1:
            topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
            print("interconnect (nvidia-smi topo -m):")
            print(topo.rstrip())
        elif n > 1:
            _line("interconnect", "unknown (nvidia-smi not found)")
    else:
        _line("GPUs", "none visible (CPU: gloo process groups, reference path)")
    for device in ("cpu", "cuda"):
        chosen = []
        for distributed, where in ((True, "in a process group"), (False, "single process")):
            try:
                chosen.append(f"{resolve_path(None, torch.device(device), distributed=distributed)} "
                              f"({where})")
            except Exception as exc:  # noqa: BLE001
                chosen.append(f"error: {exc}")
        _line(f"default path ({device})", ", ".join(chosen))
    _line("fused transport", transport_line(torch.device("cuda")))
    requested = env.text(env.BACKEND)
    if requested:
        _line(env.BACKEND.name, requested)
    return 0


def _guarded(read) -> str:
    """read() as text, or why it could not be read: a doctor line never crashes the doctor."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - report, never crash the doctor
        return f"unknown ({type(exc).__name__}: {exc})"


def _triton_version() -> Optional[str]:
    try:
        import triton
    except Exception:  # noqa: BLE001 - not installed, or broken: the "triton" line says which
        return None
    return getattr(triton, "__version__", None)


def _cudnn() -> str:
    import torch

    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not version:
        return "n/a"
    # cuDNN 9 encodes major * 10000 + minor * 100 + patch, cuDNN 8 major * 1000 + minor * 100 + patch
    major, rest = divmod(version, 10000 if version >= 90000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100} ({version})"


_SDPA_NAMES = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "mem_efficient", "MATH": "math",
               "CUDNN_ATTENTION": "cudnn", "OVERRIDEABLE": "overrideable"}


def _sdpa() -> str:
    """The order in which torch tries SDPA's backends (torch._C._get_sdp_priority_order, torch
    2.11+; "unknown" where absent) and which are enabled (torch.backends.cuda.*_sdp_enabled)."""
    import torch

    try:
        from torch.nn.attention import SDPBackend

        order = ", ".join(_SDPA_NAMES.get(SDPBackend(i).name, SDPBackend(i).name.lower())
                          for i in torch._C._get_sdp_priority_order())
    except Exception:  # noqa: BLE001 - a torch without the query
        order = "unknown"
    enabled, disabled = [], []
    for name in ("flash", "mem_efficient", "math", "cudnn"):
        query = getattr(torch.backends.cuda, f"{name}_sdp_enabled", None)
        try:
            (enabled if query() else disabled).append(name)
        except Exception:  # noqa: BLE001 - absent (None) or refusing on this build
            disabled.append(f"{name} (unknown)")
    return (f"order {order}; enabled: {', '.join(enabled) or 'none'}"
            + (f"; disabled: {', '.join(disabled)}" if disabled else ""))


def stack_lines():
    """(name, value) lines for the stack the package runs on: torch, Triton, torch's CUDA
    build, cuDNN, SDPA's backends and NCCL, each read on its own and never raising (the
    doctor prints them; bench/gpu_check.sh's env step writes them into its report)."""
    import torch

    def triton_line():
        return _triton_version() or "not importable (pip install triton)"

    def nccl_line():
        if not torch.version.cuda:
            return "n/a (CPU-only torch)"
        return ".".join(str(x) for x in torch.cuda.nccl.version())

    return [("torch", _guarded(lambda: torch.__version__)),
            ("triton", _guarded(triton_line)),
            ("CUDA (torch build)", _guarded(lambda: torch.version.cuda or "none (CPU-only torch)")),
            ("cuDNN", _guarded(_cudnn)),
            ("SDPA backends", _guarded(_sdpa)),
            ("NCCL (torch)", _guarded(nccl_line)),
            ("NCCL launch order", _guarded(_launch_order))]


def _launch_order() -> str:
    """NCCL_LAUNCH_ORDER_IMPLICIT and whether the fused path's NCCL engine may run beside
    torch's communicators (nccl_order.py)."""
    from . import nccl_order
    from .fused.transport import nccl_version

    why = nccl_order.problem(nccl_version())
    return nccl_order.describe() + ("" if why is None else f"; the NCCL engine refuses: {why}")


def version_warnings():
    """torch or Triton outside the tested range (ulysses_kernels/support.py); never raises."""
    try:
        import torch

        from . import support

        return support.problems(torch.__version__, _triton_version())
    except Exception as exc:  # noqa: BLE001 - a version string support.py cannot read
        return [f"could not compare the torch/Triton versions with the tested range ({exc})"]


def hopper_features_line(kernels) -> str:
    """The opt-in kernel features ULYSSES_KERNELS_HOPPER_FEATURES asks for (features.py)."""
    try:
        names = kernels.features.requested()
    except ValueError as exc:  # a bad list: report it, as the first launch would raise it
        return f"error: {exc}"
    return ", ".join(sorted(names)) + " (opt-in, not yet GPU-verified)" if names else "none (the measured kernels)"


def transport_line(device) -> str:
    """The fused path's default transport on `device` and why (ULYSSES_KERNELS_TRANSPORT)."""
    from . import fused

    try:
        factory, why = fused.choose_transport(device)
    except ValueError as exc:  # a bad ULYSSES_KERNELS_TRANSPORT: report it, as engine creation would raise it
        return f"error: {exc}"
    return f"{factory.name} ({why})" if factory is not None else f"unavailable: {why}"


def _head_defaults(ranks, heads, kv_heads, dim):
    """Fill the head counts and width the user left out so they fit `ranks` (for example
    8 GPUs need at least 8 query heads); explicit values are kept and checked later."""
    from .demo import DemoConfig
    from .layout import head_plan_error

    base = DemoConfig()
    if heads is None:
        heads = base.heads if base.heads % max(ranks, 1) == 0 else max(ranks, 1) * -(-base.heads // max(ranks, 1))
    if kv_heads is None:
        fits = [n for n in (base.kv_heads, 1) if ranks >= 1 and head_plan_error(ranks, heads, n) is None]
        kv_heads = fits[0] if fits else base.kv_heads
    if dim is None:
        dim = max(base.dim, 16 * heads)
    return heads, kv_heads, dim


def demo(args) -> int:
    from .demo import DemoConfig, run_demo
    from .layout import head_plan_error

    ring = max(1, args.ring)
    ulysses = args.ranks // ring if args.ranks >= 1 and args.ranks % ring == 0 else args.ranks
    heads, kv_heads, dim = _head_defaults(ulysses, args.heads, args.kv_heads, args.dim)
    cfg = DemoConfig(ranks=args.ranks, seq_len=args.seq_len, steps=args.steps, dim=dim,
                     layers=args.layers, heads=heads, kv_heads=kv_heads, vocab=args.vocab,
                     batch=args.batch, lr=args.lr, backend=args.backend, seed=args.seed, ring=ring)
    problems = []
    if cfg.ranks < 1:
        problems.append(f"--ranks must be at least 1, got {cfg.ranks}")
    if args.ring < 1 or cfg.ranks % ring:
        problems.append(f"--ring {args.ring} must be at least 1 and divide --ranks {cfg.ranks}")
    if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
        problems.append(f"--dim {cfg.dim} must be a multiple of 2 * --heads {cfg.heads}")
    if cfg.heads % ulysses:
        problems.append(f"--heads {cfg.heads} must be divisible by the Ulysses degree {ulysses} "
                        f"(--ranks {cfg.ranks} / --ring {ring}; raise --ring to go beyond the head count)")
    elif ulysses >= 1 and head_plan_error(ulysses, cfg.heads, cfg.kv_heads):
        problems.append(f"--kv-heads {cfg.kv_heads} must divide --heads and divide or be divisible by the Ulysses "
                        f"degree {ulysses}")
    if cfg.seq_len < 4:
        problems.append("--seq-len must be at least 4")
    if problems:
        print("ulysses-kernels demo: " + "; ".join(problems), file=sys.stderr)
        return 2
    verdict = run_demo(cfg, timeout=args.timeout)
    return 0 if verdict and verdict["ok"] else 1


def main(argv=None) -> int:
    from .demo import DemoConfig

    parser = argparse.ArgumentParser(prog="ulysses-kernels",
                                     description="Ulysses sequence parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="versions, extension build, GPUs and available paths; --explain: what "
                                        "runs for one attention call class")
    doc.add_argument("--explain", action="store_true",
                     help="print the path, attention kernel, exchange, kernels, tiles, Hopper features (on, and "
                          "dropped with reasons) and backward mode of the call described by the options below")
    from .explain import DTYPES, CallClass
    call = CallClass()  # one source of truth for the defaults
    for flag, field, kind, help_text in (("--batch", "batch", int, "batch size"),
                                         ("--seq-len", "seq_len", int, "global sequence length"),
                                         ("--heads", "heads", int, "query heads"),
                                         ("--kv-heads", "kv_heads", int, "key/value heads"),
                                         ("--head-dim", "head_dim", int, "head dim"),
                                         ("--head-dim-v", "head_dim_v", int, "v's head dim (default: the head dim)"),
                                         ("--softcap", "softcap", float, "logit softcap (0: none)"),
                                         ("--documents", "documents", int, "equal packed documents (batch 1; 0: none)"),
                                         ("--world", "world", int, "sequence-parallel ranks")):
        doc.add_argument(flag, dest=field, type=kind, default=getattr(call, field),
                         help=f"{help_text} (default {getattr(call, field)})")
    doc.add_argument("--dtype", choices=DTYPES, default=call.dtype)
    doc.add_argument("--causal", action=argparse.BooleanOptionalAction, default=call.causal)
    doc.add_argument("--window", type=int, nargs=2, default=list(call.window), metavar=("LEFT", "RIGHT"),
                     help="flash_attn's window_size (-1: unbounded)")
    doc.add_argument("--sinks", action="store_true", help="attention sinks")
    doc.add_argument("--deterministic", action="store_true", help="a deterministic backward")
    doc.add_argument("--sm-count", type=int, default=132, help="SMs of the GPU described (default 132: H100/H200)")
    d = sub.add_parser("demo", help="train a small causal LM with Ulysses attention on a long "
                                    "copy task and check parity with a single process")
    default_ranks = None
    try:
        import torch
        default_ranks = torch.cuda.device_count() if torch.cuda.is_available() else 4
    except ImportError:
        default_ranks = 4
    d.add_argument("--ranks", type=int, default=default_ranks,
                   help="processes (default: all visible GPUs with NCCL, else 4 on CPU with gloo)")
    cfg = DemoConfig()  # one source of truth for the defaults
    for flag, field, help_text in (("--seq-len", "seq_len", "global sequence length"),
                                   ("--steps", "steps", "training steps"),
                                   ("--dim", "dim", "model width"),
                                   ("--layers", "layers", "transformer layers"),
                                   ("--heads", "heads", "query heads"),
                                   ("--kv-heads", "kv_heads", "key/value heads"),
                                   ("--vocab", "vocab", "vocabulary size"),
                                   ("--batch", "batch", "sequences per step"),
                                   ("--lr", "lr", "AdamW learning rate"),
                                   ("--seed", "seed", "random seed")):
        default = getattr(cfg, field)
        if field in ("dim", "heads", "kv_heads"):  # defaults adapt to --ranks
            d.add_argument(flag, type=int, default=None,
                           help=f"{help_text} (default {default}, raised to fit --ranks)")
        else:
            d.add_argument(flag, type=type(default), default=default, help=f"{help_text} (default {default})")
    d.add_argument("--backend", choices=["reference", "triton", "fused"], default=None,
                   help="force an attention path (default: automatic)")
    d.add_argument("--ring", type=int, default=1,
                   help="ring degree of the Ulysses x Ring hybrid (default 1: pure Ulysses); the Ulysses "
                        "degree is --ranks / --ring")
    d.add_argument("--timeout", type=float, default=3600.0, help="seconds before a hung run is killed")
    _plan_arguments(sub.add_parser("plan", help="per-GPU memory of a training step and the longest sequence that "
                                                "fits (a model, not a measurement)"))
    sub.add_parser("env", help="every environment variable the package reads, as a Markdown table (docs/env.md)")
    sub.add_parser("kernels", help="which attention kernel computes which call class, from the capability tables "
                                   "(docs/kernels.md)")
    args = parser.parse_args(argv)
    return {"doctor": doctor, "demo": demo, "plan": plan, "env": print_env, "kernels": print_kernels}[args.command](args)


def print_kernels(_args) -> int:
    from .kernel_choice import explain

    print(explain.markdown())
    return 0


def print_env(_args) -> int:
    from . import env

    print(env.markdown(), end="")
    return 0


def _plan_arguments(p):
    from .planner import PRESETS

    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}), a config.json / checkpoint "
                                                  "folder, or a transformers model type (its default configuration)")
    p.add_argument("--seq-len", type=int, required=True, help="global sequence length (tokens)")
    p.add_argument("--gpus", "--gpus-per-node", dest="gpus", type=int, default=8,
                   help="GPUs per node (default 8); the GPUs in all are --gpus x --nodes")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: all GPUs)")
    p.add_argument("--ep", type=_auto_or_positive, default=1,
                   help="expert-parallel size of a mixture of experts (each GPU holds experts / EP of every MoE "
                        "layer), or 'auto': the smallest SP size that fits, then the smallest EP size that fits "
                        "there, each with why (default 1)")
    p.add_argument("--ring", type=_auto_or_positive, default=1,
                   help="ring degree of Ulysses x Ring, or 'auto': the smallest the model's heads allow (default 1)")
    p.add_argument("--offload", action="store_true", help="checkpoint offload + FSDP2 CPU offload of parameters, "
                                                          "gradients and optimizer states")
    p.add_argument("--checkpoint-offload", action="store_true")
    p.add_argument("--fsdp-cpu-offload", action="store_true")
    p.add_argument("--tiled", action="store_true", help="tiled MLP and tiled loss")
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--tiled-loss", action="store_true")
    p.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing (default: on)")
    p.add_argument("--no-fsdp", action="store_true", help="replicated parameters and optimizer states")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="compute dtype")
    p.add_argument("--reserve-gib", type=float, default=2.0, help="CUDA context, NCCL buffers, fragmentation")
    p.add_argument("--inference", action="store_true",
                   help="plan hf.prefill of --seq-len tokens (weights, head-sharded KV cache, one layer) instead of "
                        "a training step; --tiled-mlp with patch_model's tile")
    p.add_argument("--chunk", type=int, default=None, help="with --inference: tokens per prefill chunk")
    p.add_argument("--json", action="store_true")


def _auto_or_positive(value: str):
    """--ring, --ep: "auto" or an integer >= 1."""
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {value!r}")
    return number


def _plan_ring(args, shape) -> Tuple[Optional[int], Optional[str]]:
    """(the ring degree of the plan, None), or (None, why the Ulysses degree does not fit the
    model's heads and what to pass instead). --ring auto: the smallest degree that fits
    (`layout.choose_ring_size`)."""
    from .layout import choose_ring_size, head_plan_error

    sp = args.sp or args.gpus * args.nodes
    node = args.gpus if args.nodes > 1 else None   # several nodes: the rule init_sequence_parallel applies
    if args.ring == "auto":
        ring = choose_ring_size(sp, shape.heads, shape.kv_heads, gpus_per_node=node)
        where = f"each Ulysses group inside a node of {node} GPUs, the ring across nodes" if node else "one node"
        print(f"--ring auto: Ulysses {sp // ring} x ring {ring} ({where})", file=sys.stderr)
        return ring, None
    if sp % args.ring:
        return args.ring, None   # the planner's own error names it
    why = head_plan_error(sp // args.ring, shape.heads, shape.kv_heads)
    if why is None:
        return args.ring, None
    fit = choose_ring_size(sp, shape.heads, shape.kv_heads)
    return None, (f"SP {sp} with --ring {args.ring} is Ulysses {sp // args.ring}, which the model's heads "
                  f"({shape.heads} query, {shape.kv_heads} key/value) do not allow: {why}; use --ring {fit} "
                  f"(Ulysses {sp // fit}) or --ring auto")


def _plan_shape(model: str):
    """--model: a preset, a config.json (or its folder), or a transformers model type at its
    default configuration."""
    import os

    from .planner import PRESETS, shape_from_config, shape_from_model_type

    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    if os.path.exists(model):
        return shape_from_config(model)
    return shape_from_model_type(model)


def plan(args) -> int:
    import json
    from dataclasses import asdict

    from .planner import PRESETS, PlanOptions, choose_layout, format_plan
    from .planner import plan as make_plan

    try:
        shape = _plan_shape(args.model)
    except ValueError as exc:   # a config the planner reads but does not model
        print(f"ulysses-kernels plan: --model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    except (OSError, KeyError, ImportError) as exc:
        print(f"ulysses-kernels plan: --model {args.model!r} is neither a preset ({', '.join(PRESETS)}), a "
              f"readable config.json nor a transformers model type: {exc}", file=sys.stderr)
        return 2
    problem = shape.dense_mlp_problem()
    if problem:
        print(f"ulysses-kernels plan: --model {args.model!r}: {problem}", file=sys.stderr)
        return 2
    # --ep auto without --sp chooses the SP size, and the ring with it (planner.choose_layout)
    ring, problem = (1, None) if args.ep == "auto" and not args.sp else _plan_ring(args, shape)
    if problem:
        print(f"ulysses-kernels plan: --model {args.model!r}: {problem}", file=sys.stderr)
        return 2
    args.ring = ring
    if args.inference:
        return _plan_inference(args, shape)
    options = PlanOptions(seq_len=args.seq_len, gpus_per_node=args.gpus, nodes=args.nodes,
                          gpu_memory_gib=args.gpu_memory_gib, sp_size=args.sp, ring_size=ring,
                          ep_size=1 if args.ep == "auto" else args.ep,
                          fsdp=not args.no_fsdp, fsdp_cpu_offload=args.offload or args.fsdp_cpu_offload,
                          checkpointing=not args.no_checkpointing,
                          checkpoint_offload=args.offload or args.checkpoint_offload,
                          tiled_mlp=args.tiled or args.tiled_mlp, tiled_loss=args.tiled or args.tiled_loss,
                          dtype_bytes=4 if args.dtype == "fp32" else 2, reserve_gib=args.reserve_gib)
    reasons = []
    try:
        if args.ep == "auto":
            layout = choose_layout(shape, options, sp_sizes=[args.sp] if args.sp else None,
                                   ring_size=ring if args.sp and ring != 1 else None)
            options, result, reasons = layout.options, layout.plan, layout.reasons
        else:
            result = make_plan(shape, options)
    except ValueError as exc:
        print(f"ulysses-kernels {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "fits": result.fits, "max_seq_len": result.max_seq_len, "why": reasons,
                          "per_gpu_gib": round(result.per_gpu_gib, 3), "terms_gib": result.terms_gib,
                          "host_gib": result.host_gib, "params": shape.params, "expert_params": shape.expert_params,
                          "options": asdict(options)}, indent=1))
    else:
        if reasons:
            print("layout (--ep auto):\n" + "\n".join(f"  {line}" for line in reasons) + "\n")
        print(format_plan(args.model, options, result))
        print(_parameters_line(shape))
    return 0


def _parameters_line(shape) -> str:
    """The model's parameter count, and its routed experts' (each MoE layer's every expert,
    which FSDP gathers whole: the "gathered compute weights" term)."""
    line = f"parameters: {shape.params:,}"
    if shape.moe is not None:
        m = shape.moe
        line += (f", of which routed experts {shape.expert_params:,} ({m.layers} MoE layers x {m.experts} experts x "
                 f"{m.expert_params(shape.hidden):,}; {m.top_k} per token"
                 f"{f', shared experts of width {m.shared_width}' if m.shared_width else ''})")
    return line


def _plan_inference(args, shape) -> int:
    """`plan --inference`: the per-GPU terms of one prefill (planner.prefill_terms)."""
    import json

    from .planner import GIB, max_prefill_len, mlp_tile_tokens, prefill_terms

    sp = args.sp or args.gpus * args.nodes
    options = dict(dtype_bytes=4 if args.dtype == "fp32" else 2, reserve_gib=args.reserve_gib,
                   mlp_tile=mlp_tile_tokens(shape.hidden) if (args.tiled or args.tiled_mlp) else None,
                   chunk=args.chunk)
    terms = prefill_terms(shape, args.seq_len, sp, **options)
    total = sum(terms.values())
    longest = max_prefill_len(shape, sp, args.gpu_memory_gib, **options)
    if args.json:
        print(json.dumps({"model": args.model, "sp": sp, "seq_len": args.seq_len, "per_gpu_gib": round(total / GIB, 3),
                          "fits": total <= args.gpu_memory_gib * GIB, "max_prefill_len": longest,
                          "terms_gib": {k: v / GIB for k, v in terms.items()}}, indent=1))
        return 0
    print(f"{args.model}: prefill of {args.seq_len:,} tokens over SP {sp}, {args.gpu_memory_gib:g} GiB per GPU "
          f"(a model of hf.prefill, not a measurement)")
    for name, value in terms.items():
        print(f"  {name:<32} {value / GIB:8.2f} GiB")
    print(f"  {'total':<32} {total / GIB:8.2f} GiB: {'fits' if total <= args.gpu_memory_gib * GIB else 'does NOT fit'}")
    print(f"  longest prompt that fits: {longest:,} tokens"
          + (f" in chunks of {args.chunk:,}" if args.chunk else " in one prefill (--chunk N: chunked prefill, whose "
             "activations are the chunk's; the KV cache still holds every token)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
