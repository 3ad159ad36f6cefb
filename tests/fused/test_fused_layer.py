"""The fused self-attention layer (ulysses_kernels.fused.layer): UlyssesSelfAttention's fused
path, whose QKV and output projection GEMMs run chunk by chunk inside the exchange
pipeline, equals the plain composition (Linear -> rotary -> attention -> Linear).

On CPU with the stand-ins of `ulysses_kernels.testing` (pure-torch pack/unpack ops, the
host-memory transport over gloo) and the Triton interpreter, at world sizes 1 to 4;
marked `gpu`: the CUDA kernels with NCCL at world size 1 and the host transport for two
ranks on one GPU (see test_fused_pipeline.py).
"""

import math
import os

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, needs_extension, needs_interpreter, param_id, randn, rel_err, rope_tables, shard

import ulysses_kernels as uk
from ulysses_kernels import env, fused, testing
from ulysses_kernels.fused import engine as fused_engine
from ulysses_kernels.fused.layer import LayerHeads, _FusedSelfAttention
from ulysses_kernels.fused.pipeline import AttentionOptions, Geometry
from ulysses_kernels.launch import spawn
from ulysses_kernels.layout import HeadPlan
from ulysses_kernels.testing import HostTransport, ReferenceOps

CPU = torch.device("cpu")


def _layer_and_inputs(case):
    B, S, hidden, Hq, Hkv, D, causal, bias, rotary, _ = case
    torch.manual_seed(4321)  # the same weights and inputs on every rank
    layer = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=causal, bias=bias)
    rope = rope_tables(B, S, D) if rotary else None
    return layer, torch.randn(B, S, hidden), torch.randn(B, S, hidden), rope


def _layer_params(layer):
    return [layer.qkv_proj.weight, layer.qkv_proj.bias, layer.o_proj.weight, layer.o_proj.bias]


def _graph_has(t, name):
    """Whether the autograd graph of `t` has a node called `name`."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            return True
        todo += [n for n, _ in node.next_functions]
    return False


# ------------------------------------------------------ run on every rank (spawned)

def cpu_layer_worker(rank, world, case):
    """This rank's y, dx and weight gradients from the fused layer pipeline (stand-ins over
    gloo, Triton interpreter)."""
    chunks = case[-1]
    layer, x, dy, rope = _layer_and_inputs(case)
    B, S, hidden, Hq, Hkv, D, causal = case[:7]
    lens = [t.shape[1] for t in torch.tensor_split(x, world, dim=1)]
    xl, dyl = shard(x, world, rank), shard(dy, world, rank)
    pos = tuple(shard(t, world, rank) for t in rope) if rope is not None else None
    restore = testing.enable_fused_stand_ins()
    try:
        heads = HeadPlan(world, Hq, Hkv)
        assert len(fused.plan_chunks(heads.local_q_heads, heads.local_kv_heads, chunks)) == chunks
        xl.requires_grad_(True)
        w_qkv, b_qkv, w_o, b_o = _layer_params(layer)
        y = fused.self_attention(xl, w_qkv, b_qkv, w_o, b_o, num_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                 group=None, rank=rank, seq_lens=lens, causal=causal,
                                 softmax_scale=1 / math.sqrt(D), position_embeddings=pos, num_chunks=chunks)
        assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"
        assert fused.get_engine(None, world, rank, CPU).transport.name == "host"
        y.backward(dyl)
    finally:
        restore()
    return {"y": y.detach(), "dx": xl.grad, "grads": [p.grad if p is not None else None for p in _layer_params(layer)]}


# ------------------------------------------------------------------------- CPU tests

@pytest.mark.slow
@pytest.mark.parametrize("world,case", [
    (1, (2, 6, 24, 4, 2, 16, True, True, True, 2)),     # B > 1, GQA, two chunks, biases, rotary
    (1, (1, 5, 16, 4, 1, 16, True, False, False, 4)),   # MQA: one KV head shared by four chunks
    (1, (1, 5, 16, 2, 2, 16, False, True, True, 1)),    # one chunk at P = 1: identity head order, no gather
    (2, (2, 7, 24, 4, 2, 16, True, True, True, 2)),     # uneven S, GQA split, two chunks
    (3, (1, 8, 32, 9, 3, 16, False, True, True, 3)),    # odd world, three chunks (one query head each)
    (4, (1, 10, 32, 8, 2, 16, True, False, True, 2)),   # KV heads replicated (fewer KV heads than ranks), shared KV
])
def test_fused_layer_pipeline_cpu(world, case):
    """UlyssesSelfAttention's fused path (per-chunk projection GEMMs inside the exchange
    pipeline) equals the plain composition on one process: output, dx and every weight
    and bias gradient (summed over ranks, each rank holding its own tokens)."""
    needs_interpreter()
    reports = spawn(cpu_layer_worker, world, args=(case,), timeout=SLOW_SPAWN_TIMEOUT)
    layer, x, dy, rope = _layer_and_inputs(case)
    x.requires_grad_(True)
    y = layer(x, position_embeddings=rope)  # CPU, single process: Linear -> rotary -> reference attention -> Linear
    y.backward(dy)
    got_y = torch.cat([r["y"] for r in reports], dim=1)
    got_dx = torch.cat([r["dx"] for r in reports], dim=1)
    torch.testing.assert_close(got_y, y.detach(), rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(got_dx, x.grad, rtol=2e-4, atol=2e-5)
    for i, p in enumerate(_layer_params(layer)):
        if p is None:
            assert all(r["grads"][i] is None for r in reports)
            continue
        total = sum(r["grads"][i] for r in reports)
        torch.testing.assert_close(total, p.grad, rtol=2e-4, atol=2e-5, msg=lambda m: f"parameter {i}: {m}")


def test_self_attention_module_takes_the_fused_layer(monkeypatch):
    """The module's glue to the fused layer (validation, fused.prepare, engine, plan) on
    CPU: `backend="fused"` with the stand-ins installed."""
    needs_interpreter()
    monkeypatch.setenv(env.NUM_CHUNKS.name, "2")
    torch.manual_seed(5)
    layer = uk.UlyssesSelfAttention(32, 4, 2, 16, causal=True, bias=True)
    x = torch.randn(1, 9, 32, requires_grad=True)
    cos, sin = rope_tables(1, 9, 16)
    cos, sin = cos[:1], sin[:1]  # [1, S, D] broadcasts over the batch
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # packed documents, one of them empty
    expected = layer(x, position_embeddings=(cos, sin))  # CPU: reference path
    expected_docs = layer(x, position_embeddings=(cos, sin), cu_seqlens=cu)
    assert not torch.allclose(expected_docs, expected)  # the document boundaries matter
    with pytest.raises(ValueError, match="backend='fused' needs CUDA tensors"):
        uk.UlyssesSelfAttention(32, 4, 2, 16, backend="fused")(x)  # no stand-ins: a clear error
    layer.backend = "fused"
    with testing.fused_stand_ins():
        y = layer(x, position_embeddings=(cos, sin))
        assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"
        torch.testing.assert_close(y, expected, rtol=2e-4, atol=2e-5)
        y_docs = layer(x, position_embeddings=(cos, sin), cu_seqlens=cu)
        assert type(y_docs.grad_fn).__name__ == "_FusedSelfAttentionBackward"
        torch.testing.assert_close(y_docs, expected_docs, rtol=2e-4, atol=2e-5)
        layer.overlap_projections = False  # the plain composition on the fused attention op
        y2 = layer(x, position_embeddings=(cos, sin))
        assert type(y2.grad_fn).__name__ != "_FusedSelfAttentionBackward"
        assert _graph_has(y2, "_FusedUlyssesAttentionBackward")
        torch.testing.assert_close(y2, expected, rtol=2e-4, atol=2e-5)


def test_self_attention_module_variants_on_the_fused_path(monkeypatch):
    """A window and softcap reach the fused layer (its chunked pipeline); with sinks (a
    parameter the layer's autograd function does not return) the module takes the plain
    composition on the fused attention op. Both equal the reference path."""
    needs_interpreter()
    monkeypatch.setenv(env.NUM_CHUNKS.name, "2")
    torch.manual_seed(6)
    x = torch.randn(1, 13, 32, requires_grad=True)
    for sinks, grad_fn in ((False, "_FusedSelfAttentionBackward"), (True, None)):
        layer = uk.UlyssesSelfAttention(32, 4, 2, 16, causal=True, window_size=(4, -1), softcap=3.0, sinks=sinks)
        if sinks:
            with torch.no_grad():
                layer.sinks.normal_()
        expected = layer(x)  # CPU: reference path
        layer.backend = "fused"
        with testing.fused_stand_ins():
            y = layer(x)
        if grad_fn:
            assert type(y.grad_fn).__name__ == grad_fn
        else:
            assert _graph_has(y, "_FusedUlyssesAttentionBackward")
        torch.testing.assert_close(y, expected, rtol=2e-4, atol=2e-5)
    plain = uk.UlyssesSelfAttention(32, 4, 2, 16, causal=True)
    plain.load_state_dict({n: p for n, p in layer.state_dict().items() if n != "sinks"})
    assert not torch.allclose(plain(x), expected)  # the variants change the result


class _CountingTransport(HostTransport):
    """HostTransport that counts its exchanges."""

    name = "counting"

    def __init__(self, group, world, rank, device):
        super().__init__(group, world, rank, device)
        self.calls = 0

    def all_to_all(self, send, recv, send_counts, recv_counts):
        self.calls += 1
        super().all_to_all(send, recv, send_counts, recv_counts)


def test_self_attention_module_runs_on_a_held_engine(monkeypatch):
    """UlyssesSelfAttention(engine=): the overlapped fused layer exchanges through the
    caller's engine (its transport counts the calls), not the group's cached one, and
    equals the reference path."""
    needs_interpreter()
    monkeypatch.setattr(fused_engine, "_engines", {})
    monkeypatch.setenv(env.NUM_CHUNKS.name, "2")
    torch.manual_seed(6)
    x = torch.randn(1, 9, 32)
    with testing.fused_stand_ins():
        engine = fused.Engine(None, 1, 0, CPU, _CountingTransport)
        layer = uk.UlyssesSelfAttention(32, 4, 2, 16, causal=True, backend="fused", engine=engine)
        y = layer(x)
        assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"
        assert engine.transport.calls > 0 and fused_engine._engines == {}
    layer.backend, layer.engine = "reference", None
    torch.testing.assert_close(y, layer(x), rtol=2e-4, atol=2e-5)


def test_fused_layer_frozen_weights_and_no_grad():
    """Frozen weights get no gradient work (and None), only-o_proj training skips the
    exchanges, and a forward under torch.no_grad() saves nothing (engine buffers only)."""
    needs_interpreter()
    case = (1, 6, 24, 4, 2, 16, True, True, False, 2)
    layer, x, dy, _ = _layer_and_inputs(case)
    previous = fused.use_ops(ReferenceOps)
    try:
        engine = fused.Engine(None, 1, 0, CPU, _CountingTransport)
        plan = tuple(fused.plan_chunks(4, 2, 2))
        setup = fused.Setup(engine=engine, geometry=Geometry(batch=1, lens=(6,), rank=0, head_dim=16),
                            attention=AttentionOptions(causal=True, softmax_scale=0.25, cu_seqlens=None), plan=plan)
        params = _layer_params(layer)

        def run(x_in):
            return _FusedSelfAttention.apply(x_in, *params, None, None, setup, LayerHeads(4, 2, 16),
                                             torch.is_grad_enabled())

        with torch.no_grad():
            run(x)
        assert {"fwd_recv", "fwd_osend"} <= set(engine._buffers)  # no per-call saved copies
        assert engine.transport.calls == 2 * len(plan)  # one exchange and one back per chunk

        ref_layer, _, _, _ = _layer_and_inputs(case)
        ref_layer.softmax_scale = 0.25
        xr = x.clone().requires_grad_(True)
        ref_layer(xr).backward(dy)
        for p in params:  # frozen QKV projection: only x and the output projection train
            p.grad = None
        layer.qkv_proj.weight.requires_grad_(False)
        layer.qkv_proj.bias.requires_grad_(False)
        xf = x.clone().requires_grad_(True)
        y = run(xf)
        engine.transport.calls = 0
        y.backward(dy)
        assert engine.transport.calls == 2 * len(plan)  # dx travels back through the exchanges
        assert layer.qkv_proj.weight.grad is None and layer.qkv_proj.bias.grad is None
        torch.testing.assert_close(xf.grad, xr.grad, rtol=2e-4, atol=2e-5)
        torch.testing.assert_close(layer.o_proj.weight.grad, ref_layer.o_proj.weight.grad, rtol=2e-4, atol=2e-5)
        layer.o_proj.weight.grad = layer.o_proj.bias.grad = None
        y = run(x)  # x frozen too: only W_o, b_o train, no exchange in the backward
        engine.transport.calls = 0
        y.backward(dy)
        assert engine.transport.calls == 0
        torch.testing.assert_close(layer.o_proj.weight.grad, ref_layer.o_proj.weight.grad, rtol=2e-4, atol=2e-5)
        torch.testing.assert_close(layer.o_proj.bias.grad, ref_layer.o_proj.bias.grad, rtol=2e-4, atol=2e-5)
    finally:
        fused.use_ops(previous)


# -------------------- UlyssesSelfAttention: projections overlapped with the exchanges (GPU)

def _layer_pair(dtype, Hq, Hkv, D, hidden, seed):
    """The fused-path module and a float32 reference-path copy with the same weights."""
    torch.manual_seed(seed)
    fast = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=True, bias=True, backend="fused", device="cuda",
                                   dtype=dtype)
    ref = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=True, bias=True, backend="reference",
                                  device="cuda", dtype=torch.float32)
    ref.load_state_dict({k: v.float() for k, v in fast.state_dict().items()})
    return fast, ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=param_id)
@pytest.mark.parametrize("chunks", ["1", "4"])
def test_fused_self_attention_world1(dtype, chunks, monkeypatch):
    needs_extension(fused_ops=True)
    monkeypatch.setenv(env.NUM_CHUNKS.name, chunks)
    fast, ref = _layer_pair(dtype, 8, 2, 64, 256, seed=30)
    x = randn(2, 96, 256, dtype=dtype, seed=31, device="cuda")
    dy = randn(2, 96, 256, dtype=dtype, seed=32, device="cuda")
    rope = rope_tables(1, 96, 64, device="cuda")  # rotary tables [1, S, D]
    xf = x.clone().requires_grad_(True)
    y = fast(xf, position_embeddings=rope)
    assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"  # the overlapped layer ran
    y.backward(dy)
    xr = x.float().requires_grad_(True)
    yr = ref(xr, position_embeddings=rope)
    yr.backward(dy.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    errs = {"y": rel_err(y, yr), "dx": rel_err(xf.grad, xr.grad)}
    for (name, p), pr in zip(fast.named_parameters(), ref.parameters()):
        errs[name] = rel_err(p.grad, pr.grad)
    assert all(e < tol for e in errs.values()), errs


def gpu_layer_worker(rank, world, case):
    """One rank on GPU 0: the fused layer with the CUDA kernels and HostTransport."""
    torch.cuda.set_device(0)
    fused.use_transport(None, HostTransport)
    B, S, hidden, Hq, Hkv, D, chunks = case
    os.environ[env.NUM_CHUNKS.name] = str(chunks)
    fast, _ = _layer_pair(torch.bfloat16, Hq, Hkv, D, hidden, seed=40)
    x, dy = (randn(B, S, hidden, dtype=torch.bfloat16, seed=41 + i, device="cuda") for i in range(2))
    xl, dyl = shard(x, world, rank), shard(dy, world, rank)
    xl.requires_grad_(True)
    y = fast(xl)
    assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"
    y.backward(dyl)
    return {"y": y.detach().cpu(), "dx": xl.grad.cpu(), "grads": [p.grad.cpu() for p in fast.parameters()]}


@pytest.mark.gpu
@pytest.mark.parametrize("world,case", [
    (2, (2, 301, 256, 8, 2, 64, 2)),   # uneven S, B > 1, GQA split, 2 chunks
])
def test_fused_self_attention_multirank_one_gpu(world, case):
    needs_extension(fused_ops=True)
    # under the GPU check's step timeout, so a hang fails one test
    reports = spawn(gpu_layer_worker, world, args=(case,), timeout=60)
    B, S, hidden, Hq, Hkv, D, _ = case
    _, ref = _layer_pair(torch.bfloat16, Hq, Hkv, D, hidden, seed=40)
    x, dy = (randn(B, S, hidden, dtype=torch.bfloat16, seed=41 + i, device="cuda") for i in range(2))
    xr = x.float().requires_grad_(True)
    yr = ref(xr)
    yr.backward(dy.float())
    errs = {"y": rel_err(torch.cat([r["y"] for r in reports], dim=1), yr.cpu()),
            "dx": rel_err(torch.cat([r["dx"] for r in reports], dim=1), xr.grad.cpu())}
    for j, (name, p) in enumerate(ref.named_parameters()):
        errs[name] = rel_err(sum(r["grads"][j] for r in reports), p.grad.cpu())
    assert all(e < 2e-2 for e in errs.values()), errs
