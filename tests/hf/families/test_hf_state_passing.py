"""State passing over the sequence layout (ulysses_kernels/hf/families/halo/state_passing.py): a
selective scan (Mamba1's, a diagonal transition) run on the sequence shards, each continuing
from the state its peers pass, against the scan on one process over each document, output
and every gradient, float64: worlds 1-4, pure Ulysses and Ulysses x Ring (2 x 2, 1 x 4), shards
of one token and none, packed documents whose boundaries do not line up with the shards; a
sharded generation chunk continuing from a state, whose leaving state every rank holds.

The scan run on each shard from zero (the negative control) is off by far more.
"""

import pytest
import torch
from helpers import SPAWN_TIMEOUT, chunk_layout, layout_part, rel_err, sharded_chunk_error

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from ulysses_kernels.hf.families.halo.halo import training_layout  # noqa: E402
from ulysses_kernels.hf.families.halo.mamba1 import SelectiveScan  # noqa: E402
from ulysses_kernels.hf.families.halo.state_passing import layout_recurrence  # noqa: E402
from ulysses_kernels.hf.families.mixers import over_documents  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

CHANNELS, STATE = 3, 4
# (total, documents): long shards; 3 tokens on up to 4 ranks (a rank without tokens); documents
# inside and at the edges of shards.
CASES = [(23, None), (23, [0, 9, 23]), (3, None), (11, [0, 1, 6, 11])]


def _inputs(total, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, total, CHANNELS, generator=g, dtype=torch.float64)
    dt = torch.rand(2, total, CHANNELS, generator=g, dtype=torch.float64) * 0.5
    B, C = (torch.randn(2, total, STATE, generator=g, dtype=torch.float64) for _ in range(2))
    A = -torch.rand(CHANNELS, STATE, generator=g, dtype=torch.float64) - 0.1
    grad = torch.randn(2, total, CHANNELS, generator=g, dtype=torch.float64)
    return [x, dt, B, C], A, grad


def _one_process(tensors, A, grad, cu):
    leaves = [t.clone().requires_grad_() for t in tensors + [A]]
    out = over_documents(lambda *t: SelectiveScan(leaves[-1]).run(list(t), None)[0], leaves[:-1], cu)
    (out * grad).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _worker(rank, world, ring):
    import torch.distributed as dist

    import ulysses_kernels as uk
    from ulysses_kernels.hf.context import SequenceParallelContext
    from ulysses_kernels.ring.layout import sp_lengths

    context = SequenceParallelContext(uk.init_sequence_parallel(world, ring_size=ring))
    errors = {}
    for index, (total, documents) in enumerate(CASES):
        tensors, A, grad = _inputs(total, seed=index)
        cu = torch.tensor(documents) if documents else None
        want, want_grads = _one_process(tensors, A, grad, cu)
        layout = training_layout(context, sp_lengths(total, ring, world // ring))
        mine = layout.ranges[layout.mine]
        local = [layout_part(t, mine).clone().requires_grad_() for t in tensors]
        a = A.clone().requires_grad_()
        out = layout_recurrence(SelectiveScan(a), local, layout, cu)
        (out * layout_part(grad, mine)).sum().backward()
        da = a.grad.clone() if a.grad is not None else torch.zeros_like(a)   # a rank without tokens
        dist.all_reduce(da)
        alone = SelectiveScan(A).run([t.detach() for t in local], None)[0]
        held = sum(n for _, n in mine) > 0   # a rank of the 3-token case at world 4 holds none
        errors[index] = dict(
            out=rel_err(out.detach(), layout_part(want, mine)) if held else 0.0,
            grads=max([rel_err(t.grad, layout_part(w, mine)) for t, w in zip(local, want_grads)] if held else [0.0]),
            dA=rel_err(da, want_grads[-1]),
            alone=rel_err(alone, layout_part(want, mine)) if held else 0.0)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world,ring", [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2), (4, 4)])
def test_the_scan_with_passed_states_equals_one_process(world, ring):
    per_rank = spawn(_worker, world, args=(ring,), timeout=SPAWN_TIMEOUT)
    for rank, errors in enumerate(per_rank):
        for index, e in errors.items():
            assert max(e["out"], e["grads"], e["dA"]) < 1e-13, (world, ring, rank, CASES[index], e)
    if world > 1:   # a rank after the first scanning its shard from zero is far off
        assert max(e["alone"] for errors in per_rank for e in errors.values()) > 1e-2


def _chunk_worker(rank, world):
    errors = []
    for total in (13, 3):
        tensors, A, _ = _inputs(total, seed=total)
        initial = torch.randn(2, CHANNELS, STATE, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        want, want_final = SelectiveScan(A).run(tensors, initial)
        layout, mine = chunk_layout(total)
        out, final = layout_recurrence(SelectiveScan(A), [layout_part(t, mine) for t in tensors], layout, None,
                                       initial=initial, with_final=True)
        errors.append(sharded_chunk_error(out, want, mine, final, want_final))
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_sharded_chunk_continues_from_the_state_and_leaves_it_on_every_rank(world):
    for errors in spawn(_chunk_worker, world, timeout=SPAWN_TIMEOUT):
        assert max(errors) < 1e-13, errors


def _wkv_layer():
    """An RWKV time-mixing layer of 3 channels (its decay and bonus), float64."""
    import transformers

    layer = transformers.models.rwkv.modeling_rwkv.RwkvSelfAttention(
        transformers.RwkvConfig(hidden_size=CHANNELS, attention_hidden_size=CHANNELS, num_hidden_layers=2))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        layer.time_decay.copy_(torch.randn(CHANNELS, generator=g))
        layer.time_first.copy_(torch.randn(CHANNELS, generator=g))
    return layer.double()


def _wkv_worker(rank, world, ring):
    """RWKV's WKV (a state kept in log space with a running maximum, composed by
    `WkvRecurrence.compose`) through state passing, against transformers' kernel per document."""
    import ulysses_kernels as uk
    from ulysses_kernels.hf.context import SequenceParallelContext
    from ulysses_kernels.hf.families.halo.rwkv import WkvRecurrence
    from ulysses_kernels.ring.layout import sp_lengths

    context = SequenceParallelContext(uk.init_sequence_parallel(world, ring_size=ring))
    layer, errors = _wkv_layer(), []
    for index, (total, documents) in enumerate(CASES):
        g = torch.Generator().manual_seed(index)
        k = torch.randn(2, total, CHANNELS, generator=g, dtype=torch.float64) * 3   # keys spread: the maximum moves
        v = torch.randn(2, total, CHANNELS, generator=g, dtype=torch.float64)
        cu = torch.tensor(documents) if documents else None
        want = over_documents(lambda k, v: WkvRecurrence(layer).run([k, v], None)[0], [k, v], cu)
        layout = training_layout(context, sp_lengths(total, ring, world // ring))
        mine = layout.ranges[layout.mine]
        out = layout_recurrence(WkvRecurrence(layer), [layout_part(k, mine), layout_part(v, mine)], layout, cu)
        if out.shape[1]:
            errors.append(rel_err(out, layout_part(want, mine)))
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world,ring", [(2, 1), (3, 1), (4, 2)])
def test_rwkv_wkv_in_log_space_passes_its_state(world, ring):
    """transformers' kernel computes in float32: within 1e-6 of the one-process run."""
    for errors in spawn(_wkv_worker, world, args=(ring,), timeout=SPAWN_TIMEOUT):
        assert errors and max(errors) < 1e-6, errors
