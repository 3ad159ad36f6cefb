"""The sequence <-> head exchanges (ulysses_kernels/exchange/) behind the public
`seq_to_heads` / `heads_to_seq` / `qkv_seq_to_heads` and `shard_sequence` /
`gather_sequence`: the packing of the layout's placements against direct indexing,
bitwise round trips over gloo groups of 1 to 4 ranks, sharding and gathering with their
gradients, and the single-process checks."""

import pytest
import torch
from helpers import SPAWN_TIMEOUT, make_qkv, seq_lens
from hypothesis import given, settings
from hypothesis import strategies as st

import ulysses_kernels as uk
from ulysses_kernels.exchange.buffers import pack_for_heads, placements_for, unpack_from_heads
from ulysses_kernels.launch import spawn
from ulysses_kernels.layout import place_heads

SETTINGS = settings(max_examples=80, deadline=None)


def _placeable(world):
    """Head counts the layout places over `world` ranks: multiples (split) and divisors (replicated)."""
    return sorted({world * k for k in range(1, 4)} | {h for h in range(1, world + 1) if world % h == 0})


# ------------------------------------------------ packing of the layout's placements

@SETTINGS
@given(st.integers(1, 8), st.data(), st.integers(1, 2), st.integers(0, 3), st.integers(1, 3))
def test_pack_and_unpack_match_direct_indexing(world, data, B, S, D):
    choices = _placeable(world)
    heads = data.draw(st.lists(st.sampled_from(choices), min_size=1, max_size=3))
    placements = placements_for(heads, world)
    assert placements == [place_heads(h, world) for h in heads]
    g = torch.Generator().manual_seed(sum(heads) * 31 + world)
    tensors = [torch.randint(-50, 50, (B, S, h, D), generator=g).double() for h in heads]
    send = pack_for_heads(tensors, placements, world)
    channels = sum(p.local for p in placements)
    assert send.shape == (world, B, S, channels, D)
    expected = torch.empty_like(send)
    c = 0
    for t, p in zip(tensors, placements):
        for j in range(world):
            for l in range(p.local):
                expected[j, :, :, c + l] = t[:, :, p.source_head(j, l)]
        c += p.local
    assert torch.equal(send, expected)
    # unpack: every head is the sum of what each rank holds of it
    recv = torch.randint(-50, 50, send.shape, generator=g).double()
    outs = unpack_from_heads(recv, placements)
    c = 0
    for t, out, p in zip(tensors, outs, placements):
        want = torch.zeros_like(t)
        for j in range(world):
            for l in range(p.local):
                want[:, :, p.source_head(j, l)] += recv[j, :, :, c + l]
        assert torch.equal(out, want)
        c += p.local
    # round trip: a replicated head comes back once per replica
    back = unpack_from_heads(send, placements)
    for t, b, p in zip(tensors, back, placements):
        assert torch.equal(b, t * p.replicas)


@SETTINGS
@given(st.integers(1, 8), st.data(), st.integers(1, 2), st.integers(0, 3))
def test_pack_and_unpack_of_several_head_dims_match_direct_indexing(world, data, B, S):
    """Tensors of different head dims (a token mixer's x, B, C, dt): each destination's
    heads flattened into its channels, tensor after tensor (`ulysses_head_parallel`)."""
    choices = _placeable(world)
    heads = data.draw(st.lists(st.sampled_from(choices), min_size=2, max_size=4))
    dims = data.draw(st.lists(st.integers(1, 4), min_size=len(heads), max_size=len(heads)).filter(
        lambda d: len(set(d)) > 1))
    placements = placements_for(heads, world)
    g = torch.Generator().manual_seed(sum(heads) * 31 + world + sum(dims))
    tensors = [torch.randint(-50, 50, (B, S, h, d), generator=g).double() for h, d in zip(heads, dims)]
    send = pack_for_heads(tensors, placements, world)
    width = sum(p.local * d for p, d in zip(placements, dims))
    assert send.shape == (world, B, S, width, 1)
    expected = torch.empty(world, B, S, width, dtype=torch.float64)
    c = 0
    for t, p, d in zip(tensors, placements, dims):
        for j in range(world):
            for l in range(p.local):
                expected[j, :, :, c + l * d:c + (l + 1) * d] = t[:, :, p.source_head(j, l)]
        c += p.local * d
    assert torch.equal(send[..., 0], expected)
    back = unpack_from_heads(send, placements, dims)
    for t, b, p in zip(tensors, back, placements):
        assert torch.equal(b, t * p.replicas)


# ------------------------------------------------------ run on every rank (spawned)

def roundtrip_cases(rank, world, B, S, H, D):
    """seq_to_heads / heads_to_seq on hash-encoded float64 values: every element's value
    encodes (batch, position, head, dim), so any misplacement is visible exactly."""
    b, s, h, d = torch.meshgrid(torch.arange(B), torch.arange(S), torch.arange(H), torch.arange(D),
                                indexing="ij")
    code = (((b * S + s) * H + h) * D + d).double()
    local = torch.tensor_split(code, world, dim=1)[rank].contiguous()
    heads = uk.seq_to_heads(local)
    back = uk.heads_to_seq(heads)
    lens = seq_lens(S, world)
    back_lens = uk.heads_to_seq(heads, seq_lens=lens)  # the unchecked fast path
    # bf16 round trip on random values: bitwise identity of the pair of exchanges.
    g = torch.Generator().manual_seed(rank)
    rnd = torch.randn(local.shape, generator=g).to(torch.bfloat16)
    rnd_back = uk.heads_to_seq(uk.seq_to_heads(rnd))
    # Fused q/k/v exchange with GQA replication (1 kv head) and split (world kv heads).
    kv_rep = local[:, :, :1] + 0.5
    kv_split = local[:, :, :world] + 0.25
    q_h, k_rep, v_split = uk.qkv_seq_to_heads(local, kv_rep, kv_rep)
    _, k_split, _ = uk.qkv_seq_to_heads(local, kv_split, kv_split)
    return {"heads": heads, "back_equal": bool(torch.equal(back, local) and torch.equal(back_lens, local)),
            "q_h": q_h, "k_rep": k_rep,
            "k_split": k_split, "bf16_back_equal": bool(torch.equal(rnd_back.view(torch.int16), rnd.view(torch.int16)))}


def shard_gather_cases(rank, world, S):
    g = torch.Generator().manual_seed(7)
    full = torch.randn(2, S, 3, generator=g, dtype=torch.float64, requires_grad=True)
    local = uk.shard_sequence(full, dim=1)
    # loss on the local shard only: the gradient of `full` (all-gathered) is dL/dfull.
    weights = torch.arange(1, S + 1, dtype=torch.float64).view(1, S, 1)
    w_local = torch.tensor_split(weights, world, dim=1)[rank]
    (local * w_local).sum().backward()
    shard_grad = full.grad.clone()
    # gather then loss on one rank's copy only: the backward sums over ranks, so the local
    # gradient is exactly weights restricted to this shard.
    x = torch.tensor_split(full.detach(), world, dim=1)[rank].clone().requires_grad_(True)
    gathered = uk.gather_sequence(x, dim=1)
    loss = (gathered * weights).sum() if rank == 0 else gathered.sum() * 0
    loss.backward()
    return {"local": local.detach(), "shard_grad": shard_grad, "gathered": gathered.detach(),
            "gather_grad": x.grad}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_seq_heads_round_trip_is_bitwise(world):
    B, S, H, D = 2, 4 * world + 3, 2 * world, 4
    reports = spawn(roundtrip_cases, world, args=(B, S, H, D), timeout=SPAWN_TIMEOUT)
    b, s, h, d = torch.meshgrid(torch.arange(B), torch.arange(S), torch.arange(H), torch.arange(D), indexing="ij")
    code = (((b * S + s) * H + h) * D + d).double()
    hl = H // world
    for rank, rep in enumerate(reports):
        assert torch.equal(rep["heads"], code[:, :, rank * hl:(rank + 1) * hl]), f"rank {rank}"
        assert rep["back_equal"] and rep["bf16_back_equal"], f"rank {rank}"
        assert torch.equal(rep["q_h"], code[:, :, rank * hl:(rank + 1) * hl])
        assert torch.equal(rep["k_rep"], code[:, :, :1] + 0.5)  # one kv head replicated everywhere
        assert torch.equal(rep["k_split"], code[:, :, rank:rank + 1] + 0.25)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_gather_sequence(world):
    S = 3 * world + 2
    reports = spawn(shard_gather_cases, world, args=(S,), timeout=SPAWN_TIMEOUT)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(2, S, 3, generator=g, dtype=torch.float64)
    weights = torch.arange(1, S + 1, dtype=torch.float64).view(1, S, 1).expand(2, S, 3)
    for rank, rep in enumerate(reports):
        assert torch.equal(rep["local"], torch.tensor_split(full, world, dim=1)[rank])
        assert torch.equal(rep["shard_grad"], weights)
        assert torch.equal(rep["gathered"], full)
        assert torch.equal(rep["gather_grad"], torch.tensor_split(weights, world, dim=1)[rank])


def test_heads_to_seq_single_process_checks():
    x = torch.randn(2, 5, 3, 4)
    assert torch.equal(uk.heads_to_seq(x), x) and torch.equal(uk.heads_to_seq(x, seq_lens=[5]), x)
    with pytest.raises(ValueError, match="summing to the sequence length 5"):
        uk.heads_to_seq(x, seq_lens=[4])
    with pytest.raises(ValueError, match="must be a 4-D tensor"):
        uk.heads_to_seq(x[0])


def test_exchanges_single_process():
    """A group of one: every exchange is the identity, with the same checks."""
    q, k, v, _ = make_qkv(2, 5, 4, 2, 8, seed=8)
    assert torch.equal(uk.seq_to_heads(q), q) and torch.equal(uk.seq_to_heads(q, seq_lens=[5]), q)
    for got, want in zip(uk.qkv_seq_to_heads(q, k, v), (q, k, v)):
        assert torch.equal(got, want)
    for got, want in zip(uk.qkv_seq_to_heads(q, k, v, seq_lens=[5]), (q, k, v)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="seq_lens\\[0\\] = 4 but this rank's local length is 5"):
        uk.seq_to_heads(q, seq_lens=[4])
    with pytest.raises(ValueError, match="seq_lens has 2 entries but the group has 1 ranks"):
        uk.qkv_seq_to_heads(q, k, v, seq_lens=[3, 2])
    with pytest.raises(ValueError, match="query heads \\(4\\) must be a multiple of key/value heads \\(3\\)"):
        uk.qkv_seq_to_heads(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1), seq_lens=[5])
    assert torch.equal(uk.shard_sequence(q), q) and torch.equal(uk.gather_sequence(q), q)
    with pytest.raises(ValueError, match="do not match the group size 1"):
        uk.gather_sequence(q, seq_lens=[4])
