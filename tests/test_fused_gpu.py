"""GPU tests of the fused path: pack/unpack kernels bitwise against the torch layout,
fused ulysses_attention (NCCL engine) against the reference path at world size 1, and
at world sizes 2 and 4 on ONE GPU.

Multi-rank on one GPU: NCCL refuses two ranks on the same device ("Duplicate GPU
detected"), so those tests select the engine's test-only HostTransport
(`fused.use_transport(None, "host")`): every CUDA part of the fused path runs for real
(pack/unpack kernels, chunking, comm/compute streams and events, Triton attention reading
the receive buffers in place, GQA replica sums), and only the NCCL call is replaced by a
gloo `all_to_all_single` of the same bytes through host memory. CUDA IPC was the other
option; it would need its own exchange protocol and tests the transport, not the fused
path. The NCCL transport itself runs in the world-1 tests (a one-rank communicator,
send/recv to self through the same grouped code path).

Run: `ULYSSES_KERNELS_TRITON_AUTOTUNE=0 pytest -m gpu tests/test_fused_gpu.py`
(bench/gpu_check_fused.sh does this). Every spawned process has a timeout.
"""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import _backend, fused  # noqa: E402
from ulysses_kernels.comm import _pack_for_heads, _plans_for, _unpack_from_heads  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEADS = [  # (P, Hq, Hkv): MHA, GQA split, GQA replicated, MQA
    (1, 8, 8), (2, 8, 8), (4, 8, 4), (2, 8, 2), (4, 8, 2), (8, 8, 2), (4, 4, 1),
]


@pytest.fixture(scope="module", autouse=True)
def _needs_extension():
    module, reason = _backend.load_extension()
    if module is None or not fused.is_supported():
        pytest.skip(f"ulysses_kernels._C is not built or lacks the fused ops ({reason})")


def _rand(*shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


# ------------------------------------------------------------ pack / unpack kernels

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,Hq,Hkv", HEADS)
@pytest.mark.parametrize("B,S,D", [(1, 37, 64), (3, 5, 128), (2, 16, 8)])
def test_pack_matches_torch_layout(dtype, P, Hq, Hkv, B, S, D):
    q = _rand(B, S, Hq, D, dtype=dtype, seed=1)
    k = _rand(B, S, Hkv, D, dtype=dtype, seed=2)
    v = _rand(B, S, Hkv, D, dtype=dtype, seed=3)
    expected = _pack_for_heads([q, k, v], _plans_for([Hq, Hkv, Hkv], P), P)
    got = torch.ops.ulysses_kernels.pack([q, k, v], P)
    assert torch.equal(got, expected)
    # strided sources: a packed projection output, and a transposed (head-major) tensor
    qkv = torch.cat([q, k, v], dim=2).reshape(B, S, -1)
    qs, ks, vs = fused.split_packed_qkv(qkv, Hq, Hkv)
    assert torch.equal(torch.ops.ulysses_kernels.pack([qs, ks, vs], P), expected)
    kt = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert torch.equal(torch.ops.ulysses_kernels.pack([q, kt, v], P), expected)
    # misaligned source (scalar fallback) and a non-unit head-dim stride
    qm = torch.empty(q.numel() + 1, dtype=dtype, device="cuda")[1:].view_as(q).copy_(q)
    assert torch.equal(torch.ops.ulysses_kernels.pack([qm, k, v], P), expected)
    qd = torch.empty(B, S, Hq, D, 2, dtype=dtype, device="cuda")[..., 0]
    qd.copy_(q)
    assert torch.equal(torch.ops.ulysses_kernels.pack([qd, k, v], P), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,Hq,Hkv", HEADS)
def test_chunked_pack_and_unpack_match_reference_ops(dtype, P, Hq, Hkv):
    B, S, D = 2, 9, 64
    q = _rand(B, S, Hq, D, dtype=dtype, seed=4)
    k = _rand(B, S, Hkv, D, dtype=dtype, seed=5)
    v = _rand(B, S, Hkv, D, dtype=dtype, seed=6)
    hl_kv = Hkv // P if Hkv % P == 0 else 1
    for chunks in range(1, Hq // P + 1):
        for c in fused.plan_chunks(Hq // P, hl_kv, chunks):
            send = torch.full((P, B, S, c.channels, D), float("nan"), dtype=dtype, device="cuda")
            ref = send.clone()
            args = ([c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt])
            torch.ops.ulysses_kernels.pack_into([q, k, v], send, *args)
            fused.ReferenceOps.pack_into([q, k, v], ref, *args)
            assert torch.equal(send, ref)
            # backward direction: gradients of this chunk's heads (replicas summed)
            recv = _rand(P, B, S, c.grad_channels, D, dtype=dtype, seed=7 + chunks)
            outs = [torch.zeros(B, S, h, D, dtype=dtype, device="cuda") for h in (Hq, Hkv, Hkv)]
            refs = [o.clone() for o in outs]
            gargs = ([c.q_off, c.g_off, c.g_off], [c.q_cnt, c.g_cnt, c.g_cnt])
            torch.ops.ulysses_kernels.unpack_into(recv, outs, *gargs)
            fused.ReferenceOps.unpack_into(recv, refs, *gargs)
            for a, b in zip(outs, refs):
                assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,Hq,Hkv", HEADS)
def test_unpack_matches_torch_layout(dtype, P, Hq, Hkv):
    B, S, D = 2, 11, 128
    hl_q, hl_kv = Hq // P, (Hkv // P if Hkv % P == 0 else 1)
    hl = hl_q + 2 * hl_kv
    recv = _rand(P, B, S, hl, D, dtype=dtype, seed=8)
    got = torch.ops.ulysses_kernels.unpack(recv, [Hq, Hkv, Hkv])
    exp = _unpack_from_heads(recv, _plans_for([Hq, Hkv, Hkv], P), [Hq, Hkv, Hkv])
    assert torch.equal(got[0], exp[0])  # query heads: a pure copy
    for a, b in zip(got[1:], exp[1:]):
        if Hkv % P == 0:
            assert torch.equal(a, b)
        else:  # replica sums: fp32 accumulation vs torch's own reduction
            torch.testing.assert_close(a, b, rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-2)
    # strided outputs give the same bytes: head-major (16-byte path) and a head dim with
    # stride 2 (scalar path)
    for make in (lambda h: torch.empty(B, h, S, D, dtype=dtype, device="cuda").transpose(1, 2),
                 lambda h: torch.empty(B, S, h, D, 2, dtype=dtype, device="cuda")[..., 1]):
        outs = [make(h) for h in (Hq, Hkv, Hkv)]
        torch.ops.ulysses_kernels.unpack_into(recv, outs, [0, 0, 0], [hl_q, hl_kv, hl_kv])
        for a, b in zip(outs, got):
            assert torch.equal(a, b)


def test_attention_output_roundtrip_layout():
    """Reverse direction: `[B, S, Hl_q, D]` blocks -> unpack gives global head i*Hl_q + h."""
    P, B, Sp, Hq, D = 4, 2, 6, 8, 64
    recv = _rand(P, B, Sp, Hq // P, D, dtype=torch.bfloat16, seed=9)
    (out,) = torch.ops.ulysses_kernels.unpack(recv, [Hq])
    assert torch.equal(out, recv.permute(1, 2, 0, 3, 4).reshape(B, Sp, Hq, D))


def test_bad_arguments_raise():
    q = _rand(1, 4, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="neither split"):
        torch.ops.ulysses_kernels.pack([q], 4)
    send = torch.empty(2, 1, 4, 3, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="counts sum"):
        torch.ops.ulysses_kernels.pack_into([q], send, [0], [2])
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.ulysses_kernels.pack([q.double()], 2)


# ------------------------------------------------------ fused attention, world 1 (NCCL)

def _check_against_reference(q, k, v, do, *, causal, cu_seqlens=None, num_chunks=None, tol=None):
    tol = tol or {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-3}[q.dtype]
    qf, kf, vf = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if num_chunks is None:
        out = uk.ulysses_attention(qf, kf, vf, causal=causal, cu_seqlens=cu_seqlens, backend="fused")
    else:
        out = fused.ulysses_attention(qf, kf, vf, group=None, rank=0, seq_lens=[q.shape[1]], causal=causal,
                                      softmax_scale=1.0 / math.sqrt(q.shape[-1]), cu_seqlens=cu_seqlens,
                                      num_chunks=num_chunks)
    out.backward(do)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = uk.ulysses_attention(qr, kr, vr, causal=causal, cu_seqlens=cu_seqlens, backend="reference")
    ref.backward(do)
    for name, a, b in (("out", out, ref), ("dq", qf.grad, qr.grad), ("dk", kf.grad, kr.grad),
                       ("dv", vf.grad, vr.grad)):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,S,Hq,Hkv,D,causal", [(2, 128, 4, 4, 64, True), (1, 200, 8, 2, 128, False)])
def test_fused_world1_matches_reference(dtype, B, S, Hq, Hkv, D, causal):
    q = _rand(B, S, Hq, D, dtype=dtype, seed=10)
    k = _rand(B, S, Hkv, D, dtype=dtype, seed=11)
    v = _rand(B, S, Hkv, D, dtype=dtype, seed=12)
    do = _rand(B, S, Hq, D, dtype=dtype, seed=13)
    _check_against_reference(q, k, v, do, causal=causal)
    assert fused.get_engine(None, 1, 0, q.device).transport.name == "nccl"


@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_fused_world1_chunked_and_cu_seqlens(chunks):
    B, S, Hq, Hkv, D = 1, 160, 8, 2, 64
    q = _rand(B, S, Hq, D, dtype=torch.bfloat16, seed=14)
    k = _rand(B, S, Hkv, D, dtype=torch.bfloat16, seed=15)
    v = _rand(B, S, Hkv, D, dtype=torch.bfloat16, seed=16)
    do = _rand(B, S, Hq, D, dtype=torch.bfloat16, seed=17)
    cu = torch.tensor([0, 50, 51, 160], dtype=torch.int32, device="cuda")
    _check_against_reference(q, k, v, do, causal=True, cu_seqlens=cu, num_chunks=chunks)


def test_fused_world1_env_chunks(monkeypatch):
    monkeypatch.setenv(fused.ENV_CHUNKS, "2")
    q = _rand(2, 64, 4, 64, dtype=torch.bfloat16, seed=18)
    k = _rand(2, 64, 4, 64, dtype=torch.bfloat16, seed=19)
    _check_against_reference(q, k, k, q, causal=True)


def test_unsupported_inputs_give_reasons():
    q = _rand(1, 8, 2, 64, dtype=torch.float32).double()
    assert "bfloat16" in fused.unsupported_reason(q, q, q)
    q = _rand(1, 8, 2, 40, dtype=torch.bfloat16)
    assert "head dim" in fused.unsupported_reason(q, q, q)
    with pytest.raises(RuntimeError, match="head dim"):
        fused.ulysses_attention(q, q, q, group=None, rank=0, seq_lens=[8], causal=False, softmax_scale=1.0)


def test_engine_buffers_are_reused():
    q = _rand(1, 96, 4, 64, dtype=torch.bfloat16, seed=20)
    with torch.no_grad():
        uk.ulysses_attention(q, q, q, backend="fused", seq_lens=[96])
        engine = fused.get_engine(None, 1, 0, q.device)
        before = {k: b.data_ptr() for k, b in engine._buffers.items()}
        torch.cuda.synchronize()
        for _ in range(3):
            uk.ulysses_attention(q, q, q, backend="fused", seq_lens=[96])
        assert {k: b.data_ptr() for k, b in engine._buffers.items()} == before


def test_nccl_bad_counts_raise():  # before the capture test: a failed capture aborts the communicator
    engine = fused.get_engine(None, 1, 0, torch.device("cuda", torch.cuda.current_device()))
    x = torch.zeros(16, device="cuda")
    with pytest.raises(RuntimeError, match="exceed"):
        torch.ops.ulysses_kernels.nccl_all_to_all(engine.transport.handle, x, x.clone(), [32], [32])


@pytest.mark.parametrize("blocking", ["0", "1"])
def test_fused_world1_cuda_graph_capture(blocking, monkeypatch):
    """With seq_lens given the forward has no host sync: capture it and replay. Both NCCL
    modes: non-blocking (the default; NCCL >= 2.19 launches from a helper thread) and
    blocking (ULYSSES_KERNELS_NCCL_BLOCKING=1, read when the communicator is created)."""
    monkeypatch.setenv("ULYSSES_KERNELS_NCCL_BLOCKING", blocking)
    fused.close()  # the eager call below creates a communicator in this mode
    q = _rand(1, 128, 4, 64, dtype=torch.bfloat16, seed=21)
    k = _rand(1, 128, 2, 64, dtype=torch.bfloat16, seed=22)
    with torch.no_grad():
        eager = uk.ulysses_attention(q, k, k, backend="fused", seq_lens=[128])  # creates the engine
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                uk.ulysses_attention(q, k, k, backend="fused", seq_lens=[128])
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = uk.ulysses_attention(q, k, k, backend="fused", seq_lens=[128])
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(static, eager)


# ---------------------------------------- world sizes 2 and 4 on one GPU (host transport)

def _gpu_rank_worker(rank, world, case):
    import ulysses_kernels as uk_
    from ulysses_kernels import fused as fz
    from ulysses_kernels.reference import reference_attention as ref_attn
    torch.cuda.set_device(0)
    fz.use_transport(None, "host")
    B, S, Hq, Hkv, D, causal, dtype_name, chunks = case
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(99)
    full = [torch.randn(B, S, h, D, generator=g, device="cuda").to(dtype) for h in (Hq, Hkv, Hkv, Hq)]
    lens = [t.shape[1] for t in torch.tensor_split(full[0], world, dim=1)]
    mine = [torch.tensor_split(t, world, dim=1)[rank].contiguous() for t in full]
    ql, kl, vl = (t.clone().requires_grad_(True) for t in mine[:3])
    os.environ[fz.ENV_CHUNKS] = str(chunks)
    out = uk_.ulysses_attention(ql, kl, vl, causal=causal, seq_lens=lens, backend="fused")
    out.backward(mine[3])
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in full[:3])
    ref, _ = ref_attn(qr, kr, vr, causal=causal)
    ref.backward(full[3].float())
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-3
    for name, a, b in (("out", out, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                       ("dv", vl.grad, vr.grad)):
        b = torch.tensor_split(b, world, dim=1)[rank]
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world,case", [
    (2, (2, 301, 8, 2, 64, True, "bfloat16", 2)),   # uneven S, B > 1, GQA split, 2 chunks
    (4, (1, 258, 8, 2, 128, True, "bfloat16", 2)),  # KV replicated, shared KV across chunks
    (4, (2, 130, 4, 4, 64, False, "float32", 1)),   # MHA fp32, uneven S, B > 1
])
def test_fused_multirank_one_gpu(world, case):
    spawn(_gpu_rank_worker, world, args=(case,), timeout=60)  # under the GPU check's step timeout, so a hang fails one test


# -------------------- UlyssesSelfAttention: projections overlapped with the exchanges

def _layer_pair(dtype, Hq, Hkv, D, hidden, seed):
    """The fused-path module and a float32 reference-path copy with the same weights."""
    torch.manual_seed(seed)
    fast = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=True, bias=True, backend="fused", device="cuda",
                                   dtype=dtype)
    ref = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=True, bias=True, backend="reference",
                                  device="cuda", dtype=torch.float32)
    ref.load_state_dict({k: v.float() for k, v in fast.state_dict().items()})
    return fast, ref


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunks", ["1", "4"])
def test_fused_self_attention_world1(dtype, chunks, monkeypatch):
    monkeypatch.setenv(fused.ENV_CHUNKS, chunks)
    fast, ref = _layer_pair(dtype, 8, 2, 64, 256, seed=30)
    x = _rand(2, 96, 256, dtype=dtype, seed=31)
    dy = _rand(2, 96, 256, dtype=dtype, seed=32)
    pos = torch.arange(96, device="cuda", dtype=torch.float32)[:, None] * (
        1.0 / 10000.0 ** (torch.arange(32, device="cuda", dtype=torch.float32) / 32))[None, :]
    emb = torch.cat([pos, pos], dim=-1)[None]  # rotary tables [1, S, D]
    rope = (emb.cos(), emb.sin())
    xf = x.clone().requires_grad_(True)
    y = fast(xf, position_embeddings=rope)
    assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"  # the overlapped layer ran
    y.backward(dy)
    xr = x.float().requires_grad_(True)
    yr = ref(xr, position_embeddings=rope)
    yr.backward(dy.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    errs = {"y": _rel(y, yr), "dx": _rel(xf.grad, xr.grad)}
    for (name, p), pr in zip(fast.named_parameters(), ref.parameters()):
        errs[name] = _rel(p.grad, pr.grad)
    assert all(e < tol for e in errs.values()), errs


def _gpu_layer_worker(rank, world, case):
    from ulysses_kernels import fused as fz
    torch.cuda.set_device(0)
    fz.use_transport(None, "host")
    B, S, hidden, Hq, Hkv, D, chunks = case
    os.environ[fz.ENV_CHUNKS] = str(chunks)
    fast, _ = _layer_pair(torch.bfloat16, Hq, Hkv, D, hidden, seed=40)
    g = torch.Generator(device="cuda").manual_seed(41)
    x, dy = (torch.randn(B, S, hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    xl, dyl = (torch.tensor_split(t, world, dim=1)[rank].clone() for t in (x, dy))
    xl.requires_grad_(True)
    y = fast(xl)
    assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"
    y.backward(dyl)
    return {"y": y.detach().cpu(), "dx": xl.grad.cpu(), "grads": [p.grad.cpu() for p in fast.parameters()]}


@pytest.mark.parametrize("world,case", [
    (2, (2, 301, 256, 8, 2, 64, 2)),   # uneven S, B > 1, GQA split, 2 chunks
])
def test_fused_self_attention_multirank_one_gpu(world, case):
    reports = spawn(_gpu_layer_worker, world, args=(case,), timeout=60)  # under the GPU check's step timeout, so a hang fails one test
    B, S, hidden, Hq, Hkv, D, _ = case
    _, ref = _layer_pair(torch.bfloat16, Hq, Hkv, D, hidden, seed=40)
    g = torch.Generator(device="cuda").manual_seed(41)
    x, dy = (torch.randn(B, S, hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    xr = x.float().requires_grad_(True)
    yr = ref(xr)
    yr.backward(dy.float())
    errs = {"y": _rel(torch.cat([r["y"] for r in reports], dim=1), yr.cpu()),
            "dx": _rel(torch.cat([r["dx"] for r in reports], dim=1), xr.grad.cpu())}
    for j, (name, p) in enumerate(ref.named_parameters()):
        errs[name] = _rel(sum(r["grads"][j] for r in reports), p.grad.cpu())
    assert all(e < 2e-2 for e in errs.values()), errs
