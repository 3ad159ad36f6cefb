"""The "ulysses" attention implementation (ulysses_kernels/hf/core/attention.py) in tiny random
Llama / Qwen2 / Qwen3 GQA models at SP 2 and 4 (and Ulysses 2 x ring 2, and a 28/4-head
model at SP 8 with a ring) against a single-process eager run: logits, loss and every
parameter gradient (float32, relative error < 1e-5); masks it cannot honour raise on every
rank."""

import pytest
import torch
from helpers import rel_err
from hf_cases import SP_CASES, TOL, WIDE, WIDE_BATCH, _grad_errors, _run, reference

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("world,job", [(2, "sp"), (4, "sp"), (4, "sp_ring")], ids=["2", "4", "4=2x2ring"])
def test_sp_matches_single_process(world, job):
    per_rank = [r[job] for r in _run(world)]
    failures = []
    for i, case in enumerate(SP_CASES):
        logits, loss, grads = reference(case)
        for r in range(world):
            err = rel_err(per_rank[r][i]["loss"], loss)
            if not err < TOL:
                failures.append(f"case {i} rank {r} loss {per_rank[r][i]['loss']} vs {loss}: {err:.2e}")
        if "logits" in per_rank[0][i]:
            got = _global_order(torch.cat([per_rank[r][i]["logits"] for r in range(world)], dim=1),
                                world, 2 if job == "sp_ring" else 1)
            err = rel_err(got, logits)
            if not err < TOL:
                failures.append(f"case {i} logits rel err {err:.2e}")
        for r in range(world):  # after the SP all-reduce every rank holds the full gradient
            failures += [f"case {i} rank {r} {m}" for m in _grad_errors(per_rank[r][i]["grads"], grads)]
    assert not failures, "\n".join(failures)


def _global_order(local_concat, world, ring):
    """Rank-order concatenation of the shards -> global sequence order (the zigzag layout
    with a ring; the identity without)."""
    from ulysses_kernels.ring.layout import local_ranges

    S = local_concat.shape[1]
    positions = [s + i for rank in range(world)
                 for s, n in local_ranges(S, ring, world // ring, rank // (world // ring), rank % (world // ring))
                 for i in range(n)]
    out = torch.empty_like(local_concat)
    out[:, positions] = local_concat
    return out


def test_wide_heads_train_with_a_ring_where_pure_ulysses_raises():
    per_rank = [r["wide"] for r in _run(8)]
    _, ref_loss, ref_grads = reference(dict(WIDE_BATCH, **WIDE))
    failures = []
    for rank, r in enumerate(per_rank):
        assert r["pure_error"] and "query heads (28)" in r["pure_error"], r["pure_error"]
        assert r["members"]["sizes"] == (4, 2)  # 28 heads split over 4, not 8
        assert r["members"]["ulysses"] == [4 * (rank // 4) + u for u in range(4)]  # consecutive ranks
        assert r["members"]["ring"] == [rank % 4, rank % 4 + 4]                     # strided ranks
        if not abs(r["losses"][0] - ref_loss.item()) < TOL * abs(ref_loss.item()):
            failures.append(f"rank {rank}: first loss {r['losses'][0]} vs {ref_loss.item()}")
        failures += [f"rank {rank} {m}" for m in _grad_errors(r["grads"], ref_grads)]
        assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert not failures, "\n".join(failures)


def test_unsupported_masks_raise_on_every_rank():
    per_rank = [r["errors"] for r in _run(2)]
    for r, rep in enumerate(per_rank):
        msg = rep["padding_one_rank"] or ""
        assert "padding" in msg or "another rank" in msg, (r, msg)
        assert rep["all_ones_ok"]
        assert rep["custom_4d"] and "mask" in rep["custom_4d"], rep["custom_4d"]
        assert rep["dropout"] and "dropout" in rep["dropout"], rep["dropout"]
        assert rep["indices"] and "got indices=, which the attention function does not honour" in rep["indices"]
        assert rep["indices"] == per_rank[0]["indices"], (r, rep["indices"])
        assert rep["labels"] and "labels= given to the model at SP 2" in rep["labels"], rep["labels"]
        assert rep["labels"] == per_rank[0]["labels"], (r, rep["labels"])
    ref_logits, _, _ = reference(dict(kind="llama", S=21, batch_seed=1))
    got = torch.cat([rep["after"] for rep in per_rank], dim=1)
    assert rel_err(got, ref_logits) < TOL
