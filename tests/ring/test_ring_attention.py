"""Ulysses x Ring (ulysses_kernels/ring/: schedule.py, validate.py, shard.py; every path's
block ops; the ring_group arguments of api.py and distributed/groups.py): exact attention on every grid of a world, against
single-process float64 attention on the gathered tensors, and the same clear error on
every rank of the grid.

Worlds 4 (1x4 ring only, 2x2, 4x1) and 6 (3 Ulysses x 2 ring, 2 x 3); causal and not,
GQA with fewer KV heads than the Ulysses degree, MQA, odd lengths, packed documents with
an empty one and one spanning ring ranks, batch 2; float64 below 1e-9, float32 below 1e-5.
"""

import json
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    SLOW_SPAWN_TIMEOUT,
    SPAWN_TIMEOUT,
    make_qkv,
    needs_interpreter,
    param_id,
    reference_with_grads,
    rel_err,
)

import ulysses_kernels as uk
from ulysses_kernels.launch import RankError, spawn


def _cases(ulysses: int):
    """Cases whose head counts fit a Ulysses degree of `ulysses`."""
    gqa_kv = 2 if ulysses % 2 == 0 else 1  # fewer KV heads than a Ulysses degree > 2: replicated
    hq = 2 * ulysses if ulysses > 1 else 4
    base = [
        dict(B=1, S=53, Hq=hq, Hkv=1, causal=True),                              # MQA, odd length
        dict(B=2, S=38, Hq=hq, Hkv=max(1, hq // 2), causal=False),              # batch 2, GQA
        dict(B=1, S=61, Hq=hq, Hkv=gqa_kv, causal=True, cu=[0, 7, 7, 40, 61]),  # empty doc, doc across ranks
        dict(B=1, S=45, Hq=hq, Hkv=gqa_kv, causal=False, cu=[0, 12, 20, 45]),
        dict(B=1, S=3, Hq=hq, Hkv=1, causal=True),  # fewer tokens than chunks: empty shards and portions
    ]
    cases = []
    for i, c in enumerate(base):
        for dtype in (torch.float64, torch.float32):
            cases.append(dict(c, D=16, dtype=dtype, seed=31 * i + (dtype == torch.float32)))
    return cases


def grid_cases(rank, world, grids, backend):
    """ring_cases for several (ring_size, cases) grids of one world, in one spawn."""
    return [ring_cases(rank, world, ring_size, cases, backend) for ring_size, cases in grids]


def ring_cases(rank, world, ring_size, cases, backend, device_type="cpu", groups=None):
    g = groups or uk.init_sequence_parallel(world, ring_size=ring_size)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    assert g.ulysses_size * g.ring_size == world and g.ring_size == ring_size
    results = []
    for c in cases:
        q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], c["D"], dtype=c["dtype"], seed=c["seed"],
                               device=device)
        cu = torch.tensor(c["cu"], dtype=torch.int32, device=device) if c.get("cu") else None
        shard = lambda t: uk.shard_sequence(t, g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
        local = [shard(t).detach().requires_grad_(True) for t in (q, k, v)]
        out = uk.ulysses_attention(*local, group=g.ulysses_group, ring_group=g.ring_group, causal=c["causal"],
                                   cu_seqlens=cu, backend=backend)
        out.backward(shard(do))
        gather = lambda t: uk.gather_sequence(t.detach().cpu(), g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
        results.append([gather(out)] + [gather(t.grad) for t in local])
    return results


def _check(cases, per_rank, tol=None):
    failures = []
    for i, c in enumerate(cases):
        q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], c["D"], dtype=c["dtype"], seed=c["seed"])
        cu = torch.tensor(c["cu"], dtype=torch.int32) if c.get("cu") else None
        ref = reference_with_grads(q, k, v, do, c["causal"], cu)
        limit = tol or (1e-9 if c["dtype"] == torch.float64 else 1e-5)
        for rank_results in per_rank:  # gathered: every rank holds the whole result
            for name, got, want in zip(("out", "dq", "dk", "dv"), rank_results[i], ref):
                assert got.dtype == c["dtype"]
                err = rel_err(got, want)
                if not err < limit:
                    failures.append(f"case {c} {name}: rel err {err:.3e} >= {limit}")
    assert not failures, "\n".join(sorted(set(failures)))


@pytest.mark.slow
@pytest.mark.parametrize("world,rings", [(4, (4, 2, 1)), (6, (2, 3))],
                         ids=["4=1x4,2x2,4x1", "6=3x2,2x3"])
def test_hybrid_matches_single_process(world, rings):
    grids = [(ring, _cases(world // ring)) for ring in rings]
    per_rank = spawn(grid_cases, world, args=(grids, "reference"), timeout=SPAWN_TIMEOUT)
    for i, (_, cases) in enumerate(grids):
        _check(cases, [r[i] for r in per_rank])


@pytest.mark.slow
def test_hybrid_triton_path_matches_single_process():
    """backend="triton" (Triton interpreter on CPU): flash blocks plus the fp32 merge kernel."""
    needs_interpreter()
    cases = [c for c in _cases(2) if c["dtype"] == torch.float32][:3:2]  # MQA causal; documents causal
    per_rank = spawn(ring_cases, 4, args=(2, cases, "triton"), timeout=SLOW_SPAWN_TIMEOUT)
    _check(cases, per_rank)


def fused_ring_cases(rank, world, ring_size, cases, device_type):
    """The fused path of the hybrid: on CPU with the stand-ins (pure-torch pack/unpack ops
    and the host transport for both the Ulysses and the ring group's engines, the Triton
    kernels in the interpreter); on a GPU with the real pack kernels and streams, ranks
    sharing the GPU through the host transport (NCCL refuses two ranks on one device)."""
    from ulysses_kernels import fused, testing

    g = uk.init_sequence_parallel(world, ring_size=ring_size)
    restore = (testing.enable_fused_stand_ins(g.ulysses_group) if device_type == "cpu"
               else (lambda previous: lambda: fused.use_transport(g.ulysses_group, previous))(
                   fused.use_transport(g.ulysses_group, testing.HostTransport)))
    previous_ring = fused.use_transport(g.ring_group, testing.HostTransport)
    try:
        results = ring_cases(rank, world, ring_size, cases, "fused", device_type, groups=g)
        return results, self_attention_fused_vs_reference(g, device_type)
    finally:
        fused.use_transport(g.ring_group, previous_ring)
        restore()
        fused.close()


def self_attention_fused_vs_reference(g, device_type):
    """UlyssesSelfAttention with a ring on the fused path (the plain composition: the
    fused layer has no ring) against the reference path: relative error of the output."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    outs = []
    for backend in ("fused", "reference"):
        torch.manual_seed(0)
        block = uk.UlyssesSelfAttention(64, 4, 2, group=g.ulysses_group, ring_group=g.ring_group,
                                        backend=backend).to(device)
        x = uk.shard_sequence(torch.randn(1, 29, 64, generator=torch.Generator().manual_seed(1)).to(device),
                              g.ulysses_group, ring_group=g.ring_group)
        outs.append(block(x).detach().double().cpu())
    return rel_err(outs[0], outs[1])


@pytest.mark.slow
def test_hybrid_fused_path_with_stand_ins_matches_single_process():
    """backend="fused" with a ring: the Ulysses exchanges through the engine's pack/unpack
    ops and transport, the ring's transfers through the ring group's engine (a shift is an
    all-to-all with two non-zero counts), batch 2 (the block reordering) and documents."""
    needs_interpreter()
    cases = [c for c in _cases(2) if c["dtype"] == torch.float32][1:3]  # batch 2 GQA; documents, causal
    per_rank = spawn(fused_ring_cases, 4, args=(2, cases, "cpu"), timeout=SLOW_SPAWN_TIMEOUT)
    _check(cases, [r for r, _ in per_rank])
    assert all(err < 1e-5 for _, err in per_rank), [err for _, err in per_rank]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_hybrid_fused_path_gpu(dtype):
    """Every CUDA part of the fused hybrid (pack kernels, both engines' comm streams, the
    Triton blocks and merge kernel) on one GPU, 2 ranks as 1 Ulysses x 2 ring."""
    cases = [dict(c, dtype=dtype) for c in _cases(1) if c["dtype"] == torch.float32][:3]
    per_rank = spawn(fused_ring_cases, 2, args=(2, cases, "cuda"), timeout=SLOW_SPAWN_TIMEOUT, backend="gloo")
    _check(cases, [r for r, _ in per_rank], tol=1e-5 if dtype == torch.float32 else 2e-2)
    assert all(err < 1e-4 for _, err in per_rank), [err for _, err in per_rank]


# ---------------------------------------------------------------- layout helpers

def roundtrip(rank, world, ring_size):
    g = uk.init_sequence_parallel(world, ring_size=ring_size)
    x = torch.arange(2 * 23, dtype=torch.float64).view(2, 23, 1).requires_grad_(True)
    local = uk.shard_sequence(x, g.ulysses_group, ring_group=g.ring_group)
    full = uk.gather_sequence(local, g.ulysses_group, ring_group=g.ring_group)
    lens = uk.sp_lengths(23, g.ring_size, g.ulysses_size)
    again = uk.gather_sequence(local, g.ulysses_group, ring_group=g.ring_group, seq_lens=lens)
    (full * (1 + rank)).sum().backward()  # every rank's gather; the shard's backward collects all
    return local.shape[1], torch.equal(full, x.detach()), torch.equal(again, x.detach()), x.grad.clone()


def layout_jobs(rank, world):
    return (roundtrip(rank, world, 2), trusted_lengths(rank, world), groups_report(rank, world, 4, 2),
            groups_report(rank, world, 2, 1))


@pytest.mark.slow
def test_groups_shard_gather_and_trusted_lengths_with_a_ring():
    jobs = spawn(layout_jobs, 4, timeout=SPAWN_TIMEOUT)
    for rank, (_, _, grid, plain) in enumerate(jobs):
        _check_grid(rank, grid, plain)
    assert all(t for _, t, _, _ in jobs)  # the trusted seq_lens path gives the checked path's result
    reports = [r for r, _, _, _ in jobs]
    assert [r[0] for r in reports] == uk.sp_lengths(23, 2, 2)
    assert all(r[1] and r[2] for r in reports)
    # d/dx of sum_r (1 + r) * gather(x) = sum over ranks of (1 + r) = 10, on every rank
    for r in reports:
        assert torch.equal(r[3], torch.full_like(r[3], 10.0))


def groups_report(rank, world, sp, ring):
    import torch.distributed as dist

    g = uk.init_sequence_parallel(sp, ring_size=ring)
    members = lambda grp: dist.get_process_group_ranks(grp) if grp is not None else None  # noqa: E731
    return dict(sp=members(g.sp_group), ulysses=members(g.ulysses_group), ring=members(g.ring_group),
                sizes=(g.ulysses_size, g.ring_size), ranks=(g.ulysses_rank, g.ring_rank),
                mesh=None if g.usp_mesh is None else g.usp_mesh.mesh_dim_names)


def _check_grid(rank, grid, plain):
    """World 4 as 2 Ulysses x 2 ring; and ring_size 1 with SP 2 (DP 2): today's groups.
    (World 8 with ring_size="auto" for 28 / 4 heads: tests/hf/core/test_hf_attention.py.)"""
    assert grid["sizes"] == (2, 2) and grid["ranks"] == (rank % 2, rank // 2)
    assert grid["ulysses"] == [2 * (rank // 2), 2 * (rank // 2) + 1]  # consecutive ranks
    assert grid["ring"] == [rank % 2, rank % 2 + 2]                   # strided ranks
    assert grid["mesh"] == ("dp", "ring", "ulysses")
    assert plain["ring"] is None and plain["ulysses"] == plain["sp"] and plain["sizes"] == (2, 1)
    assert plain["mesh"] is None


# ------------------------------------------------------------------------- errors

ERROR_CASES = [
    (dict(tensor_split=True, S=23), "zigzag"),  # (with 24 tokens both layouts have the same lengths)
    (dict(bad_dtype_rank=3), "in the Ulysses group of ring rank 1: rank 1: dtypes differ"),
    (dict(Hq=3), "query heads (3) must be a multiple"),
    (dict(cu=[0, 5, 23]), "global sequence length 24"),
    (dict(world_as_ulysses=True), "not orthogonal"),
    (dict(shard_with_default_group=True), "pass this rank's Ulysses group"),
    (dict(B=2, cu=[0, 10, 24], trusted=True), "needs batch size 1, got 2"),  # the seq_lens path too
    (dict(backend="fused"), "backend='fused' needs CUDA tensors"),  # on CPU, without the stand-ins
]


def ring_errors(rank, world, cases):
    """Every case's message on this rank; the groups stay usable after each error."""
    g = uk.init_sequence_parallel(world, ring_size=2)
    messages = []
    for case in cases:
        S, Hq = case.get("S", 24), case.get("Hq", 4)
        q, k, v, _ = make_qkv(case.get("B", 1), S, Hq, 2, 16, dtype=torch.float64, seed=rank)
        if case.get("shard_with_default_group"):
            try:
                uk.shard_sequence(q, None, ring_group=g.ring_group)
                messages.append(None)
            except ValueError as exc:
                messages.append(str(exc))
            continue
        if case.get("tensor_split"):  # the pure-Ulysses layout, not the zigzag
            local = [torch.tensor_split(t, world, dim=1)[rank] for t in (q, k, v)]
        else:
            local = [uk.shard_sequence(t, g.ulysses_group, ring_group=g.ring_group) for t in (q, k, v)]
        if case.get("bad_dtype_rank") == rank:
            local[0] = local[0].float()
        group = None if case.get("world_as_ulysses") else g.ulysses_group
        cu = torch.tensor(case["cu"], dtype=torch.int32) if "cu" in case else None
        try:
            lens = uk.sp_lengths(S, 2, 2) if case.get("trusted") else None
            uk.ulysses_attention(*local, group=group, ring_group=g.ring_group, causal=True, cu_seqlens=cu,
                                 backend=case.get("backend"), seq_lens=lens)
            messages.append(None)
        except (ValueError, RuntimeError) as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.slow
def test_hybrid_errors_reach_every_rank():
    per_rank = spawn(ring_errors, 4, args=([c for c, _ in ERROR_CASES],), timeout=SPAWN_TIMEOUT)
    for i, (case, needle) in enumerate(ERROR_CASES):
        messages = [r[i] for r in per_rank]
        assert all(m is not None and needle in m for m in messages), (case, messages)
        assert len(set(messages)) == 1, (case, messages)  # the same words on every rank


def trusted_lengths(rank, world):
    g = uk.init_sequence_parallel(world, ring_size=2)
    q, k, v, _ = make_qkv(1, 21, 4, 2, 16, dtype=torch.float64, seed=1)
    local = [uk.shard_sequence(t, g.ulysses_group, ring_group=g.ring_group) for t in (q, k, v)]
    lens = uk.sp_lengths(21, 2, 2)
    checked = uk.ulysses_attention(*local, group=g.ulysses_group, ring_group=g.ring_group, causal=True)
    trusted = uk.ulysses_attention(*local, group=g.ulysses_group, ring_group=g.ring_group, causal=True,
                                   seq_lens=lens)
    with pytest.raises(ValueError, match="every SP rank's length"):
        uk.ulysses_attention(*local, group=g.ulysses_group, ring_group=g.ring_group, seq_lens=lens[:2])
    return torch.equal(checked, trusted)


@pytest.mark.slow
def test_ring_size_must_divide_sp():
    with pytest.raises(RankError, match="ring_size=3"):
        spawn(groups_report, 2, args=(2, 3), timeout=SPAWN_TIMEOUT)


@pytest.mark.slow
def test_ring_error_does_not_grow_with_ring_size():
    """bench/ring_numerics.py --check at world 4 (4x1, 2x2, 1x4), float32 and bfloat16
    inputs: the ring's error against float64 stays within 2x of the no-ring (single-device
    attention) error at every length. Full tables: bench/results/ring_numerics_cpu.md."""
    script = ROOT / "bench" / "ring_numerics.py"
    proc = subprocess.run([sys.executable, str(script), "--lengths", "96", "384", "--check", "--json"],
                          capture_output=True, text=True, timeout=SPAWN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout[:proc.stdout.rindex("]") + 1])
    assert {(r["dtype"], r["ring"]) for r in rows} == {(d, r) for d in ("float32", "bfloat16") for r in (1, 2, 4)}
    assert all(r["out"] < (1e-6 if r["dtype"] == "float32" else 1e-2) for r in rows)


def pure_ring_exchanges(rank, world):
    """A pure ring (Ulysses degree 1) with trusted lengths and host document boundaries: the
    collectives and host reads of one forward + backward, and the gathered result."""
    import collections

    import torch.distributed as dist

    g = uk.init_sequence_parallel(world, ring_size=world)
    c = dict(B=1, S=45, Hq=4, Hkv=2, D=16, causal=True, cu=[0, 12, 20, 45], dtype=torch.float32, seed=7)
    q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], c["D"], dtype=c["dtype"], seed=c["seed"])
    shard = lambda t: uk.shard_sequence(t, g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
    local = [shard(t).detach().requires_grad_(True) for t in (q, k, v)]
    from ulysses_kernels.ring.layout import sp_lengths

    lens = sp_lengths(45, world, 1)   # trusted: every SP rank's length, ring rank major
    calls = collections.Counter()
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_to_all")}
    original_tolist = torch.Tensor.tolist

    def counting(name):
        def counted(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return counted

    for name in originals:
        setattr(dist, name, counting(name))
    torch.Tensor.tolist = lambda self: calls.update(["tolist"]) or original_tolist(self)
    try:
        out = uk.ulysses_attention(*local, group=g.ulysses_group, ring_group=g.ring_group, causal=True,
                                   cu_seqlens=c["cu"], seq_lens=lens)
        out.backward(shard(do))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        torch.Tensor.tolist = original_tolist
    gather = lambda t: uk.gather_sequence(t.detach(), g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
    return dict(calls), c, [gather(out)] + [gather(t.grad) for t in local]


@pytest.mark.slow
def test_a_pure_ring_runs_no_exchange_and_reads_host_documents_once():
    per_rank = spawn(pure_ring_exchanges, 2, timeout=SPAWN_TIMEOUT)
    for calls, case, _ in per_rank:
        assert calls == {}, calls          # no all-to-all on the one-rank Ulysses group, no read of the documents
    _check([per_rank[0][1]], [[r[2]] for r in per_rank])
