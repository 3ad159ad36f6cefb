"""One rank of the simulated two-node launch (tests/distributed/test_topology.py): two
`torchrun` agents, `--nnodes 2 --nproc-per-node 2`, on 127.0.0.1. `init_sequence_parallel(4,
ring_size="auto")` reads `LOCAL_WORLD_SIZE` (2): the heads alone would allow Ulysses 4 (one
group across both nodes), the node rule gives Ulysses 2 inside each node x ring 2 across
them. Then the same steps as one process: causal attention with packed documents
(forward and backward, float64) and one training step of a tiny Llama (loss and every
gradient). Each rank writes its groups and errors to OUT/rank{RANK}.json."""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "hf")]


def attention_error(groups) -> float:
    import torch
    from helpers import make_qkv, reference_with_grads, rel_err

    import ulysses_kernels as uk

    q, k, v, do = make_qkv(1, 37, 4, 2, 16, seed=11)
    cu = torch.tensor([0, 9, 30, 37], dtype=torch.int32)
    shard = lambda t: uk.shard_sequence(t, groups.ulysses_group, ring_group=groups.ring_group)  # noqa: E731
    local = [shard(t).detach().requires_grad_(True) for t in (q, k, v)]
    out = uk.ulysses_attention(*local, group=groups.ulysses_group, ring_group=groups.ring_group, causal=True,
                               cu_seqlens=cu)
    out.backward(shard(do))
    gather = lambda t: uk.gather_sequence(t.detach(), groups.ulysses_group, ring_group=groups.ring_group)  # noqa: E731
    got = [gather(out)] + [gather(t.grad) for t in local]
    return max(rel_err(a, b) for a, b in zip(got, reference_with_grads(q, k, v, do, True, cu)))


def model_step_error(groups):
    from family_cases import register_exact_eager
    from sweep import DOCUMENTS, largest_error, reference_step, sp_step
    from tiny_models import build_tiny_model

    from ulysses_kernels import hf as ukhf

    ukhf.register(groups)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    reference = build_tiny_model("llama", register_exact_eager(), overrides=heads)
    model = build_tiny_model("llama", "ulysses", overrides=heads)
    documents = DOCUMENTS["two packed documents"]
    return largest_error(sp_step(model, documents, groups), reference_step(reference, documents))


def main(out: str) -> None:
    import torch.distributed as dist

    import ulysses_kernels as uk

    dist.init_process_group("gloo")
    groups = uk.init_sequence_parallel(4, ring_size="auto", num_heads=4, num_kv_heads=2)
    error, where = model_step_error(groups)
    result = dict(rank=dist.get_rank(), local_world=int(os.environ["LOCAL_WORLD_SIZE"]),
                  ulysses=dist.get_process_group_ranks(groups.ulysses_group),
                  ring=dist.get_process_group_ranks(groups.ring_group),
                  attention=attention_error(groups), model=error, where=where)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
