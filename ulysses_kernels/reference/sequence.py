"""Differentiable sharding along the sequence: this rank's `torch.tensor_split` slice of
a tensor every rank holds, and its inverse (the autograd functions behind the public
`shard_sequence` / `gather_sequence`); with a ring group, the zigzag portions of
`zigzag.py` first."""

import torch
import torch.distributed as dist

from ..layout import split_lengths
from ..zigzag import portion_lengths, zigzag_segments
from .exchange import all_to_all


class ShardSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, rank, dim, x):
        ctx.group, ctx.world, ctx.rank, ctx.dim = group, world, rank, dim
        ctx.lengths = split_lengths(x.shape[dim], world)
        return torch.tensor_split(x, world, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, _all_gather_seq(grad.contiguous(), ctx.lengths, ctx.dim, ctx.group)


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, rank, dim, lengths, x):
        ctx.group, ctx.rank, ctx.dim, ctx.lengths = group, rank, dim, lengths
        return _all_gather_seq(x.contiguous(), lengths, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank consumed the gathered tensor: the gradient of a shard is the sum over
        # ranks of their gradients for that slice (a reduce-scatter, done as an all-to-all
        # because gloo has no reduce_scatter).
        chunks = [c.contiguous() for c in torch.split(grad, ctx.lengths, dim=ctx.dim)]
        mine = chunks[ctx.rank]
        if ctx.group is None:
            return None, None, None, None, None, mine
        send = torch.cat([c.reshape(-1) for c in chunks])
        recv = all_to_all(send, [c.numel() for c in chunks], [mine.numel()] * len(chunks), ctx.group)
        return None, None, None, None, None, recv.view(len(chunks), *mine.shape).sum(0)


def _all_gather_seq(x, lengths, dim, group):
    if group is None:
        return x
    longest = max(lengths)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths)], dim=dim)


# ------------------------------------------------------------- the ring's zigzag layout

def zigzag_portion(x: torch.Tensor, total: int, ring: int, ring_rank: int, dim: int) -> torch.Tensor:
    """Ring rank `ring_rank`'s portion (`zigzag.py`) of a full-sequence tensor (differentiable)."""
    return torch.cat([x.narrow(dim, s, n) for s, n in zigzag_segments(total, ring, ring_rank)], dim=dim)


def zigzag_restore(portions: torch.Tensor, total: int, ring: int, dim: int) -> torch.Tensor:
    """The global order of the ring ranks' portions concatenated in ring-rank order
    (inverse of `zigzag_portion` over all ring ranks; differentiable)."""
    pieces, offset = {}, 0
    for r in range(ring):
        for s, n in zigzag_segments(total, ring, r):
            pieces[s] = (offset, n)
            offset += n
    return torch.cat([portions.narrow(dim, o, n) for _, (o, n) in sorted(pieces.items())], dim=dim)


class RingShard(torch.autograd.Function):
    """This ring rank's portion of a tensor every rank holds; the backward all-gathers the
    portions' gradients over the ring group, so every rank gets the full gradient (as
    `ShardSequence` does over the Ulysses group)."""

    @staticmethod
    def forward(ctx, group, ring, ring_rank, dim, x):
        ctx.group, ctx.ring, ctx.dim, ctx.total = group, ring, dim, x.shape[dim]
        return zigzag_portion(x, x.shape[dim], ring, ring_rank, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        whole = _all_gather_seq(grad.contiguous(), portion_lengths(ctx.total, ctx.ring), ctx.dim, ctx.group)
        return None, None, None, None, zigzag_restore(whole, ctx.total, ctx.ring, ctx.dim)
