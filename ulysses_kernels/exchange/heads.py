"""The sequence <-> head exchanges as differentiable torch operations (docs/architecture.md,
"Reference path"): the exchange of the reference and Triton paths (their
`seq_to_heads` / `heads_to_seq`, distributed/dispatch.py's `Path`), of the public
`seq_to_heads` / `heads_to_seq` / `qkv_seq_to_heads`, and of the Ulysses x Ring hybrid on
those paths. The backward of an exchange is the inverse exchange (summing the gradients
of replicated KV heads).
"""

from typing import Sequence, Tuple

import torch

from .buffers import (
    exchange_heads_to_seq,
    exchange_seq_to_heads,
    join_head_channels,
    pack_for_heads,
    placements_for,
    recv_blocks_to_bshd,
    split_head_channels,
    unpack_from_heads,
)


def seq_to_heads(tensors: Sequence[torch.Tensor], *, group, rank: int, seq_lens) -> Tuple[torch.Tensor, ...]:
    """Sequence shards `[B, S_local, H_t, D]` -> head shards `[B, S, Hl_t, D]` over the whole
    sequence, all tensors in one exchange (differentiable; validated by the caller)."""
    return SeqToHeads.apply(group, rank, list(seq_lens), *tensors)


def exchange_qkv(exchange, q, k, v, *, group, rank: int, seq_lens):
    """q/k/v sequence shards -> head shards with a path's `exchange` (`seq_to_heads` here or
    the fused path's): one exchange, or two when v has a head dim of its own (an exchange
    moves tensors of one head dim)."""
    if v.shape[3] == q.shape[3]:
        return exchange((q, k, v), group=group, rank=rank, seq_lens=seq_lens)
    qh, kh = exchange((q, k), group=group, rank=rank, seq_lens=seq_lens)
    (vh,) = exchange((v,), group=group, rank=rank, seq_lens=seq_lens)
    return qh, kh, vh


def local_sinks(sinks, rank: int, world: int):
    """This rank's slice of the global `[Hq]` sink logits: its query heads are the rank-th
    of `world` equal slices (`layout.py`). Differentiable, so each rank's gradient is its
    share and the sum over the group is the full gradient."""
    if sinks is None:
        return None
    local = sinks.shape[0] // world
    return sinks[rank * local:(rank + 1) * local]


def heads_to_seq(x: torch.Tensor, *, group, rank: int, seq_lens) -> torch.Tensor:
    """Head shard `[B, S, Hl, D]` -> sequence shard `[B, S_local, P * Hl, D]` (differentiable)."""
    return HeadsToSeq.apply(group, rank, list(seq_lens), x)


class SeqToHeads(torch.autograd.Function):
    """Tensors `[B, S_local, H_t, D_t]` -> `[B, S, Hl_t, D_t]` in one exchange (head dims may
    differ between tensors: `buffers.pack_for_heads` then flattens each head)."""

    @staticmethod
    def forward(ctx, group, rank, seq_lens, *tensors):
        world = len(seq_lens)
        num_heads = [t.shape[2] for t in tensors]
        placements = placements_for(num_heads, world)
        B = tensors[0].shape[0]
        send = pack_for_heads(tensors, placements, world)
        recv = exchange_seq_to_heads(send, seq_lens, rank, group)
        full = recv_blocks_to_bshd(recv, seq_lens, B, send.shape[3], send.shape[4])
        ctx.group, ctx.rank, ctx.seq_lens, ctx.placements = group, rank, seq_lens, placements
        ctx.head_dims = [t.shape[3] for t in tensors]
        return tuple(split_head_channels(full, placements, ctx.head_dims))

    @staticmethod
    def backward(ctx, *grads):
        B, S = next(g for g in grads if g is not None).shape[:2]
        grads = [g if g is not None else torch.zeros(B, S, p.local, d, dtype=_dtype_of(grads), device=_device_of(grads))
                 for g, p, d in zip(grads, ctx.placements, ctx.head_dims)]
        recv = exchange_heads_to_seq(join_head_channels(grads).contiguous(), ctx.seq_lens, ctx.rank, ctx.group)
        return (None, None, None) + tuple(unpack_from_heads(recv, ctx.placements, ctx.head_dims))


class HeadsToSeq(torch.autograd.Function):
    """`[B, S, Hl, D]` -> `[B, S_local, P*Hl, D]`."""

    @staticmethod
    def forward(ctx, group, rank, seq_lens, x):
        ctx.group, ctx.rank, ctx.seq_lens = group, rank, seq_lens
        recv = exchange_heads_to_seq(x, seq_lens, rank, group)
        P, B, S_local, Hl, D = recv.shape
        return recv.permute(1, 2, 0, 3, 4).reshape(B, S_local, P * Hl, D)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        world = len(ctx.seq_lens)
        placements = placements_for([grad.shape[2]], world)
        send = pack_for_heads([grad], placements, world)
        recv = exchange_seq_to_heads(send, ctx.seq_lens, ctx.rank, ctx.group)
        B, _, _, D = grad.shape
        return None, None, None, recv_blocks_to_bshd(recv, ctx.seq_lens, B, placements[0].local, D)


def _dtype_of(grads):
    return next(g for g in grads if g is not None).dtype


def _device_of(grads):
    return next(g for g in grads if g is not None).device
