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
    (1, (1, 5, 16, 2, 2, 16, False, True, True, 1)),    # one chunk at P = 1: identity head order, no gather
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


# --------------------- kernel index math on the host (the kernels compiled as C++ code)

_HARNESS = r"""// Host emulation of the pack/unpack kernels' index math (generated by tests/test_extension.py).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <vector>
#include <random>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __launch_bounds__
#define __launch_bounds__(x)
#undef blockIdx
#undef threadIdx
#undef gridDim
#undef blockDim
struct Idx { unsigned x, y, z; };
static Idx blockIdx, threadIdx, gridDim, blockDim;
@KERNELS@
}  // namespace

// ---------------- reference (float32 data, any element size emulated via ELEM=4)
template <typename F>
void launch(F kernel, int64_t grid_x, int grid_y) {
  gridDim = {(unsigned)grid_x, (unsigned)grid_y, 1};
  for (unsigned by = 0; by < (unsigned)grid_y; ++by)
    for (unsigned bx = 0; bx < grid_x; ++bx)
      for (unsigned t = 0; t < (unsigned)kThreads; ++t) {
        blockIdx = {bx, by, 0}; threadIdx = {t, 0, 0};
        kernel();
      }
}

int64_t grid_for_host(int64_t rows, int inner, int64_t cap) {
  const int it = inner < kThreads ? inner : kThreads;
  const int rpb = kThreads / it;
  int64_t b = (rows + rpb - 1) / rpb;
  if (b > cap) b = cap;
  return b < 1 ? 1 : b;
}

int failures = 0;

// One tensor set: srcs float arrays with strides; test pack then unpack (copy/sum).
template <int V>
void run_case(int P, int B, int S, std::vector<int> H, int D, std::vector<int> off, std::vector<int> cnt,
              bool transposed, int64_t cap) {
  std::mt19937 rng(P * 1000 + B * 100 + S + D);
  std::uniform_real_distribution<float> U(-1, 1);
  int n = H.size();
  std::vector<std::vector<float>> src(n);
  std::vector<int64_t> sb(n), ss(n), sh(n);
  for (int t = 0; t < n; ++t) {
    src[t].resize((size_t)B * S * H[t] * D);
    for (auto& x : src[t]) x = U(rng);
    if (!transposed) { sh[t] = D; ss[t] = (int64_t)H[t] * D; sb[t] = (int64_t)S * H[t] * D; }
    else { ss[t] = D; sh[t] = (int64_t)S * D; sb[t] = (int64_t)S * H[t] * D; }  // [B, H, S, D] memory
  }
  int C = 0; for (int c : cnt) C += c;
  std::vector<float> send((size_t)P * B * S * C * D, -7.f), ref(send.size(), -7.f);
  PackParams p{}; p.send = (char*)send.data(); p.P = P; p.B = B; p.S = S; p.C = C; p.D = D;
  int chan = 0, nj = 0;
  for (int t = 0; t < n; ++t) {
    int local, split, rep;
    if (H[t] % P == 0) { local = H[t] / P; split = 1; rep = 1; } else { local = 1; split = 0; rep = P / H[t]; }
    if (cnt[t] == 0) continue;
    PackJob& j = p.job[nj++];
    j.src = (const char*)src[t].data(); j.sb = sb[t]; j.ss = ss[t]; j.sh = sh[t]; j.sd = 1;
    j.local = local; j.split = split; j.rep = rep; j.offset = off[t]; j.count = cnt[t]; j.chan = chan;
    // reference
    for (int jj = 0; jj < P; ++jj) for (int b = 0; b < B; ++b) for (int s = 0; s < S; ++s)
      for (int l = 0; l < cnt[t]; ++l) for (int d = 0; d < D; ++d) {
        int head = split ? jj * local + off[t] + l : jj / rep;
        ref[((((size_t)jj * B + b) * S + s) * C + chan + l) * D + d] = src[t][b * sb[t] + s * ss[t] + head * sh[t] + d];
      }
    chan += cnt[t];
  }
  p.njobs = nj;
  int64_t grid = grid_for_host((int64_t)P * B * S, C * (D / V), cap);
  launch([&] { pack_kernel<4, V>(p); }, grid, 1);
  if (memcmp(send.data(), ref.data(), send.size() * 4) != 0) {
    ++failures; printf("PACK MISMATCH V=%d P=%d B=%d S=%d D=%d C=%d\n", V, P, B, S, D, C);
  }
  // unpack the send buffer back (as if it were the receive buffer of the backward)
  std::vector<std::vector<float>> out(n), oref(n);
  UnpackParams u{}; u.recv = (const char*)send.data(); u.P = P; u.B = B; u.S = S; u.C = C; u.D = D;
  chan = 0; nj = 0; int max_inner = 1;
  for (int t = 0; t < n; ++t) {
    out[t].assign((size_t)B * S * H[t] * D, 0.f); oref[t] = out[t];
    int local, split, rep;
    if (H[t] % P == 0) { local = H[t] / P; split = 1; rep = 1; } else { local = 1; split = 0; rep = P / H[t]; }
    if (cnt[t] == 0) continue;
    UnpackJob& j = u.job[nj++];
    j.out = (char*)out[t].data(); j.ob = sb[t]; j.os = ss[t]; j.oh = sh[t]; j.od = 1;
    j.local = local; j.split = split; j.rep = rep; j.offset = off[t]; j.count = cnt[t]; j.chan = chan;
    j.nheads = split ? P * cnt[t] : H[t];
    max_inner = std::max(max_inner, j.nheads * (D / V));
    for (int b = 0; b < B; ++b) for (int s = 0; s < S; ++s) for (int d = 0; d < D; ++d) {
      if (split) {
        for (int jj = 0; jj < P; ++jj) for (int l = 0; l < cnt[t]; ++l)
          oref[t][b * sb[t] + s * ss[t] + (jj * local + off[t] + l) * sh[t] + d] =
              send[((((size_t)jj * B + b) * S + s) * C + chan + l) * D + d];
      } else {
        for (int h = 0; h < H[t]; ++h) {
          float acc = 0; for (int r = 0; r < rep; ++r) acc += send[((((size_t)(h * rep + r) * B + b) * S + s) * C + chan) * D + d];
          oref[t][b * sb[t] + s * ss[t] + h * sh[t] + d] = acc;
        }
      }
    }
    chan += cnt[t];
  }
  launch([&] { unpack_kernel<float, V>(u); }, grid_for_host((int64_t)B * S, max_inner, cap), nj);
  for (int t = 0; t < n; ++t)
    if (memcmp(out[t].data(), oref[t].data(), out[t].size() * 4) != 0) {
      ++failures; printf("UNPACK MISMATCH t=%d V=%d P=%d B=%d S=%d D=%d\n", t, V, P, B, S, D);
    }
}

int main() {
  int cases = 0;
  for (int64_t cap : {3, 1000}) for (bool tr : {false, true})
  for (auto P : {1, 2, 4, 8}) for (auto hs : std::vector<std::vector<int>>{{8, 8, 8}, {8, 2, 2}, {8, 4, 4}, {16, 1, 1}})
  for (auto BS : std::vector<std::pair<int,int>>{{1, 5}, {2, 3}, {3, 7}}) for (int D : {8, 16, 64, 128, 256}) {
    std::vector<int> H = hs;
    if (H[0] % P) continue;
    std::vector<int> local(3), off(3), cnt(3);
    for (int t = 0; t < 3; ++t) local[t] = H[t] % P == 0 ? H[t] / P : 1;
    // full, and a chunk in the middle (q offset 1 when possible)
    for (int mode = 0; mode < 2; ++mode) {
      for (int t = 0; t < 3; ++t) { off[t] = 0; cnt[t] = local[t]; }
      if (mode == 1) {
        if (local[0] < 2) continue;
        off[0] = 1; cnt[0] = local[0] - 1;
        if (local[1] >= 2) { off[1] = off[2] = 1; cnt[1] = cnt[2] = local[1] - 1; } else { cnt[1] = cnt[2] = 0; }
      }
      run_case<1>(P, BS.first, BS.second, H, D, off, cnt, tr, cap);
      run_case<4>(P, BS.first, BS.second, H, D, off, cnt, tr, cap);
      cases += 2;
    }
  }
  printf("%d cases, %d failures\n", cases, failures);
  return failures != 0;
}
"""


def _cuda_include_dirs():
    import glob
    import sys
    import shutil
    dirs = []
    for site in sys.path:
        dirs += glob.glob(os.path.join(site, "nvidia", "cu[0-9]*", "include"))
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    dirs += [os.path.join(h, "include") for h in homes if h]
    return [d for d in dirs if os.path.isdir(d)]


def test_kernel_index_math_on_host(tmp_path):
    """Compile the bodies of pack_kernel / unpack_kernel as host C++ (g++, __global__ and
    __device__ defined away, blockIdx/threadIdx emulated by loops over a small capped grid
    so the grid-stride loops run) and compare them with a direct reference: all strides
    (BSHD and head-major sources), chunk offsets/counts, split and replicated heads
    (replica sums), scalar (V=1) and 16-byte (V=4 floats) paths, P in 1..8, D 8..256."""
    import shutil
    import subprocess
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    inc = _cuda_include_dirs()
    if not any(os.path.exists(os.path.join(d, "cuda_bf16.h")) for d in inc) or \
            not any(os.path.exists(os.path.join(d, "crt", "host_config.h")) for d in inc):
        pytest.skip("CUDA headers not found")
    src = open(os.path.join(os.path.dirname(__file__), "..", "csrc", "pack_kernels.cu")).read()
    start = src.index("namespace {")
    stop = src.index("// ------------------------------------------------------------------ host helpers")
    (tmp_path / "harness.cpp").write_text(_HARNESS.replace("@KERNELS@", src[start:stop]))
    exe = tmp_path / "harness"
    cmd = [cxx, "-std=c++20", "-O1", "-w"] + [f"-I{d}" for d in inc] + [str(tmp_path / "harness.cpp"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and " 0 failures" in run.stdout, run.stdout[-3000:]


# ----------------------------------------------------- NCCL engine host-side errors

def test_nccl_unique_id_and_handle_errors():
    _extension()
    ops = torch.ops.ulysses_kernels
    uid = ops.nccl_unique_id()
    assert uid.shape == (128,) and uid.dtype == torch.uint8 and uid.device.type == "cpu"
    ops.nccl_comm_destroy(987654)  # unknown handle: idempotent no-op
    with pytest.raises(RuntimeError, match="not open"):
        ops.nccl_comm_wait(987654, 1.0)
    with pytest.raises(RuntimeError, match="unique_id"):
        ops.nccl_comm_create(torch.zeros(5, dtype=torch.uint8), 1, 0, 0, 1.0)
    with pytest.raises(RuntimeError, match="bad rank"):
        ops.nccl_comm_create(uid, 2, 2, 0, 1.0)
    if not torch.cuda.is_available():
        # no GPU: a clear Python exception, not a crash
        with pytest.raises(RuntimeError):
            ops.nccl_comm_create(uid, 1, 0, 0, 1.0)


def test_unsupported_reason_cpu_and_dtypes():
    q = torch.randn(1, 4, 2, 16)
    assert "CUDA" in fused.unsupported_reason(q, q, q)


def test_default_group_engine_key_and_transport_override(monkeypatch, tmp_path):
    """`ulysses_attention` resolves group=None to dist.group.WORLD once torch.distributed
    is initialised; `use_transport(None, ...)` (what the one-GPU multi-rank GPU tests
    use) must reach that engine, and a replaced engine must be closed."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.setattr(fused, "_transport_override", {})
    monkeypatch.setattr(fused, "_engines", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert fused._group_key(None) == fused._group_key(dist.group.WORLD) == 0
        fused.use_transport(None, "host")
        engine = fused.get_engine(dist.group.WORLD, 1, 0, torch.device("cpu"))
        assert engine.transport.name == "host"
        assert fused.get_engine(None, 1, 0, torch.device("cpu")) is engine
        closed = []
        monkeypatch.setattr(engine, "close", lambda: closed.append(True))
        other = fused.get_engine(dist.group.WORLD, 2, 0, torch.device("cpu"))  # world changed: new engine
        assert other is not engine and closed == [True]
    finally:
        fused._engines.clear()
        dist.destroy_process_group()


def test_engines_of_destroyed_groups_are_closed(monkeypatch, tmp_path):
    """An engine holds a communicator and grow-only buffers: once its group is destroyed,
    the next engine creation closes it, and close(group) closes one group's engines only."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.setattr(fused, "_engines", {})
    monkeypatch.setenv(fused.ENV_TRANSPORT, "host")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        first, second = dist.new_group([0]), dist.new_group([0])
        e_first = fused.get_engine(first, 1, 0, cpu)
        e_second = fused.get_engine(second, 1, 0, cpu)
        e_world = fused.get_engine(None, 1, 0, cpu)
        closed = []
        for name, e in (("first", e_first), ("second", e_second), ("world", e_world)):
            monkeypatch.setattr(e, "close", lambda name=name: closed.append(name))
        assert fused.get_engine(first, 1, 0, cpu) is e_first  # cached while alive
        dist.destroy_process_group(first)
        third = dist.new_group([0])
        fused.get_engine(third, 1, 0, cpu)                    # a miss prunes destroyed groups
        assert closed == ["first"]
        assert fused.get_engine(second, 1, 0, cpu) is e_second
        fused.close(second)
        assert closed == ["first", "second"]
        assert fused.get_engine(None, 1, 0, cpu) is e_world
        fused.close()
        assert closed == ["first", "second", "world"] and not fused._engines
    finally:
        fused._engines.clear()
        dist.destroy_process_group()


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
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # packed documents, one of them empty
    y_docs = layer(x, position_embeddings=(cos, sin), cu_seqlens=cu)
    assert type(y_docs.grad_fn).__name__ == "_FusedSelfAttentionBackward"
    monkeypatch.undo()  # back to the reference path for the expected value
    expected_docs = layer(x, position_embeddings=(cos, sin), cu_seqlens=cu)
    torch.testing.assert_close(y_docs, expected_docs, rtol=2e-4, atol=2e-5)
    assert not torch.allclose(expected_docs, expected)  # the document boundaries matter
    monkeypatch.setattr(fused, "_ops_override", fused.ReferenceOps)
    monkeypatch.setattr(fused, "_engines", {})
    monkeypatch.setenv(fused.ENV_TRANSPORT, "host")
    monkeypatch.setenv(fused.ENV_CHUNKS, "2")
    monkeypatch.setattr(_backend, "resolve_backend", lambda *a, **k: "fused")
    layer.overlap_projections = False  # the plain composition on the fused attention op
    monkeypatch.setattr(fused, "unsupported_reason", lambda *a: None)
    y2 = layer(x, position_embeddings=(cos, sin))
    assert type(y2.grad_fn).__name__ != "_FusedSelfAttentionBackward"
    torch.testing.assert_close(y2, expected, rtol=2e-4, atol=2e-5)


def test_fused_layer_frozen_weights_and_no_grad(monkeypatch):
    """Frozen weights get no gradient work (and None), only-o_proj training skips the
    exchanges, and a forward under torch.no_grad() saves nothing (engine buffers only)."""
    _extension()
    why = _triton_cpu_ok()
    if why:
        pytest.skip(why)
    from ulysses_kernels import fused_layer
    monkeypatch.setattr(fused, "_ops_override", fused.ReferenceOps)
    case = (1, 6, 24, 4, 2, 16, True, True, False, 2)
    layer, x, dy, _ = _layer_and_inputs(case)
    engine = fused.Engine(None, 1, 0, torch.device("cpu"), "host")
    plan = tuple(fused.plan_chunks(4, 2, 2))
    params = _layer_params(layer)

    def run(x_in):
        return fused_layer._FusedSelfAttention.apply(x_in, *params, None, None, engine, [6], True, 0.25, None,
                                                     plan, (4, 2, 16), torch.is_grad_enabled())

    with torch.no_grad():
        run(x)
    assert {"fwd_recv", "fwd_osend"} <= set(engine._buffers)  # no per-call saved copies

    ref_layer, _, _, _ = _layer_and_inputs(case)
    xr = x.clone().requires_grad_(True)
    ref_layer(xr).backward(dy)
    for p in params:  # frozen QKV projection: only x and the output projection train
        p.grad = None
    layer.qkv_proj.weight.requires_grad_(False)
    layer.qkv_proj.bias.requires_grad_(False)
    xf = x.clone().requires_grad_(True)
    run(xf).backward(dy)
    assert layer.qkv_proj.weight.grad is None and layer.qkv_proj.bias.grad is None
    torch.testing.assert_close(xf.grad, xr.grad, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(layer.o_proj.weight.grad, ref_layer.o_proj.weight.grad, rtol=2e-4, atol=2e-5)
    layer.o_proj.weight.grad = layer.o_proj.bias.grad = None
    calls = []
    monkeypatch.setattr(fused_layer, "_backward", lambda *a, **k: calls.append(1))
    run(x).backward(dy)  # x frozen too: only W_o, b_o train, no exchange in the backward
    assert calls == []
    torch.testing.assert_close(layer.o_proj.weight.grad, ref_layer.o_proj.weight.grad, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(layer.o_proj.bias.grad, ref_layer.o_proj.bias.grad, rtol=2e-4, atol=2e-5)
