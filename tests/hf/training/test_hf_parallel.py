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
