"""The ring's block plan (docs/architecture.md, "Ulysses x Ring"): which attention blocks
each ring step computes. Pure arithmetic over the zigzag layout (`layout.py`).

The attention of one portion's queries against another portion's keys is a short list
of rectangles `Block`, each either dense (every query sees every key) or a diagonal
block (queries and keys are the same tokens: causal and/or documents inside it), and
with a window (`ulysses_kernels/variants.py`) a block the window cuts carries its band
in the block's own coordinates. Key blocks that no query can see (behind the causal
mask, in another document, outside the window) are not in the list, so they are neither
computed nor masked.
"""

import bisect
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

from ..variants import Band
from .layout import zigzag_segments


@dataclass(frozen=True)
class Block:
    """Queries `[q_start, q_stop)` of the query portion against keys `[k_start, k_stop)` of
    the key portion (local indices). Dense unless `diagonal`: then queries and keys are
    the same tokens (equal lengths) and `causal` / `documents` (local boundaries, or None)
    apply inside the block as in single-device attention. `band` (variants.py): the part
    of the window that cuts this block, bottom-right aligned in its own rows and keys
    (sides may be negative; (None, None): the window does not cut it)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    diagonal: bool = False
    causal: bool = False
    documents: Optional[Tuple[int, ...]] = None
    band: Band = (None, None)

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


def _windowed(block: Block, q_global: int, k_global: int, window: Band) -> Optional[Block]:
    """`block` (its first query and key at global positions `q_global` / `k_global`) cut by
    the global window band: None when no pair of it is inside the band, else the block
    with the band in its own coordinates (a side the whole block satisfies is None)."""
    left, right = window
    rows, keys = block.q_stop - block.q_start, block.k_stop - block.k_start
    shift = q_global - k_global  # key b of query a is visible iff a + shift - left <= b <= a + shift + right
    if (right is not None and 0 > rows - 1 + shift + right) or (left is not None and keys - 1 < shift - left):
        return None
    off = keys - rows  # the kernels' bottom-right alignment: their band is about a + off
    band_left = None if left is None or rows - 1 + shift - left <= 0 else left + off - shift
    band_right = None if right is None or keys - 1 <= shift + right else right + shift - off
    return Block(block.q_start, block.q_stop, block.k_start, block.k_stop, block.diagonal, block.causal,
                 block.documents, (band_left, band_right))


def _global_start(segments, local: int) -> int:
    """The global position of local row `local` of a portion made of `segments`."""
    for start, n, offset in segments:
        if offset <= local < offset + n:
            return start + local - offset
    raise AssertionError(f"local row {local} is outside the portion")


def _merge(blocks: List[Block]) -> List[Block]:
    """Join dense blocks that share a key range and touch along the queries (or the
    reverse), so the kernels get a few large rectangles."""
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j or a.diagonal or b.diagonal or a.band != (None, None) or b.band != (None, None):
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
                documents: Optional[Tuple[int, ...]] = None, window: Band = (None, None)) -> Tuple[Block, ...]:
    """The blocks of ring rank `q_rank`'s queries against ring rank `kv_rank`'s keys.

    `documents`: global `cu_seqlens` (0, ..., total) of packed documents, or None.
    `window`: the global window band (variants.py; the global problem has Sq == Sk).
    Their union covers exactly the visible (query, key) pairs, each once.
    """
    qsegs = _local_segments(total, ring, q_rank)
    if q_rank == kv_rank and documents is None and window == (None, None):
        # The portion is chunk i then the later chunk 2R-1-i: causal attention over the
        # concatenation is exactly the global causal mask (the first chunk cannot see the
        # second, the second sees all of the first).
        n = sum(s[1] for s in qsegs)
        return (Block(0, n, 0, n, True, causal, None),) if n else ()
    ksegs = _local_segments(total, ring, kv_rank)
    blocks = [b for qs in qsegs for ks in ksegs for b in _pair_blocks(qs, ks, causal, documents)]
    if window != (None, None):
        cut = (_windowed(b, _global_start(qsegs, b.q_start), _global_start(ksegs, b.k_start), window)
               for b in blocks)
        blocks = [b for b in cut if b is not None]
    return tuple(_merge(blocks))
