"""The fused path of `ulysses_attention` (docs/architecture.md, "Fused path"): the
autograd function around the pipelines of pipeline.py, the checks of what this path can
run, and `prepare` (engine, geometry, chunk plan), which the fused self-attention layer
(layer.py) shares.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .. import env, kernel_choice
from ..exchange.heads import local_sinks
from ..extensions import load_extension
from ..layout import HeadPlan, split_lengths
from ..streams import device_ctx
from ..triton_path import kernels_problem
from ..variants import PLAIN, Variant
from . import ops, pipeline
from .engine import Engine, get_engine
from .pipeline import AttentionOptions, Geometry, Saved
from .plan import Chunk, plan_chunks, resolve_num_chunks


def problem(device: torch.device, tensors=()) -> Optional[str]:
    """Why this path cannot run q/k/v `tensors` on `device` (None when it can; no tensors:
    whether it can run there at all), phrased to follow "backend='fused' " (dispatch's
    errors) or "the fused path " (doctor). The attention runs on the Triton kernels, so
    their limits are this path's too."""
    if device.type not in ops.device_types():
        return f"needs CUDA tensors, got tensors on {device}"
    if len(tensors) == 3 and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors) \
            and tensors[2].shape[3] != tensors[0].shape[3]:
        return ("moves q, k and v of one head dim in one exchange; v's head dim "
                f"({tensors[2].shape[3]}) differs from q's ({tensors[0].shape[3]})")
    if not ops.is_supported():
        _, reason = load_extension()
        if reason:
            return f"needs the CUDA extension, which is unavailable ({reason})"
        return "needs the CUDA extension's fused exchange ops, which this build lacks"
    return kernels_problem(device, tensors)


@dataclass(frozen=True)
class Setup:
    """A validated call on this path: the engine, the geometry, the attention options and
    the chunk plan (`prepare`)."""

    engine: Engine
    geometry: Geometry
    attention: AttentionOptions
    plan: Tuple[Chunk, ...]


def prepare(q_shape, kv_heads: int, dtype: torch.dtype, device: torch.device, *, group, rank: int,
            seq_lens: Sequence[int], causal: bool, softmax_scale: float, cu_seqlens=None,
            num_chunks: Optional[int] = None, variant: Variant = PLAIN, sinks=None,
            engine: Optional[Engine] = None, grad: bool = True) -> Setup:
    """Engine, geometry, options and chunk plan for a validated call whose q is
    `q_shape = [B, S_p, Hq, D]` (shared by the attention op and layer.py); `sinks`: this
    rank's local query heads' (detached: the autograd function returns their gradient);
    `engine`: the caller's (Engine.create), else the group's default one (get_engine);
    `grad`: the call will be differentiated (the kernel choice times forward + backward)."""
    lens = tuple(int(n) for n in seq_lens)
    world = len(lens)
    B, _, Hq, D = q_shape
    if B > 1 and world > 1 and list(lens) != split_lengths(sum(lens), world):
        raise ValueError(f"fused ulysses_attention: local lengths {list(lens)} are not the torch.tensor_split "
                         f"of {sum(lens)} over {world} ranks")
    heads = HeadPlan(world, Hq, kv_heads)
    geo = Geometry(batch=B, lens=lens, rank=rank, head_dim=D)
    recv_bytes = geo.recv_numel(heads.channels) * torch.empty((), dtype=dtype).element_size()
    chunks = resolve_num_chunks(num_chunks, world, heads.local_q_heads, heads.local_kv_heads, recv_bytes)
    plan = tuple(plan_chunks(heads.local_q_heads, heads.local_kv_heads, chunks))
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
    kernel = _kernel(geo, plan, dtype, device, group=group, causal=causal, packed=cu_seqlens is not None,
                     variant=variant, sinks=sinks is not None, grad=grad)
    attn = AttentionOptions(causal=bool(causal), softmax_scale=float(softmax_scale), cu_seqlens=cu_seqlens,
                            variant=variant, sinks=sinks.detach() if sinks is not None else None, kernel=kernel)
    if engine is None:
        engine = get_engine(group, world, rank, device)
    else:
        why = engine.problem(group, world, rank, device)
        if why:
            raise ValueError(f"fused ulysses_attention: {why}")
    return Setup(engine, geo, attn, plan)


def _kernel(geo: Geometry, plan, dtype, device, *, group, causal, packed, variant, sinks, grad) -> str:
    """The kernel choice for this call's chunks (docs/architecture.md, "The kernel choice"),
    agreed over the SP group: one class for the call, the largest chunk's heads (every rank
    has the same plan, so the same class). The receive buffer is a `[B, S, h, D]` view at
    batch 1 or on one rank, else block rows that only our kernel reads."""
    largest = max(plan, key=lambda c: c.q_cnt)
    call = kernel_choice.call_for(device, dtype, batch=geo.batch, q_len=geo.total, k_len=geo.total,
                                  q_heads=largest.q_cnt, kv_heads=largest.kv_use, head_dim=geo.head_dim,
                                  value_dim=geo.head_dim, causal=causal, variant=variant, sinks=sinks, packed=packed,
                                  rows_layout=geo.batch > 1 and geo.world > 1,
                                  deterministic=env.flag(env.DETERMINISTIC), grad=grad)
    return kernel_choice.choose(call, groups=(group,) if geo.world > 1 else (), device=device).choice


class _AttentionIo:
    """`pipeline.ChunkIo` of the attention op: chunk i packs its heads of q/k/v (forward)
    or dO (backward) and unpacks into the op's results."""

    computes_inputs = False

    def __init__(self, sources, results, backward: bool):
        self.sources, self.results, self.backward = sources, results, backward

    def inputs(self, i, c):
        if self.backward:
            return self.sources, [c.q_off], [c.q_cnt]
        return self.sources, [c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt]

    def pack_rotary(self, i):
        return None

    def after_inputs(self):
        pass

    def outputs(self, i, c):
        if self.backward:
            return self.results, [c.q_off, c.g_off, c.g_off], [c.q_cnt, c.g_cnt, c.g_cnt]
        return self.results, [c.q_off], [c.q_cnt]

    def consume(self, i, c, ready):
        pass


class _FusedUlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, setup: Setup, grad_enabled: bool):
        # needs_input_grad does not see torch.no_grad(): the caller passes the grad mode.
        save = grad_enabled and any(ctx.needs_input_grad[:4])
        out = q.new_empty(q.shape)
        with device_ctx(q.device):
            saved = pipeline.forward(setup.engine, _AttentionIo([q, k, v], [out], backward=False), setup.geometry,
                                     setup.attention, setup.plan, save=save, dtype=q.dtype, device=q.device)
        if save:
            ctx.setup, ctx.kv_shape = setup, tuple(k.shape)
            # The buffers are saved through autograd (not as ctx attributes) so that backward
            # frees them unless retain_graph=True, and a second backward without it raises
            # torch's usual error instead of reading freed state.
            ctx.recv_off, ctx.osend_off, ctx.graphs = saved.recv_off, saved.osend_off, saved.graphs
            ctx.save_for_backward(saved.recv, saved.osend, *saved.lses)
        return out

    @staticmethod
    def backward(ctx, dout):
        recv, osend, *lses = ctx.saved_tensors
        saved = Saved(recv, ctx.recv_off, osend, ctx.osend_off, lses, ctx.graphs)
        setup = ctx.setup
        dq = dout.new_empty(dout.shape)
        dk, dv = (dout.new_empty(ctx.kv_shape) for _ in range(2))
        sinks = setup.attention.sinks
        dsinks = torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device) if sinks is not None else None
        with device_ctx(dout.device):
            pipeline.backward(setup.engine, _AttentionIo([dout], [dq, dk, dv], backward=True), setup.geometry,
                              setup.attention, setup.plan, saved, dtype=dout.dtype, device=dout.device,
                              dsinks=dsinks)
        dsinks = dsinks.to(sinks.dtype) if dsinks is not None else None
        return dq, dk, dv, dsinks, None, None  # setup, grad_enabled


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, rank: int,
                      seq_lens: Sequence[int], causal: bool, softmax_scale: float, cu_seqlens=None,
                      num_chunks: Optional[int] = None, variant: Variant = PLAIN, sinks=None,
                      engine: Optional[Engine] = None) -> torch.Tensor:
    """Fused Ulysses attention (differentiable). Called by `ulysses_kernels.ulysses_attention`
    after it validated the inputs: `seq_lens` is every rank's local length, `group` None
    means the default group (or a single process when torch.distributed is not initialised).
    `variant` and the global `[Hq]` `sinks` are the attention variants (variants.py);
    `engine`: the caller's engine (Engine.create), else the group's default one.
    """
    why = problem(q.device, (q, k, v))
    if why:
        raise RuntimeError(f"the fused path {why}; use backend='triton' or 'reference'")
    sinks = local_sinks(sinks, rank, len(seq_lens))
    setup = prepare(q.shape, k.shape[2], q.dtype, q.device, group=group, rank=rank, seq_lens=seq_lens,
                    causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, num_chunks=num_chunks,
                    variant=variant, sinks=sinks, engine=engine,
                    grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None))
    return _FusedUlyssesAttention.apply(q, k, v, sinks, setup, torch.is_grad_enabled())
