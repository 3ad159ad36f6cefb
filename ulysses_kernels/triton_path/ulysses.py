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
the kernel may instead be torch SDPA or flash_attn, timed faster and exact for the call
(select.py); its backward replays the autograd graph recorded in the forward.
Backward: dO takes the same route as q; the kernels write dq|dk|dv into one buffer in
the send layout; one all-to-all returns them; unpack sums replicated KV heads.

The buffers and exchanges are the shared torch ones (`ulysses_kernels/exchange/`); the
fused path replaces them with CUDA pack kernels and the NCCL engine.
"""

import torch

from ..distributed.collectives import all_to_all
from ..exchange.buffers import exchange_seq_to_heads, pack_for_heads, placements_for, unpack_from_heads
from ..extensions import require_triton_kernels
from . import select


def _reverse_exchange(rows: torch.Tensor, batch: int, seq_lens, rank: int, group):
    """Send block-ordered rows `[B*S, Hc, D]` back to the ranks owning each sequence slice.

    Returns `[P, B, S_r, Hc, D]` (slot i = source rank i's heads)."""
    P = len(seq_lens)
    _, Hc, D = rows.shape
    per_token = batch * Hc * D
    recv = all_to_all(rows, [n * per_token for n in seq_lens], [seq_lens[rank] * per_token] * P, group)
    return recv.view(P, batch, seq_lens[rank], Hc, D)


def _kernel_choice(q_rows, k_rows, batch, world, causal, cu_seqlens, grad) -> str:
    """The attention kernel for the receive buffer (select.py). With one batch
    row or one rank the buffer rows are a strided `[B, S, H, D]` tensor that torch SDPA or
    flash_attn read in place; batch > 1 across ranks (two-level addressing) and packed
    documents stay on the Triton kernels."""
    split = batch > 1 and world > 1
    view = (lambda t: t.view(batch, t.shape[0] // batch, *t.shape[1:])) if not split else (lambda t: t.unsqueeze(0))
    return select.choose(view(q_rows), view(k_rows), causal=causal, varlen=cu_seqlens is not None,
                         split_layout=split, grad=grad)


def _external_forward(name, row_views, out_rows, batch, causal, softmax_scale, grad):
    """Run a non-Triton kernel on `[B, S, H, D]` views of the buffer rows and write the
    output into `out_rows`. For the backward, the kernel's own autograd graph is recorded on
    detached views (no copies) and returned; backward replays it with torch.autograd.grad."""
    views = [t.detach().view(batch, t.shape[0] // batch, *t.shape[1:]).requires_grad_(grad) for t in row_views]
    with torch.enable_grad() if grad else torch.no_grad():
        out = select.run(name, *views, causal=causal, softmax_scale=softmax_scale)
    out_rows.view(out.shape).copy_(out)
    return (views, out) if grad else None


def _external_backward(recorded, do_rows, grads) -> None:
    """dq, dk, dv of a recorded non-Triton forward, written into the `grads` row views."""
    views, out = recorded
    d_views = torch.autograd.grad(out, views, do_rows.view(out.shape))
    for dst, src in zip(grads, d_views):
        dst.view(src.shape).copy_(src)


class TritonUlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, seq_lens, causal, softmax_scale, cu_seqlens):
        kernels = require_triton_kernels()
        world = len(seq_lens)
        B, _, Hq, D = q.shape
        placements = placements_for([Hq, k.shape[2], v.shape[2]], world)
        hl_q, hl_kv = placements[0].local, placements[1].local
        send = pack_for_heads([q, k, v], placements, world)
        recv = exchange_seq_to_heads(send, seq_lens, rank, group)
        channels = hl_q + 2 * hl_kv
        rows = recv.view(B * sum(seq_lens), channels, D)  # block-ordered rows, zero copy
        q_rows, k_rows, v_rows = rows[:, :hl_q], rows[:, hl_q:hl_q + hl_kv], rows[:, hl_q + hl_kv:]
        out_rows = torch.empty(rows.shape[0], hl_q, D, dtype=q.dtype, device=q.device)
        ctx.external = None
        ctx.kernel = name = _kernel_choice(q_rows, k_rows, B, world, causal, cu_seqlens, any(ctx.needs_input_grad[:3]))
        if name == "triton":
            _, lse = kernels.flash_attention_forward(q_rows, k_rows, v_rows, causal=causal,
                                                     softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                                     out=out_rows, seq_splits=world, batch=B)
        else:
            lse = torch.empty(0)
            ctx.external = _external_forward(name, (q_rows, k_rows, v_rows), out_rows, B, causal, softmax_scale,
                                             any(ctx.needs_input_grad[:3]))
        back = _reverse_exchange(out_rows, B, seq_lens, rank, group)  # [P, B, S_r, hl_q, D]
        ctx.save_for_backward(rows, out_rows, lse, cu_seqlens if cu_seqlens is not None else torch.empty(0))
        ctx.has_cu = cu_seqlens is not None
        ctx.meta = (group, rank, seq_lens, causal, softmax_scale, placements, B)
        return back.permute(1, 2, 0, 3, 4).reshape(B, seq_lens[rank], Hq, D)

    @staticmethod
    def backward(ctx, grad_out):
        kernels = require_triton_kernels()
        rows, out_rows, lse, cu = ctx.saved_tensors
        group, rank, seq_lens, causal, softmax_scale, placements, B = ctx.meta
        world = len(seq_lens)
        hl_q, hl_kv = placements[0].local, placements[1].local
        D = rows.shape[-1]
        send = pack_for_heads([grad_out.to(out_rows.dtype)], placements[:1], world)
        do_rows = exchange_seq_to_heads(send, seq_lens, rank, group).view(rows.shape[0], hl_q, D)
        grad_rows = torch.empty_like(rows)  # dq|dk|dv, block-ordered: the reverse send buffer
        grads = (grad_rows[:, :hl_q], grad_rows[:, hl_q:hl_q + hl_kv], grad_rows[:, hl_q + hl_kv:])
        if ctx.kernel != "triton":
            if ctx.external is None:  # never run the Triton backward on a forward it did not compute
                raise RuntimeError(f"the {ctx.kernel} attention graph was already freed by an earlier backward")
            _external_backward(ctx.external, do_rows, grads)
            ctx.external = None  # free the recorded graph (and its copy of the output)
        else:
            kernels.flash_attention_backward(
                do_rows, rows[:, :hl_q], rows[:, hl_q:hl_q + hl_kv], rows[:, hl_q + hl_kv:], out_rows, lse,
                causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu if ctx.has_cu else None,
                dq=grads[0], dk=grads[1], dv=grads[2], seq_splits=world, batch=B)
        back = _reverse_exchange(grad_rows, B, seq_lens, rank, group)
        dq, dk, dv = unpack_from_heads(back, placements)
        return dq, dk, dv, None, None, None, None, None, None


def ulysses_attention(q, k, v, *, group, rank, seq_lens, causal, softmax_scale, cu_seqlens):
    """Pure Ulysses attention on this path (differentiable; validated by the caller)."""
    return TritonUlyssesAttention.apply(q, k, v, group, rank, list(seq_lens), causal, softmax_scale, cu_seqlens)
