"""THE sequence layout of the Ulysses x Ring hybrid (docs/architecture.md, "Ulysses x
Ring"): where each token lives. Pure arithmetic, like `ulysses_kernels/layout.py`; every
path, the sharding helpers (`shard.py`), the validation (`validate.py`), the block plan
(`plan.py`), `hf.shard_batch` and the benchmarks ask this module.

Over `ring` ring ranks x `ulysses` Ulysses ranks (the global zigzag):
- the global sequence of `total` tokens is cut into `2 * ring` chunks by
  `torch.tensor_split` (the first `total % (2 * ring)` chunks one token longer);
- ring rank i holds its *portion*, chunk i followed by chunk `2 * ring - 1 - i`: with
  causal attention every ring rank then has the same share of the triangle, so each ring
  step does equal work (the layout of Transformer Engine and ring-flash-attn);
- Ulysses rank u of ring rank i holds `torch.tensor_split(portion, ulysses)[u]`, so the
  Ulysses all-to-all of ring rank i gathers exactly its portion.
SP rank `i * ulysses + u` (Ulysses groups are consecutive ranks) holds that slice; with
`ring == 1` this is the plain `torch.tensor_split` layout of pure Ulysses.
"""

from typing import List, Optional, Sequence, Tuple

from ..layout import split_lengths

Segment = Tuple[int, int]  # (global start, length)


def zigzag_segments(total: int, ring: int, ring_rank: int) -> Tuple[Segment, Segment]:
    """The two global ranges (start, length) of ring rank `ring_rank`'s portion, in the
    order the portion stores them (chunk i, then chunk 2R-1-i)."""
    chunks = split_lengths(total, 2 * ring)
    starts = [sum(chunks[:c]) for c in range(2 * ring)]
    first, second = ring_rank, 2 * ring - 1 - ring_rank
    return (starts[first], chunks[first]), (starts[second], chunks[second])


def portion_lengths(total: int, ring: int) -> List[int]:
    """Tokens each ring rank holds (summed over its Ulysses group)."""
    return [sum(n for _, n in zigzag_segments(total, ring, i)) for i in range(ring)]


def sp_lengths(total: int, ring: int, ulysses: int) -> List[int]:
    """Local length of every SP rank, in SP-rank order (ring rank major)."""
    return [n for p in portion_lengths(total, ring) for n in split_lengths(p, ulysses)]


def local_ranges(total: int, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int) -> List[Segment]:
    """The global ranges (start, length) one SP rank holds, in its local order."""
    lens = split_lengths(sum(n for _, n in zigzag_segments(total, ring, ring_rank)), ulysses)
    lo = sum(lens[:ulysses_rank])
    hi = lo + lens[ulysses_rank]
    ranges, offset = [], 0
    for start, n in zigzag_segments(total, ring, ring_rank):
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            ranges.append((start + a - offset, b - a))
        offset += n
    return ranges


def lengths_error(lengths: Sequence[int], ulysses: int) -> Optional[str]:
    """Why SP-rank local `lengths` (ring rank major) are not the zigzag layout of their sum."""
    expected = sp_lengths(sum(lengths), len(lengths) // ulysses, ulysses)
    if list(lengths) != expected:
        return (f"local sequence lengths {list(lengths)} are not the Ulysses x Ring (zigzag) layout of the "
                f"global length {sum(lengths)} over {len(lengths) // ulysses} ring x {ulysses} Ulysses ranks "
                f"(expected {expected}; shard with ulysses_kernels.shard_sequence(..., ring_group=...))")
    return None
