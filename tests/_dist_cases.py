"""Functions run on every rank by the multi-process tests (via ulysses_kernels.launch.spawn).

Each runs a whole batch of cases in one process group (spawning costs seconds) and
returns plain tensors; the parent test compares them against float64 references.
"""

import torch
import torch.distributed as dist

import ulysses_kernels as uk
from _helpers import make_qkv, reference_with_grads, rel_err


def attention_cases(rank, world, cases):
    """Run ulysses_attention fwd+bwd on this rank's shard of each case's global inputs."""
    results = []
    for case in cases:
        q, k, v, do = make_qkv(case["seed"], case["B"], case["S"], case["Hq"], case["Hkv"], case["D"],
                               case["dtype"])
        shard = lambda t: torch.tensor_split(t, world, dim=1)[rank].clone()  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_(True) for t in (q, k, v))
        out = uk.ulysses_attention(ql, kl, vl, causal=case["causal"], cu_seqlens=case.get("cu_seqlens"),
                                   seq_lens=case.get("seq_lens"), backend=case.get("backend"))
        out.backward(shard(do))
        results.append({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad})
    return results


def _expect_error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _recovery_check(rank, world, group=None):
    """A valid call after an error: the group must still work and be exact."""
    q, k, v, do = make_qkv(123, 1, 4 * world + 1, 2 * world, world, 8)
    shard = lambda t: torch.tensor_split(t, world, dim=1)[rank]  # noqa: E731
    out = uk.ulysses_attention(shard(q), shard(k), shard(v), causal=True, group=group)
    ref, *_ = reference_with_grads(q, k, v, do, True)
    return rel_err(out, shard(ref))


def error_cases(rank, world, scenarios):
    """For each named scenario, build this rank's (bad) inputs, call, record the error."""
    report = {}
    for name in scenarios:
        call = _SCENARIOS[name](rank, world)
        report[name] = {"error": _expect_error(call), "recovery": _recovery_check(rank, world)}
    return report


def _inputs(rank, world, B=1, S_local=None, Hq=None, Hkv=None, D=8, dtype=torch.float64, S=None):
    Hq = Hq if Hq is not None else 2 * world
    Hkv = Hkv if Hkv is not None else world
    S = S if S is not None else 4 * world + 1
    n = S_local if S_local is not None else len(torch.tensor_split(torch.empty(S), world)[rank])
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, n, Hq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, n, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, k.clone()


def _bad_q_heads(rank, world):
    q, k, v = _inputs(rank, world, Hq=2 * world + 1, Hkv=1)
    return lambda: uk.ulysses_attention(q, k, v)


def _bad_kv_heads(rank, world):
    # world 3: 6 query heads, 2 kv heads (2 does not divide 3 and 3 does not divide 2)
    # world 4: 12 query heads, 3 kv heads.
    Hkv = {2: 3, 3: 2, 4: 3}[world]
    q, k, v = _inputs(rank, world, Hq=Hkv * world, Hkv=Hkv)
    return lambda: uk.ulysses_attention(q, k, v)


def _head_dim_mismatch_one_rank(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 1:
        k = torch.randn(*k.shape[:3], 16, dtype=k.dtype)
    return lambda: uk.ulysses_attention(q, k, v)


def _dtype_mismatch_between_ranks(rank, world):
    q, k, v = _inputs(rank, world, dtype=torch.float32 if rank == 0 else torch.float64)
    return lambda: uk.ulysses_attention(q, k, v)


def _dtype_mismatch_qv(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == world - 1:
        v = v.float()
    return lambda: uk.ulysses_attention(q, k, v)


def _device_mismatch(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 1:
        v = v.to("meta")
    return lambda: uk.ulysses_attention(q, k, v)


def _heads_differ_between_ranks(rank, world):
    q, k, v = _inputs(rank, world, Hq=2 * world if rank else 4 * world)
    return lambda: uk.ulysses_attention(q, k, v)


def _batch_differs(rank, world):
    q, k, v = _inputs(rank, world, B=2 if rank == 0 else 1)
    return lambda: uk.ulysses_attention(q, k, v)


def _lengths_not_tensor_split(rank, world):
    # tensor_split of 4*world gives 4 each; rank 0 has 6 and rank 1 has 2.
    n = {0: 6, 1: 2}.get(rank, 4)
    q, k, v = _inputs(rank, world, S_local=n)
    return lambda: uk.ulysses_attention(q, k, v)


def _not_4d(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 0:
        q = q[0]
    return lambda: uk.ulysses_attention(q, k, v)


def _cu_seqlens_short(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=torch.tensor([0, 3, S - 1], dtype=torch.int32))


def _cu_seqlens_decreasing(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 2, S], dtype=torch.int32))


def _cu_seqlens_differ(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    cu = torch.tensor([0, 3 + rank, S], dtype=torch.int32)
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=cu)


def _cu_seqlens_float(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=torch.tensor([0.0, float(S)]))


def _causal_differs(rank, world):
    q, k, v = _inputs(rank, world)
    return lambda: uk.ulysses_attention(q, k, v, causal=rank == 0)


def _bad_backend_one_rank(rank, world):
    q, k, v = _inputs(rank, world)
    return lambda: uk.ulysses_attention(q, k, v, backend="bogus" if rank == 1 else None)


def _forced_fused_on_cpu(rank, world):
    q, k, v = _inputs(rank, world)
    return lambda: uk.ulysses_attention(q, k, v, backend="fused")


def _different_ops(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 0:
        return lambda: uk.seq_to_heads(q)
    return lambda: uk.ulysses_attention(q, k, v)


def _seq_lens_wrong_size(rank, world):
    q, k, v = _inputs(rank, world)
    lens = [q.shape[1]] * (world + 1)
    return lambda: uk.ulysses_attention(q, k, v, seq_lens=lens)


def _cu_seqlens_unreadable(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    cu = ["zero", S] if rank == world - 1 else [0, S]
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=cu)


def _q_not_a_tensor(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 0:
        q = q.numpy()
    return lambda: uk.ulysses_attention(q, k, v)


def _heads_to_seq_lengths_differ(rank, world):
    # Each rank holds a head shard of the whole sequence: rank 0 believes it is one longer.
    x = torch.randn(1, 4 * world + 1 + (rank == 0), 2, 8, dtype=torch.float64)
    return lambda: uk.heads_to_seq(x)


def _heads_to_seq_heads_differ(rank, world):
    x = torch.randn(2, 4 * world + 1, 2 + (rank == world - 1), 8, dtype=torch.float64)
    return lambda: uk.heads_to_seq(x)


def _self_attention_bad_hidden(rank, world):
    layer = uk.UlyssesSelfAttention(16, 2 * world, world, 8, dtype=torch.float64)
    x = torch.randn(1, 5, 16 + (rank == world - 1), dtype=torch.float64)
    return lambda: layer(x)


_SCENARIOS = {
    "self_attention_bad_hidden": _self_attention_bad_hidden,
    "heads_to_seq_lengths_differ": _heads_to_seq_lengths_differ,
    "heads_to_seq_heads_differ": _heads_to_seq_heads_differ,
    "cu_seqlens_unreadable": _cu_seqlens_unreadable,
    "q_not_a_tensor": _q_not_a_tensor,
    "q_heads_not_divisible": _bad_q_heads,
    "kv_heads_incompatible": _bad_kv_heads,
    "head_dim_mismatch_one_rank": _head_dim_mismatch_one_rank,
    "dtype_differs_between_ranks": _dtype_mismatch_between_ranks,
    "dtype_differs_q_v": _dtype_mismatch_qv,
    "device_differs": _device_mismatch,
    "heads_differ_between_ranks": _heads_differ_between_ranks,
    "batch_differs": _batch_differs,
    "lengths_not_tensor_split": _lengths_not_tensor_split,
    "not_4d": _not_4d,
    "cu_seqlens_does_not_cover": _cu_seqlens_short,
    "cu_seqlens_decreasing": _cu_seqlens_decreasing,
    "cu_seqlens_differ_between_ranks": _cu_seqlens_differ,
    "cu_seqlens_float": _cu_seqlens_float,
    "causal_differs": _causal_differs,
    "bad_backend_one_rank": _bad_backend_one_rank,
    "forced_fused_on_cpu": _forced_fused_on_cpu,
    "different_ops": _different_ops,
    "seq_lens_wrong_size": _seq_lens_wrong_size,
}


def non_member_group(rank, world):
    """Ranks outside a subgroup get a ValueError; members use it normally."""
    sub = dist.new_group([0, 1])
    others = dist.new_group([2, 3])
    if rank in (0, 1):
        return {"error": None, "recovery": _recovery_check(rank, 2, group=sub)}
    q, k, v = _inputs(rank, world)
    return {"error": _expect_error(lambda: uk.ulysses_attention(q, k, v, group=sub)),
            "recovery": _recovery_check(rank - 2, 2, group=others)}


def roundtrip_cases(rank, world, B, S, H, D):
    """seq_to_heads / heads_to_seq on hash-encoded float64 values: every element's value
    encodes (batch, position, head, dim), so any misplacement is visible exactly."""
    b, s, h, d = torch.meshgrid(torch.arange(B), torch.arange(S), torch.arange(H), torch.arange(D),
                                indexing="ij")
    code = (((b * S + s) * H + h) * D + d).double()
    local = torch.tensor_split(code, world, dim=1)[rank].contiguous()
    heads = uk.seq_to_heads(local)
    back = uk.heads_to_seq(heads)
    lens = [t.shape[1] for t in torch.tensor_split(code, world, dim=1)]
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


def dp_sp_cases(rank, world, sp_size, S):
    groups = uk.init_sequence_parallel(sp_size)
    seed = 1000 + groups.dp_rank  # each SP group works on its own batch
    q, k, v, do = make_qkv(seed, 1, S, 4, 2, 8)
    shard = lambda t: torch.tensor_split(t, sp_size, dim=1)[groups.sp_rank].clone()  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_(True) for t in (q, k, v))
    out = uk.ulysses_attention(ql, kl, vl, group=groups.sp_group, causal=True)
    out.backward(shard(do))
    ref, dq, dk, dv = reference_with_grads(q, k, v, do, True)
    err = max(rel_err(out, shard(ref)), rel_err(ql.grad, shard(dq)), rel_err(kl.grad, shard(dk)),
              rel_err(vl.grad, shard(dv)))
    return {"sp_rank": groups.sp_rank, "dp_rank": groups.dp_rank,
            "sp_ranks": dist.get_process_group_ranks(groups.sp_group),
            "dp_ranks": dist.get_process_group_ranks(groups.dp_group), "err": err}


def self_attention_cases(rank, world, cases):
    """UlyssesSelfAttention on this rank's shard: output, dx and the weight gradients of the
    local tokens (the parent sums them over ranks)."""
    results = []
    for case in cases:
        torch.manual_seed(case["seed"])  # the same weights and inputs on every rank
        layer = uk.UlyssesSelfAttention(case["hidden"], case["Hq"], case["Hkv"], case["D"], causal=case["causal"],
                                        bias=True, backend=case.get("backend"), dtype=case.get("dtype", torch.float64))
        x = torch.randn(case["B"], case["S"], case["hidden"], dtype=case.get("dtype", torch.float64))
        dy = torch.randn_like(x)
        shard = lambda t: torch.tensor_split(t, world, dim=1)[rank].clone()  # noqa: E731
        xl = shard(x).requires_grad_(True)
        y = layer(xl)
        y.backward(shard(dy))
        results.append({"y": y.detach(), "dx": xl.grad, "grads": [p.grad for p in layer.parameters()]})
    return results
