"""The fused path's sequence <-> head exchange (docs/architecture.md, "Fused path"): the
CUDA pack/unpack kernels and the engine's transport on its comm stream.

- `send_to_heads` / `return_to_seq`: one exchange each way as comm-stream work (pack +
  all-to-all; all-to-all + unpack). The pipelines (pipeline.py) issue them per chunk.
- `seq_to_heads` / `heads_to_seq`: the same exchanges unchunked, as autograd functions:
  the path's `Path.seq_to_heads` / `heads_to_seq` (distributed/dispatch.py), which the Ulysses
  x Ring hybrid and HF inference run.

Buffer layouts are the shared ones (`ulysses_kernels/exchange/buffers.py`): the send
buffer of seq -> heads is `[P, B, S_local, C, D]`, its receive buffer the source-major
`[B, S_i, C, D]` blocks, and heads -> seq the reverse.
"""

from typing import List, Sequence

import torch

from ..exchange.buffers import bshd_to_blocks, recv_blocks_to_bshd
from ..layout import place_heads
from ..streams import current_stream, device_ctx, event, on, record_stream, wait
from . import ops
from .engine import Engine, get_engine


def send_to_heads(engine: Engine, srcs: Sequence[torch.Tensor], send: torch.Tensor, recv: torch.Tensor,
                  lens: Sequence[int], *, offsets, counts, rotary=None) -> None:
    """Comm-stream work: pack local heads `[offsets[t], offsets[t] + counts[t])` of every
    destination of `srcs` into `send` `[P, B, S_local, C, D]` (rotary: ops.pack_into) and
    exchange it into the flat receive buffer `recv` (source-major `[B, S_i, C, D]` blocks)."""
    P, B, Sp, C, D = send.shape
    ops.pack_into(srcs, send, offsets, counts, rotary=rotary)
    engine.transport.all_to_all(send, recv, [B * Sp * C * D] * P, [B * n * C * D for n in lens])


def return_to_seq(engine: Engine, send: torch.Tensor, recv: torch.Tensor, outs: Sequence[torch.Tensor],
                  lens: Sequence[int], *, offsets, counts) -> None:
    """Comm-stream work: exchange the flat block-ordered `send` (`[B, S_j, C, D]` for every
    rank j) into `recv` `[P, B, S_local, C, D]` and unpack it into `outs` (replicated
    heads summed in fp32)."""
    P, B, Sp, C, D = recv.shape
    engine.transport.all_to_all(send, recv, [B * n * C * D for n in lens], [B * Sp * C * D] * P)
    ops.unpack_into(recv, outs, offsets, counts)


# ------------------------------------------------------------ unchunked, differentiable

def keep_for_comm(engine: Engine, *tensors) -> None:
    """Tensors made on the compute stream and used on the comm stream stay allocated until
    the comm stream is done with them."""
    for t in tensors:
        record_stream(t, engine.stream)


def on_comm(engine: Engine, device: torch.device, work):
    """Run `work()` on the engine's comm stream after the compute stream's queued work;
    returns the event of its completion (None on CPU)."""
    wait(engine.stream, event(current_stream(device)))
    with on(engine.stream):
        work()
        engine.transport.check()
        return event(engine.stream)


def _local_heads(tensors, world: int) -> List[int]:
    return [place_heads(t.shape[2], world).local for t in tensors]


class _SeqToHeads(torch.autograd.Function):
    """Tensors `[B, S_p, H_t, D]` -> head shards `[B, S, Hl_t, D]`, one exchange."""

    @staticmethod
    def forward(ctx, engine, lens, *tensors):
        P, (B, Sp, _, D) = engine.world, tensors[0].shape
        local = _local_heads(tensors, P)
        C = sum(local)
        send = engine.buffer("x_seq_send", P * B * Sp * C * D, tensors[0].dtype).view(P, B, Sp, C, D)
        recv = tensors[0].new_empty(B * sum(lens) * C * D)
        keep_for_comm(engine, recv)
        device = tensors[0].device
        wait(current_stream(device), on_comm(engine, device, lambda: send_to_heads(
            engine, tensors, send, recv, lens, offsets=[0] * len(tensors), counts=local)))
        full = recv_blocks_to_bshd(recv, lens, B, C, D)
        ctx.engine, ctx.lens, ctx.local, ctx.shapes = engine, lens, local, [t.shape for t in tensors]
        edges = [sum(local[:i]) for i in range(len(local) + 1)]
        return tuple(full[:, :, a:b] for a, b in zip(edges, edges[1:]))

    @staticmethod
    def backward(ctx, *grads):
        engine, lens, local = ctx.engine, ctx.lens, ctx.local
        (B, Sp, _, D), P, C = ctx.shapes[0], engine.world, sum(ctx.local)
        like = next(g for g in grads if g is not None)
        grads = [g if g is not None else like.new_zeros(B, sum(lens), n, D) for g, n in zip(grads, local)]
        send = bshd_to_blocks(torch.cat(grads, dim=2), lens).contiguous()
        recv = engine.buffer("x_seq_grecv", P * B * Sp * C * D, send.dtype).view(P, B, Sp, C, D)
        outs = [send.new_empty(s) for s in ctx.shapes]
        keep_for_comm(engine, send, *outs)
        wait(current_stream(send.device), on_comm(engine, send.device, lambda: return_to_seq(
            engine, send, recv, outs, lens, offsets=[0] * len(outs), counts=local)))
        return (None, None, *outs)


class _HeadsToSeq(torch.autograd.Function):
    """Head shard `[B, S, Hl, D]` -> `[B, S_p, P * Hl, D]` (query-like heads: split)."""

    @staticmethod
    def forward(ctx, engine, lens, rank, x):
        P, (B, _, hl, D) = engine.world, x.shape
        Sp = lens[rank]
        send = bshd_to_blocks(x.contiguous(), lens).contiguous()
        recv = engine.buffer("x_head_recv", P * B * Sp * hl * D, x.dtype).view(P, B, Sp, hl, D)
        out = x.new_empty(B, Sp, P * hl, D)
        keep_for_comm(engine, send, out)
        wait(current_stream(x.device), on_comm(engine, x.device, lambda: return_to_seq(
            engine, send, recv, [out], lens, offsets=[0], counts=[hl])))
        ctx.engine, ctx.lens, ctx.shape = engine, lens, x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        engine, lens = ctx.engine, ctx.lens
        P, (B, S, hl, D) = engine.world, ctx.shape
        grad = grad.contiguous()
        Sp = grad.shape[1]
        send = engine.buffer("x_head_gsend", P * B * Sp * hl * D, grad.dtype).view(P, B, Sp, hl, D)
        recv = grad.new_empty(B * S * hl * D)
        keep_for_comm(engine, grad, recv)
        wait(current_stream(grad.device), on_comm(engine, grad.device, lambda: send_to_heads(
            engine, [grad], send, recv, lens, offsets=[0], counts=[hl])))
        return None, None, None, recv_blocks_to_bshd(recv, lens, B, hl, D)


def seq_to_heads(tensors: Sequence[torch.Tensor], *, group, rank: int, seq_lens):
    """Sequence shards -> head shards over the whole sequence on the group's engine (one
    exchange for all `tensors`, at most 3; differentiable; validated by the caller)."""
    lens = [int(n) for n in seq_lens]
    device = tensors[0].device
    with device_ctx(device):
        engine = get_engine(group, len(lens), rank, device)
        return _SeqToHeads.apply(engine, lens, *tensors)


def heads_to_seq(x: torch.Tensor, *, group, rank: int, seq_lens) -> torch.Tensor:
    """Head shard `[B, S, Hl, D]` -> sequence shard `[B, S_local, P * Hl, D]` on the group's
    engine (differentiable)."""
    lens = [int(n) for n in seq_lens]
    with device_ctx(x.device):
        engine = get_engine(group, len(lens), rank, x.device)
        return _HeadsToSeq.apply(engine, lens, rank, x)
