"""The sequence halo (docs/hf_hybrids.md, "The sequence halo"): a causal convolution along the
sequence, or any token mixer that reads a fixed number of earlier inputs (a token shift), run on
the sequence shards themselves, without the head exchange.

A layer that reads the `width` inputs before each token (a depthwise convolution of kernel
`width + 1`) needs, at the first tokens of each shard, the last inputs of the shards before it;
nothing else crosses a shard. So every rank shares the last `width` inputs of each of its
ranges of the global sequence (one all-gather over the Ulysses group, then one over the ring:
`width` x channels per range, whatever the sequence length), and each range reads its history
from the ranges before it, several of them when shards are shorter than `width` (a position
`p < s` in the `width` before a range starting at `s` lies in the last `width` of its own
range, which ends at or before `s`). Taps that reach across a document start of a packed row
read zero, as on one device when each document runs alone.

Bytes on the wire per layer and rank: (P - 1) x ranges x `width` x channels gathered, against
the head exchange's 2 x (P - 1) / P x S/P x channels (in and out): for a kernel of 3 and 4k
tokens a rank, about a thousandth.

The all-gathers are differentiable (their backward sums each tail's gradient over the ranks
that read it), and every rank's output depends on them, so every rank runs the backward
collectives (also a rank with no tokens).

In generation a sharded chunk (the prefill: sequence shards of the chunk, hf/inference/cache.py)
reads the history before the chunk from the layer's replicated state (`before`), and every rank
keeps the chunk's last `width` inputs as the next state (the second value returned), so decoding runs the
layer replicated.
"""

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ....exchange.sequence import GatherSequence
from ....ring.layout import lengths_error as zigzag_lengths_error
from ....ring.layout import local_ranges
from ..mixers import causal_conv1d, document_bounds

Range = Tuple[int, int]   # (global start, length)


class SequenceLayout(NamedTuple):
    """Where the global sequence lives: every SP rank's ranges (global start, length) in
    the order of the gathers (ring rank major, then Ulysses rank: the SP ranks' order),
    this rank's index into it, and the groups to gather over."""
    ranges: List[List[Range]]
    mine: int
    ulysses: tuple    # (group, world, rank)
    ring: tuple       # (group, world, rank); world 1 without a ring

    @property
    def total(self) -> int:
        return sum(n for rank in self.ranges for _, n in rank)


def training_layout(context, lens: Sequence[int]) -> SequenceLayout:
    """The layout of a training forward, `lens` every SP rank's length (ring rank major):
    contiguous shards of those lengths without a ring; under a ring, the zigzag chunks
    split over each Ulysses group (ring/layout.py), which `lens` must be (else the same
    ValueError on every rank)."""
    ulysses, ring = context.ulysses(), context.ring()
    if ring[1] == 1:
        return contiguous_layout(ulysses, lens)
    err = zigzag_lengths_error(lens, ulysses[1]) if len(lens) == ring[1] * ulysses[1] else \
        f"{len(lens)} lengths for {ring[1]} ring x {ulysses[1]} Ulysses ranks"
    if err:
        raise ValueError(f"ulysses_kernels.hf: a token mixer on a ring got the sequence lengths {list(lens)}: {err}")
    total = sum(lens)
    ranges = [local_ranges(total, ring[1], ulysses[1], r, u) for r in range(ring[1]) for u in range(ulysses[1])]
    return SequenceLayout(ranges, ring[2] * ulysses[1] + ulysses[2], ulysses, ring)


def contiguous_layout(ulysses, lens: Sequence[int]) -> SequenceLayout:
    """Contiguous shards of `lens` over the Ulysses group, in rank order (pure Ulysses, and a
    sharded generation chunk: generation runs without a ring)."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return SequenceLayout([[(s, n)] for s, n in zip(starts, lens)], ulysses[2], ulysses, (None, 1, 0))


def generation_layout(cache, length: int) -> SequenceLayout:
    """The layout of a forward inside `generate` / `prefill` (hf/inference/cache.py): a chunk
    split along the sequence over the Ulysses group, or, every rank holding the whole chunk
    (decoding), one range of `length` on a group of one."""
    if cache.chunk_lens is not None:
        return contiguous_layout(cache.ulysses, cache.chunk_lens)
    return contiguous_layout((None, 1, 0), [length])


def _slots(layout: SequenceLayout) -> int:
    return max(1, max(len(r) for r in layout.ranges))


def _gather(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Every rank's `x` `[B, L, C]` (the same L everywhere) in layout order, `[B, ranks x L, C]`."""
    for group, world, rank in (layout.ulysses, layout.ring):
        if world > 1:
            x = GatherSequence.apply(group, world, rank, 1, [x.shape[1]] * world, x)
    return x


def _table(x: torch.Tensor, layout: SequenceLayout, width: int, before: Optional[torch.Tensor]):
    """(every rank's last `width` inputs of each range, gathered, behind `before` (or zeros:
    the inputs before position 0); {global position: row of the table})."""
    B, _, C = x.shape
    slots = _slots(layout)
    tails, offset = [], 0
    for _, n in layout.ranges[layout.mine]:
        piece = x[:, max(offset, offset + n - width):offset + n]
        tails.append(torch.cat([piece.new_zeros(B, width - piece.shape[1], C), piece], dim=1))
        offset += n
    tails += [x.new_zeros(B, width, C)] * (slots - len(tails))
    tails = torch.cat(tails, dim=1)
    if torch.is_grad_enabled() and x.requires_grad and not tails.requires_grad:
        tails = tails + (0 * x).sum()   # a rank without tokens: its peers' gathers have a backward it must join
    gathered = _gather(tails, layout)
    head = before.to(x.dtype) if before is not None else x.new_zeros(B, width, C)
    rows = {-width + i: i for i in range(width)}
    for rank, ranges in enumerate(layout.ranges):
        for slot, (start, n) in enumerate(ranges):
            for j in range(width):
                position = start + n - width + j
                if position >= start:
                    rows[position] = width + (rank * slots + slot) * width + j
    return torch.cat([head, gathered], dim=1), rows


def _rows(table: torch.Tensor, rows: dict, positions: range) -> torch.Tensor:
    index = torch.tensor([rows[p] for p in positions], device=table.device, dtype=torch.long)
    return table.index_select(1, index)


def _ranges_with_history(x: torch.Tensor, layout: SequenceLayout, width: int, before: Optional[torch.Tensor]):
    """(the gathered table, its rows, [(start, n, extended)]): each of this rank's non-empty
    ranges (global start, length) with the `width` inputs before it prepended,
    `extended` `[B, width + n, C]`."""
    table, rows = _table(x, layout, width, before)
    ranges, offset = [], 0
    for start, n in layout.ranges[layout.mine]:
        if n:
            history = _rows(table, rows, range(start - width, start))
            ranges.append((start, n, torch.cat([history, x[:, offset:offset + n]], dim=1)))
        offset += n
    return table, rows, ranges


def _outputs(out: List[torch.Tensor], empty: Optional[torch.Tensor], table, rows, layout: SequenceLayout, width: int):
    """(this rank's outputs in local order, `empty` on a rank without tokens, reading the
    gathers: every rank's output depends on them, the module doc; the last `width` inputs
    of the global sequence, the same on every rank)."""
    result = torch.cat(out, dim=1) if out else empty
    return result + (0 * table).sum(), _rows(table, rows, range(layout.total - width, layout.total))


def halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], layout: SequenceLayout, *,
              cu_seqlens=None, activation: Optional[str] = None, before: Optional[torch.Tensor] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution (`mixers.causal_conv1d`, weight `[C, K]`) of this
    rank's inputs `x` `[B, S_local, C]` (its ranges of the layout, in local order) over the
    global sequence: zero history before each document (`cu_seqlens`, global), or the inputs
    `before` `[B, K - 1, C]` before position 0 (generation). Returns (the output
    `[B, S_local, C]`, the last `K - 1` inputs of the global sequence `[B, K - 1, C]`, the
    same on every rank: generation's next state)."""
    width = weight.shape[-1] - 1
    if width == 0:
        return causal_conv1d(x, weight, bias, None, activation), x[:, :0]
    table, rows, ranges = _ranges_with_history(x, layout, width, before)
    bounds = document_bounds(cu_seqlens, layout.total)
    out = []
    for start, n, extended in ranges:
        starts = None
        if bounds is not None:   # per tap position, its document's start: taps before it read zero
            positions = torch.arange(start - width, start + n, device=x.device)
            edges = torch.tensor(bounds, device=x.device)
            document = edges[torch.searchsorted(edges, positions.clamp(min=0), right=True) - 1]
            starts = document - (start - width)
        out.append(causal_conv1d(extended, weight, bias, starts, activation)[:, width:])
    return _outputs(out, x[:, :0] + (0 * weight).sum(), table, rows, layout, width)


def halo_map(x: torch.Tensor, operator: Callable, width: int, layout: SequenceLayout, *, cu_seqlens=None,
             before: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Any causal operator that reads the `width` inputs before each token, over the global
    sequence: `operator(inputs)` maps `[B, width + m, C]` (the `width` inputs before `m`
    tokens, then theirs) to the `m` tokens' outputs `[B, m, C']`, as a stack of unpadded
    convolutions does (ZAYA's two). Each document piece of this rank's ranges runs on its own
    (a composition of convolutions cannot zero its taps per output position as `halo_conv`
    does), its history zero before its document's start, or `before` before position 0.
    Returns (the outputs `[B, S_local, C']`, the last `width` inputs of the global sequence,
    the same on every rank)."""
    if width == 0:
        return operator(x), x[:, :0]
    table, rows, ranges = _ranges_with_history(x, layout, width, before)
    bounds = document_bounds(cu_seqlens, layout.total) or [0, layout.total]
    out = []
    for start, n, extended in ranges:
        pieces = sorted({start, start + n, *(b for b in bounds if start < b < start + n)})
        for a, b in zip(pieces[:-1], pieces[1:]):
            history = extended[:, a - start:a - start + width]
            document = max(c for c in bounds[:-1] if c <= a)
            if a - width < document and not (document == 0 and before is not None):   # zeros before its start
                kept = max(0, a - document)
                history = torch.cat([torch.zeros_like(history[:, :width - kept]), history[:, width - kept:]], dim=1)
            out.append(operator(torch.cat([history, extended[:, width + a - start:width + b - start]], dim=1)))
    empty = None if out else operator(x.new_zeros(x.shape[0], width + 1, x.shape[2]))[:, :0]   # its channels
    return _outputs(out, empty, table, rows, layout, width)
