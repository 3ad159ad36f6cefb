"""State passing over the sequence layout (docs/hf_hybrids.md, "State passing"): a recurrence
whose transition is diagonal or scalar and whose state is small, run on the sequence shards
themselves, with no per-token exchange.

The ring's scheme (mixer_ring.py, `ring_recurrence`) on the layout of the whole SP group
(halo.py's `SequenceLayout`: contiguous shards, or a ring's zigzag chunks split over each
Ulysses group): each rank runs its ranges from a zero state, giving the state F leaving each
and its transition M (the state leaving a range is `M S + F`); one all-gather over the Ulysses
group (then one over the ring) shares every range's (M, F); every rank composes the state
entering each range in global order and runs its ranges again from it. Documents restart the
state as on one device.

Bytes per layer and rank: 2 x ranges x (P - 1) x the state (M and F), whatever the sequence
length, against the head exchange's (P - 1) / P x S/P x the per-token channels there and back.
For Mamba1 at 7B sizes (8192 channels x 16 states, float32) at P = 8: 7 MiB, against 32k tokens
a rank x (x, dt, B, C there and y back: 24,608 channels) x 2 B x 7/8: 1.3 GiB. The price is
compute: each range runs twice (F from zero, then the outputs from the entering state).
"""

from typing import List, Sequence

import torch

from ....exchange.sequence import GatherSequence
from ..mixer_ring import portion_pieces, ring_recurrence
from .halo import SequenceLayout


class LayoutPortion:
    """`ring_recurrence`'s portion over a `SequenceLayout`: this rank's ranges (`segments`,
    global (start, length)), their indices in the global order of every rank's ranges
    (`chunks`), and the gather that puts every rank's per-range tensors in that order."""

    def __init__(self, layout: SequenceLayout):
        self.layout, self.total = layout, layout.total
        # a rank without tokens holds one empty range at the end (it passes the state through)
        ranges = [list(r) if r else [(self.total, 0)] for r in layout.ranges]
        self.slots = max(len(r) for r in ranges)
        self.order = sorted(((start, n, rank, slot) for rank, rs in enumerate(ranges)
                             for slot, (start, n) in enumerate(rs)), key=lambda e: (e[0], e[1] > 0))
        index = {(rank, slot): i for i, (_, _, rank, slot) in enumerate(self.order)}
        self.segments = ranges[layout.mine]
        self.chunks = tuple(index[(layout.mine, slot)] for slot in range(len(self.segments)))

    def split(self, x: torch.Tensor):
        """`[B, S_local, ...]` -> this rank's ranges."""
        return torch.split(x, [n for _, n in self.segments], dim=1)

    def gather(self, per_range: Sequence[torch.Tensor], anchor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's tensors, one per range (same shapes everywhere), in global order.
        Differentiable; tied to `anchor` when nothing here needs a gradient, so that every
        rank runs the backward collective (mixer_ring.RingPortion.gather)."""
        stacked = torch.stack(list(per_range) + [torch.zeros_like(per_range[0])] * (self.slots - len(per_range)))
        if torch.is_grad_enabled() and anchor.requires_grad and not stacked.requires_grad:
            stacked = stacked + (0 * anchor).sum()
        for group, world, rank in (self.layout.ulysses, self.layout.ring):
            if world > 1:
                stacked = GatherSequence.apply(group, world, rank, 0, [stacked.shape[0]] * world, stacked)
        return [stacked[rank * self.slots + slot] for _, _, rank, slot in self.order]


def layout_recurrence(ops, tensors: Sequence[torch.Tensor], layout: SequenceLayout, cu_seqlens, *,
                      initial=None, with_final: bool = False):
    """The recurrence `ops` (mixer_ring.py's ChunkRecurrence shape) over the global sequence,
    on this rank's inputs `[B, S_local, ...]` in the sequence layout (the module doc); the
    outputs `[B, S_local, ...]` (and the state leaving the sequence: `with_final`)."""
    portion = LayoutPortion(layout)
    return ring_recurrence(ops, portion_pieces(portion, tensors), portion, cu_seqlens, initial=initial,
                           with_final=with_final)
