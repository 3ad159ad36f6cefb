"""The stream-order checker (ulysses_kernels/testing/stream_order.py) over every mechanism
that orders work across streams: the fused pipeline (attention forward and backward, the
self-attention layer, chunked, every transport), the unchunked exchanges, the ring's
transfers on the engine, and checkpoint offload. Each configuration runs clean; each
mutation (one wait or record_stream left out) is caught, and the test prints what it found.

Simulated streams on CPU: the kernels run in the Triton interpreter and the pack/unpack
ops are the pure-torch stand-ins, so what is checked is the order the code asks for, as a
GPU would run it (docs/architecture.md, "Streams and the stream-order checker").
"""

import contextlib
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import SLOW_SPAWN_TIMEOUT, brute_force_attention, make_qkv, needs_interpreter, rel_err, seq_lens, shard
from torch import nn
from torch.utils.checkpoint import checkpoint

import ulysses_kernels as uk
from ulysses_kernels import env, fused, streams, testing
from ulysses_kernels.hf.training.offload import CheckpointOffload, enable_checkpoint_offload
from ulysses_kernels.launch import spawn
from ulysses_kernels.testing.stream_order import (
    Mutation,
    StreamOrderChecker,
    StreamOrderedTransport,
    byte_spans,
    covers,
    fake_symmetric_memory,
    transports,
)

CPU = torch.device("cpu")


# ----------------------------------------------------------------- the checker itself

def test_byte_spans_of_strided_views():
    base = torch.zeros(4, 6, dtype=torch.float32)
    assert byte_spans(base).tolist() == [[0, 96]]
    assert byte_spans(base[:, 2:4]).tolist() == [[8, 16], [32, 40], [56, 64], [80, 88]]
    assert byte_spans(base.t()[1]).tolist() == [[4, 8], [28, 32], [52, 56], [76, 80]]
    assert byte_spans(base.view(-1).view(torch.uint8)[10:20]).tolist() == [[10, 20]]
    assert byte_spans(base[1:3].expand(2, 2, 6)).tolist() == [[24, 72]]  # repeated elements merge


def _read_on(side, *, wait=True):
    """A tensor written on the compute stream and read on `side` (after a stream wait unless
    wait=False): (the tensor, the read's result)."""
    x = torch.ones(8) * 2
    if wait:
        streams.wait_stream(side, streams.current_stream(CPU))
    with streams.on(side):
        return x, x + 1


def test_a_read_on_another_stream_needs_a_wait_and_memory_needs_record_stream():
    """The three rules on hand-written stream code: a read after a write on another stream,
    a write after a read on another stream, and a free while another stream still uses it."""
    with StreamOrderChecker() as c:
        _read_on(streams.new_stream(CPU), wait=False)
        assert c.violations and "reads memory that aten.mul" in c.violations[0]
    with StreamOrderChecker() as c:
        x, y = _read_on(streams.new_stream(CPU))
        x.add_(1)                                # overwritten while the side stream may read it
        assert len(c.violations) == 1 and "writes memory that aten.add" in c.violations[0]
    with StreamOrderChecker() as c:
        side = streams.new_stream(CPU)
        x, y = _read_on(side)
        streams.wait(streams.current_stream(CPU), streams.event(side))
        del x
        assert not c.violations, c.violations            # the free is ordered after the read
        x, y = _read_on(side)
        del x
        assert len(c.violations) == 1 and "was freed while" in c.violations[0]
        x, y = _read_on(side)
        streams.record_stream(x, side)
        del x, y
        assert len(c.violations) == 1, c.violations      # record_stream keeps it
    assert streams.current_stream(CPU) is None  # the real layer is back


def test_history_pruning_keeps_what_a_later_access_could_conflict_with():
    """The checker drops an access that a later one on the same stream covers: a read on
    the side stream of half a buffer, then of all of it, keeps the conflict with an
    unordered write of the first half; a later read of the other half alone covers
    nothing, so the first half's read is still there to conflict with."""
    with StreamOrderChecker() as c:
        side = streams.new_stream(CPU)
        x = torch.ones(8) * 2
        streams.wait_stream(side, streams.current_stream(CPU))
        with streams.on(side):
            x[:4].sum()
            x.sum()                              # covers the first read: it is pruned
            x[4:].sum()                          # covers only the second half
        x[:4].zero_()                            # unordered after both reads of the first half
        assert len(c.violations) == 1 and "aten.zero_" in c.violations[0] and "aten.sum" in c.violations[0]
    assert covers(np.array([[0, 16]]), np.array([[0, 8], [12, 16]]))
    assert not covers(np.array([[0, 8], [12, 16]]), np.array([[4, 14]]))
    assert not covers(np.zeros((0, 2), dtype=np.int64), np.array([[0, 1]]))


# ------------------------------------------------------------- the fused path, one rank

def _use(transport, groups=(None,)):
    """The stand-in pack/unpack ops and `transport` for `groups` (default: the default
    group); returns the function that restores what was there."""
    previous_ops = fused.use_ops(testing.ReferenceOps)
    previous = [(g, fused.use_transport(g, transport)) for g in groups]

    def restore():
        fused.use_ops(previous_ops)
        for g, p in previous:
            fused.use_transport(g, p)
        fused.close()
    return restore


def attention_steps(*, group, rank, world, chunks, Hq=4, Hkv=1, B=1, S=6, calls=2):
    """`calls` forward + backward calls of `ulysses_attention(backend="fused")` whose q, k, v
    are computed on the compute stream (so the pack must wait for them), then one call
    without a gradient (the engine's receive and output buffers, reused)."""
    q0, k0, v0, do = make_qkv(B, S, Hq, Hkv, 16, dtype=torch.float32, seed=7)
    os.environ[env.NUM_CHUNKS.name] = str(chunks)
    want = brute_force_attention(q0, k0, v0, do, causal=True)  # float64 out, dq, dk, dv
    for _ in range(calls):
        leaves = [shard(t, world, rank).requires_grad_(True) for t in (q0, k0, v0)]
        q, k, v = (t * 1.0 for t in leaves)
        out = uk.ulysses_attention(q, k, v, group=group, causal=True, backend="fused")
        (out * shard(do, world, rank)).sum().backward()
        # the simulated transports move the right bytes: this rank's slice of exact attention
        for got, ref in zip((out, *(t.grad for t in leaves)), want):
            assert rel_err(got, shard(ref, world, rank)) < 1e-5
    with torch.no_grad():
        q, k, v = (shard(t, world, rank) * 1.0 for t in (q0, k0, v0))
        out = uk.ulysses_attention(q, k, v, group=group, causal=False, backend="fused")
        float(out.sum())


def layer_steps(*, group, rank, world, chunks, Hq=4, Hkv=2):
    """Forward + backward of the fused self-attention block (projection GEMMs inside the
    pipeline, the output projection consuming each chunk one chunk late)."""
    torch.manual_seed(0)
    hidden, D, S = 32, 16, 7
    w_qkv = torch.randn((Hq + 2 * Hkv) * D, hidden, requires_grad=True)
    w_o = torch.randn(hidden, Hq * D, requires_grad=True)
    x = torch.randn(1, S, hidden)
    lens = seq_lens(S, world)
    xl = shard(x, world, rank).requires_grad_(True)
    y = fused.self_attention(xl * 1.0, w_qkv, None, w_o, None, num_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                             group=group, rank=rank, seq_lens=lens, causal=True, softmax_scale=1 / math.sqrt(D),
                             num_chunks=chunks)
    y.square().sum().backward()
    assert xl.grad is not None and w_qkv.grad is not None


def exchange_steps(*, group, rank, world):
    """The unchunked exchanges (seq -> heads and back) the ring hybrid and HF inference run."""
    x = torch.randn(1, 5 * world, 4 * world, 16)
    lens = seq_lens(x.shape[1], world)
    xl = shard(x, world, rank).requires_grad_(True)
    heads = fused.PATH.seq_to_heads([xl * 1.0], group=group, rank=rank, seq_lens=lens)[0]
    back = fused.PATH.heads_to_seq(heads * 2.0, group=group, rank=rank, seq_lens=lens)
    back.sum().backward()
    assert torch.allclose(back, 2 * xl) and xl.grad is not None


def run_checked(steps, transport, *, drop=(), **kwargs):
    """Run `steps` under the checker with `transport` (symm: on fake symmetric memory);
    returns (violations, (operations, waits), how often each mutation applied)."""
    restore = _use(transport)
    symm = fake_symmetric_memory() if transport is transports()["symm"] else contextlib.nullcontext()
    try:
        with symm, StreamOrderChecker(drop) as checker:
            steps(**kwargs)
            fused.close()
    finally:
        restore()
    import gc
    gc.collect()
    return checker.violations, (checker.operations, checker.waits), [m.dropped for m in checker.drop]


def _slow_but(fast, cases):
    """The cases as parameters, all but `fast` in the slow tier (the fast tier keeps one)."""
    return [pytest.param(*c, marks=() if c == fast else pytest.mark.slow) for c in cases]


@pytest.mark.parametrize("transport,chunks,Hq,Hkv,B", _slow_but(
    ("nccl", 4, 4, 1, 1), [(t, *c) for t in ("nccl", "host", "symm") for c in ((1, 4, 2, 1), (2, 4, 2, 2), (4, 4, 1, 1))]))
def test_fused_attention_one_rank_is_clean(transport, chunks, Hq, Hkv, B):
    """One chunk, two chunks at batch 2, and four chunks sharing one KV head (its dK/dV
    accumulated across chunks): forward and backward twice (buffers reused), then a call
    without a gradient; every transport."""
    needs_interpreter()
    violations, (ops, waits), _ = run_checked(attention_steps, transports()[transport], group=None, rank=0,
                                              world=1, chunks=chunks, Hq=Hq, Hkv=Hkv, B=B)
    assert not violations, "\n".join(violations)
    assert ops > 100 and waits >= 4 * chunks, (ops, waits)


@pytest.mark.parametrize("chunks", [2, 4])
def test_fused_attention_on_another_kernel_is_clean_and_its_wait_is_needed(chunks):
    """The pipeline's branch for a kernel other than ours (the kernel choice's pick; here
    `testing.kernel_stand_in`, the reference declared like an external kernel): its reads of
    the receive buffer and its copy into the send buffer are ordered after the chunk's exchange,
    forward and backward (four chunks share one KV head); without the wait they are not."""
    with testing.kernel_stand_in() as calls:
        violations, (ops, waits), _ = run_checked(attention_steps, StreamOrderedTransport, group=None, rank=0,
                                                  world=1, chunks=chunks, Hq=4, Hkv=1, B=1)
        ran = calls["run"]
    assert ran >= 2 * chunks and not violations, "\n".join(violations)
    with testing.kernel_stand_in():
        violations, _, dropped = run_checked(attention_steps, StreamOrderedTransport, drop=[MUTATIONS[0][2]],
                                             group=None, rank=0, world=1, chunks=chunks, Hq=4, Hkv=1, B=1)
    assert dropped[0] > 0 and violations, "removing the attention's wait for the exchange was not caught"


@pytest.mark.parametrize("chunks", _slow_but((2,), [(1,), (2,), (4,)]))
def test_fused_layer_and_exchanges_one_rank_are_clean(chunks):
    needs_interpreter()
    violations, (ops, waits), _ = run_checked(layer_steps, StreamOrderedTransport, group=None, rank=0, world=1,
                                              chunks=chunks)
    assert not violations, "\n".join(violations)
    assert waits >= 3 * chunks
    violations, _, _ = run_checked(exchange_steps, StreamOrderedTransport, group=None, rank=0, world=1)
    assert not violations, "\n".join(violations)


# ------------------------------------------------------------------------ checkpoint offload

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return checkpoint(lambda h: h + self.down(torch.tanh(self.up(h))), x, use_reentrant=False)


def offload_steps(drop=()):
    """Two steps of a checkpointed 3-block model with offload (device_type "cpu": the side
    stream simulated), the second reusing the host buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16) for _ in range(3)])
    x = torch.randn(2, 8, 16)
    with StreamOrderChecker(drop) as checker:
        offload = CheckpointOffload(device_type="cpu", min_bytes=0)
        enable_checkpoint_offload(list(model), offload)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(x * 1.0).square().mean().backward()
        assert offload.packed == 4 and offload.stream is not None
        del offload
    import gc
    gc.collect()
    return checker.violations, [m.dropped for m in checker.drop]


def test_checkpoint_offload_is_clean():
    violations, _ = offload_steps()
    assert not violations, "\n".join(violations)


# ------------------------------------------------------------------------- mutations

# (mechanism, what runs, the wait or record_stream left out)
MUTATIONS = [
    ("fused forward: attention waits for the chunk's exchange", "attention",
     Mutation("pipeline.py", "forward", "wait(compute, ready[i])")),
    ("fused backward: attention backward waits for dO's exchange", "attention",
     Mutation("pipeline.py", "backward", "wait(compute, ready[i])")),
    ("fused forward: the comm stream waits for the caller's q, k, v", "attention",
     Mutation("pipeline.py", "forward", "wait(comm, event(compute))")),
    ("fused: the reverse exchange waits for the chunk's attention", "attention",
     Mutation("pipeline.py", "_chunk_done", "wait(comm, done)")),
    ("fused: the caller's stream waits for the last unpack", "attention",
     Mutation("pipeline.py", "_pipeline_done", "wait(compute, event(engine.stream))")),
    ("fused layer: the pack waits for the chunk's projection GEMM", "layer",
     Mutation("pipeline.py", "_pack_and_send", "wait(comm, produced)")),
    ("fused layer: the output projection waits for the chunk's unpack", "layer",
     Mutation("layer.py", "consume", "wait(self.compute, event)")),
    ("unchunked exchange: the comm stream waits for its input", "exchange",
     Mutation("exchange.py", "on_comm", "wait(engine.stream, event(current_stream(device)))")),
    ("checkpoint offload: the copy to the host waits for the activation", "offload",
     Mutation("offload.py", "_pack", "streams.wait_stream(side")),
    ("checkpoint offload: the activation's memory is kept for the side stream's copy", "offload",
     Mutation("offload.py", "_pack", "streams.record_stream(src, side)")),
    ("checkpoint offload: the backward waits for the copy back", "offload",
     Mutation("offload.py", "_unpack", "streams.wait(compute, done)")),
    ("checkpoint offload: the copy back's memory is kept for the compute stream", "offload",
     Mutation("offload.py", "_unpack", "streams.record_stream(t, compute)")),
]


FAST_MUTATIONS = (0, 6, 10)  # one per mechanism in the fast tier: pipeline, layer, offload


@pytest.mark.parametrize("mechanism,runs,mutation", [
    m if i in FAST_MUTATIONS else pytest.param(*m, marks=pytest.mark.slow) for i, m in enumerate(MUTATIONS)],
    ids=[m[0] for m in MUTATIONS])
def test_a_removed_wait_is_caught(mechanism, runs, mutation):
    needs_interpreter()
    if runs == "offload":
        violations, dropped = offload_steps([mutation])
    else:
        steps = {"attention": attention_steps, "layer": layer_steps, "exchange": exchange_steps}[runs]
        kwargs = dict(group=None, rank=0, world=1)
        if runs != "exchange":
            kwargs["chunks"] = 2
        violations, _, dropped = run_checked(steps, StreamOrderedTransport, drop=[mutation], **kwargs)
    assert dropped[0] > 0, f"the mutation never applied: {mutation}"
    assert violations, f"{mechanism}: removing {mutation} was not caught"
    print(f"\n{mechanism}\n  removed: {mutation}\n  caught: {violations[0]}")


# ------------------------------------------------------- several ranks and the ring (spawned)

def ranks_worker(rank, world, transport, ring_size):
    """Every mechanism at this world size with `transport`; with a ring, the hybrid on the
    fused path (the ring's transfers on the ring group's engine) and one mutation of it."""
    if ring_size == 1:
        found = {}
        for name, steps, kwargs in [("attention", attention_steps, dict(chunks=2, Hq=2 * world, Hkv=1, B=2)),
                                    ("layer", layer_steps, dict(chunks=2, Hq=2 * world, Hkv=1)),
                                    ("exchange", exchange_steps, {})]:
            violations, counts, _ = run_checked(steps, transports()[transport], group=dist.group.WORLD, rank=rank,
                                                world=world, **kwargs)
            found[name] = (violations, counts)
        return found
    groups = uk.init_sequence_parallel(world, ring_size=ring_size)
    results = {}
    for label, drop in [("clean", []), ("mutated", [Mutation("ring.py", "wait",
                                                             "wait(current_stream(self.device), self.done)")])]:
        restore = _use(transports()[transport], (groups.ulysses_group, groups.ring_group))
        try:
            with StreamOrderChecker(drop) as checker:
                _ring_steps(groups, world, rank)
                fused.close()
        finally:
            restore()
        import gc
        gc.collect()
        results[label] = (checker.violations, [m.dropped for m in checker.drop])
    return results


def _ring_steps(groups, world, rank):
    q0, k0, v0, do = make_qkv(1, 12, 4, 2, 16, dtype=torch.float32, seed=5)
    leaves = [uk.shard_sequence(t, groups.ulysses_group, ring_group=groups.ring_group).requires_grad_(True)
              for t in (q0, k0, v0)]
    q, k, v = (t * 1.0 for t in leaves)
    out = uk.ulysses_attention(q, k, v, group=groups.ulysses_group, ring_group=groups.ring_group, causal=True,
                               backend="fused")
    out.square().sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("world,transport", [(2, "nccl"), (2, "host"), (2, "symm"), (3, "nccl"), (3, "symm")])
def test_fused_path_on_several_ranks_is_clean(world, transport):
    """Worlds 2 and 3 (uneven lengths at 3), every transport; the symmetric-memory transport
    with its windows and barriers on fake symmetric memory."""
    needs_interpreter()
    for rank, found in enumerate(spawn(ranks_worker, world, args=(transport, 1), timeout=SLOW_SPAWN_TIMEOUT)):
        for name, (violations, (ops, waits)) in found.items():
            assert not violations, f"rank {rank}, {name}: " + "\n".join(violations)
            assert ops > 20 and waits > 0, (rank, name, ops, waits)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nccl", "host"])
def test_ring_transfers_on_the_engine(transport):
    """Ulysses 1 x ring 2 on the fused path: clean, and the compute stream reading a block
    before its transfer is waited for (EngineShift.wait left out) is caught."""
    needs_interpreter()
    for rank, found in enumerate(spawn(ranks_worker, 2, args=(transport, 2), timeout=SLOW_SPAWN_TIMEOUT)):
        violations, _ = found["clean"]
        assert not violations, f"rank {rank}: " + "\n".join(violations)
        violations, dropped = found["mutated"]
        assert dropped[0] > 0 and violations, (rank, dropped)
        print(f"\nring, rank {rank}\n  removed: ring.py:wait: `wait(current_stream(self.device), self.done)`"
              f"\n  caught: {violations[0]}")
