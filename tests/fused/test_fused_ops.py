"""The fused path's pack/unpack ops (ulysses_kernels.fused.ops, csrc/pack_kernels.cu): the op
table, the placements the wrappers pass (from ulysses_kernels.layout), the pure-torch
stand-ins (ulysses_kernels.testing.ReferenceOps) against the reference exchange's layout,
fake-tensor shape propagation, and (marked `gpu`) the CUDA kernels bitwise against both.
"""

import pytest
import torch
from helpers import needs_extension, param_id, randn

from ulysses_kernels import env, fused, testing
from ulysses_kernels.exchange.buffers import pack_for_heads, placements_for, unpack_from_heads
from ulysses_kernels.fused import ops
from ulysses_kernels.layout import HeadPlan, place_heads
from ulysses_kernels.testing import ReferenceOps


def _placement_lists(num_heads, world):
    placements = placements_for(num_heads, world)
    return [p.local for p in placements], [p.replicas for p in placements]


# --------------------------------------------------------------------- op table

class _RecordingOps(ReferenceOps):
    """ReferenceOps that remember the arguments they were called with."""

    calls = []

    @staticmethod
    def pack_into(srcs, send, offsets, counts, local_heads, replicas):
        _RecordingOps.calls.append(("pack_into", list(offsets), list(counts), list(local_heads), list(replicas)))
        ReferenceOps.pack_into(srcs, send, offsets, counts, local_heads, replicas)

    @staticmethod
    def unpack_into(recv, outs, offsets, counts, local_heads, replicas):
        _RecordingOps.calls.append(("unpack_into", list(offsets), list(counts), list(local_heads), list(replicas)))
        ReferenceOps.unpack_into(recv, outs, offsets, counts, local_heads, replicas)


@pytest.mark.parametrize("P,Hq,Hkv", [(1, 4, 2), (2, 4, 2), (4, 8, 2), (4, 4, 1), (3, 6, 3), (6, 6, 2)])
def test_wrappers_pass_the_layout_placements(P, Hq, Hkv):
    """The kernels never decide a placement: the wrappers hand them layout.py's."""
    heads = HeadPlan(P, Hq, Hkv)
    want_local = [p.local for p in heads.placements()]
    want_rep = [p.replicas for p in heads.placements()]
    q, k, v = _qkv(P, Hq, Hkv)
    previous = fused.use_ops(_RecordingOps)
    try:
        _RecordingOps.calls.clear()
        assert ops.device_types() == ("cpu", "cuda") and ops.table() is _RecordingOps and fused.is_supported()
        send = ops.pack([q, k, v], P)
        outs = ops.unpack(send, [Hq, Hkv, Hkv])
        c = fused.plan_chunks(heads.local_q_heads, heads.local_kv_heads, 2)[-1]
        chunk = send.new_empty(P, *q.shape[:2], c.channels, q.shape[3])
        ops.pack_into([q, k, v], chunk, [c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt])
        ops.unpack_into(chunk[:, :, :, :c.q_cnt].contiguous(), [outs[0]], [c.q_off], [c.q_cnt])
    finally:
        assert fused.use_ops(previous) is _RecordingOps
    assert send.shape == (P, *q.shape[:2], heads.channels, q.shape[3])
    assert [o.shape[2] for o in outs] == [Hq, Hkv, Hkv]
    assert _RecordingOps.calls == [
        ("pack_into", [0, 0, 0], want_local, want_local, want_rep),
        ("unpack_into", [0, 0, 0], want_local, want_local, want_rep),
        ("pack_into", [c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt], want_local, want_rep),
        ("unpack_into", [c.q_off], [c.q_cnt], want_local[:1], want_rep[:1]),
    ]
    assert ops.table() is torch.ops.ulysses_kernels and ops.device_types() == ops.EXTENSION_DEVICE_TYPES


def test_is_supported_matches_extension():
    needs_extension()
    assert fused.is_supported()
    assert fused.problem(torch.device("cuda"), ()) is None


def test_placement_errors_are_raised_before_the_ops():
    q = torch.randn(1, 4, 6, 16)
    with pytest.raises(ValueError, match="6 heads can be neither split over nor replicated to 4 ranks"):
        with testing.fused_stand_ins():
            ops.pack([q], 4)


# ------------------------------------------- reference ops vs the reference exchange layout

def _qkv(P, Hq, Hkv, B=2, S=3, D=8, dtype=torch.float32, device="cpu"):
    seed = P * 100 + Hq * 10 + Hkv
    return (randn(B, S, Hq, D, dtype=dtype, seed=seed, device=device),
            randn(B, S, Hkv, D, dtype=dtype, seed=seed + 1, device=device),
            randn(B, S, Hkv, D, dtype=dtype, seed=seed + 2, device=device))


@pytest.mark.parametrize("P,Hq,Hkv", [(1, 4, 2), (2, 4, 4), (2, 4, 2), (4, 8, 2), (4, 4, 1), (8, 8, 2)])
def test_reference_ops_match_exchange_layout(P, Hq, Hkv):
    q, k, v = _qkv(P, Hq, Hkv)
    B, S, _, D = q.shape
    placements = placements_for([Hq, Hkv, Hkv], P)
    local, replicas = _placement_lists([Hq, Hkv, Hkv], P)
    expected = pack_for_heads([q, k, v], placements, P)
    # the stand-in op itself, with the placement passed explicitly
    direct = q.new_empty(expected.shape)
    ReferenceOps.pack_into([q, k, v], direct, [0, 0, 0], local, local, replicas)
    assert torch.equal(direct, expected)
    heads = HeadPlan(P, Hq, Hkv)
    with testing.fused_stand_ins():
        got = ops.pack([q, k.transpose(0, 1).contiguous().transpose(0, 1), v], P)
        assert torch.equal(got, expected)
        # chunked packing reassembles the same buffer
        for c in range(1, heads.local_q_heads + 1):
            plan = fused.plan_chunks(heads.local_q_heads, heads.local_kv_heads, c)
            parts = []
            for ch in plan:
                send = q.new_empty(P, B, S, ch.channels, D)
                ops.pack_into([q, k, v], send, [ch.q_off, ch.kv_off, ch.kv_off], [ch.q_cnt, ch.kv_cnt, ch.kv_cnt])
                parts.append(send)
            qs = torch.cat([p[:, :, :, :ch.q_cnt] for p, ch in zip(parts, plan)], dim=3)
            ks = torch.cat([p[:, :, :, ch.q_cnt:ch.q_cnt + ch.kv_cnt] for p, ch in zip(parts, plan)], dim=3)
            vs = torch.cat([p[:, :, :, ch.q_cnt + ch.kv_cnt:] for p, ch in zip(parts, plan)], dim=3)
            assert torch.equal(torch.cat([qs, ks, vs], dim=3), expected)
        grads = unpack_from_heads(expected, placements)
        got = ops.unpack(expected, [Hq, Hkv, Hkv])
    for a, b in zip(got, grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    outs = [torch.zeros_like(t) for t in (q, k, v)]
    ReferenceOps.unpack_into(expected, outs, [0, 0, 0], local, local, replicas)
    for a, b in zip(outs, got):
        assert torch.equal(a, b)


def test_bench_qkv_exchange_is_the_reference_exchange():
    """`testing.bench.qkv_exchange` (what bench_a2a times): the pack op and one transport
    exchange give the reference exchange's receive buffer (world 1: the send buffer)."""
    from ulysses_kernels.testing.bench import qkv_exchange

    q, k, v = _qkv(1, 4, 2, B=2, S=5, D=16)
    with testing.fused_stand_ins():
        engine = fused.Engine(None, 1, 0, torch.device("cpu"), testing.HostTransport)
        recv = qkv_exchange(q, k, v, engine, [5])
    expected = pack_for_heads([q, k, v], placements_for([4, 2, 2], 1), 1)
    assert torch.equal(recv, expected.reshape(-1))


# ------------------------------------------------------------------ fake tensors

def _fake_cuda(mode, *shape, dtype=torch.bfloat16):
    """A CUDA fake tensor built without touching a GPU (meta tensor + device override)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor(mode, torch.empty(*shape, dtype=dtype, device="meta"), torch.device("cuda", 0))


def test_fake_pack_unpack_shapes():
    needs_extension()
    assert fused.is_supported()  # registers the fakes
    from torch._subclasses.fake_tensor import FakeTensorMode
    raw = torch.ops.ulysses_kernels
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        for P, Hq, Hkv in [(1, 8, 8), (2, 8, 2), (4, 8, 2), (8, 16, 2), (3, 6, 3)]:
            heads = HeadPlan(P, Hq, Hkv)
            local, replicas = _placement_lists([Hq, Hkv, Hkv], P)
            q = _fake_cuda(mode, 2, 5, Hq, 64)
            k = _fake_cuda(mode, 2, 5, Hkv, 64)
            send = ops.pack([q, k, k], P)
            assert tuple(send.shape) == (P, 2, 5, heads.local_q_heads + 2 * heads.local_kv_heads, 64)
            assert send.device.type == "cuda" and send.dtype == torch.bfloat16
            outs = ops.unpack(send, [Hq, Hkv, Hkv])
            assert [tuple(o.shape) for o in outs] == [(2, 5, Hq, 64), (2, 5, Hkv, 64), (2, 5, Hkv, 64)]
            assert all(o.device.type == "cuda" for o in outs)
            assert raw.pack_into([q, k, k], send, [0, 0, 0], local, local, replicas) is None
            assert raw.unpack_into(send, [q, k, k], [0, 0, 0], local, local, replicas) is None
            recv = _fake_cuda(mode, send.numel())
            assert raw.nccl_all_to_all(1, send.reshape(-1), recv, [1] * P, [1] * P) is None


def test_fake_ops_trace_with_make_fx():
    """Shape propagation through a traced function (what torch.compile relies on)."""
    needs_extension()
    assert fused.is_supported()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v):
        send = ops.pack([q, k, v], 2)
        return ops.unpack(send, [q.shape[2], k.shape[2], v.shape[2]])

    with FakeTensorMode() as mode:
        q = _fake_cuda(mode, 1, 4, 4, 16, dtype=torch.float16)
        k = _fake_cuda(mode, 1, 4, 1, 16, dtype=torch.float16)
        gm = make_fx(f, tracing_mode="fake")(q, k, k)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("ulysses_kernels.pack_into" in t for t in targets), targets
    assert any("ulysses_kernels.unpack_into" in t for t in targets), targets
    # the placement arguments are constants of the graph: layout.py's numbers
    node = next(n for n in gm.graph.nodes if "ulysses_kernels.pack_into" in str(n.target))
    assert list(node.args[4:]) == [[2, 1, 1], [1, 2, 2]]


# ------------------------------------------------------- the CUDA kernels (GPU)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEADS = [  # (P, Hq, Hkv): MHA, GQA split, GQA replicated, MQA
    (1, 8, 8), (2, 8, 8), (4, 8, 4), (2, 8, 2), (4, 8, 2), (8, 8, 2), (4, 4, 1),
]


def _rand(*shape, dtype, seed=0):
    return randn(*shape, dtype=dtype, seed=seed, device="cuda")


def _split_packed_qkv(qkv, num_q_heads, num_kv_heads):
    """Views q, k, v of a packed projection output `[B, S, (Hq + 2*Hkv) * D]` (no copy)."""
    B, S, width = qkv.shape
    heads = num_q_heads + 2 * num_kv_heads
    assert width % heads == 0
    x = qkv.view(B, S, heads, width // heads)
    return (x[:, :, :num_q_heads], x[:, :, num_q_heads:num_q_heads + num_kv_heads],
            x[:, :, num_q_heads + num_kv_heads:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("P,Hq,Hkv", HEADS)
@pytest.mark.parametrize("B,S,D", [(1, 37, 64), (3, 5, 128), (2, 16, 8)])
def test_pack_matches_torch_layout(dtype, P, Hq, Hkv, B, S, D):
    needs_extension(fused_ops=True)
    q = _rand(B, S, Hq, D, dtype=dtype, seed=1)
    k = _rand(B, S, Hkv, D, dtype=dtype, seed=2)
    v = _rand(B, S, Hkv, D, dtype=dtype, seed=3)
    expected = pack_for_heads([q, k, v], placements_for([Hq, Hkv, Hkv], P), P)
    got = ops.pack([q, k, v], P)
    assert torch.equal(got, expected)
    # strided sources: a packed projection output, and a transposed (head-major) tensor
    qkv = torch.cat([q, k, v], dim=2).reshape(B, S, -1)
    qs, ks, vs = _split_packed_qkv(qkv, Hq, Hkv)
    assert torch.equal(ops.pack([qs, ks, vs], P), expected)
    kt = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert torch.equal(ops.pack([q, kt, v], P), expected)
    # misaligned source (scalar fallback) and a non-unit head-dim stride
    qm = torch.empty(q.numel() + 1, dtype=dtype, device="cuda")[1:].view_as(q).copy_(q)
    assert torch.equal(ops.pack([qm, k, v], P), expected)
    qd = torch.empty(B, S, Hq, D, 2, dtype=dtype, device="cuda")[..., 0]
    qd.copy_(q)
    assert torch.equal(ops.pack([qd, k, v], P), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("P,Hq,Hkv", HEADS)
def test_chunked_pack_and_unpack_match_reference_ops(dtype, P, Hq, Hkv):
    needs_extension(fused_ops=True)
    B, S, D = 2, 9, 64
    q = _rand(B, S, Hq, D, dtype=dtype, seed=4)
    k = _rand(B, S, Hkv, D, dtype=dtype, seed=5)
    v = _rand(B, S, Hkv, D, dtype=dtype, seed=6)
    heads = HeadPlan(P, Hq, Hkv)
    local, replicas = _placement_lists([Hq, Hkv, Hkv], P)
    for chunks in range(1, heads.local_q_heads + 1):
        for c in fused.plan_chunks(heads.local_q_heads, heads.local_kv_heads, chunks):
            send = torch.full((P, B, S, c.channels, D), float("nan"), dtype=dtype, device="cuda")
            ref = send.clone()
            args = ([c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt])
            ops.pack_into([q, k, v], send, *args)  # the kernel, placements from layout.py
            ReferenceOps.pack_into([q, k, v], ref, *args, local, replicas)
            assert torch.equal(send, ref)
            # backward direction: gradients of this chunk's heads (replicas summed)
            recv = _rand(P, B, S, c.grad_channels, D, dtype=dtype, seed=7 + chunks)
            outs = [torch.zeros(B, S, h, D, dtype=dtype, device="cuda") for h in (Hq, Hkv, Hkv)]
            refs = [o.clone() for o in outs]
            gargs = ([c.q_off, c.g_off, c.g_off], [c.q_cnt, c.g_cnt, c.g_cnt])
            ops.unpack_into(recv, outs, *gargs)
            ReferenceOps.unpack_into(recv, refs, *gargs, local, replicas)
            for a, b in zip(outs, refs):
                assert torch.equal(a, b)


def _rope(B, S, D, dtype, device, seed):
    """Rotary tables `[B, S, D]` as the fused layer passes them (one table, expanded)."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, S, D // 2, generator=g) * 6.28
    emb = torch.cat([angles, angles], dim=-1)
    return tuple(t.to(device=device, dtype=dtype).expand(B, S, D) for t in (emb.cos(), emb.sin()))


@pytest.mark.parametrize("P,Hq,Hkv", [(2, 4, 2), (4, 4, 1), (3, 6, 3)])
def test_reference_rotary_pack_is_rotary_then_pack(P, Hq, Hkv):
    """The stand-in's rotary pack = rotary.py's embedding on q and k (not v), then the pack."""
    from ulysses_kernels.rotary import apply_rotary

    q, k, v = _qkv(P, Hq, Hkv, B=2, S=5, D=8)
    cos, sin = _rope(2, 5, 8, torch.float32, "cpu", seed=P)
    local, replicas = _placement_lists([Hq, Hkv, Hkv], P)
    got = torch.empty(P, 2, 5, sum(local), 8)
    ReferenceOps.pack_into([q, k, v], got, [0, 0, 0], local, local, replicas, cos, sin, [1, 1, 0])
    want = pack_for_heads([apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v],
                          placements_for([Hq, Hkv, Hkv], P), P)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("P,Hq,Hkv", HEADS)
@pytest.mark.parametrize("B,S,D", [(2, 9, 64), (1, 5, 128), (2, 3, 8)])
def test_rotary_pack_matches_reference_ops(dtype, P, Hq, Hkv, B, S, D):
    """The rotary pack kernel (q and k rotated while packed, fp32 math, one rounding) against
    the stand-in, chunk by chunk; vector and scalar paths (a misaligned table)."""
    needs_extension(fused_ops=True)
    q = _rand(B, S, Hq, D, dtype=dtype, seed=11)
    k = _rand(B, S, Hkv, D, dtype=dtype, seed=12)
    v = _rand(B, S, Hkv, D, dtype=dtype, seed=13)
    cos, sin = _rope(B, S, D, dtype, "cuda", seed=D)
    heads = HeadPlan(P, Hq, Hkv)
    local, replicas = _placement_lists([Hq, Hkv, Hkv], P)
    misaligned = torch.empty(cos[0].numel() + 1, dtype=dtype, device="cuda")[1:].view(1, S, D)
    tables = [(cos, sin), (misaligned.copy_(cos[:1]).expand(B, S, D), sin)]
    for c in fused.plan_chunks(heads.local_q_heads, heads.local_kv_heads, min(2, heads.local_q_heads)):
        args = ([c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt])
        flags = [1, 1, 0]
        for cs, sn in tables:
            send = torch.full((P, B, S, c.channels, D), float("nan"), dtype=dtype, device="cuda")
            ref = send.clone()
            ops.pack_into([q, k, v], send, *args, rotary=(cs, sn, flags))
            ReferenceOps.pack_into([q, k, v], ref, *args, local, replicas, cs, sn, flags)
            tol = 0 if dtype == torch.float32 else 1  # FMA contraction: at most one last-bit step
            diff = (send.float() - ref.float()).abs()
            ulp = ref.float().abs().clamp_min(1e-30) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
            assert not torch.isnan(send).any()
            assert bool((diff <= tol * ulp + 1e-6 * ref.float().abs() + 1e-7).all()), diff.max()
    # error paths: flags without tables, a table of the wrong shape, a different dtype
    send = torch.empty((P, B, S, heads.local_q_heads + 2 * heads.local_kv_heads, D), dtype=dtype, device="cuda")
    local_counts = [heads.local_q_heads, heads.local_kv_heads, heads.local_kv_heads]
    with pytest.raises(RuntimeError, match="need cos and sin"):
        torch.ops.ulysses_kernels.pack_into([q, k, v], send, [0, 0, 0], local_counts, local, replicas, None, None,
                                            [1, 1, 0])
    with pytest.raises(RuntimeError, match="cos/sin must be"):
        ops.pack_into([q, k, v], send, [0, 0, 0], local_counts, rotary=(cos[:, :1], sin[:, :1], [1, 1, 0]))
    with pytest.raises(RuntimeError, match="cos/sin must be"):
        ops.pack_into([q, k, v], send, [0, 0, 0], local_counts, rotary=(cos.double(), sin.double(), [1, 1, 0]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("P,Hq,Hkv", HEADS)
def test_unpack_matches_torch_layout(dtype, P, Hq, Hkv):
    needs_extension(fused_ops=True)
    B, S, D = 2, 11, 128
    heads = HeadPlan(P, Hq, Hkv)
    hl_q, hl_kv = heads.local_q_heads, heads.local_kv_heads
    recv = _rand(P, B, S, heads.channels, D, dtype=dtype, seed=8)
    got = ops.unpack(recv, [Hq, Hkv, Hkv])
    exp = unpack_from_heads(recv, placements_for([Hq, Hkv, Hkv], P))
    assert torch.equal(got[0], exp[0])  # query heads: a pure copy
    for a, b in zip(got[1:], exp[1:]):
        if heads.kv_split:
            assert torch.equal(a, b)
        else:  # replica sums: fp32 accumulation vs torch's own reduction
            torch.testing.assert_close(a, b, rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-2)
    # strided outputs give the same bytes: head-major (16-byte path) and a head dim with
    # stride 2 (scalar path)
    for make in (lambda h: torch.empty(B, h, S, D, dtype=dtype, device="cuda").transpose(1, 2),
                 lambda h: torch.empty(B, S, h, D, 2, dtype=dtype, device="cuda")[..., 1]):
        outs = [make(h) for h in (Hq, Hkv, Hkv)]
        ops.unpack_into(recv, outs, [0, 0, 0], [hl_q, hl_kv, hl_kv])
        for a, b in zip(outs, got):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_attention_output_roundtrip_layout():
    """Reverse direction: `[B, S, Hl_q, D]` blocks -> unpack gives global head i*Hl_q + h."""
    needs_extension(fused_ops=True)
    P, B, Sp, Hq, D = 4, 2, 6, 8, 64
    recv = _rand(P, B, Sp, Hq // P, D, dtype=torch.bfloat16, seed=9)
    (out,) = ops.unpack(recv, [Hq])
    assert torch.equal(out, recv.permute(1, 2, 0, 3, 4).reshape(B, Sp, Hq, D))


@pytest.mark.gpu
def test_bad_arguments_raise():
    needs_extension(fused_ops=True)
    q = _rand(1, 4, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="neither split"):
        ops.pack([q], 4)
    send = torch.empty(2, 1, 4, 3, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="counts sum"):
        ops.pack_into([q], send, [0], [2])
    with pytest.raises(RuntimeError, match="dtype"):
        ops.pack([q.double()], 2)
    # a placement that does not describe the tensor is refused by the kernels' host code
    p = place_heads(6, 2)
    raw = torch.ops.ulysses_kernels
    with pytest.raises(RuntimeError, match="do not describe"):
        raw.pack_into([q], send, [0], [p.local], [p.local], [2])
    with pytest.raises(RuntimeError, match="do not describe"):
        raw.unpack_into(send, [q], [0], [p.local], [p.local + 1], [p.replicas])
    with pytest.raises(RuntimeError, match="exceeds its 3 heads"):
        raw.pack_into([q], send, [1], [p.local], [p.local], [p.replicas])


def test_stand_ins_restore_what_was_there():
    """enable_fused_stand_ins / fused_stand_ins put back the ops and the transport that were
    installed before, also when nested (use_ops and use_transport return the previous ones)."""
    from ulysses_kernels.fused import engine as fused_engine
    from ulysses_kernels.testing import HostTransport

    class OtherTransport(HostTransport):
        pass

    previous = fused.use_transport(None, OtherTransport)
    try:
        with testing.fused_stand_ins():
            assert ops.table() is ReferenceOps and fused_engine._transport_for[0] is HostTransport
            with testing.fused_stand_ins():
                assert ops.device_types() == ("cpu", "cuda")
            assert ops.table() is ReferenceOps and fused_engine._transport_for[0] is HostTransport
        assert ops.device_types() == ops.EXTENSION_DEVICE_TYPES
        assert fused_engine._transport_for[0] is OtherTransport
    finally:
        fused.use_transport(None, previous)
    assert 0 not in fused_engine._transport_for


def test_nccl_transport_reads_its_switches_before_any_collective(monkeypatch):
    """A bad ULYSSES_KERNELS_NCCL_CHECK raises when the communicator is created, before the
    unique-id broadcast and any extension call, not in the middle of a call."""
    from ulysses_kernels.fused import transport as fused_transport

    calls = []
    monkeypatch.setattr(fused_transport, "_extension", lambda: calls.append(1))
    monkeypatch.setenv(env.NCCL_CHECK.name, "maybe")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_NCCL_CHECK='maybe' is not a boolean"):
        fused.NcclTransport(None, 2, 0, torch.device("cpu"))
    monkeypatch.setenv(env.NCCL_CHECK.name, "0")
    monkeypatch.setenv(env.NCCL_BLOCKING.name, "sometimes")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_NCCL_BLOCKING"):
        fused.NcclTransport(None, 2, 0, torch.device("cpu"))
    assert calls == []
