"""Differentiable sharding along the sequence: this rank's `torch.tensor_split` slice of
a tensor every rank holds, and its inverse (the autograd functions behind the public
`shard_sequence` / `gather_sequence`; the ring's zigzag portions build on them,
`ring/shard.py`)."""

import torch

from ..distributed.collectives import all_gather_tensor, all_to_all
from ..layout import split_lengths


class ShardSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, rank, dim, x):
        ctx.group, ctx.world, ctx.rank, ctx.dim = group, world, rank, dim
        ctx.lengths = split_lengths(x.shape[dim], world)
        return torch.tensor_split(x, world, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, all_gather_sequence(grad.contiguous(), ctx.lengths, ctx.dim, ctx.group)


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, rank, dim, lengths, x):
        ctx.group, ctx.rank, ctx.dim, ctx.lengths = group, rank, dim, lengths
        return all_gather_sequence(x.contiguous(), lengths, dim, group)

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


def all_gather_sequence(x, lengths, dim, group):
    """Every rank's `x` (its `lengths[rank]` positions along `dim`) concatenated along `dim`
    (shards are padded to the longest for the all-gather)."""
    if group is None:
        return x
    longest = max(lengths)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x
    parts = all_gather_tensor(padded, group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths)], dim=dim)
