"""The attention variants (ulysses_kernels/variants.py and every place that computes them:
reference/attention.py, reference/block_ops.py, ring/plan.py, ring/merge.py,
ring/schedule.py, the checks of distributed/validate.py, api.py): windows, softcap,
sinks and a value head dim of its own, against an independent float64 brute force
(tests/helpers.py, `brute_force_attention`), in one process here; over process groups
in tests/test_variants_distributed.py."""

import itertools

import pytest
import torch
from helpers import brute_force_attention, randn, rel_err

import ulysses_kernels as uk
from ulysses_kernels.reference.block_ops import TorchBlockOps, _block_mask
from ulysses_kernels.ring.layout import zigzag_segments
from ulysses_kernels.ring.merge import merge_sinks, sink_gradient
from ulysses_kernels.ring.plan import ring_blocks
from ulysses_kernels.variants import Variant, make_variant


def qkv(B, Sq, Hq, Hkv, D, Dv=None, *, Sk=None, seed=0, dtype=torch.float64):
    Sk = Sq if Sk is None else Sk
    shapes = [(B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, Dv or D), (B, Sq, Hq, Dv or D)]
    return [randn(*s, seed=seed + i, dtype=dtype) for i, s in enumerate(shapes)]


# ------------------------------------------------------------------ the rules

def test_make_variant_normalises_flash_attn_windows():
    assert make_variant((-1, -1)) == Variant()
    assert make_variant((4, -1)).window == (4, None)
    assert make_variant((4, 0)).window == (4, 0)
    assert make_variant((4, 3), causal=True).window == (4, None)  # the causal mask bounds the right side
    assert make_variant(softcap=None).softcap == 0.0
    assert make_variant((2, 5), 30.0).describe() == "window_size=(2, 5), softcap=30.0"


def test_one_causal_fold():
    """variants.fold_causal is the rule; make_variant and the kernels' kernel_band both
    apply it (a right side >= 0 adds nothing to causal; a negative one stays)."""
    from ulysses_kernels.variants import band_problem, fold_causal

    assert fold_causal((4, 3), causal=True) == (4, None)
    assert fold_causal((4, 0), causal=True) == (4, None)
    assert fold_causal((None, -2), causal=True) == (None, -2)  # the ring's shifted band
    assert fold_causal((4, 3), causal=False) == (4, 3)
    for window_size in [(4, 3), (-1, 0), (2, -1)]:
        band = tuple(None if side == -1 else side for side in window_size)
        assert make_variant(window_size, causal=True).window == fold_causal(band, True)
    assert band_problem((1, None)) is None and band_problem((-3, -4)) is None
    assert "must be a pair" in band_problem((1,))
    assert "right side must be an int or None" in band_problem((1, 2.0))
    kernels = pytest.importorskip("ulysses_kernels.triton.kernel_call")
    for band in [(4, 3), (4, 0), (None, -2), (None, 5), (3, None)]:
        # the kernels' encoding of causal + band equals that of the folded band + causal
        assert kernels.kernel_band(True, band, 10, 10) == kernels.kernel_band(True, fold_causal(band, True), 10, 10)


@pytest.mark.parametrize("window,softcap,message", [
    ((-2, 0), 0.0, "left side must be >= 0 or -1"),
    ((3,), 0.0, "must be a pair"),
    ((1.5, 0), 0.0, "must be an int"),
    ((-1, -1), -1.0, "softcap must be > 0"),
    ((-1, -1), float("nan"), "softcap must be > 0"),
])
def test_bad_variants_raise_clearly(window, softcap, message):
    with pytest.raises(ValueError, match=message):
        make_variant(window, softcap)
    q, k, v, _ = qkv(1, 8, 2, 2, 16)
    with pytest.raises(ValueError, match=message):
        uk.flash_attention(q, k, v, window_size=window, softcap=softcap)


@pytest.mark.parametrize("sinks,message", [
    (torch.zeros(3), r"shape \[2\]"),
    (torch.zeros(2, 1), r"shape \[2\]"),
    (torch.zeros(2, dtype=torch.int64), "floating-point"),
    ([0.0, 0.0], "must be a tensor"),
    (torch.zeros(2, device="meta"), "are on meta"),
])
def test_bad_sinks_raise_clearly(sinks, message):
    q, k, v, _ = qkv(1, 8, 2, 2, 16)
    with pytest.raises(ValueError, match=message):
        uk.flash_attention(q, k, v, sinks=sinks)
    with pytest.raises(ValueError, match=message):
        uk.ulysses_attention(q, k, v, sinks=sinks)


# ------------------------------------------------------------ reference attention

CASES = [  # (B, Sq, Sk, Hq, Hkv, D, Dv, causal, window, softcap, sinks, cu)
    (2, 29, 29, 4, 2, 16, 16, True, (5, -1), 0.0, False, None),
    (1, 33, 33, 4, 4, 16, 16, False, (3, 6), 0.0, False, None),
    (1, 24, 31, 4, 1, 16, 16, True, (4, -1), 0.0, False, None),        # Sq != Sk, MQA
    (1, 31, 24, 2, 1, 16, 16, False, (2, 1), 0.0, False, None),        # rows that see nothing
    (1, 30, 30, 4, 2, 16, 16, False, (-1, -1), 7.5, False, None),
    (1, 30, 30, 4, 2, 16, 16, True, (-1, -1), 0.0, True, None),
    (1, 31, 24, 2, 2, 16, 16, True, (-1, -1), 0.0, True, None),        # sinks in rows that see no key
    (1, 30, 30, 4, 2, 24, 8, True, (-1, -1), 0.0, False, None),        # Dv != D (MLA-like)
    (1, 40, 40, 4, 2, 16, 16, True, (4, -1), 0.0, False, [0, 9, 9, 25, 40]),  # documents with a window
    (2, 37, 37, 6, 2, 24, 16, True, (6, -1), 20.0, True, None),        # all combined
    (1, 45, 45, 4, 1, 16, 8, False, (3, 2), 5.0, True, [0, 12, 30, 45]),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_reference_attention_matches_brute_force(case):
    B, Sq, Sk, Hq, Hkv, D, Dv, causal, window, softcap, with_sinks, cu = case
    q, k, v, do = qkv(B, Sq, Hq, Hkv, D, Dv, Sk=Sk, seed=len(str(case)))
    sinks = randn(Hq, seed=7, dtype=torch.float64) if with_sinks else None
    cu = torch.tensor(cu, dtype=torch.int32) if cu else None
    want = brute_force_attention(q, k, v, do, causal=causal, cu_seqlens=cu, window_size=window, softcap=softcap,
                                 sinks=sinks)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    s = sinks.clone().requires_grad_(True) if with_sinks else None
    out = uk.flash_attention(*leaves, causal=causal, cu_seqlens=cu, window_size=window, softcap=softcap, sinks=s,
                             backend="reference")
    assert out.shape == (B, Sq, Hq, Dv)
    out.backward(do)
    got = [out, *(t.grad for t in leaves)] + ([s.grad] if with_sinks else [])
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert rel_err(a, b) < 1e-12, name


# ------------------------------------------------------------------ the ring plan

def _visible(total, causal, documents, window):
    i = torch.arange(total)[:, None]
    j = torch.arange(total)[None, :]
    seen = torch.ones(total, total, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window[0] is not None:
        seen &= j >= i - window[0]
    if window[1] is not None:
        seen &= j <= i + window[1]
    if documents is not None:
        doc = torch.searchsorted(torch.tensor(documents[1:]), torch.arange(total), right=True)
        seen &= doc[:, None] == doc[None, :]
    return seen


def _positions(total, ring, rank):
    return torch.cat([torch.arange(start, start + n) for start, n in zigzag_segments(total, ring, rank)]
                     or [torch.zeros(0, dtype=torch.int64)])


@pytest.mark.parametrize("total,ring", [(64, 2), (61, 3), (40, 4), (7, 3)])
@pytest.mark.parametrize("causal,window", [(True, (5, None)), (True, (20, None)), (False, (3, 7)),
                                           (False, (0, 0)), (True, (None, None))])
@pytest.mark.parametrize("documents", [None, "docs"])
def test_ring_plan_covers_exactly_the_visible_pairs_once(total, ring, causal, window, documents):
    docs = None if documents is None else tuple(sorted({0, total // 3, total // 3, total // 2 + 1, total}))
    want = _visible(total, causal, docs, window)
    covered = torch.zeros(total, total, dtype=torch.int64)
    for q_rank, kv_rank in itertools.product(range(ring), repeat=2):
        qpos, kpos = _positions(total, ring, q_rank), _positions(total, ring, kv_rank)
        for b in ring_blocks(total, ring, q_rank, kv_rank, causal, docs, window):
            mask = _block_mask(b, b.q_stop - b.q_start, b.k_stop - b.k_start, "cpu")
            rows, keys = qpos[b.q_start:b.q_stop], kpos[b.k_start:b.k_stop]
            inside = torch.ones(len(rows), len(keys), dtype=torch.bool) if mask is None else mask
            assert inside.any(), f"block {b} computes nothing"
            covered[rows[:, None], keys[None, :]] += inside.long()
    assert covered.max() <= 1, "a pair is computed twice"
    assert torch.equal(covered.bool(), want)


def _tiles_with_work(block, tile):
    """How many tile x tile pieces of `block` hold a visible pair (what a kernel that skips
    the tiles outside its band visits)."""
    rows, keys = block.q_stop - block.q_start, block.k_stop - block.k_start
    mask = _block_mask(block, rows, keys, "cpu")
    mask = torch.ones(rows, keys, dtype=torch.bool) if mask is None else mask
    padded = torch.zeros(-(-rows // tile) * tile, -(-keys // tile) * tile, dtype=torch.bool)
    padded[:rows, :keys] = mask
    return int(padded.view(padded.shape[0] // tile, tile, -1, tile).any(3).any(1).sum())


def test_ring_plan_work_scales_with_the_window():
    """S = 4096 over a ring of 4, W = 256 (window (255, 0)): the plan drops every block
    outside the window, and the 64 x 64 tiles with work in the blocks it keeps stay within
    (W / 64 + 2) per query tile, against S / 128 for causal attention."""
    total, ring, window, tile = 4096, 4, 255, 64
    pairs = list(itertools.product(range(ring), repeat=2))
    windowed = [b for q, k in pairs for b in ring_blocks(total, ring, q, k, True, None, (window, None))]
    full = [b for q, k in pairs for b in ring_blocks(total, ring, q, k, True, None)]
    query_tiles = total // tile
    tiles = sum(_tiles_with_work(b, tile) for b in windowed)
    assert tiles <= query_tiles * ((window + 1) // tile + 2), tiles
    assert tiles >= int(_visible(total, True, None, (window, None)).sum()) // tile ** 2
    assert sum(_tiles_with_work(b, tile) for b in full) > 5 * tiles
    # a chunk (512 tokens) sees only itself and the chunk before it: 2R - 1 + 2R blocks
    assert len(windowed) == 4 * ring - 1, windowed


# -------------------------------------------------- the ring's sinks and block ops

def test_merge_sinks_and_its_gradient_match_the_brute_force():
    q, k, v, do = qkv(2, 19, 3, 3, 16, 8, seed=3)
    sinks = randn(3, seed=9, dtype=torch.float64)
    want = brute_force_attention(q, k, v, do, causal=True, sinks=sinks)
    out, lse = uk.reference_attention(q, k, v, causal=True)
    merged, merged_lse = merge_sinks(out, lse, sinks)
    assert rel_err(merged, want[0]) < 1e-13
    assert rel_err(sink_gradient(sinks, merged_lse, merged, do), want[4]) < 1e-12


def test_sink_gradient_is_zero_for_rows_without_keys_and_a_minus_inf_sink():
    """A row that sees no key (lse -inf) with a head whose sink is -inf (no sink) adds
    nothing to the sinks' gradient: 0, not NaN (exp(-inf - -inf)); the ring's rule and the
    Triton path's are the one `variants.sinks_gradient`."""
    from ulysses_kernels.variants import sinks_gradient

    out, do = randn(1, 4, 2, 8, seed=1, dtype=torch.float64), randn(1, 4, 2, 8, seed=2, dtype=torch.float64)
    lse = randn(1, 2, 4, seed=3, dtype=torch.float64)
    lse[0, 1, :2] = float("-inf")                                   # head 1: two rows without keys
    sinks = torch.tensor([0.5, float("-inf")], dtype=torch.float64)
    got = sink_gradient(sinks, lse, out, do)
    assert torch.isfinite(got).all() and float(got[1]) == 0.0, got
    delta = (do * out).sum(-1).transpose(1, 2)
    assert rel_err(got[0], -(torch.exp(0.5 - lse[0, 0]) * delta[0, 0]).sum()) < 1e-14
    assert torch.equal(got, sinks_gradient(sinks, lse, delta))


@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_torch_block_ops_with_band_and_softcap(softcap):
    """A shifted band (negative left side: the ring's blocks behind the diagonal) on the
    block ops equals the brute force on the same rectangle."""
    from ulysses_kernels.ring.plan import Block

    q, k, v, do = qkv(1, 12, 2, 1, 16, 8, Sk=20, seed=5)
    block = Block(0, 12, 0, 20, band=(-3, 4))  # key b visible to row a iff a + 11 <= b <= a + 12
    out, lse = TorchBlockOps.forward(q, k, v, block, 0.25, softcap)
    i = torch.arange(12)[:, None]
    j = torch.arange(20)[None, :]
    mask = (j >= i + 8 + 3) & (j <= i + 8 + 4)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 0.25
    scores = softcap * torch.tanh(scores / softcap) if softcap else scores
    scores = scores.masked_fill(~mask, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert rel_err(lse[seen], want_lse[seen]) < 1e-13
    p = torch.exp(scores - want_lse.unsqueeze(-1)).nan_to_num(0.0)
    assert rel_err(out, torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(2, 2))) < 1e-13
