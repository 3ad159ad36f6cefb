"""Process groups (ulysses_kernels.distributed.groups): which group a call runs on, and the data x
sequence parallel mesh."""

import pytest
import torch
import torch.distributed as dist
from helpers import SPAWN_TIMEOUT, make_qkv, reference_with_grads, rel_err, shard

import ulysses_kernels as uk
from ulysses_kernels.distributed.groups import resolve_group
from ulysses_kernels.launch import spawn


def dp_sp_cases(rank, world, sp_size, S):
    """Runs on every rank: each SP group computes attention over its own batch."""
    groups = uk.init_sequence_parallel(sp_size)
    seed = 1000 + groups.dp_rank  # each SP group works on its own batch
    q, k, v, do = make_qkv(1, S, 4, 2, 8, seed=seed)
    ql, kl, vl = (shard(t, sp_size, groups.sp_rank).requires_grad_(True) for t in (q, k, v))
    out = uk.ulysses_attention(ql, kl, vl, group=groups.sp_group, causal=True)
    out.backward(shard(do, sp_size, groups.sp_rank))
    ref, dq, dk, dv = reference_with_grads(q, k, v, do, True)
    mine = lambda t: shard(t, sp_size, groups.sp_rank)  # noqa: E731
    err = max(rel_err(out, mine(ref)), rel_err(ql.grad, mine(dq)), rel_err(kl.grad, mine(dk)),
              rel_err(vl.grad, mine(dv)))
    bad_size = None
    try:
        uk.init_sequence_parallel(3)
    except ValueError as exc:
        bad_size = str(exc)
    return {"sp_rank": groups.sp_rank, "dp_rank": groups.dp_rank, "sizes": (groups.dp_size, groups.sp_size),
            "sp_ranks": dist.get_process_group_ranks(groups.sp_group),
            "dp_ranks": dist.get_process_group_ranks(groups.dp_group),
            "mesh": tuple(groups.mesh.mesh_dim_names), "resolved": resolve_group(groups.sp_group)[1:],
            "err": err, "bad_size": bad_size}


@pytest.mark.slow
def test_dp_x_sp_groups_compute_their_own_batches():
    reports = spawn(dp_sp_cases, 4, args=(2, 19), timeout=SPAWN_TIMEOUT)
    assert [r["sp_ranks"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in reports] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(r["dp_rank"], r["sp_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["sizes"] == (2, 2) and r["mesh"] == ("dp", "sp") for r in reports)
    assert [r["resolved"] for r in reports] == [(2, 0), (2, 1), (2, 0), (2, 1)]  # (world, rank) in the SP group
    assert all(r["err"] < 1e-9 for r in reports), [r["err"] for r in reports]
    assert all("sp_size=3 must be >= 1 and divide the world size 4" in r["bad_size"] for r in reports)


def test_single_process_group_resolution():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    assert resolve_group(None) == (None, 1, 0)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        resolve_group(object())
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        uk.init_sequence_parallel(1)
    q, k, v, _ = make_qkv(1, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        uk.ulysses_attention(q, k, v, group=object())
    assert torch.equal(uk.ulysses_attention(q, k, v), uk.flash_attention(q, k, v))


def test_parallel_groups_as_one_group():
    """`ParallelGroups` where a call takes one group: without a ring its sequence-parallel
    group; with a ring a ValueError naming the two groups to pass (the same on every rank:
    it reads the argument alone)."""
    from ulysses_kernels.distributed.groups import ParallelGroups, as_process_group

    plain = ParallelGroups(sp_group="sp", dp_group="dp", sp_rank=0, sp_size=2, dp_rank=0, dp_size=1, mesh=None,
                           ulysses_group="sp", ulysses_size=2)
    assert as_process_group(plain) == "sp"
    ringed = plain._replace(ulysses_group="u", ring_group="r", ulysses_size=2, ring_size=2, sp_size=4)
    with pytest.raises(ValueError, match="ulysses_group, ring_group=groups.ring_group"):
        as_process_group(ringed)
