"""Which blocks a tile visits: THE block-range rule of the attention kernels, in both
directions (docs/architecture.md, "Attention kernels").

A query tile ``[m0, m_last]`` (forward, dQ) visits key blocks; a key tile ``[n0, n_last]``
(dK/dV) visits query-row blocks. Both see the same mask, read from either side: with
off = Sk - Sq, query i sees key j iff ``j <= i + off`` (causal), ``i + off - left <= j <=
i + off + right`` (a band) and i, j share a document. From a key's side the band is the
mirror image: key j is seen by rows ``[j - off - right, j - off + left]``, i.e. the band
rule with ``-off`` and the sides swapped; ``band_visit_range`` is that rule, written once
for both, on the tile's positions moved onto the other side's diagonal (``i + off`` for a
query row, ``j - off`` for a key).

Every range comes as phases: blocks that need a mask (a causal diagonal, a band edge, a
document boundary, the sequence end) and blocks every valid row (column) of the tile sees
whole, which the kernels visit without a mask. Each function returns the bounds of its
phases; the kernels call their ``*_inner`` loop once per phase.
"""

import triton
import triton.language as tl


@triton.jit
def tile_documents(offs, ok, first, last, DOCS, CU, MISSING: tl.constexpr):
    """The documents of a tile of positions ``[first, last]`` (VARLEN): (each position's
    document, MISSING past the sequence; the tile's documents' start lo and end hi; whether
    the tile lies in one document). Query tiles pass MISSING = -2 and key tiles -1, so a
    padded row never matches a padded key."""
    doc = tl.load(DOCS + offs, mask=ok, other=MISSING)
    first_doc = tl.load(DOCS + first)
    last_doc = tl.load(DOCS + last)
    return doc, tl.load(CU + first_doc), tl.load(CU + last_doc + 1), first_doc == last_doc


@triton.jit
def tile_extent(offs, ok, first, last, S, DOCS, CU, VARLEN: tl.constexpr, MISSING: tl.constexpr):
    """Where a tile of positions ``[first, last]`` may look on the other side: (each
    position's document or ``offs`` without documents; lo, hi; one_doc): the tile's
    documents' ``[lo, hi)`` with VARLEN (tile_documents), else the other side's whole
    sequence ``[0, S)``."""
    if VARLEN:
        doc, lo, hi, one_doc = tile_documents(offs, ok, first, last, DOCS, CU, MISSING)
    else:
        doc = offs  # unused
        lo = 0
        hi = S
        one_doc = True
    return doc, lo, hi, one_doc


@triton.jit
def in_band(key_pos, query_pos, causal_off, window_left, window_right):
    """The band rule (WINDOW): key j is visible to query i iff
    ``i + off - left <= j <= i + off + right`` (broadcast key_pos against query_pos)."""
    rel = key_pos - (query_pos + causal_off)  # the key's distance from the query's diagonal
    return (rel >= -window_left) & (rel <= window_right)


@triton.jit
def phase_bounds(start, end, full_lo, full_hi, BLOCK: tl.constexpr):
    """Split the visited range ``[start, end)`` into masked ``[start, a)``, unmasked
    ``[a, b)`` and masked ``[b, end)``, where ``[full_lo, full_hi)`` holds the positions
    every valid row (column) of the tile sees. a and b are start plus whole blocks, so the
    three loops together visit exactly ``cdiv(end - start, BLOCK)`` blocks."""
    a = tl.minimum(start + tl.cdiv(tl.maximum(full_lo - start, 0), BLOCK) * BLOCK, end)
    b = a + tl.maximum(full_hi - a, 0) // BLOCK * BLOCK
    return a, b


@triton.jit
def band_visit_range(diag_first, diag_last, lo, hi, one_doc, below, above,
                     SPLIT: tl.constexpr, BLOCK: tl.constexpr, PAST_END_NEUTRAL: tl.constexpr):
    """THE band rule for both directions: a tile whose positions lie on the other side's
    diagonal at ``[diag_first, diag_last]`` (a query tile: ``m + off``; a key tile:
    ``n - off``) sees, from position d, the other side's ``[d - below, d + above]`` inside
    ``[lo, hi)`` (the sequence, or the tile's documents: ``one_doc`` when it lies in one).
    A query tile passes (left, right), a key tile (right, left).

    Returns (start, a, b, end): the tile visits ``[start, end)``; ``[start, a)`` and
    ``[b, end)`` need masks, every valid position of the tile sees all of ``[a, b)``
    (phase_bounds). All bounds lie in ``[lo, hi]``, so an empty phase addresses nothing past
    the sequence. PAST_END_NEUTRAL: positions past ``hi`` contribute nothing unmasked (a key
    tile's rows past Sq: q = dO = 0, P = 0), so a band reaching the end needs no mask there.
    """
    start = tl.minimum(tl.maximum(lo, diag_first - below), hi)
    end = tl.maximum(tl.minimum(hi, diag_last + above + 1), start)
    if SPLIT == 1:
        # Affine tiles must not straddle two buffer blocks: blocks start at multiples of
        # BLOCK (lo = 0 here: SPLIT 1 never has documents).
        start = start // BLOCK * BLOCK
    # Every position of the tile sees [diag_last - below, diag_first + above], if one document.
    full_lo = tl.maximum(lo, diag_last - below)
    full_hi = tl.where(one_doc, tl.minimum(hi, diag_first + above + 1), full_lo)
    if PAST_END_NEUTRAL:
        full_hi = tl.where(full_hi == hi, hi + BLOCK - 1, full_hi)
    a, b = phase_bounds(start, end, full_lo, full_hi, BLOCK)
    return start, a, b, end


# ------------------------------------------------------------------------- query tiles

@triton.jit
def query_tile_key_range(offs_m, m_ok, m0, m_last, Sk, causal_off, DOCS, CU,
                         CAUSAL: tl.constexpr, VARLEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys a query tile ``[m0, m_last]`` visits without a band (forward, dQ).

    Returns (doc_q, lo, hi, unmasked_end): any row may see keys in ``[lo, hi)``; every valid
    row sees all of ``[lo, unmasked_end)`` (whole BLOCK_N blocks that need no mask), so only
    ``[unmasked_end, hi)`` is visited with masks. doc_q is each row's document (VARLEN).
    """
    if VARLEN:
        doc_q, lo, hi, one_doc = tile_documents(offs_m, m_ok, m0, m_last, DOCS, CU, -2)
        if CAUSAL:
            full_end = tl.where(one_doc, tl.minimum(hi, m0 + 1), lo)
            hi = tl.minimum(hi, m_last + 1)
        else:
            full_end = tl.where(one_doc, hi, lo)
    else:
        doc_q = offs_m  # unused
        lo = 0
        hi = Sk
        if CAUSAL:
            full_end = tl.maximum(tl.minimum(Sk, m0 + causal_off + 1), 0)
            hi = tl.maximum(tl.minimum(Sk, m_last + causal_off + 1), 0)
        else:
            full_end = Sk
    unmasked_end = tl.maximum(lo + ((full_end - lo) // BLOCK_N) * BLOCK_N, lo)
    return doc_q, lo, hi, unmasked_end


@triton.jit
def query_tile_band_range(offs_m, m_ok, m0, m_last, Sk, causal_off, window_left, window_right, DOCS, CU,
                          VARLEN: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys a query tile ``[m0, m_last]`` visits under a band (WINDOW; forward, dQ):
    ``[max(lo, m0+off-left), min(hi, m_last+off+right+1))`` with ``[lo, hi)`` the sequence
    or the tile's documents; no block outside it is visited. Returns (doc_q, start, a, b,
    end) as band_visit_range."""
    doc_q, lo, hi, one_doc = tile_extent(offs_m, m_ok, m0, m_last, Sk, DOCS, CU, VARLEN, -2)
    start, a, b, end = band_visit_range(m0 + causal_off, m_last + causal_off, lo, hi, one_doc, window_left,
                                        window_right, SPLIT, BLOCK_N, False)
    return doc_q, start, a, b, end


@triton.jit
def query_tile_visit_range(offs_m, m_ok, m0, m_last, Sk, causal_off, window_left, window_right, DOCS, CU,
                           CAUSAL: tl.constexpr, VARLEN: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """(doc_q, lo, hi): every key a query tile visits, for the warp-specialized kernels'
    single masked loop (forward and dQ): query_tile_band_range's [start, end) under a
    band, else query_tile_key_range's [lo, hi)."""
    if WINDOW:
        doc_q, lo, _a, _b, hi = query_tile_band_range(offs_m, m_ok, m0, m_last, Sk, causal_off, window_left,
                                                      window_right, DOCS, CU, VARLEN, SPLIT, BLOCK_N)
    else:
        doc_q, lo, hi, _u = query_tile_key_range(offs_m, m_ok, m0, m_last, Sk, causal_off, DOCS, CU, CAUSAL,
                                                 VARLEN, BLOCK_N)
    return doc_q, lo, hi


# --------------------------------------------------------------------------- key tiles

@triton.jit
def key_tile_query_range(offs_n, n_ok, n0, n_last, Sq, causal_off, DOCS, CU,
                         CAUSAL: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query rows a key tile ``[n0, n_last]`` visits without a band (dK/dV): the mirror of
    query_tile_key_range (causal bounds the rows' start, not the keys' end). Returns (doc_k,
    lo, a, b, hi) with ``[lo, a)`` and ``[b, hi)`` masked and every row of ``[a, b)`` seeing
    the whole tile."""
    # Query rows [lo, hi) that may see a key of the tile; [full_lo, full_hi) see all of it.
    if VARLEN:
        doc_k, lo, hi, one_doc = tile_documents(offs_n, n_ok, n0, n_last, DOCS, CU, -1)
        if CAUSAL:
            lo = tl.maximum(lo, n0)
            full_lo = tl.minimum(tl.maximum(n_last, lo), hi)
        else:
            full_lo = lo
        full_hi = tl.where(one_doc, hi, full_lo)
    else:
        doc_k = offs_n  # unused
        lo = 0
        hi = Sq
        if CAUSAL:
            lo = tl.minimum(tl.maximum(n0 - causal_off, 0), Sq)
            full_lo = tl.minimum(tl.maximum(n_last - causal_off, lo), Sq)
        else:
            full_lo = lo
        # Rows past Sq are neutral (q = dO = 0, P = 0): the last block needs no mask.
        full_hi = Sq + BLOCK_M - 1
    a_end = lo + tl.cdiv(full_lo - lo, BLOCK_M) * BLOCK_M
    a_end = tl.minimum(a_end, hi)
    b_end = a_end + tl.maximum(full_hi - a_end, 0) // BLOCK_M * BLOCK_M
    return doc_k, lo, a_end, b_end, hi


@triton.jit
def key_tile_band_range(offs_n, n_ok, n0, n_last, Sq, causal_off, window_left, window_right, DOCS, CU,
                        VARLEN: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query rows a key tile ``[n0, n_last]`` visits under a band (WINDOW; dK/dV): key j is
    seen by rows ``[j - off - right, j - off + left]`` (band_visit_range on ``j - off``
    with the sides swapped) within the sequence or its documents. Returns (doc_k, start, a, b, end)
    as key_tile_query_range; all bounds lie in ``[0, Sq]``."""
    doc_k, lo, hi, one_doc = tile_extent(offs_n, n_ok, n0, n_last, Sq, DOCS, CU, VARLEN, -1)
    start, a, b, end = band_visit_range(n0 - causal_off, n_last - causal_off, lo, hi, one_doc, window_right,
                                        window_left, SPLIT, BLOCK_M, not VARLEN)
    return doc_k, start, a, b, end
