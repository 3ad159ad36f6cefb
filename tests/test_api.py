"""The public API (ulysses_kernels.api): `ulysses_attention` on the reference and Triton
paths over gloo process groups of 1 to 4 ranks against float64 single-process attention,
the exchanges on their own (bitwise round trips), sharding along the sequence, and the
single-process checks of `flash_attention` and friends."""

import pytest
import torch
from helpers import SPAWN_TIMEOUT, make_qkv, needs_interpreter, reference_with_grads, rel_err, seq_lens, shard

import ulysses_kernels as uk
from ulysses_kernels.launch import spawn

# world -> (query heads, kv head counts to try): MHA, GQA split, GQA replicate, MQA.
HEADS = {1: (4, [4, 2, 1]), 2: (4, [4, 2, 1]), 3: (6, [6, 3, 1]), 4: (8, [8, 4, 2, 1])}


# ------------------------------------------------------ run on every rank (spawned)

def attention_cases(rank, world, cases):
    """Run ulysses_attention fwd+bwd on this rank's shard of each case's global inputs."""
    results = []
    for case in cases:
        q, k, v, do = make_qkv(case["B"], case["S"], case["Hq"], case["Hkv"], case["D"], dtype=case["dtype"],
                               seed=case["seed"])
        ql, kl, vl = (shard(t, world, rank).requires_grad_(True) for t in (q, k, v))
        out = uk.ulysses_attention(ql, kl, vl, causal=case["causal"], cu_seqlens=case.get("cu_seqlens"),
                                   seq_lens=case.get("seq_lens"), backend=case.get("backend"))
        out.backward(shard(do, world, rank))
        results.append({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad})
    return results


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


# ----------------------------------------------------- attention over process groups

def _attention_cases(world):
    Hq, kv_options = HEADS[world]
    cases = []
    for Hkv in kv_options:
        for causal in (False, True):
            cases.append(dict(B=2, S=37, Hq=Hq, Hkv=Hkv, D=8, causal=causal, dtype=torch.float64))
    # packed documents, including an empty and a length-1 document
    cu = torch.tensor([0, 1, 10, 10, 25, 37], dtype=torch.int32)
    for causal in (False, True):
        cases.append(dict(B=1, S=37, Hq=Hq, Hkv=kv_options[-1], D=8, causal=causal, dtype=torch.float64,
                          cu_seqlens=cu))
    # float32, the seq_lens fast path, and fewer tokens than ranks (a rank with 0 tokens)
    cases.append(dict(B=2, S=37, Hq=Hq, Hkv=kv_options[1], D=16, causal=True, dtype=torch.float32))
    cases.append(dict(B=1, S=29, Hq=Hq, Hkv=kv_options[0], D=8, causal=True, dtype=torch.float64,
                      seq_lens=seq_lens(29, world)))
    cases.append(dict(B=1, S=max(1, world - 1), Hq=Hq, Hkv=kv_options[-1], D=8, causal=False,
                      dtype=torch.float64))
    for i, c in enumerate(cases):
        c["seed"] = 100 * world + i
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_attention_matches_single_process(world):
    cases = _attention_cases(world)
    per_rank = spawn(attention_cases, world, args=(cases,), timeout=SPAWN_TIMEOUT)
    _check_against_reference(cases, per_rank, world)


def _check_against_reference(cases, per_rank, world):
    failures = []
    for i, case in enumerate(cases):
        q, k, v, do = make_qkv(case["B"], case["S"], case["Hq"], case["Hkv"], case["D"], dtype=case["dtype"],
                               seed=case["seed"])
        ref = reference_with_grads(q, k, v, do, case["causal"], case.get("cu_seqlens"))
        tol = 1e-9 if case["dtype"] == torch.float64 else 1e-5
        for name, r in zip(("out", "dq", "dk", "dv"), ref):
            got = torch.cat([per_rank[p][i][name] for p in range(world)], dim=1)
            assert got.dtype == case["dtype"]
            err = rel_err(got, r)
            if not err < tol:
                failures.append(f"case {i} {case} {name}: rel err {err:.3e} >= {tol}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_triton_path_matches_single_process(world):
    """backend="triton": the kernels (Triton interpreter on CPU) read the all-to-all receive
    buffer through two-level sequence addressing, B > 1 and uneven S included."""
    needs_interpreter()
    Hq, kv_options = HEADS[world]
    cu = torch.tensor([0, 1, 10, 10, 25, 37], dtype=torch.int32)
    cases = [dict(B=2, S=37, Hq=Hq, Hkv=kv_options[-1], D=16, causal=True, dtype=torch.float32),
             dict(B=1, S=37, Hq=Hq, Hkv=kv_options[1], D=16, causal=False, dtype=torch.float32, cu_seqlens=cu)]
    for i, c in enumerate(cases):
        c.update(seed=500 + 10 * world + i, backend="triton")
    per_rank = spawn(attention_cases, world, args=(cases,), timeout=SPAWN_TIMEOUT)
    _check_against_reference(cases, per_rank, world)


# -------------------------------------------------------------- the exchanges

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


# ------------------------------------------------------------ single process

def test_ulysses_attention_single_process_equals_flash_attention():
    q, k, v, _ = make_qkv(2, 11, 4, 2, 8, seed=2)
    assert torch.equal(uk.ulysses_attention(q, k, v, causal=True), uk.flash_attention(q, k, v, causal=True))


@pytest.mark.parametrize("args,message", [
    (dict(q=(1, 4, 3, 8), k=(1, 4, 2, 8)), "must be a multiple of key/value heads"),
    (dict(q=(1, 4, 2, 8), k=(1, 4, 2, 4)), "disagree on batch or head dim"),
    (dict(q=(2, 4, 2, 8), k=(1, 4, 2, 8)), "disagree on batch or head dim"),
    (dict(q=(4, 2, 8), k=(1, 4, 2, 8)), "q must be a 4-D tensor"),
])
def test_flash_attention_shape_errors(args, message):
    q = torch.randn(*args["q"])
    k = torch.randn(*args["k"])
    with pytest.raises(ValueError, match=message):
        uk.flash_attention(q, k, k.clone())


def test_flash_attention_rejects_bad_cu_seqlens_and_dtypes():
    q, k, v, _ = make_qkv(1, 8, 2, 2, 8, seed=5)
    with pytest.raises(ValueError, match="end at the global sequence length 8"):
        uk.flash_attention(q, k, v, cu_seqlens=[0, 4, 7])
    with pytest.raises(ValueError, match="non-decreasing"):
        uk.flash_attention(q, k, v, cu_seqlens=[0, 5, 3, 8])
    with pytest.raises(ValueError, match="dtype int64"):
        uk.flash_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="dtypes differ"):
        uk.flash_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="needs batch size 1"):
        uk.flash_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                           cu_seqlens=[0, 8])


def test_module_wraps_the_call():
    q, k, v, _ = make_qkv(1, 10, 4, 2, 8, seed=7)
    layer = uk.UlyssesAttention(causal=True)
    assert torch.equal(layer(q, k, v), uk.flash_attention(q, k, v, causal=True))
    assert "causal=True" in repr(layer)


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
