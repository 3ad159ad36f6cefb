"""DP x SP training (ulysses_kernels/hf/training/parallel.py, loss.py): FSDP2 over the world or inside
SP groups, DDP and manual all-reduces at DP 2 x SP 2 against the single-process mean, and
examples/train_hf.py."""

import pytest
import torch
from hf_cases import DP_MODES, DP_SEQS, _grad_errors, _run, reference

pytestmark = pytest.mark.slow

def test_dp_x_sp_fsdp_ddp_match_and_train():
    """World 4 = DP 2 x SP 2: FSDP2 sharded over the whole world (with tiling), FSDP2 HSDP
    (sharded inside SP groups), DDP and manual all-reduces all give the first-step gradients
    of the single-process mean over the two DP batches, and the loss decreases."""
    per_rank = [r["dp_sp"] for r in _run(4)]
    # reference: mean over the DP groups of the single-process gradients of each batch
    refs = [reference(dict(kind="llama", S=s["S"], doc_lens=s.get("doc_lens"), batch_seed=s["seed"]))
            for s in DP_SEQS]
    ref_loss = sum(r[1] for r in refs) / len(refs)
    ref_grads = {n: sum(r[2][n] for r in refs) / len(refs) for n in refs[0][2]}
    failures = []
    for mode in DP_MODES:
        for r in range(4):
            res = per_rank[r][mode]
            if not abs(res["losses"][0] - ref_loss.item()) < 1e-5 * abs(ref_loss.item()):
                failures.append(f"{mode} rank {r}: first loss {res['losses'][0]} vs {ref_loss.item()}")
            failures += [f"{mode} rank {r} {m}" for m in _grad_errors(res["grads"], ref_grads)]
            if not all(b < a for a, b in zip(res["losses"], res["losses"][1:])):
                failures.append(f"{mode} rank {r}: loss did not decrease: {res['losses']}")
    assert not failures, "\n".join(failures)


def test_example_train_hf_runs():
    losses = [r["example"] for r in _run(2)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    assert all(torch.isfinite(torch.tensor(losses[0]))) and losses[0][-1] < losses[0][0], losses[0]


def _uneven_use_worker(rank, world):
    """Three parameters: one every rank uses, one only rank 0 uses (an expert only its tokens
    chose; a rank without tokens), one no rank uses; DP 2 x SP 2."""
    import ulysses_kernels as uk
    from ulysses_kernels.hf import allreduce_gradients

    groups = uk.init_sequence_parallel(2)
    everyone, only_rank0, nobody = (torch.nn.Parameter(torch.full((3,), float(i + 1), dtype=torch.float64))
                                    for i in range(3))
    loss = (everyone * (rank + 1)).sum()
    if rank == 0:
        loss = loss + (only_rank0 * 2).sum()
    loss.backward()
    allreduce_gradients([everyone, only_rank0, nobody], groups)
    return everyone.grad.tolist(), None if only_rank0.grad is None else only_rank0.grad.tolist(), nobody.grad


def test_gradients_reduce_when_some_ranks_did_not_reach_a_parameter():
    """allreduce_gradients agrees which parameters any rank reached: rank 0's only gradient is
    summed over its SP group and averaged over DP on every rank (zeros elsewhere), not left out
    on the ranks without it (the buffers would differ in layout across ranks); a parameter no
    rank reached keeps no gradient, as on one device."""
    from ulysses_kernels.launch import spawn

    for everyone, only_rank0, nobody in spawn(_uneven_use_worker, 4, timeout=120):
        # SP groups {0, 1} and {2, 3}: sums 1 + 2 and 3 + 4, averaged over the two DP groups
        assert everyone == [5.0, 5.0, 5.0]
        assert only_rank0 == [1.0, 1.0, 1.0]   # (2 + 0) over SP group 0, (0 + 0) over group 1, averaged
        assert nobody is None
