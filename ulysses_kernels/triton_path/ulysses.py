"""The Triton path's Ulysses attention (docs/architecture.md, "Triton path"): the
attention kernels read the all-to-all receive buffer in place and write into the reverse
send buffer (no unpack copy).

Forward:
  pack q|k|v -> send `[P, B, S_r, Hc, D]` -> all-to-all -> receive buffer, whose rows are
  the blocks `[B, S_i]` of every source rank i in order. q/k/v are 3-D views
  `[B*S, Hl, D]` of it (a channel offset into each row), which the kernels address with
  `seq_splits=P` (two-level sequence addressing). The output is written into `[B*S, Hl_q, D]`,
  which has the block layout the reverse all-to-all sends from, then unpacked to
  `[B, S_r, Hq, D]`.
With one batch row (or one rank) the buffer rows are a strided `[B, S, H, D]` tensor, and
the kernel may instead be any candidate of the kernel choice (ulysses_kernels/kernel_choice/:
cuDNN, FlashAttention, torch's varlen_attn, ...), agreed by the group; its backward replays
the autograd graph recorded in the forward.
Backward: dO takes the same route as q; the kernels write dq|dk|dv into one buffer in
the send layout; one all-to-all returns them; unpack sums replicated KV heads. When v has
a head dim of its own (MLA) q|k and v move in two buffers (a row holds one head dim).
The variants (window, softcap, sinks: `ulysses_kernels/variants.py`) go to the kernels.

The buffers and exchanges are the shared torch ones (`ulysses_kernels/exchange/`); the
fused path replaces them with CUDA pack kernels and the NCCL engine.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import env, kernel_choice
from ..distributed.collectives import all_to_all
from ..exchange.buffers import exchange_seq_to_heads, pack_for_heads, placements_for, unpack_from_heads
from ..exchange.heads import local_sinks
from ..extensions import require_triton_kernels
from ..variants import PLAIN, Variant


def _reverse_exchange(rows: torch.Tensor, batch: int, seq_lens, rank: int, group):
    """Send block-ordered rows `[B*S, Hc, D]` back to the ranks owning each sequence slice.

    Returns `[P, B, S_r, Hc, D]` (slot i = source rank i's heads)."""
    P = len(seq_lens)
    _, Hc, D = rows.shape
    per_token = batch * Hc * D
    recv = all_to_all(rows, [n * per_token for n in seq_lens], [seq_lens[rank] * per_token] * P, group)
    return recv.view(P, batch, seq_lens[rank], Hc, D)


def _kernel_choice(rows, batch, world, group, causal, cu_seqlens, grad, variant, sinks) -> str:
    """The attention kernel for the receive buffer (ulysses_kernels/kernel_choice/), agreed
    over the SP group. With one batch row or one rank the buffer rows are a strided
    `[B, S, H, D]` tensor that every candidate reads in place; batch > 1 across ranks
    (two-level addressing) is block rows, which only our kernels read."""
    call = kernel_choice.call_of(*rows, causal=causal, packed=cu_seqlens is not None, variant=variant, sinks=sinks,
                                 rows_layout=True, batch=batch, deterministic=env.flag(env.DETERMINISTIC),
                                 grad=grad)
    if not (batch > 1 and world > 1):
        call = dataclasses.replace(call, rows_layout=False)
    return kernel_choice.choose(call, groups=(group,) if world > 1 else (), device=rows[0].device).choice


def _external_forward(name, row_views, out_rows, batch, causal, softmax_scale, cu_seqlens, grad, variant):
    """Run a kernel other than ours on `[B, S, H, D]` views of the buffer rows and write the
    output into `out_rows`. For the backward, the kernel's own autograd graph is recorded on
    detached views (no copies) and returned; backward replays it with torch.autograd.grad."""
    views = [t.detach().view(batch, t.shape[0] // batch, *t.shape[1:]).requires_grad_(grad) for t in row_views]
    with torch.enable_grad() if grad else torch.no_grad():
        out = kernel_choice.run(name, *views, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                variant=variant)
    out_rows.view(out.shape).copy_(out)
    return (views, out) if grad else None


def _external_backward(recorded, do_rows, grads) -> None:
    """dq, dk, dv of a recorded non-Triton forward, written into the `grads` row views."""
    views, out = recorded
    # retain_graph: the recorded graph lives as long as the call's autograd node (ctx), so a
    # backward with retain_graph=True can run again; torch frees both after the last one.
    d_views = torch.autograd.grad(out, views, do_rows.view(out.shape), retain_graph=True)
    for dst, src in zip(grads, d_views):
        dst.view(src.shape).copy_(src)


def _exchange_groups(q, k, v):
    """The tensors each exchange moves: q|k|v in one, or q|k and v in two when v has a
    head dim of its own (a buffer row holds heads of one head dim)."""
    return [(0, 1, 2)] if v.shape[3] == q.shape[3] else [(0, 1), (2,)]


def _row_views(buffers, groups, placements):
    """The q, k, v (or dq, dk, dv) views `[B*S, Hl_t, D_t]` of the block-ordered row buffers."""
    views = [None] * 3
    for rows, members in zip(buffers, groups):
        c = 0
        for t in members:
            views[t] = rows[:, c:c + placements[t].local]
            c += placements[t].local
    return views


@dataclass(frozen=True)
class _ExchangeRecord:
    """What the forward's exchange leaves for the backward (besides the saved tensors)."""

    group: object                 # the process group
    rank: int
    seq_lens: Tuple[int, ...]     # every rank's sequence length
    causal: bool
    softmax_scale: Optional[float]
    placements: list              # exchange.buffers placements of q, k, v heads
    groups: list                  # _exchange_groups: the tensors each exchange moves
    batch: int
    variant: Variant


class TritonUlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, rank, seq_lens, causal, softmax_scale, cu_seqlens, variant):
        kernels = require_triton_kernels()
        world = len(seq_lens)
        B, _, Hq, _ = q.shape
        rows_total = B * sum(seq_lens)
        tensors = (q, k, v)
        placements = placements_for([Hq, k.shape[2], v.shape[2]], world)
        groups = _exchange_groups(q, k, v)
        buffers = []
        for members in groups:  # block-ordered rows of the receive buffer, zero copy
            send = pack_for_heads([tensors[t] for t in members], [placements[t] for t in members], world)
            recv = exchange_seq_to_heads(send, seq_lens, rank, group)
            buffers.append(recv.view(rows_total, send.shape[3], send.shape[4]))
        q_rows, k_rows, v_rows = _row_views(buffers, groups, placements)
        out_rows = torch.empty(rows_total, placements[0].local, v.shape[3], dtype=q.dtype, device=q.device)
        grad = any(ctx.needs_input_grad[:4])
        ctx.external = None
        ctx.kernel = name = _kernel_choice((q_rows, k_rows, v_rows), B, world, group, causal, cu_seqlens, grad,
                                           variant, sinks is not None)
        if name == "triton":
            _, lse = kernels.flash_attention_forward(q_rows, k_rows, v_rows, causal=causal,
                                                     softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                                     out=out_rows, seq_splits=world, batch=B, _band=variant.window,
                                                     softcap=variant.softcap, sinks=sinks)
        else:
            lse = torch.empty(0)
            ctx.external = _external_forward(name, (q_rows, k_rows, v_rows), out_rows, B, causal, softmax_scale,
                                             cu_seqlens, grad, variant)
        back = _reverse_exchange(out_rows, B, seq_lens, rank, group)  # [P, B, S_r, hl_q, Dv]
        ctx.save_for_backward(out_rows, lse, cu_seqlens if cu_seqlens is not None else torch.empty(0),
                              sinks if sinks is not None else torch.empty(0), *buffers)
        ctx.has_cu, ctx.has_sinks = cu_seqlens is not None, sinks is not None
        ctx.record = _ExchangeRecord(group=group, rank=rank, seq_lens=tuple(seq_lens), causal=causal,
                                     softmax_scale=softmax_scale, placements=placements, groups=groups, batch=B,
                                     variant=variant)
        return back.permute(1, 2, 0, 3, 4).reshape(B, seq_lens[rank], Hq, v.shape[3])

    @staticmethod
    def backward(ctx, grad_out):
        kernels = require_triton_kernels()
        out_rows, lse, cu, sinks, *buffers = ctx.saved_tensors
        r = ctx.record
        group, rank, seq_lens, placements, groups, B = r.group, r.rank, r.seq_lens, r.placements, r.groups, r.batch
        world = len(seq_lens)
        send = pack_for_heads([grad_out.to(out_rows.dtype)], placements[:1], world)
        do_rows = exchange_seq_to_heads(send, seq_lens, rank, group).view(out_rows.shape)
        grad_buffers = [torch.empty_like(rows) for rows in buffers]  # dq|dk|dv, block-ordered: the send layout
        grads = _row_views(grad_buffers, groups, placements)
        dsinks = None
        if ctx.kernel != "triton":
            if ctx.external is None:  # never run the Triton backward on a forward it did not compute
                raise RuntimeError(f"the {ctx.kernel} attention graph was not recorded (the forward ran without grad)")
            _external_backward(ctx.external, do_rows, grads)
        else:
            q_rows, k_rows, v_rows = _row_views(buffers, groups, placements)
            if ctx.has_sinks:
                dsinks = torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device)
            kernels.flash_attention_backward(
                do_rows, q_rows, k_rows, v_rows, out_rows, lse, causal=r.causal, softmax_scale=r.softmax_scale,
                cu_seqlens=cu if ctx.has_cu else None, dq=grads[0], dk=grads[1], dv=grads[2], seq_splits=world,
                batch=B, _band=r.variant.window, softcap=r.variant.softcap,
                sinks=sinks if ctx.has_sinks else None, dsinks=dsinks)
        results = [None] * 3
        for rows, members in zip(grad_buffers, groups):
            back = _reverse_exchange(rows, B, seq_lens, rank, group)
            for t, d in zip(members, unpack_from_heads(back, [placements[t] for t in members])):
                results[t] = d
        dsinks = dsinks.to(sinks.dtype) if dsinks is not None else None
        return (*results, dsinks, None, None, None, None, None, None, None)


def ulysses_attention(q, k, v, *, group, rank, seq_lens, causal, softmax_scale, cu_seqlens, variant=PLAIN,
                      sinks=None, engine=None):
    """Pure Ulysses attention on this path (differentiable; validated by the caller); `sinks`
    `[Hq]` are the global heads' (this rank's slice is used)."""
    return TritonUlyssesAttention.apply(q, k, v, local_sinks(sinks, rank, len(seq_lens)), group, rank,
                                        list(seq_lens), causal, softmax_scale, cu_seqlens, variant)
