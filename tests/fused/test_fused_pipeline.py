"""The fused path's attention (ulysses_kernels.fused: engine, pipeline, attention).

On CPU the whole pipeline (chunking, buffer views, GQA replication, shared-KV gradient
accumulation, the Triton attention in the interpreter) runs with the stand-ins of
`ulysses_kernels.testing` (pure-torch pack/unpack ops, a host-memory transport over gloo)
through the public API with `backend="fused"`, at world sizes 1 to 4, against the
reference path. The engine cache (per group, transports, closing) is tested on CPU too.

Marked `gpu`: the CUDA kernels and the NCCL engine at world size 1 (a one-rank
communicator), and world sizes 2 and 4 on ONE GPU. NCCL refuses two ranks on the same
device ("Duplicate GPU detected"), so those select `testing.HostTransport`
(`fused.use_transport(None, HostTransport)`): every CUDA part of the fused path runs for
real (pack/unpack kernels, chunking, comm/compute streams and events, Triton attention
reading the receive buffers in place, GQA replica sums), and only the NCCL call is
replaced by a gloo `all_to_all_single` of the same bytes through host memory. Run them
with `ULYSSES_KERNELS_TRITON_AUTOTUNE=0 pytest -m gpu tests/fused/test_fused_pipeline.py`.
Every spawned process group has a timeout.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
from helpers import (
    SLOW_SPAWN_TIMEOUT,
    brute_force_attention,
    check_rank_against_reference,
    make_qkv,
    needs_extension,
    needs_interpreter,
    param_id,
    randn,
    rel_err,
    seq_lens,
    shard,
)

import ulysses_kernels as uk
from ulysses_kernels import env, fused, testing
from ulysses_kernels.fused import engine as fused_engine
from ulysses_kernels.fused.attention import _FusedUlyssesAttention
from ulysses_kernels.fused.pipeline import AttentionOptions, Geometry
from ulysses_kernels.launch import spawn
from ulysses_kernels.layout import HeadPlan
from ulysses_kernels.reference import reference_attention
from ulysses_kernels.testing import HostTransport

CPU = torch.device("cpu")


def _grad_fn(t):
    return type(t.grad_fn).__name__


# ------------------------------------------ the pipeline on CPU, one process (stand-ins)

@pytest.mark.parametrize("Hq,Hkv,chunks", [(4, 4, 2), (4, 2, 2), (4, 1, 4), (8, 2, 8), (4, 2, 1)])
def test_fused_pipeline_cpu_world1(Hq, Hkv, chunks, monkeypatch):
    """`ulysses_attention(backend="fused")` on CPU tensors with the stand-ins installed,
    chunk count from the environment, against the reference path."""
    needs_interpreter()
    torch.manual_seed(0)
    B, S, D = 2, 6, 16
    q = torch.randn(B, S, Hq, D)
    k = torch.randn(B, S, Hkv, D)
    v = torch.randn(B, S, Hkv, D)
    do = torch.randn(B, S, Hq, D)
    monkeypatch.setenv(env.NUM_CHUNKS.name, str(chunks))
    with testing.fused_stand_ins():
        setup = fused.prepare(q.shape, Hkv, q.dtype, CPU, group=None, rank=0, seq_lens=[S], causal=True,
                              softmax_scale=0.25)
        assert len(setup.plan) == chunks and setup.engine.transport.name == "host"
        qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = uk.ulysses_attention(qf, kf, vf, causal=True, backend="fused")
        assert _grad_fn(out) == "_FusedUlyssesAttentionBackward"
        out.backward(do)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = uk.ulysses_attention(qr, kr, vr, causal=True, backend="reference")
    ref.backward(do)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(qf.grad, qr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kf.grad, kr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(vf.grad, vr.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunks", [1, 2])
def test_fused_pipeline_cpu_variants(chunks, monkeypatch):
    """A window, softcap and sinks through the chunked pipeline (each chunk its heads'
    sinks), against the float64 brute force."""
    needs_interpreter()
    q, k, v, do = make_qkv(2, 9, 4, 2, 16, dtype=torch.float32, seed=11)
    sinks = randn(4, seed=3)
    monkeypatch.setenv(env.NUM_CHUNKS.name, str(chunks))
    options = dict(causal=True, window_size=(3, -1), softcap=5.0)
    with testing.fused_stand_ins():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        out = uk.ulysses_attention(*leaves[:3], sinks=leaves[3], backend="fused", **options)
        assert _grad_fn(out) == "_FusedUlyssesAttentionBackward"
        out.backward(do)
    want = brute_force_attention(q, k, v, do, sinks=sinks, **options)
    for name, got, ref in zip(("out", "dq", "dk", "dv", "dsinks"), [out] + [t.grad for t in leaves], want):
        assert rel_err(got, ref) < 2e-5, name


def test_fused_pipeline_cpu_retain_graph():
    """retain_graph=True: a second backward gives the same gradients again; without it,
    a second backward raises torch's usual error instead of reading freed buffers."""
    needs_interpreter()
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 5, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    do = torch.randn(1, 5, 4, 16)
    qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
    with testing.fused_stand_ins():
        out = fused.ulysses_attention(qf, kf, vf, group=None, rank=0, seq_lens=[5], causal=False,
                                      softmax_scale=1.0 / math.sqrt(16), num_chunks=2)
        out.backward(do, retain_graph=True)
        first = [t.grad.clone() for t in (qf, kf, vf)]
        out.backward(do)
        for t, g in zip((qf, kf, vf), first):
            torch.testing.assert_close(t.grad, 2 * g, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="second time"):
            out.backward(do)


def test_fused_attention_op_no_grad_uses_engine_buffers():
    """The autograd function on an engine built with an explicit transport factory: under
    torch.no_grad() nothing is saved (the receive and output buffers are the engine's),
    with a gradient they are per-call tensors."""
    needs_interpreter()
    q, k, v, _ = make_qkv(1, 6, 4, 2, 16, dtype=torch.float32, seed=2)
    previous = fused.use_ops(testing.ReferenceOps)
    try:
        engine = fused.Engine(None, 1, 0, CPU, HostTransport)
        assert isinstance(engine.transport, HostTransport) and engine.stream is None
        setup = fused.Setup(engine=engine, geometry=Geometry(batch=1, lens=(6,), rank=0, head_dim=16),
                            attention=AttentionOptions(causal=True, softmax_scale=0.25, cu_seqlens=None),
                            plan=tuple(fused.plan_chunks(4, 2, 2)))
        with torch.no_grad():
            out = _FusedUlyssesAttention.apply(q, k, v, None, setup, torch.is_grad_enabled())
        assert {"fwd_recv", "fwd_osend", "fwd_orecv", "fwd_send"} <= set(engine._buffers)
        ref, _ = reference_attention(q, k, v, causal=True, softmax_scale=0.25)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        engine._buffers.clear()
        qg = q.clone().requires_grad_(True)
        out = _FusedUlyssesAttention.apply(qg, k, v, None, setup, True)
        assert "fwd_recv" not in engine._buffers and "fwd_orecv" in engine._buffers
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    finally:
        fused.use_ops(previous)


def test_problem_cpu_and_dtypes():
    q = torch.randn(1, 4, 2, 16)
    assert "needs CUDA tensors, got tensors on cpu" in fused.problem(CPU, (q, q, q))
    with testing.fused_stand_ins():  # the stand-ins run on CPU: only the kernels' limits remain
        assert fused.problem(CPU, (q, q, q)) is None
        assert "float16/bfloat16/float32" in fused.problem(CPU, (q.double(), q.double(), q.double()))
        assert "multiple of 16" in fused.problem(CPU, (q[..., :8], q[..., :8], q[..., :8]))
        assert "v's head dim (32) differs" in fused.problem(CPU, (q, q, torch.randn(1, 4, 2, 32)))
        with pytest.raises(RuntimeError, match="the fused path cannot run these inputs: .*head dim.*; "
                                               "use backend='triton' or 'reference'"):
            fused.ulysses_attention(q[..., :8], q[..., :8], q[..., :8], group=None, rank=0, seq_lens=[4],
                                    causal=False, softmax_scale=1.0)
        with pytest.raises(ValueError, match="backend='fused' cannot run these inputs"):
            uk.ulysses_attention(q.double(), q.double(), q.double(), backend="fused")


# ------------------------------------ the pipeline on CPU over gloo (stand-ins, worlds 2-4)

def cpu_rank_worker(rank, world, case):
    """One rank: `ulysses_attention(backend="fused")` with the stand-ins over gloo vs the
    full single-process reference (out and grads of this rank's slice)."""
    B, S, Hq, Hkv, D, causal, chunks, expected_chunks = case
    q, k, v, do = make_qkv(B, S, Hq, Hkv, D, dtype=torch.float32, seed=1234)
    lens = seq_lens(S, world)
    restore = testing.enable_fused_stand_ins()
    try:
        os.environ[env.NUM_CHUNKS.name] = str(chunks)
        setup = fused.prepare((B, lens[rank], Hq, D), Hkv, torch.float32, CPU, group=dist.group.WORLD, rank=rank,
                              seq_lens=lens, causal=causal, softmax_scale=1.0)
        assert len(setup.plan) == expected_chunks and setup.engine.transport.name == "host"
        ql, kl, vl = (shard(t, world, rank).requires_grad_(True) for t in (q, k, v))
        out = uk.ulysses_attention(ql, kl, vl, causal=causal, backend="fused")
        assert _grad_fn(out) == "_FusedUlyssesAttentionBackward"
        out.backward(shard(do, world, rank))
    finally:
        restore()
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, causal=causal)
    ref.backward(do)
    pieces = [(out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)]
    for name, (a, b) in zip(("out", "dq", "dk", "dv"), pieces):
        b = torch.tensor_split(b, world, dim=1)[rank]
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("world,case", [
    (2, (2, 7, 4, 2, 16, True, 2, 2)),    # uneven S, B > 1 (3-D seq_splits views), GQA split, 2 chunks
    (4, (1, 10, 8, 2, 16, True, 2, 2)),   # KV heads replicated (fewer KV heads than ranks), shared KV across chunks
    (3, (2, 7, 6, 3, 16, False, 3, 2)),   # odd world, 3 chunks asked for 2 query heads: lowered to 2
])
def test_fused_pipeline_cpu_multirank(world, case):
    needs_interpreter()
    spawn(cpu_rank_worker, world, args=(case,), timeout=SLOW_SPAWN_TIMEOUT)


# ------------------------------------------------------------------- a user-held engine

def test_user_held_engine_runs_the_call_and_the_default_cache_stays_empty(monkeypatch):
    """engine=: the call (and UlyssesAttention(engine=)) runs on the caller's engine, exact
    against the reference; no default engine is made; bad engines get clear errors."""
    needs_interpreter()
    monkeypatch.setattr(fused_engine, "_engines", {})
    q, k, v, do = make_qkv(2, 9, 4, 2, 16, dtype=torch.float32, seed=5)
    with testing.fused_stand_ins():
        engine = fused.Engine.create(None, device=CPU)
        assert (engine.world, engine.rank, engine.transport.name) == (1, 0, "host")
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = uk.ulysses_attention(*leaves, causal=True, backend="fused", engine=engine)
        assert _grad_fn(out) == "_FusedUlyssesAttentionBackward"
        out.backward(do)
        module_out = uk.UlyssesAttention(causal=True, backend="fused", engine=engine)(q, k, v)
        assert engine._buffers and fused_engine._engines == {}  # the caller's engine, not the cache
        for bad, message in [(fused.Engine(None, 2, 1, CPU, HostTransport), "made for rank 1 of 2"),
                             (fused.Engine(None, 1, 0, torch.device("meta"), HostTransport), "is on meta"),
                             ("nccl", "must be a ulysses_kernels.fused.Engine")]:
            with pytest.raises(ValueError, match=message):
                uk.ulysses_attention(q, k, v, causal=True, backend="fused", engine=bad)
        engine.close()
    want = brute_force_attention(q, k, v, do, causal=True)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], want):
        assert rel_err(got, ref) < 2e-5, name
    assert rel_err(module_out, want[0]) < 2e-5


def engine_rank_worker(rank, world):
    """Rank 1 passes an engine of another rank, then every rank one of another group: every
    rank raises the same error each time (no hang); then every rank passes its own engine:
    exact, and no default engine is made."""
    q, k, v, do = make_qkv(1, 7 * world, 2 * world, world, 16, dtype=torch.float32, seed=77)
    restore = testing.enable_fused_stand_ins(dist.group.WORLD)
    try:
        mine = fused.Engine.create(dist.group.WORLD, device=CPU)
        wrong = fused.Engine(dist.group.WORLD, world, (rank + 1) % world, CPU, HostTransport)
        ql, kl, vl = (shard(t, world, rank) for t in (q, k, v))
        other_group = fused.Engine.create(dist.new_group(list(range(world))), device=CPU, transport=HostTransport)
        messages = []
        for engine in (wrong if rank == 1 else mine, other_group):
            try:
                uk.ulysses_attention(ql, kl, vl, causal=True, backend="fused", engine=engine)
                messages.append(None)
            except ValueError as exc:
                messages.append(str(exc))
        out = uk.ulysses_attention(ql, kl, vl, causal=True, backend="fused", engine=mine)
        cached = len(fused_engine._engines)
    finally:
        restore()
    ref, _ = reference_attention(q, k, v, causal=True)
    return messages, rel_err(out, shard(ref, world, rank)), cached


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_user_held_engine_errors_on_every_rank(world):
    needs_interpreter()
    reports = spawn(engine_rank_worker, world, timeout=SLOW_SPAWN_TIMEOUT)
    for i, expected in enumerate(("engine= was made for rank", "engine= was made for another process group")):
        messages = {report[0][i] for report in reports}
        assert len(messages) == 1 and expected in messages.pop(), messages
    assert all(err < 2e-5 and cached == 0 for _, err, cached in reports)


# ----------------------------------------------------------------------- the engine

def _single_rank_group(monkeypatch, tmp_path):
    """A one-rank gloo default group and empty engine tables (restored by monkeypatch);
    the caller destroys the group."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.setattr(fused_engine, "_transport_for", {})
    monkeypatch.setattr(fused_engine, "_engines", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)


def test_default_group_engine_key_and_transport_override(monkeypatch, tmp_path):
    """`ulysses_attention` resolves group=None to dist.group.WORLD once torch.distributed
    is initialised; `use_transport(None, ...)` (what the one-GPU multi-rank GPU tests
    use) must reach that engine, and a replaced engine must be closed."""
    _single_rank_group(monkeypatch, tmp_path)
    try:
        assert fused_engine._group_key(None) == fused_engine._group_key(dist.group.WORLD) == 0
        fused.use_transport(None, HostTransport)
        engine = fused.get_engine(dist.group.WORLD, 1, 0, CPU)
        assert engine.transport.name == "host" and isinstance(engine.transport, HostTransport)
        assert fused.get_engine(None, 1, 0, CPU) is engine
        closed = []
        monkeypatch.setattr(engine, "close", lambda: closed.append(True))
        other = fused.get_engine(dist.group.WORLD, 2, 0, CPU)  # world changed: new engine
        assert other is not engine and closed == [True]
        fused.use_transport(None, None)  # back to NCCL: the cached engine of the group is dropped
        assert fused_engine._transport_for == {} and fused_engine._engines == {}
    finally:
        fused_engine._engines.clear()
        dist.destroy_process_group()


def test_engines_of_destroyed_groups_are_closed(monkeypatch, tmp_path):
    """An engine holds a communicator and grow-only buffers: once its group is destroyed,
    the next engine creation closes it, and close(group) closes one group's engines only."""
    _single_rank_group(monkeypatch, tmp_path)
    try:
        first, second, third = dist.new_group([0]), dist.new_group([0]), dist.new_group([0])
        for group in (first, second, third, None):
            fused.use_transport(group, HostTransport)
        e_first = fused.get_engine(first, 1, 0, CPU)
        e_second = fused.get_engine(second, 1, 0, CPU)
        e_world = fused.get_engine(None, 1, 0, CPU)
        closed = []
        for name, e in (("first", e_first), ("second", e_second), ("world", e_world)):
            monkeypatch.setattr(e, "close", lambda name=name: closed.append(name))
        assert fused.get_engine(first, 1, 0, CPU) is e_first  # cached while alive
        dist.destroy_process_group(first)
        fused.get_engine(third, 1, 0, CPU)                    # a miss prunes destroyed groups
        assert closed == ["first"]
        assert fused.get_engine(second, 1, 0, CPU) is e_second
        fused.close(second)
        assert closed == ["first", "second"]
        assert fused.get_engine(None, 1, 0, CPU) is e_world
        fused.close()
        assert closed == ["first", "second", "world"] and not fused_engine._engines
    finally:
        fused_engine._engines.clear()
        dist.destroy_process_group()


def test_engine_builds_its_transport_with_the_factory():
    made = []

    class Recording(HostTransport):
        name = "recording"

        def __init__(self, group, world, rank, device):
            made.append((group, world, rank, device))
            super().__init__(group, world, rank, device)

    engine = fused.Engine(None, 1, 0, CPU, Recording)
    assert made == [(None, 1, 0, CPU)] and engine.transport.name == "recording"
    buf = engine.buffer("x", 10, torch.float32)
    assert buf.shape == (10,) and buf.dtype == torch.float32
    assert engine.buffer("x", 4, torch.float16).data_ptr() == buf.data_ptr()  # grow-only: reused
    assert engine.buffer("x", 20, torch.float32).numel() == 20
    engine.close()
    assert engine._buffers == {}


# ------------------------------------------------------ fused attention, world 1 (GPU, NCCL)

def _rand(*shape, dtype, seed=0):
    return randn(*shape, dtype=dtype, seed=seed, device="cuda")


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=param_id)
@pytest.mark.parametrize("B,S,Hq,Hkv,D,causal", [(2, 128, 4, 4, 64, True), (1, 200, 8, 2, 128, False)])
def test_fused_world1_matches_reference(dtype, B, S, Hq, Hkv, D, causal):
    needs_extension(fused_ops=True)
    q = _rand(B, S, Hq, D, dtype=dtype, seed=10)
    k = _rand(B, S, Hkv, D, dtype=dtype, seed=11)
    v = _rand(B, S, Hkv, D, dtype=dtype, seed=12)
    do = _rand(B, S, Hq, D, dtype=dtype, seed=13)
    _check_against_reference(q, k, v, do, causal=causal)
    assert fused.get_engine(None, 1, 0, q.device).transport.name == "nccl"


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_fused_world1_chunked_and_cu_seqlens(chunks):
    needs_extension(fused_ops=True)
    B, S, Hq, Hkv, D = 1, 160, 8, 2, 64
    q = _rand(B, S, Hq, D, dtype=torch.bfloat16, seed=14)
    k = _rand(B, S, Hkv, D, dtype=torch.bfloat16, seed=15)
    v = _rand(B, S, Hkv, D, dtype=torch.bfloat16, seed=16)
    do = _rand(B, S, Hq, D, dtype=torch.bfloat16, seed=17)
    cu = torch.tensor([0, 50, 51, 160], dtype=torch.int32, device="cuda")
    _check_against_reference(q, k, v, do, causal=True, cu_seqlens=cu, num_chunks=chunks)


@pytest.mark.gpu
def test_fused_world1_env_chunks(monkeypatch):
    needs_extension(fused_ops=True)
    monkeypatch.setenv(env.NUM_CHUNKS.name, "2")
    q = _rand(2, 64, 4, 64, dtype=torch.bfloat16, seed=18)
    k = _rand(2, 64, 4, 64, dtype=torch.bfloat16, seed=19)
    _check_against_reference(q, k, k, q, causal=True)


@pytest.mark.gpu
def test_unsupported_inputs_give_reasons():
    needs_extension(fused_ops=True)
    q = _rand(1, 8, 2, 64, dtype=torch.float32).double()
    assert "bfloat16" in fused.problem(q.device, (q, q, q))
    q = _rand(1, 8, 2, 40, dtype=torch.bfloat16)
    assert "head dim" in fused.problem(q.device, (q, q, q))
    with pytest.raises(RuntimeError, match="head dim"):
        fused.ulysses_attention(q, q, q, group=None, rank=0, seq_lens=[8], causal=False, softmax_scale=1.0)


@pytest.mark.gpu
def test_engine_buffers_are_reused():
    needs_extension(fused_ops=True)
    q = _rand(1, 96, 4, 64, dtype=torch.bfloat16, seed=20)
    with torch.no_grad():
        uk.ulysses_attention(q, q, q, backend="fused", seq_lens=[96])
        engine = fused.get_engine(None, 1, 0, q.device)
        before = {k: b.data_ptr() for k, b in engine._buffers.items()}
        torch.cuda.synchronize()
        for _ in range(3):
            uk.ulysses_attention(q, q, q, backend="fused", seq_lens=[96])
        assert {k: b.data_ptr() for k, b in engine._buffers.items()} == before


@pytest.mark.gpu
def test_nccl_bad_counts_raise():  # before the capture test: a failed capture aborts the communicator
    needs_extension(fused_ops=True)
    engine = fused.get_engine(None, 1, 0, torch.device("cuda", torch.cuda.current_device()))
    x = torch.zeros(16, device="cuda")
    with pytest.raises(RuntimeError, match="exceed"):
        torch.ops.ulysses_kernels.nccl_all_to_all(engine.transport.handle, x, x.clone(), [32], [32])


@pytest.mark.gpu
@pytest.mark.parametrize("blocking", ["0", "1"])
def test_fused_world1_cuda_graph_capture(blocking, monkeypatch):
    """With seq_lens given the forward has no host sync: capture it and replay. Both NCCL
    modes: non-blocking (the default; NCCL >= 2.19 launches from a helper thread, so the
    capture must tolerate other threads: capture_error_mode="thread_local", as the README
    says) and blocking (ULYSSES_KERNELS_NCCL_BLOCKING=1, read when the communicator is
    created; the default global capture mode)."""
    needs_extension(fused_ops=True)
    monkeypatch.setenv(env.NCCL_BLOCKING.name, blocking)
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
        mode = "thread_local" if blocking == "0" else "global"
        with torch.cuda.graph(graph, capture_error_mode=mode):
            static = uk.ulysses_attention(q, k, k, backend="fused", seq_lens=[128])
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(static, eager)


# ---------------------------------- world sizes 2 and 4 on one GPU (host transport, GPU)

def gpu_rank_worker(rank, world, case):
    """One rank on GPU 0: the fused path with the CUDA kernels and HostTransport."""
    torch.cuda.set_device(0)
    fused.use_transport(None, HostTransport)
    B, S, Hq, Hkv, D, causal, dtype_name, chunks = case
    dtype = getattr(torch, dtype_name)
    full = [randn(B, S, h, D, dtype=dtype, seed=99 + i, device="cuda") for i, h in enumerate((Hq, Hkv, Hkv, Hq))]
    lens = seq_lens(S, world)
    mine = [torch.tensor_split(t, world, dim=1)[rank].contiguous() for t in full]
    ql, kl, vl = (t.clone().requires_grad_(True) for t in mine[:3])
    os.environ[env.NUM_CHUNKS.name] = str(chunks)
    heads = HeadPlan(world, Hq, Hkv)
    assert len(fused.plan_chunks(heads.local_q_heads, heads.local_kv_heads, chunks)) == chunks
    out = uk.ulysses_attention(ql, kl, vl, causal=causal, seq_lens=lens, backend="fused")
    assert type(out.grad_fn).__name__ == "_FusedUlyssesAttentionBackward"
    assert fused.get_engine(None, world, rank, ql.device).transport.name == "host"
    out.backward(mine[3])
    check_rank_against_reference(full, out, (ql, kl, vl), rank=rank, world=world, causal=causal,
                                 tol=3e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("world,case", [
    (2, (2, 301, 8, 2, 64, True, "bfloat16", 2)),   # uneven S, B > 1, GQA split, 2 chunks
    (4, (1, 258, 8, 2, 128, True, "bfloat16", 2)),  # KV replicated, shared KV across chunks
    (4, (2, 130, 4, 4, 64, False, "float32", 1)),   # MHA fp32, uneven S, B > 1
], ids=param_id)
def test_fused_multirank_one_gpu(world, case):
    needs_extension(fused_ops=True)
    # under the GPU check's step timeout, so a hang fails one test
    spawn(gpu_rank_worker, world, args=(case,), timeout=60)
