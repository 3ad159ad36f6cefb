"""CPU checks of the CUDA extension and the fused path (no kernel is launched here).

- op schemas (names, mutability annotations) and fake-tensor shape propagation;
- dispatch: the fused path is never chosen for CPU tensors, forcing it raises clearly;
- the chunk plan (pure Python) and the whole fused pipeline (chunking, buffer views,
  GQA replication, shared-KV gradient accumulation) run on CPU with the pure-torch
  `ReferenceOps` in place of the CUDA kernels and the Triton interpreter for attention,
  against the reference path.
The GPU side (kernels bitwise, NCCL) is tests/test_fused_gpu.py.
"""

import math
import os

import pytest
import torch

import ulysses_kernels as uk
from ulysses_kernels import _backend, fused
from ulysses_kernels.comm import _pack_for_heads, _plans_for, _unpack_from_heads
from ulysses_kernels.launch import spawn

EXPECTED_SCHEMAS = {
    "pack": "ulysses_kernels::pack(Tensor[] srcs, int world) -> Tensor",
    "pack_into": "ulysses_kernels::pack_into(Tensor[] srcs, Tensor(a!) send, int[] offsets, int[] counts) -> ()",
    "unpack": "ulysses_kernels::unpack(Tensor recv, int[] num_heads) -> Tensor[]",
    "unpack_into": "ulysses_kernels::unpack_into(Tensor recv, Tensor(a!)[] outs, int[] offsets, int[] counts) -> ()",
    "nccl_unique_id": "ulysses_kernels::nccl_unique_id() -> Tensor",
    "nccl_comm_create": ("ulysses_kernels::nccl_comm_create(Tensor unique_id, int world, int rank, int device, "
                         "float timeout_s) -> int"),
    "nccl_comm_destroy": "ulysses_kernels::nccl_comm_destroy(int comm) -> ()",
    "nccl_all_to_all": ("ulysses_kernels::nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, "
                        "int[] send_counts, int[] recv_counts) -> ()"),
    "nccl_comm_wait": "ulysses_kernels::nccl_comm_wait(int comm, float timeout_s) -> ()",
}


def _extension():
    module, reason = _backend.load_extension()
    if module is None:
        pytest.skip(f"ulysses_kernels._C is not built ({reason}); build with "
                    "`pip install --no-build-isolation -e .`")
    return module


# ------------------------------------------------------------------------ schemas

def test_build_info():
    _extension()
    info = torch.ops.ulysses_kernels.build_info()
    assert "cuda=" in info and "nccl=" in info


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEMAS))
def test_schema(name):
    _extension()
    schema = getattr(torch.ops.ulysses_kernels, name).default._schema
    assert str(schema) == EXPECTED_SCHEMAS[name]


def test_mutability_annotations():
    _extension()
    ops = torch.ops.ulysses_kernels
    written = {"pack_into": {"send"}, "unpack_into": {"outs"}, "nccl_all_to_all": {"recv"}}
    for name in EXPECTED_SCHEMAS:
        schema = getattr(ops, name).default._schema
        for arg in schema.arguments:
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            assert is_write == (arg.name in written.get(name, ())), (name, arg.name)


def test_is_supported_matches_extension():
    _extension()
    assert fused.is_supported()
    assert _backend.fused_available() == (True, None)


# ------------------------------------------------------------------ fake tensors

def _fake_cuda(mode, *shape, dtype=torch.bfloat16):
    """A CUDA fake tensor built without touching a GPU (meta tensor + device override)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor(mode, torch.empty(*shape, dtype=dtype, device="meta"), torch.device("cuda", 0))


def test_fake_pack_unpack_shapes():
    _extension()
    fused.is_supported()  # registers the fakes
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.ulysses_kernels
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        for P, Hq, Hkv in [(1, 8, 8), (2, 8, 2), (4, 8, 2), (8, 16, 2), (3, 6, 3)]:
            q = _fake_cuda(mode, 2, 5, Hq, 64)
            k = _fake_cuda(mode, 2, 5, Hkv, 64)
            send = ops.pack([q, k, k], P)
            hl_kv = Hkv // P if Hkv % P == 0 else 1
            assert tuple(send.shape) == (P, 2, 5, Hq // P + 2 * hl_kv, 64)
            assert send.device.type == "cuda" and send.dtype == torch.bfloat16
            outs = ops.unpack(send, [Hq, Hkv, Hkv])
            assert [tuple(o.shape) for o in outs] == [(2, 5, Hq, 64), (2, 5, Hkv, 64), (2, 5, Hkv, 64)]
            assert all(o.device.type == "cuda" for o in outs)
            assert ops.pack_into([q, k, k], send, [0, 0, 0], [Hq // P, hl_kv, hl_kv]) is None
            assert ops.unpack_into(send, [q, k, k], [0, 0, 0], [Hq // P, hl_kv, hl_kv]) is None
            recv = _fake_cuda(mode, send.numel())
            assert ops.nccl_all_to_all(1, send.reshape(-1), recv, [1] * P, [1] * P) is None


def test_fake_ops_trace_with_make_fx():
    """Shape propagation through a traced function (what torch.compile relies on)."""
    _extension()
    fused.is_supported()
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(q, k, v):
        send = torch.ops.ulysses_kernels.pack([q, k, v], 2)
        return torch.ops.ulysses_kernels.unpack(send, [q.shape[2], k.shape[2], v.shape[2]])

    with FakeTensorMode() as mode:
        q = _fake_cuda(mode, 1, 4, 4, 16, dtype=torch.float16)
        k = _fake_cuda(mode, 1, 4, 1, 16, dtype=torch.float16)
        gm = make_fx(f, tracing_mode="fake")(q, k, k)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("ulysses_kernels.pack" in t for t in targets)
    assert any("ulysses_kernels.unpack" in t for t in targets)


# -------------------------------------------------------------------- dispatch

def test_auto_never_picks_fused_for_cpu():
    assert _backend.resolve_backend(None, torch.device("cpu"), distributed=True) == "reference"
    assert _backend.resolve_backend(None, torch.device("cpu"), distributed=False) == "reference"


def test_forced_fused_on_cpu_raises_clear_error():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    with pytest.raises((ValueError, RuntimeError), match="fused.*CUDA|CUDA.*fused"):
        uk.ulysses_attention(q, k, k, backend="fused")


def test_forced_fused_without_extension_message(monkeypatch):
    """A missing build reads as a reason, not a crash."""
    monkeypatch.setattr(_backend, "load_extension", lambda: (None, "not built: test"))
    assert not fused.is_supported()
    ok, reason = _backend.fused_available()
    assert not ok and "not built: test" in reason


# ------------------------------------------------------------------ chunk plan

@pytest.mark.parametrize("hl_q,hl_kv", [(1, 1), (4, 4), (4, 2), (4, 1), (8, 2), (6, 3), (6, 1), (12, 4), (16, 1)])
def test_chunk_plan_covers_every_head_once(hl_q, hl_kv):
    g = hl_q // hl_kv
    for requested in range(1, hl_q + 2):
        plan = fused.plan_chunks(hl_q, hl_kv, requested)
        assert 1 <= len(plan) <= max(1, min(requested, hl_q))
        q_heads = [h for c in plan for h in range(c.q_off, c.q_off + c.q_cnt)]
        assert q_heads == list(range(hl_q))
        sent = [h for c in plan for h in range(c.kv_off, c.kv_off + c.kv_cnt)]
        done = [h for c in plan for h in range(c.g_off, c.g_off + c.g_cnt)]
        assert sent == list(range(hl_kv)) and done == list(range(hl_kv))
        for i, c in enumerate(plan):
            src = plan[c.kv_src]
            assert c.kv_src <= i
            assert 0 <= c.kv_lo and c.kv_lo + c.kv_use <= src.kv_cnt
            used = range(src.kv_off + c.kv_lo, src.kv_off + c.kv_lo + c.kv_use)
            # every query head of the chunk reads KV head h // g, and it is in `used`
            assert all(h // g in used for h in range(c.q_off, c.q_off + c.q_cnt))
            if not c.shared:
                assert c.kv_src == i and (c.g_off, c.g_cnt) == (c.kv_off, c.kv_cnt)


def test_num_chunks_env_and_argument(monkeypatch):
    monkeypatch.setenv(fused.ENV_CHUNKS, "4")
    assert fused.resolve_num_chunks(None, 2, 8, 2, 1) == 4
    assert fused.resolve_num_chunks(2, 2, 8, 2, 1) == 2      # argument beats env
    assert fused.resolve_num_chunks(3, 2, 8, 2, 1) == 2      # lowered to a valid count
    monkeypatch.setenv(fused.ENV_CHUNKS, "x")
    with pytest.raises(ValueError, match=fused.ENV_CHUNKS):
        fused.resolve_num_chunks(None, 2, 8, 2, 1)
    monkeypatch.delenv(fused.ENV_CHUNKS)
    assert fused.resolve_num_chunks(None, 1, 8, 2, 1 << 30) == 1   # world 1: nothing to overlap
    assert fused.resolve_num_chunks(None, 8, 8, 1, 1 << 30) == 4


# ------------------------------------------- reference ops vs the comm.py layout

@pytest.mark.parametrize("P,Hq,Hkv", [(1, 4, 2), (2, 4, 4), (2, 4, 2), (4, 8, 2), (4, 4, 1), (8, 8, 2)])
def test_reference_ops_match_comm_layout(P, Hq, Hkv):
    g = torch.Generator().manual_seed(P * 100 + Hq * 10 + Hkv)
    B, S, D = 2, 3, 8
    q = torch.randn(B, S, Hq, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    plans = _plans_for([Hq, Hkv, Hkv], P)
    expected = _pack_for_heads([q, k, v], plans, P)
    got = fused.ReferenceOps.pack([q, k.transpose(0, 1).contiguous().transpose(0, 1), v], P)
    assert torch.equal(got, expected)
    # chunked packing reassembles the same buffer
    hl_kv = Hkv // P if Hkv % P == 0 else 1
    for c in range(1, Hq // P + 1):
        plan = fused.plan_chunks(Hq // P, hl_kv, c)
        parts = []
        for ch in plan:
            send = q.new_empty(P, B, S, ch.channels, D)
            fused.ReferenceOps.pack_into([q, k, v], send, [ch.q_off, ch.kv_off, ch.kv_off],
                                         [ch.q_cnt, ch.kv_cnt, ch.kv_cnt])
            parts.append(send)
        qs = torch.cat([p[:, :, :, :ch.q_cnt] for p, ch in zip(parts, plan)], dim=3)
        ks = torch.cat([p[:, :, :, ch.q_cnt:ch.q_cnt + ch.kv_cnt] for p, ch in zip(parts, plan)], dim=3)
        vs = torch.cat([p[:, :, :, ch.q_cnt + ch.kv_cnt:] for p, ch in zip(parts, plan)], dim=3)
        assert torch.equal(torch.cat([qs, ks, vs], dim=3), expected)
    grads = _unpack_from_heads(expected, plans, [Hq, Hkv, Hkv])
    got = fused.ReferenceOps.unpack(expected, [Hq, Hkv, Hkv])
    for a, b in zip(got, grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ------------------------------- whole fused pipeline on CPU (reference ops, interpreter)

def _triton_cpu_ok():
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "the Triton interpreter is off (TRITON_INTERPRET=1 is set by conftest without CUDA)"
    mod, reason = _backend.triton_kernels()
    if mod is None or not hasattr(mod, "flash_attention_forward"):
        return f"Triton kernels unavailable: {reason}"
    return None


def _run_pipeline_cpu(q, k, v, *, causal, num_chunks, monkeypatch):
    """world 1 fused pipeline on CPU: ReferenceOps + identity (host) transport."""
    monkeypatch.setattr(fused, "_ops_override", fused.ReferenceOps)
    engine = fused.Engine(None, 1, 0, torch.device("cpu"), "host")
    B, S, Hq, D = q.shape
    plan = fused.plan_chunks(Hq, k.shape[2], num_chunks)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fused._FusedUlyssesAttention.apply(q, k, v, engine, [S], 0, causal, 1.0 / math.sqrt(D), None,
                                             tuple(plan))
    return q, k, v, out, plan


@pytest.mark.parametrize("Hq,Hkv,chunks", [(4, 4, 2), (4, 2, 2), (4, 1, 4), (8, 2, 8), (4, 2, 1)])
def test_fused_pipeline_cpu_world1(Hq, Hkv, chunks, monkeypatch):
    _extension()
    why = _triton_cpu_ok()
    if why:
        pytest.skip(why)
    torch.manual_seed(0)
    B, S, D = 2, 6, 16
    q = torch.randn(B, S, Hq, D)
    k = torch.randn(B, S, Hkv, D)
    v = torch.randn(B, S, Hkv, D)
    do = torch.randn(B, S, Hq, D)
    qf, kf, vf, out, plan = _run_pipeline_cpu(q, k, v, causal=True, num_chunks=chunks, monkeypatch=monkeypatch)
    assert len(plan) == chunks
    out.backward(do)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = uk.ulysses_attention(qr, kr, vr, causal=True, backend="reference")
    ref.backward(do)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(qf.grad, qr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kf.grad, kr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(vf.grad, vr.grad, rtol=1e-4, atol=1e-4)


def test_fused_pipeline_cpu_retain_graph(monkeypatch):
    """retain_graph=True: a second backward gives the same gradients again; without it,
    a second backward raises torch's usual error instead of reading freed buffers."""
    _extension()
    why = _triton_cpu_ok()
    if why:
        pytest.skip(why)
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 5, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    do = torch.randn(1, 5, 4, 16)
    qf, kf, vf, out, _ = _run_pipeline_cpu(q, k, v, causal=False, num_chunks=2, monkeypatch=monkeypatch)
    out.backward(do, retain_graph=True)
    first = [t.grad.clone() for t in (qf, kf, vf)]
    out.backward(do)
    for t, g in zip((qf, kf, vf), first):
        torch.testing.assert_close(t.grad, 2 * g, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward(do)


# ------------------------ multi-rank fused pipeline on CPU (gloo, reference ops, interpreter)

def _cpu_rank_worker(rank, world, case):
    """One rank: fused pipeline with ReferenceOps + HostTransport over gloo vs the full
    single-process reference (out and grads of this rank's slice)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from ulysses_kernels import fused as fz
    from ulysses_kernels.reference import reference_attention
    B, S, Hq, Hkv, D, causal, chunks = case
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(B, S, Hq, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    do = torch.randn(B, S, Hq, D, generator=g)
    lens = [t.shape[1] for t in torch.tensor_split(q, world, dim=1)]
    mine = [torch.tensor_split(t, world, dim=1)[rank] for t in (q, k, v, do)]
    fz._ops_override = fz.ReferenceOps
    engine = fz.Engine(None, world, rank, torch.device("cpu"), "host")
    hl_kv = Hkv // world if Hkv % world == 0 else 1
    plan = fz.plan_chunks(Hq // world, hl_kv, chunks)
    ql, kl, vl = (t.clone().requires_grad_(True) for t in mine[:3])
    out = fz._FusedUlyssesAttention.apply(ql, kl, vl, engine, lens, rank, causal, 1.0 / math.sqrt(D), None,
                                          tuple(plan))
    out.backward(mine[3])
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, causal=causal)
    ref.backward(do)
    pieces = [(out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)]
    for name, (a, b) in zip(("out", "dq", "dk", "dv"), pieces):
        b = torch.tensor_split(b, world, dim=1)[rank]
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world,case", [
    (2, (2, 7, 4, 2, 16, True, 2)),    # uneven S, B > 1 (3-D seq_splits views), GQA split, 2 chunks
    (4, (1, 10, 8, 2, 16, True, 2)),   # KV heads replicated (P % Hkv == 0), shared KV across chunks
    (3, (2, 7, 6, 3, 16, False, 3)),   # odd world, 3 chunks (one KV head each)
])
def test_fused_pipeline_cpu_multirank(world, case):
    _extension()
    why = _triton_cpu_ok()
    if why:
        pytest.skip(why)
    spawn(_cpu_rank_worker, world, args=(case,), timeout=240)


# ------------- fused self-attention layer (projections in the pipeline) on CPU, world 1-4

def _rope_tables(B, S, D):
    """Rotary (cos, sin) `[B, S, D]` at global positions 0..S-1 (Llama convention)."""
    freqs = 1.0 / (10000.0 ** (torch.arange(D // 2, dtype=torch.float32) / (D // 2)))
    angles = torch.arange(S, dtype=torch.float32)[:, None] * freqs[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().expand(B, S, D), emb.sin().expand(B, S, D)


def _layer_and_inputs(case):
    B, S, hidden, Hq, Hkv, D, causal, bias, rotary, _ = case
    torch.manual_seed(4321)  # the same weights and inputs on every rank
    layer = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=causal, bias=bias)
    rope = _rope_tables(B, S, D) if rotary else None
    return layer, torch.randn(B, S, hidden), torch.randn(B, S, hidden), rope


def _layer_params(layer):
    return [layer.qkv_proj.weight, layer.qkv_proj.bias, layer.o_proj.weight, layer.o_proj.bias]


def _cpu_layer_worker(rank, world, case):
    """This rank's y, dx and weight gradients from the fused layer pipeline (ReferenceOps,
    HostTransport over gloo, Triton interpreter)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from ulysses_kernels import fused as fz
    from ulysses_kernels import fused_layer
    fz._ops_override = fz.ReferenceOps
    chunks = case[-1]
    layer, x, dy, rope = _layer_and_inputs(case)
    B, S, hidden, Hq, Hkv, D, causal = case[:7]
    lens = [t.shape[1] for t in torch.tensor_split(x, world, dim=1)]
    mine = lambda t: torch.tensor_split(t, world, dim=1)[rank].clone()  # noqa: E731
    xl, dyl = mine(x), mine(dy)
    cos, sin = (mine(t) for t in rope) if rope is not None else (None, None)
    engine = fz.Engine(None, world, rank, torch.device("cpu"), "host")
    hl_kv = Hkv // world if Hkv % world == 0 else 1
    plan = tuple(fz.plan_chunks(Hq // world, hl_kv, chunks))
    assert len(plan) == chunks
    xl.requires_grad_(True)
    y = fused_layer._FusedSelfAttention.apply(xl, *_layer_params(layer), cos, sin, engine, lens, causal,
                                              1 / math.sqrt(D), None, plan, (Hq, Hkv, D))
    y.backward(dyl)
    return {"y": y.detach(), "dx": xl.grad, "grads": [p.grad if p is not None else None for p in _layer_params(layer)]}


@pytest.mark.parametrize("world,case", [
    (1, (2, 6, 24, 4, 2, 16, True, True, True, 2)),     # B > 1, GQA, two chunks, biases, rotary
    (1, (1, 5, 16, 4, 1, 16, True, False, False, 4)),   # MQA: one KV head shared by four chunks
    (2, (2, 7, 24, 4, 2, 16, True, True, True, 2)),     # uneven S, GQA split, two chunks
    (3, (1, 8, 32, 9, 3, 16, False, True, True, 3)),    # odd world, three chunks (one query head each)
    (4, (1, 10, 32, 8, 2, 16, True, False, True, 2)),   # KV heads replicated (P % Hkv == 0), shared KV
])
def test_fused_layer_pipeline_cpu(world, case):
    """UlyssesSelfAttention's fused path (per-chunk projection GEMMs inside the exchange
    pipeline) equals the plain composition on one process: output, dx and every weight
    and bias gradient (summed over ranks, each rank holding its own tokens)."""
    _extension()
    why = _triton_cpu_ok()
    if why:
        pytest.skip(why)
    reports = spawn(_cpu_layer_worker, world, args=(case,), timeout=240)
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
    CPU: the path is forced to "fused", the ops are the torch stand-ins."""
    _extension()
    why = _triton_cpu_ok()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(fused, "_ops_override", fused.ReferenceOps)
    monkeypatch.setattr(fused, "_engines", {})
    monkeypatch.setenv(fused.ENV_TRANSPORT, "host")
    monkeypatch.setenv(fused.ENV_CHUNKS, "2")
    torch.manual_seed(5)
    layer = uk.UlyssesSelfAttention(32, 4, 2, 16, causal=True, bias=True)
    x = torch.randn(1, 9, 32, requires_grad=True)
    cos, sin = _rope_tables(1, 9, 16)
    cos, sin = cos[:1], sin[:1]  # [1, S, D] broadcasts over the batch
    expected = layer(x, position_embeddings=(cos, sin))  # CPU: reference path
    monkeypatch.setattr(_backend, "resolve_backend", lambda *a, **k: "fused")
    y = layer(x, position_embeddings=(cos, sin))
    assert type(y.grad_fn).__name__ == "_FusedSelfAttentionBackward"
    torch.testing.assert_close(y, expected, rtol=2e-4, atol=2e-5)
    layer.overlap_projections = False  # the plain composition on the fused attention op
    monkeypatch.setattr(fused, "unsupported_reason", lambda *a: None)
    y2 = layer(x, position_embeddings=(cos, sin))
    assert type(y2.grad_fn).__name__ != "_FusedSelfAttentionBackward"
    torch.testing.assert_close(y2, expected, rtol=2e-4, atol=2e-5)
