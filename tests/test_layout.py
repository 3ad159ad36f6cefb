"""ulysses_kernels.layout: the sequence split and the head placement every path uses
(docs/architecture.md, "Layout rules"). The exchange's packing of these placements is
tested in tests/exchange/test_exchanges.py.

The placements themselves are never recomputed here: the properties below say what a
placement must achieve (every rank receives `local` heads, every head reaches exactly the
ranks whose query heads read it, replicas are consecutive ranks) and check that
`place_heads` / `HeadPlan` achieve it.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ulysses_kernels as uk
from ulysses_kernels.layout import HeadPlan, head_plan_error, place_heads, split_lengths

SETTINGS = settings(max_examples=80, deadline=None)


# ------------------------------------------------------------------ sequence split

def test_split_lengths_is_tensor_split():
    for total in range(0, 23):
        for parts in range(1, 6):
            expected = [len(c) for c in torch.tensor_split(torch.arange(total), parts)]
            assert uk.split_lengths(total, parts) == expected


@SETTINGS
@given(st.integers(0, 500), st.integers(1, 16))
def test_split_lengths_is_tensor_split_property(total, parts):
    assert split_lengths(total, parts) == [len(c) for c in torch.tensor_split(torch.arange(total), parts)]


# ---------------------------------------------------------------- head placement

def _valid_pairs(limit=16):
    """(heads, world) pairs the contract places: heads a multiple of the world (split) or
    the world a multiple of the heads (replicated), built from products."""
    pairs = {(world * k, world) for world in range(1, limit + 1) for k in range(1, limit // world + 2)}
    pairs |= {(heads, heads * m) for heads in range(1, limit + 1) for m in range(1, limit // heads + 1)}
    return sorted(pairs)


VALID = _valid_pairs()
valid_pair = st.sampled_from(VALID)


def _holders(p):
    """head -> the ranks that hold it (from the placement's own source_head)."""
    held = {}
    for rank in range(p.world):
        for l in range(p.local):
            held.setdefault(p.source_head(rank, l), []).append(rank)
    return held


@SETTINGS
@given(valid_pair)
def test_place_heads_properties(pair):
    heads, world = pair
    p = place_heads(heads, world)
    assert (p.heads, p.world) == (heads, world)
    assert p.local >= 1 and p.replicas >= 1 and p.split == (p.replicas == 1)
    assert p.local * world == heads * p.replicas  # every rank receives `local` heads
    for rank in range(world):
        mine = [p.source_head(rank, l) for l in range(p.local)]
        assert len(set(mine)) == p.local and all(0 <= h < heads for h in mine)
        assert p.source_head(rank) == mine[0]
    held = _holders(p)
    assert sorted(held) == list(range(heads))  # every head reaches some rank
    for h, ranks in held.items():
        # exactly `replicas` consecutive ranks hold each head
        assert ranks == list(range(ranks[0], ranks[0] + p.replicas)), (h, ranks)
        assert ranks[0] % p.replicas == 0
    if heads >= world:
        assert p.split  # heads are split whenever there are enough of them
    else:
        assert p.local == 1  # fewer heads than ranks: one (replicated) head each


@pytest.mark.parametrize("heads,world", [(3, 2), (2, 3), (4, 6), (6, 4), (5, 3), (9, 6), (0, 2), (2, 0), (-1, 2)])
def test_place_heads_rejects_impossible_counts(heads, world):
    with pytest.raises(ValueError, match=f"{heads} heads"):
        place_heads(heads, world)


def test_place_heads_accepts_exactly_the_contract():
    valid = set(VALID)
    for heads in range(1, 13):
        for world in range(1, 13):
            if (heads, world) in valid:
                place_heads(heads, world)
            else:
                with pytest.raises(ValueError, match="neither split over nor replicated"):
                    place_heads(heads, world)


@st.composite
def head_plans(draw):
    """(world, Hq, Hkv) with a plan: KV heads placeable, Hq a common multiple of Hkv and world."""
    hkv, world = draw(valid_pair)
    return world, math.lcm(hkv, world) * draw(st.integers(1, 3)), hkv


@SETTINGS
@given(head_plans())
def test_head_plan_every_query_head_finds_its_kv_head(case):
    world, hq, hkv = case
    assert head_plan_error(world, hq, hkv) is None
    plan = HeadPlan(world, hq, hkv)
    q, kv = plan.q, plan.kv
    assert plan.placements() == (q, kv, kv)
    assert (plan.local_q_heads, plan.local_kv_heads) == (q.local, kv.local)
    assert plan.channels == q.local + 2 * kv.local
    assert plan.kv_replicas == kv.replicas and plan.kv_split == kv.split
    assert q.split  # query heads are always split
    group = hq // hkv
    for rank in range(world):
        assert plan.q_head_start(rank) == q.source_head(rank)
        assert plan.kv_head_start(rank) == kv.source_head(rank)
        my_kv = {kv.source_head(rank, l) for l in range(kv.local)}
        for l in range(q.local):
            qh = q.source_head(rank, l)
            assert qh // group in my_kv, (rank, qh)  # GQA: query head qh reads KV head qh // group


@pytest.mark.parametrize("world,hq,hkv,message", [
    (2, 4, 3, "must be a multiple of key/value heads"),
    (3, 4, 2, "must be divisible by the sequence-parallel size"),
    (4, 12, 3, "key/value heads \\(3\\) must either be divisible"),
    (3, 6, 2, "key/value heads \\(2\\) must either be divisible"),
])
def test_head_plan_errors(world, hq, hkv, message):
    assert head_plan_error(world, hq, hkv)
    with pytest.raises(ValueError, match=message):
        HeadPlan(world, hq, hkv)


@SETTINGS
@given(valid_pair, st.data())
def test_sent_heads_are_what_the_slice_covers(pair, data):
    heads, world = pair
    p = place_heads(heads, world)
    offset = data.draw(st.integers(0, p.local - 1))
    count = data.draw(st.integers(0, p.local - offset))
    sent = p.sent_heads(offset, count)
    covered = []  # direct definition: local heads [offset, offset + count) of every rank, in rank order
    for rank in range(world):
        for i in range(count):
            h = p.source_head(rank, offset + i)
            if h not in covered:
                covered.append(h)
    assert sent == covered
    # slices that partition [0, local) send every head exactly once
    cut = data.draw(st.integers(0, p.local))
    assert sorted(p.sent_heads(0, cut) + p.sent_heads(cut, p.local - cut)) == list(range(heads))
