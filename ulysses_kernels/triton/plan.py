"""What the Triton kernels run for a call class, without running them.

``plan_attention`` walks the same launchers a call walks (ops._run_fwd / _run_bwd ->
launch_fwd / launch_bwd) on meta tensors with ``plan=`` set: each launcher records its
decision (kernel, grid, config and why, the Hopper features on and those dropped with the
reason, the backward's mode and head splits) instead of launching. So the plan is the
launchers' own rule, not a copy of it; ``ulysses-kernels doctor --explain`` prints it and
tests assert it. Plans are cached per call class: the arguments of plan_attention and the
settings the launchers read (the Hopper features, forced head splits, autotuning).

The tensors are laid out as the Triton path lays them: ``[B, S, H, D]`` contiguous for one
rank (``seq_splits`` 1), or the all-to-all receive buffer's ``[B*S, H, D]`` rows of
``seq_splits`` blocks (contiguous q, k and v buffers).
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch

from ..env import BWD_HEAD_SPLITS, HOPPER_FEATURES, TRITON_AUTOTUNE, flag, integer, text
from .kernel_call import Target
from .launcher import LaunchPlan, PlanNote
from .ops import CallOptions, _run_bwd, _run_fwd


class CallPlan(NamedTuple):
    """The forward's launches, then the backward's notes (mode, head splits) and launches."""

    forward: Tuple[LaunchPlan, ...]
    backward: Tuple[object, ...]


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def plan_attention(**call) -> CallPlan:
    """The plan of one attention call of the Triton kernels (see _plan for the arguments),
    cached under the call and the settings the launchers read."""
    settings = (text(HOPPER_FEATURES), integer(BWD_HEAD_SPLITS, 0), flag(TRITON_AUTOTUNE, default=True))
    return _plan(settings, **call)


@functools.lru_cache(maxsize=256)
def _plan(settings, *, batch: int, seqlen_q: int, seqlen_k: int, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, head_dim_v: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                   causal: bool = False, band: Tuple[Optional[int], Optional[int]] = (None, None),
                   softcap: float = 0.0, sinks: bool = False, documents: Optional[Tuple[int, ...]] = None,
                   seq_splits: int = 1, deterministic: bool = False,
                   target: Target = Target("cuda", interpreting=False, sm_count=132)) -> CallPlan:
    """The plan of one attention call (module docstring); `settings` only keys the cache. The
    kernel shapes of one rank (heads and lengths as the kernels see them); ``documents``: the
    packed documents' ``cu_seqlens`` (batch 1); ``target``: the machine described (default
    an H100/H200-class GPU: sm_90, 132 SMs)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if seq_splits > 1:  # the all-to-all buffer: [B*S, H, D] rows
        shapes = [(batch * seqlen_q, num_q_heads, head_dim), (batch * seqlen_k, num_kv_heads, head_dim),
                  (batch * seqlen_k, num_kv_heads, head_dim_v), (batch * seqlen_q, num_q_heads, head_dim_v)]
    else:
        shapes = [(batch, seqlen_q, num_q_heads, head_dim), (batch, seqlen_k, num_kv_heads, head_dim),
                  (batch, seqlen_k, num_kv_heads, head_dim_v), (batch, seqlen_q, num_q_heads, head_dim_v)]
    q, k, v, out = (_meta(shape, dtype) for shape in shapes)
    lse = _meta((batch, num_q_heads, seqlen_q), torch.float32)
    cu_seqlens = torch.tensor(documents, dtype=torch.int32) if documents is not None else None
    sink_logits = _meta((num_q_heads,), torch.float32) if sinks else None
    scale = head_dim ** -0.5
    options = CallOptions(causal, scale, cu_seqlens, seq_splits, batch if seq_splits > 1 else None, band=band,
                          softcap=softcap, sinks=sink_logits, deterministic=deterministic)
    forward: list = []
    _run_fwd(q, k, v, out, lse, options, target=target, plan=forward)
    backward: list = []
    grads = [torch.empty_like(t) for t in (q, k, v)]
    dsinks = _meta((num_q_heads,), torch.float32) if sinks else None
    _run_bwd(torch.empty_like(out), q, k, v, out, lse, grads, options, dsinks=dsinks, target=target, plan=backward)
    return CallPlan(tuple(forward), tuple(backward))


def config_text(config) -> str:
    block_m, block_n, warps, stages = config
    return f"{block_m}x{block_n}, {warps} warps, {stages} stages"


_LAYOUTS = {0: "strided", 1: "all-to-all buffer, affine tiles", 2: "all-to-all buffer, per-token rows"}
_SHOWN_SWITCHES = ("WINDOW", "SOFTCAP", "SINKS", "DQ_ATOMIC", "KV_ATOMIC", "KV_DESC", "FMA_SCALE", "LAZY_RESCALE",
                   "WARP_SPECIALIZE", "DQ_REDUCE")


def describe(plan: CallPlan):
    """(name, text) lines of a plan, for ``ulysses-kernels doctor --explain``."""
    lines = []
    for section, items in (("forward", plan.forward), ("backward", plan.backward)):
        for item in items:
            if isinstance(item, PlanNote):
                lines.append((f"{section} {item.topic}", f"{item.choice}: {item.why}"))
                continue
            consts = item.constexprs
            lines.append((f"{section} kernel", f"{item.kernel}, grid {item.grid}"))
            tile = config_text(item.config) if item.config else f"default {config_text(item.default)}"
            lines.append(("  tile", f"{tile} ({item.config_why})"))
            on = [name for name in _SHOWN_SWITCHES if consts.get(name)]
            lines.append(("  layout", f"{_LAYOUTS.get(consts.get('SPLIT'))} (SPLIT {consts.get('SPLIT')}), "
                                      f"{'causal' if consts.get('CAUSAL') else 'not causal'}, "
                                      f"{'packed documents' if consts.get('VARLEN') else 'no documents'}, "
                                      f"head dims {consts.get('HEAD_DIM')}/{consts.get('HEAD_DIM_V')}; "
                                      f"switches on: {', '.join(on) or 'none'}"))
            for switches in item.switches:
                lines.append(("  Hopper features", switches.describe()))
    return lines
