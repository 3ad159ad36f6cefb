"""THE layout rules of the Ulysses x Ring hybrid (docs/architecture.md, "Ulysses x Ring"):
where each token lives, and which attention blocks each ring step computes.

Pure arithmetic, like `layout.py`; every path, the sharding helpers, the validation and
the benchmarks ask this module.

Sequence layout over `ring` ring ranks x `ulysses` Ulysses ranks (the global zigzag):
- the global sequence of `total` tokens is cut into `2 * ring` chunks by
  `torch.tensor_split` (the first `total % (2 * ring)` chunks one token longer);
- ring rank i holds its *portion*, chunk i followed by chunk `2 * ring - 1 - i`: with
  causal attention every ring rank then has the same share of the triangle, so each ring
  step does equal work (the layout of Transformer Engine and ring-flash-attn);
- Ulysses rank u of ring rank i holds `torch.tensor_split(portion, ulysses)[u]`, so the
  Ulysses all-to-all of ring rank i gathers exactly its portion.
SP rank `i * ulysses + u` (Ulysses groups are consecutive ranks) holds that slice; with
`ring == 1` this is the plain `torch.tensor_split` layout of pure Ulysses.

Ring step plan (`ring_blocks`): the attention of one portion's queries against another
portion's keys is a short list of rectangles `Block`, each either dense (every query
sees every key) or a diagonal block (queries and keys are the same tokens: causal and/or
documents inside it). Key blocks that no query can see are not in the list, so they are
neither computed nor masked.
"""

import bisect
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from .layout import head_plan_error, split_lengths

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


def choose_ring_size(sp_size: int, num_heads: int, num_kv_heads: Optional[int] = None) -> int:
    """The smallest ring size that makes the Ulysses degree `sp_size / ring` valid for
    these head counts (query heads split, KV heads split or replicated). A ring of
    `sp_size` (Ulysses degree 1) always works, so every SP size fits every model."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if sp_size < 1 or num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"choose_ring_size: need sp_size >= 1 and query heads ({num_heads}) a multiple of "
                         f"key/value heads ({num_kv_heads})")
    for ring in range(1, sp_size + 1):
        if sp_size % ring == 0 and head_plan_error(sp_size // ring, num_heads, num_kv_heads) is None:
            return ring
    return sp_size  # unreachable: ring == sp_size gives Ulysses degree 1


# ------------------------------------------------------------------------ ring step plan

@dataclass(frozen=True)
class Block:
    """Queries `[q_start, q_stop)` of the query portion against keys `[k_start, k_stop)` of
    the key portion (local indices). Dense unless `diagonal`: then queries and keys are
    the same tokens (equal lengths) and `causal` / `documents` (local boundaries, or None)
    apply inside the block as in single-device attention."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    diagonal: bool = False
    causal: bool = False
    documents: Optional[Tuple[int, ...]] = None

    @property
    def area(self) -> int:
        return (self.q_stop - self.q_start) * (self.k_stop - self.k_start)


def _local_segments(total, ring, rank):
    out, offset = [], 0
    for start, n in zigzag_segments(total, ring, rank):
        if n:
            out.append((start, n, offset))
        offset += n
    return out


def _documents_inside(documents, start, n):
    """Local boundaries of `documents` clipped to [start, start + n); None if one document."""
    inner = [b - start for b in documents if start < b < start + n]
    return None if not inner else tuple([0] + inner + [n])


def _pair_blocks(qseg, kseg, causal, documents) -> List[Block]:
    (qs, qn, qo), (ks, kn, ko) = qseg, kseg
    if qs == ks:
        docs = _documents_inside(documents, qs, qn) if documents is not None else None
        return [Block(qo, qo + qn, ko, ko + kn, True, causal, docs)]
    if causal and ks > qs:  # disjoint ranges: keys after every query
        return []
    if documents is None:
        return [Block(qo, qo + qn, ko, ko + kn)]
    # Disjoint ranges: a document with tokens in both spans the gap between them, so at
    # most one does; its tokens in each range form a dense rectangle.
    lo, hi = min(qs + qn, ks + kn), max(qs, ks)  # the gap [lo, hi)
    d = bisect.bisect_right(documents, lo - 1) - 1  # the document holding position lo - 1
    if d < 0 or d + 1 >= len(documents) or documents[d + 1] < hi + 1 or documents[d] >= lo:
        return []
    doc_start, doc_stop = documents[d], documents[d + 1]
    qa, qb = max(qs, doc_start), min(qs + qn, doc_stop)
    ka, kb = max(ks, doc_start), min(ks + kn, doc_stop)
    if qa >= qb or ka >= kb:
        return []
    return [Block(qo + qa - qs, qo + qb - qs, ko + ka - ks, ko + kb - ks)]


def _merge(blocks: List[Block]) -> List[Block]:
    """Join dense blocks that share a key range and touch along the queries (or the
    reverse), so the kernels get a few large rectangles."""
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j or a.diagonal or b.diagonal:
                    continue
                if (a.k_start, a.k_stop) == (b.k_start, b.k_stop) and a.q_stop == b.q_start:
                    joined = Block(a.q_start, b.q_stop, a.k_start, a.k_stop)
                elif (a.q_start, a.q_stop) == (b.q_start, b.q_stop) and a.k_stop == b.k_start:
                    joined = Block(a.q_start, a.q_stop, a.k_start, b.k_stop)
                else:
                    continue
                blocks = [x for n, x in enumerate(blocks) if n not in (i, j)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(blocks, key=lambda b: (b.q_start, b.k_start))


@lru_cache(maxsize=4096)
def ring_blocks(total: int, ring: int, q_rank: int, kv_rank: int, causal: bool,
                documents: Optional[Tuple[int, ...]] = None) -> Tuple[Block, ...]:
    """The blocks of ring rank `q_rank`'s queries against ring rank `kv_rank`'s keys.

    `documents`: global `cu_seqlens` (0, ..., total) of packed documents, or None. Their
    union covers exactly the visible (query, key) pairs, each once.
    """
    qsegs = _local_segments(total, ring, q_rank)
    if q_rank == kv_rank and documents is None:
        # The portion is chunk i then the later chunk 2R-1-i: causal attention over the
        # concatenation is exactly the global causal mask (the first chunk cannot see the
        # second, the second sees all of the first).
        n = sum(s[1] for s in qsegs)
        return (Block(0, n, 0, n, True, causal, None),) if n else ()
    ksegs = _local_segments(total, ring, kv_rank)
    blocks = [b for qs in qsegs for ks in ksegs for b in _pair_blocks(qs, ks, causal, documents)]
    return tuple(_merge(blocks))
