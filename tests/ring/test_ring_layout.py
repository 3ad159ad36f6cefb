"""The Ulysses x Ring sequence layout and the ring's block plan (ulysses_kernels/ring/:
layout.py, plan.py, shard.py; docs/architecture.md, "Ulysses x Ring"), checked against
direct definitions: the layout against index arithmetic on `torch.arange`, the plan
against the global attention mask.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulysses_kernels.layout import choose_ring_size
from ulysses_kernels.reference.attention import attention_mask, document_ids
from ulysses_kernels.ring.layout import lengths_error, local_ranges, portion_lengths, sp_lengths, zigzag_segments
from ulysses_kernels.ring.plan import ring_blocks
from ulysses_kernels.ring.shard import zigzag_portion, zigzag_restore

SETTINGS = settings(max_examples=60, deadline=None)


def _positions(total, ring, ulysses, ring_rank, ulysses_rank):
    return [s + i for s, n in local_ranges(total, ring, ulysses, ring_rank, ulysses_rank) for i in range(n)]


@SETTINGS
@given(st.integers(0, 300), st.integers(1, 6), st.integers(1, 5))
def test_layout_is_a_permutation_in_tensor_split_chunks(total, ring, ulysses):
    chunks = torch.tensor_split(torch.arange(total), 2 * ring)
    seen = []
    for i in range(ring):
        portion = torch.cat([chunks[i], chunks[2 * ring - 1 - i]])
        expected_slices = torch.tensor_split(portion, ulysses)
        for u in range(ulysses):
            got = _positions(total, ring, ulysses, i, u)
            assert got == expected_slices[u].tolist()
            seen += got
    assert sorted(seen) == list(range(total))
    assert sp_lengths(total, ring, ulysses) == [
        len(s) for i in range(ring) for s in torch.tensor_split(
            torch.cat([chunks[i], chunks[2 * ring - 1 - i]]), ulysses)]
    assert lengths_error(sp_lengths(total, ring, ulysses), ulysses) is None


def test_ring_of_one_is_the_tensor_split_layout():
    for total in range(0, 20):
        for ulysses in range(1, 5):
            assert sp_lengths(total, 1, ulysses) == [len(c) for c in torch.tensor_split(torch.arange(total), ulysses)]


def test_lengths_error_names_the_expected_layout():
    err = lengths_error([5, 5, 5, 5], 2)  # 20 tokens over 2 ring x 2 Ulysses: zigzag gives the same
    assert err is None
    err = lengths_error([6, 4, 5, 5], 2)
    assert "zigzag" in err and "expected [5, 5, 5, 5]" in err


@SETTINGS
@given(st.integers(0, 100), st.integers(1, 5), st.integers(0, 3))
def test_zigzag_portion_and_restore_are_inverse(total, ring, rank_seed):
    x = torch.arange(total).view(1, total)
    portions = [zigzag_portion(x, total, ring, r, 1) for r in range(ring)]
    assert [p.shape[1] for p in portions] == portion_lengths(total, ring)
    assert torch.equal(zigzag_restore(torch.cat(portions, 1), total, ring, 1), x)


def _portion_positions(total, ring, rank):
    return torch.tensor([s + i for s, n in zigzag_segments(total, ring, rank) for i in range(n)], dtype=torch.long)


def _covered(total, ring, q_rank, causal, documents):
    """How many times the plan computes each (query, key) pair of q_rank's queries."""
    qpos = _portion_positions(total, ring, q_rank)
    count = torch.zeros(len(qpos), total, dtype=torch.int64)
    for kv_rank in range(ring):
        kpos = _portion_positions(total, ring, kv_rank)
        for b in ring_blocks(total, ring, q_rank, kv_rank, causal, documents):
            rows, keys = b.q_stop - b.q_start, b.k_stop - b.k_start
            local = torch.ones(rows, keys, dtype=torch.bool)
            if b.diagonal:
                assert rows == keys and torch.equal(qpos[b.q_start:b.q_stop], kpos[b.k_start:b.k_stop])
                doc = None
                if b.documents is not None:
                    doc = document_ids(torch.tensor(b.documents), rows, "cpu")
                m = attention_mask(rows, keys, 0, rows, b.causal, doc, doc)
                local = m if m is not None else local
            else:
                assert not b.causal and b.documents is None
            block_pos = kpos[b.k_start:b.k_stop]
            count[b.q_start:b.q_stop][:, block_pos] += local.long()
    return qpos, count


@SETTINGS
@given(st.integers(1, 120), st.integers(1, 5), st.booleans(), st.lists(st.integers(0, 120), max_size=6))
def test_plan_covers_the_mask_exactly_once(total, ring, causal, cuts):
    documents = None
    if cuts:
        documents = tuple([0] + sorted(min(c, total) for c in cuts) + [total])
    for q_rank in range(ring):
        qpos, count = _covered(total, ring, q_rank, causal, documents)
        doc = document_ids(torch.tensor(documents), total, "cpu") if documents else None
        full = attention_mask(total, total, 0, total, causal, doc, doc)
        want = (full if full is not None else torch.ones(total, total, dtype=torch.bool))[qpos]
        assert torch.equal(count, want.long()), (total, ring, q_rank, causal, documents)


def test_plan_skips_invisible_blocks_and_balances_causal_work():
    total, ring = 64, 4  # 8 chunks of 8: each portion 16 tokens
    for q_rank in range(ring):
        areas = []
        for kv_rank in range(ring):
            blocks = ring_blocks(total, ring, q_rank, kv_rank, True, None)
            assert len(blocks) == 1  # one rectangle per step, nothing computed and masked
            areas.append(sum(b.area for b in blocks))
        # the diagonal step is one causal 16 x 16 block; every other step a dense 8 x 16 or 16 x 8 one
        assert areas[q_rank] == 256 and all(a == 128 for r, a in enumerate(areas) if r != q_rank)


def test_plan_with_documents_computes_only_connected_pieces():
    # one document per ring portion boundary region: 40 tokens, ring 2 -> chunks of 10
    documents = (0, 10, 20, 40)  # chunk 0 alone, chunk 1 alone, chunks 2-3 together
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2: rank 1's queries see nothing of rank 0's keys
    assert ring_blocks(40, 2, 1, 0, True, documents) == ()
    assert len(ring_blocks(40, 2, 1, 0, True, None)) == 1
    for causal in (True, False):  # chunk 3's queries see chunk 2's keys: one dense rectangle
        blocks = ring_blocks(40, 2, 0, 1, causal, documents)
        assert [(b.q_start, b.q_stop, b.k_start, b.k_stop, b.diagonal) for b in blocks] == [(10, 20, 10, 20, False)]


@pytest.mark.parametrize("sp,heads,kv,ring", [(8, 28, 4, 2), (8, 32, 8, 1), (8, 32, 2, 1), (6, 28, 4, 3),
                                             (64, 32, 8, 2), (7, 8, 8, 7), (1, 3, 1, 1)])
def test_choose_ring_size(sp, heads, kv, ring):
    assert choose_ring_size(sp, heads, kv) == ring


@pytest.mark.parametrize("sp,heads,kv,node,ring", [
    (16, 32, 8, 8, 2),    # 2 nodes x 8: Ulysses 8 inside each node, not Ulysses 16 across them
    (16, 28, 4, 8, 4),    # the heads allow Ulysses 4 (not 8): ring 4
    (64, 32, 8, 8, 8),    # 8 nodes x 8
    (4, 32, 8, 8, 1),     # the SP group fits in a node
    (12, 24, 12, 4, 3),   # nodes of 4: Ulysses 4 (12 heads would allow 6 and 12)
    (8, 8, 8, 3, 8),      # nodes of 3 (ranks do not split evenly): only Ulysses 1 stays inside
])
def test_choose_ring_size_keeps_ulysses_inside_a_node(sp, heads, kv, node, ring):
    assert choose_ring_size(sp, heads, kv, gpus_per_node=node) == ring
    assert choose_ring_size(sp, heads, kv, gpus_per_node=None) <= ring


def test_the_node_size_comes_from_the_launcher_or_the_argument(monkeypatch):
    """init_sequence_parallel's node size: gpus_per_node, else LOCAL_WORLD_SIZE; None on one
    node (or unknown); a world that is not whole nodes raises."""
    from ulysses_kernels.distributed.groups import _node_size

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _node_size(16, None) is None and _node_size(16, 8) == 8 and _node_size(8, 8) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _node_size(16, None) == 4 and _node_size(16, 8) == 8 and _node_size(4, None) is None
    with pytest.raises(ValueError, match="not whole nodes of 3"):
        _node_size(16, 3)


def test_choose_ring_size_rejects_bad_heads():
    with pytest.raises(ValueError, match="multiple"):
        choose_ring_size(8, 28, 3)
