"""The fused path of the Ulysses x Ring hybrid (docs/architecture.md, "Ulysses x Ring").

- Ulysses exchanges: the CUDA pack/unpack kernels and the Ulysses group's engine (its own
  NCCL communicator on its comm stream), unchunked: ring attention needs every head of
  the portion before its first block.
- Ring transfers: the ring group's engine (one per (ring group, device)), on its comm
  stream. A shift to the next ring rank is an all-to-all whose only non-zero counts are
  the next rank (send) and the previous one (receive): the engine skips empty peers, so
  that is one grouped ncclSend/ncclRecv pair. The compute stream waits for a transfer
  only when the ring schedule needs its data, so the transfer of block i+1 runs while
  block i is computed.
- The ring schedule itself is the reference path's (`reference/ring.py`, this path's
  declared interface to it), with the Triton block kernels that `api` puts in the spec.
"""

import dataclasses

import torch

from ..layout import place_heads
from ..reference.exchange import bshd_to_blocks, recv_blocks_to_bshd
from ..reference.ring import RingSpec, ring_attention
from . import ops
from .engine import Engine, get_engine
from .streams import current_stream, device_ctx, event, on, wait


def _record(engine: Engine, *tensors):
    """Tensors made on the compute stream and used on the comm stream stay allocated until
    the comm stream is done with them."""
    if engine.stream is not None:
        for t in tensors:
            t.record_stream(engine.stream)


def _on_comm(engine: Engine, device, work):
    """Run `work()` on the engine's comm stream after the compute stream's queued work;
    returns the event of its completion (None on CPU)."""
    wait(engine.stream, event(current_stream(device)))
    with on(engine.stream):
        work()
        engine.transport.check()
        return event(engine.stream)


class EngineShift:
    """One ring transfer on the ring engine: `send` to the next ring rank, `recv` from the
    previous one; `wait()` makes the compute stream wait for it."""

    def __init__(self, engine: Engine, send: torch.Tensor, recv: torch.Tensor):
        R, r = engine.world, engine.rank
        send_counts, recv_counts = [0] * R, [0] * R
        send_counts[(r + 1) % R] = send.numel()
        recv_counts[(r - 1) % R] = recv.numel()
        self.device = send.device
        _record(engine, send, recv)
        self.done = _on_comm(engine, send.device,
                             lambda: engine.transport.all_to_all(send, recv, send_counts, recv_counts))

    def wait(self):
        wait(current_stream(self.device), self.done)


def _heads(tensors, world):
    return [place_heads(t.shape[2], world).local for t in tensors]


class _SeqToHeads(torch.autograd.Function):
    """q, k, v `[B, S_p, H_t, D]` -> head shards `[B, S, Hl_t, D]` of the portion."""

    @staticmethod
    def forward(ctx, engine, lens, q, k, v):
        P, (B, Sp, _, D) = engine.world, q.shape
        local = _heads((q, k, v), P)
        channels = sum(local)
        send = engine.buffer("ring_seq_send", P * B * Sp * channels * D, q.dtype).view(P, B, Sp, channels, D)
        recv = torch.empty(B * sum(lens) * channels * D, dtype=q.dtype, device=q.device)
        _record(engine, recv)

        def work():
            ops.pack_into([q, k, v], send, [0, 0, 0], local)
            engine.transport.all_to_all(send, recv, [B * Sp * channels * D] * P, [B * n * channels * D for n in lens])
        wait(current_stream(q.device), _on_comm(engine, q.device, work))
        full = recv_blocks_to_bshd(recv, lens, B, channels, D)
        ctx.engine, ctx.lens, ctx.local, ctx.shapes = engine, lens, local, [t.shape for t in (q, k, v)]
        edges = [0, local[0], local[0] + local[1], channels]
        return tuple(full[:, :, a:b] for a, b in zip(edges, edges[1:]))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        engine, lens, local = ctx.engine, ctx.lens, ctx.local
        B, D = ctx.shapes[0][0], ctx.shapes[0][3]
        like = next(g for g in (dq, dk, dv) if g is not None)
        grads = [g if g is not None else like.new_zeros(B, sum(lens), n, D) for g, n in zip((dq, dk, dv), local)]
        P = engine.world
        Sp, channels = ctx.shapes[0][1], sum(local)
        send = bshd_to_blocks(torch.cat(grads, dim=2), lens).contiguous()
        recv = engine.buffer("ring_seq_grecv", P * B * Sp * channels * D, send.dtype).view(P, B, Sp, channels, D)
        outs = [send.new_empty(s) for s in ctx.shapes]
        _record(engine, send, *outs)

        def work():
            engine.transport.all_to_all(send, recv, [B * n * channels * D for n in lens], [B * Sp * channels * D] * P)
            ops.unpack_into(recv, outs, [0, 0, 0], local)  # sums the replicas of replicated KV heads
        wait(current_stream(send.device), _on_comm(engine, send.device, work))
        return (None, None, *outs)


class _HeadsToSeq(torch.autograd.Function):
    """Head shard `[B, S, Hl, D]` of the portion -> `[B, S_p, P * Hl, D]`."""

    @staticmethod
    def forward(ctx, engine, lens, rank, x):
        P, (B, _, hl, D) = engine.world, x.shape
        Sp = lens[rank]
        send = bshd_to_blocks(x.contiguous(), lens).contiguous()
        recv = engine.buffer("ring_head_recv", P * B * Sp * hl * D, x.dtype).view(P, B, Sp, hl, D)
        out = x.new_empty(B, Sp, P * hl, D)  # query heads are split, never replicated
        _record(engine, send, out)

        def work():
            engine.transport.all_to_all(send, recv, [B * n * hl * D for n in lens], [B * Sp * hl * D] * P)
            ops.unpack_into(recv, [out], [0], [hl])
        wait(current_stream(x.device), _on_comm(engine, x.device, work))
        ctx.engine, ctx.lens, ctx.shape = engine, lens, x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        engine, lens = ctx.engine, ctx.lens
        P, (B, S, hl, D) = engine.world, ctx.shape
        grad = grad.contiguous()
        Sp = grad.shape[1]
        send = engine.buffer("ring_head_gsend", P * B * Sp * hl * D, grad.dtype).view(P, B, Sp, hl, D)
        recv = torch.empty(B * S * hl * D, dtype=grad.dtype, device=grad.device)
        _record(engine, grad, recv)

        def work():
            ops.pack_into([grad], send, [0], [hl])
            engine.transport.all_to_all(send, recv, [B * Sp * hl * D] * P, [B * n * hl * D for n in lens])
        wait(current_stream(grad.device), _on_comm(engine, grad.device, work))
        return None, None, None, recv_blocks_to_bshd(recv, lens, B, hl, D)


def ulysses_ring_attention(q, k, v, *, group, world: int, rank: int, seq_lens, ring: RingSpec) -> torch.Tensor:
    """The fused path of a Ulysses x Ring call (validated by api): Ulysses exchanges on the
    Ulysses group's engine, ring attention with transfers on the ring group's engine."""
    with device_ctx(q.device):
        engine = get_engine(group, world, rank, q.device)
        ring_engine = get_engine(ring.group, ring.world, ring.rank, q.device)
        spec = dataclasses.replace(ring, shift=lambda send, recv: EngineShift(ring_engine, send, recv))
        lens = list(seq_lens)
        qh, kh, vh = _SeqToHeads.apply(engine, lens, q, k, v)
        out = ring_attention(qh, kh, vh, spec)
        return _HeadsToSeq.apply(engine, lens, rank, out)
