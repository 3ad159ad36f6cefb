"""The fused path of `ulysses_attention` (docs/architecture.md, "Fused path"): the
autograd function around the pipelines of pipeline.py, the checks of what this path can
run, and `prepare` (engine, lengths, chunk plan), which the fused self-attention layer
(layer.py) shares.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..extensions import kernel_input_problem, load_extension
from ..layout import HeadPlan, split_lengths
from . import ops, pipeline
from .engine import Engine, get_engine
from .plan import Chunk, plan_chunks, resolve_num_chunks
from .ring import ulysses_ring_attention
from .streams import device_ctx


def problem(device: torch.device, tensors) -> Optional[str]:
    """Why this path cannot run q/k/v `tensors` on `device` (None when it can), phrased to
    follow "backend='fused' " (dispatch's errors) or "the fused path " (doctor)."""
    if device.type not in ops.device_types():
        return f"needs CUDA tensors, got tensors on {device}"
    if not ops.is_supported():
        _, reason = load_extension()
        if reason:
            return f"needs the CUDA extension, which is unavailable ({reason})"
        return "needs the CUDA extension's fused exchange ops, which this build lacks"
    why = unsupported_reason(*tensors) if tensors else None
    return f"cannot run these inputs: {why}" if why else None


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the fused path cannot take these inputs (None when it can), for tensors on a
    device the active ops run on: one dtype among bf16/fp16/fp32 and a head dim that is a
    multiple of 16 up to 256 (the Triton attention's limits)."""
    if not all(isinstance(t, torch.Tensor) and t.device.type in ops.device_types() for t in (q, k, v)):
        return "the fused path needs CUDA tensors"
    return kernel_input_problem("fused", (q, k, v))


class _AttentionIo:
    """io of the attention op: chunk i packs its heads of q/k/v (forward) or dO (backward)
    and unpacks into the op's results."""

    computes_inputs = False

    def __init__(self, sources, results, backward: bool):
        self.sources, self.results, self.backward = sources, results, backward

    def inputs(self, i, c):
        if self.backward:
            return self.sources, [c.q_off], [c.q_cnt]
        return self.sources, [c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt]

    def after_inputs(self):
        pass

    def outputs(self, i, c):
        if self.backward:
            return self.results, [c.q_off, c.g_off, c.g_off], [c.q_cnt, c.g_cnt, c.g_cnt]
        return self.results, [c.q_off], [c.q_cnt]

    def consume(self, i, c, event):
        pass


class _FusedUlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, engine, lens, rank, causal, scale, cu_seqlens, plan, grad_enabled=True):
        # needs_input_grad does not see torch.no_grad(): the caller passes the grad mode.
        save = grad_enabled and any(ctx.needs_input_grad[:3])
        out = q.new_empty(q.shape)
        with device_ctx(q.device):
            state = pipeline.forward(engine, _AttentionIo([q, k, v], [out], backward=False), q.shape, lens, causal,
                                     scale, cu_seqlens, plan, save, q.device, q.dtype)
        if save:
            ctx.engine, ctx.lens, ctx.rank, ctx.causal, ctx.scale = engine, lens, rank, causal, scale
            ctx.cu_seqlens, ctx.plan = cu_seqlens, plan
            ctx.q_shape, ctx.kv_heads = tuple(q.shape), k.shape[2]
            # Saved through autograd (not as ctx attributes) so that backward frees them
            # unless retain_graph=True, and a second backward without it raises torch's
            # usual error instead of reading freed state.
            ctx.recv_off, ctx.osend_off = state["recv_off"], state["osend_off"]
            ctx.save_for_backward(state["recv"], state["osend"], *state["lses"])
        return out

    @staticmethod
    def backward(ctx, dout):
        recv, osend, *lses = ctx.saved_tensors
        state = dict(recv=recv, recv_off=ctx.recv_off, osend=osend, osend_off=ctx.osend_off, lses=lses)
        B, Sp, Hq, D = ctx.q_shape
        dq = dout.new_empty(B, Sp, Hq, D)
        dk, dv = (dout.new_empty(B, Sp, ctx.kv_heads, D) for _ in range(2))
        with device_ctx(dout.device):
            pipeline.backward(ctx.engine, _AttentionIo([dout], [dq, dk, dv], backward=True), ctx.q_shape, ctx.lens,
                              ctx.causal, ctx.scale, ctx.cu_seqlens, ctx.plan, state, dout.device, dout.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, rank: int,
                      seq_lens: Sequence[int], causal: bool, softmax_scale: float, cu_seqlens=None,
                      num_chunks: Optional[int] = None, ring=None) -> torch.Tensor:
    """Fused Ulysses attention (differentiable). Called by `ulysses_kernels.ulysses_attention`
    after it validated the inputs: `seq_lens` is every rank's local length, `group` None
    means the default group (or a single process when torch.distributed is not initialised).
    `ring`: the `RingSpec` of a Ulysses x Ring call (fused/ring.py).
    """
    why = problem(q.device, (q, k, v))
    if why:
        raise RuntimeError(f"the fused path {why}; use backend='triton' or 'reference'")
    if ring is not None:
        return ulysses_ring_attention(q, k, v, group=group, world=len(seq_lens), rank=rank, seq_lens=seq_lens,
                                      ring=ring)
    setup = prepare(q.shape, k.shape[2], q.dtype, q.device, group=group, rank=rank, seq_lens=seq_lens,
                    cu_seqlens=cu_seqlens, num_chunks=num_chunks)
    return _FusedUlyssesAttention.apply(q, k, v, setup.engine, setup.lens, rank, bool(causal), float(softmax_scale),
                                        setup.cu_seqlens, setup.plan, torch.is_grad_enabled())


@dataclass(frozen=True)
class Setup:
    engine: Engine
    lens: List[int]
    plan: Tuple[Chunk, ...]
    cu_seqlens: Optional[torch.Tensor]


def prepare(q_shape, kv_heads: int, dtype: torch.dtype, device: torch.device, *, group, rank: int,
            seq_lens: Sequence[int], cu_seqlens=None, num_chunks: Optional[int] = None) -> Setup:
    """Engine, lengths, chunk plan and device cu_seqlens for a validated call whose q is
    `q_shape = [B, S_p, Hq, D]` (shared by the attention op and layer.py)."""
    lens = [int(n) for n in seq_lens]
    world = len(lens)
    B, Sp, Hq, D = q_shape
    if B > 1 and world > 1 and lens != split_lengths(sum(lens), world):
        raise ValueError(f"fused ulysses_attention: local lengths {lens} are not the torch.tensor_split "
                         f"of {sum(lens)} over {world} ranks")
    heads = HeadPlan(world, Hq, kv_heads)
    hl_q, hl_kv = heads.local_q_heads, heads.local_kv_heads
    recv_bytes = B * sum(lens) * heads.channels * D * torch.empty((), dtype=dtype).element_size()
    chunks = resolve_num_chunks(num_chunks, world, hl_q, hl_kv, recv_bytes)
    plan = tuple(plan_chunks(hl_q, hl_kv, chunks))
    engine = get_engine(group, world, rank, device)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
    return Setup(engine, lens, plan, cu_seqlens)
