"""Sharding along the sequence with a ring group (docs/architecture.md, "Ulysses x Ring"):
the zigzag portions of `layout.py` as differentiable tensor operations, behind the
public `shard_sequence` / `gather_sequence` with `ring_group=`."""

from typing import Optional, Sequence, Tuple

import torch

from ..distributed.collectives import gather_ints
from ..exchange.sequence import GatherSequence, all_gather_sequence
from .layout import portion_lengths, zigzag_segments


def cut_ranges(t: torch.Tensor, ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """The global (start, length) `ranges` of `t` along dim 1, concatenated (a rank's
    tokens of a whole sequence, in its local order)."""
    return torch.cat([t[:, start:start + n] for start, n in ranges], dim=1) if ranges else t[:, :0].clone()


def zigzag_portion(x: torch.Tensor, total: int, ring: int, ring_rank: int, dim: int) -> torch.Tensor:
    """Ring rank `ring_rank`'s portion (`layout.py`) of a full-sequence tensor (differentiable)."""
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
        whole = all_gather_sequence(grad.contiguous(), portion_lengths(ctx.total, ctx.ring), ctx.dim, ctx.group)
        return None, None, None, None, zigzag_restore(whole, ctx.total, ctx.ring, ctx.dim)


def gather_ring(x: torch.Tensor, group, world: int, rank: int, ring, dim: int,
                seq_lens: Optional[Sequence[int]]) -> torch.Tensor:
    """gather_sequence over the Ulysses x Ring grid: the Ulysses group, then the ring group
    (`ring` = (group, size, rank)), then the zigzag portions back in global order.
    seq_lens: every SP rank's length, ring rank major (None: exchanged)."""
    ring_group, ring_world, ring_rank = ring
    if seq_lens is None:
        ulysses_lens = [n for (n,) in gather_ints([x.shape[dim]], group)]
        portions = [n for (n,) in gather_ints([sum(ulysses_lens)], ring_group)]
    else:
        seq_lens = [int(n) for n in seq_lens]
        if len(seq_lens) != world * ring_world:
            raise ValueError(f"gather_sequence: with a ring group seq_lens must list all {world * ring_world} "
                             f"SP ranks' lengths (ring rank major), got {len(seq_lens)}")
        ulysses_lens = seq_lens[ring_rank * world:(ring_rank + 1) * world]
        portions = [sum(seq_lens[r * world:(r + 1) * world]) for r in range(ring_world)]
    total = sum(portions)
    if ulysses_lens[rank] != x.shape[dim] or portions != portion_lengths(total, ring_world):
        raise ValueError(f"gather_sequence: local lengths {ulysses_lens} / ring portions {portions} are not the "
                         f"Ulysses x Ring layout of {total} tokens (see shard_sequence(..., ring_group=...))")
    portion = GatherSequence.apply(group, world, rank, dim, ulysses_lens, x)
    whole = GatherSequence.apply(ring_group, ring_world, ring_rank, dim, portions, portion)
    return zigzag_restore(whole, total, ring_world, dim)
