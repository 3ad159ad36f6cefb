"""UlyssesSelfAttention (ulysses_kernels.modules): the block over a sharded sequence equals
the same block run on one process over the whole sequence. The fused path's overlapped
projections are tested in tests/fused/test_fused_layer.py."""

import pytest
import torch
from helpers import SPAWN_TIMEOUT, brute_force_attention, rel_err, rope_tables, shard

import ulysses_kernels as uk
from ulysses_kernels import env
from ulysses_kernels.launch import spawn
from ulysses_kernels.rotary import apply_rotary

# ------------------------------------------------------ run on every rank (spawned)

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
        xl = shard(x, world, rank).requires_grad_(True)
        y = layer(xl)
        y.backward(shard(dy, world, rank))
        results.append({"y": y.detach(), "dx": xl.grad, "grads": [p.grad for p in layer.parameters()]})
    return results


# ------------------------------------------------------------------------- tests

@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_self_attention_module_matches_single_process(world):
    """UlyssesSelfAttention (reference path, and the Triton path in the interpreter at
    world 2) equals the same module run on one process over the whole sequence."""
    Hq = 2 * world
    cases = [dict(seed=11, B=2, S=4 * world + 3, hidden=24, Hq=Hq, Hkv=world, D=8, causal=True),
             dict(seed=12, B=1, S=4 * world + 1, hidden=24, Hq=Hq, Hkv=1, D=8, causal=False)]
    if world == 2 and env.interpreting():  # the Triton path on CPU needs the interpreter
        cases.append(dict(seed=13, B=1, S=9, hidden=32, Hq=4, Hkv=2, D=16, causal=True, backend="triton",
                          dtype=torch.float32))
    reports = spawn(self_attention_cases, world, args=(cases,), timeout=SPAWN_TIMEOUT)
    single = self_attention_cases(0, 1, [dict(c, backend="reference") for c in cases])
    for i, (case, ref) in enumerate(zip(cases, single)):
        tol = 1e-9 if case.get("backend") is None else 1e-5
        y = torch.cat([r[i]["y"] for r in reports], dim=1)
        dx = torch.cat([r[i]["dx"] for r in reports], dim=1)
        assert rel_err(y, ref["y"]) < tol and rel_err(dx, ref["dx"]) < tol, case
        for j, g in enumerate(ref["grads"]):
            assert rel_err(sum(r[i]["grads"][j] for r in reports), g) < tol, (case, j)


def test_single_process_block_is_the_plain_composition():
    """Linear -> (rotary) -> reference attention -> Linear, computed by hand."""
    torch.manual_seed(3)
    B, S, hidden, Hq, Hkv, D = 2, 7, 24, 4, 2, 8
    layer = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=True, bias=True, dtype=torch.float64)
    x = torch.randn(B, S, hidden, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_tables(B, S, D))
    qkv = layer.qkv_proj(x).view(B, S, Hq + 2 * Hkv, D)
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    q, k = (apply_rotary(t, cos, sin) for t in (q, k))
    out, _ = uk.reference_attention(q, k, v, causal=True)
    want = layer.o_proj(out.reshape(B, S, Hq * D))
    assert rel_err(layer(x, position_embeddings=(cos, sin)), want) < 1e-12
    assert rel_err(layer(x, position_embeddings=(cos[:1], sin[:1])), want) < 1e-12  # [1, S, D] broadcasts
    assert "heads=4, kv_heads=2, head_dim=8" in repr(layer)


def test_modules_pass_the_variants():
    """UlyssesSelfAttention(window_size, softcap, sinks=True) is the composition with the
    float64 brute force of the variants (its `sinks` parameter differentiable);
    UlyssesAttention passes the same and its per-call sinks."""
    torch.manual_seed(4)
    B, S, hidden, Hq, Hkv, D = 2, 11, 24, 4, 2, 8
    variants = dict(window_size=(3, -1), softcap=4.0)
    layer = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=True, sinks=True, dtype=torch.float64, **variants)
    with torch.no_grad():
        layer.sinks.copy_(torch.randn(Hq, dtype=torch.float64))  # the zeros it starts with would hide a dropped sink
    x = torch.randn(B, S, hidden, dtype=torch.float64)
    y = layer(x)
    y.backward(torch.ones_like(y))
    qkv = layer.qkv_proj(x).view(B, S, Hq + 2 * Hkv, D).detach()
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    d_out = torch.ones(B, S, hidden, dtype=torch.float64) @ layer.o_proj.weight.detach()
    out, *_, dsinks = brute_force_attention(q, k, v, d_out.view(B, S, Hq, D), causal=True,
                                            sinks=layer.sinks.detach(), **variants)
    assert rel_err(y, layer.o_proj(out.reshape(B, S, Hq * D))) < 1e-12
    assert rel_err(layer.sinks.grad, dsinks) < 1e-12
    module = uk.UlyssesAttention(causal=True, **variants)
    assert "window_size=(3, -1), softcap=4.0" in repr(module)
    got = module(q, k, v, sinks=layer.sinks.detach())
    assert rel_err(got, out) < 1e-12


def test_single_process_errors():
    with pytest.raises(ValueError, match="num_heads \\(4\\) a positive multiple of num_kv_heads \\(3\\)"):
        uk.UlyssesSelfAttention(24, 4, 3, 8)
    layer = uk.UlyssesSelfAttention(16, 2, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="x must be \\[batch, seq_local, 16\\], got \\(1, 5, 17\\)"):
        layer(torch.randn(1, 5, 17, dtype=torch.float64))
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    cos, sin = rope_tables(1, 5, 8)
    with pytest.raises(ValueError, match="position_embeddings cos must be \\[1 or 1, 5, 8\\], got \\(1, 4, 8\\)"):
        layer(x, position_embeddings=(cos[:, :4], sin[:, :4]))
    with pytest.raises(ValueError, match="position_embeddings must be a pair"):
        layer(x, position_embeddings=cos)
    with pytest.raises(ValueError, match="left side must be >= 0 or -1"):
        uk.UlyssesSelfAttention(16, 2, 1, 8, window_size=(-4, 0))
    with pytest.raises(ValueError, match="softcap must be > 0"):
        uk.UlyssesAttention(softcap=-1.0)
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    call = uk.api.prepare_attention(q, q, q)
    with pytest.raises(ValueError, match="pass the sinks the call was prepared with"):
        uk.api.run_attention(call, q, q, q, sinks=torch.zeros(2, dtype=torch.float64))
