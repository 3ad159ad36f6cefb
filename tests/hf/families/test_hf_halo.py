"""The sequence halo (ulysses_kernels/hf/families/halo/halo.py): a causal depthwise convolution run on
the sequence shards, each reading the last inputs of the shards before it, against the same
convolution on one process over the whole sequence (each packed document alone), output and
every gradient, float64: worlds 1-4, pure Ulysses and Ulysses x Ring (2 x 2, 1 x 4), shards
shorter than the window (several ranks feed one history), packed documents whose boundaries
do not line up with the shards, kernel sizes 2 to 7; and a sharded generation chunk after a
state, whose next state every rank holds. The same for `halo_map` with a stack of two unpadded
convolutions (depthwise, then grouped: ZAYA's), which runs each document piece on its own.

A convolution run on each shard alone (the negative control) is off by far more.
"""

import pytest
import torch
from helpers import SPAWN_TIMEOUT, chunk_layout, layout_part, rel_err, sharded_chunk_error

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from ulysses_kernels.hf.families.halo.halo import halo_conv, halo_map, training_layout  # noqa: E402
from ulysses_kernels.hf.families.mixers import causal_conv1d, document_starts  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

C = 6
# (total, kernel, documents): long shards; shards shorter than the window at 4 ranks (K 7:
# a history of 6 from up to 4 ranks); documents starting inside shards and at a shard start.
CASES = [(23, 4, None), (23, 3, [0, 9, 23]), (9, 7, [0, 2, 5, 9]), (11, 2, [0, 6, 11]), (6, 5, None),
         (3, 3, None)]   # at 4 ranks: a rank without tokens


def _inputs(total, kernel, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, total, C, generator=g, dtype=torch.float64)
    weight = torch.randn(C, kernel, generator=g, dtype=torch.float64)
    bias = torch.randn(C, generator=g, dtype=torch.float64)
    grad = torch.randn(2, total, C, generator=g, dtype=torch.float64)
    return x, weight, bias, grad


def _one_process(x, weight, bias, grad, cu):
    x, weight, bias = (t.clone().requires_grad_() for t in (x, weight, bias))
    out = causal_conv1d(x, weight, bias, document_starts(cu, x.shape[1], x.device), "silu")
    (out * grad).sum().backward()
    return out.detach(), x.grad, weight.grad, bias.grad


def _stacked_convolutions(kernel, seed):
    """(operator, its parameters, its reach): a depthwise convolution of `kernel`, then a
    grouped one of 3 (two groups), both unpadded, over `[B, reach + m, C]` -> `[B, m, C]`."""
    g = torch.Generator().manual_seed(seed)
    depthwise = torch.nn.Conv1d(C, C, kernel, groups=C, dtype=torch.float64)
    grouped = torch.nn.Conv1d(C, C, 3, groups=2, dtype=torch.float64)
    params = [*depthwise.parameters(), *grouped.parameters()]
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return (lambda rows: grouped(depthwise(rows.transpose(1, 2))).transpose(1, 2)), params, kernel + 1


def _stacked_one_process(operator, params, reach, x, grad, documents):
    """Each document alone, zeros before it: (output, dx, [dparam])."""
    x = x.clone().requires_grad_()
    bounds = documents or [0, x.shape[1]]
    out = torch.cat([operator(torch.cat([x.new_zeros(x.shape[0], reach, C), x[:, a:b]], dim=1))
                     for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    grads = torch.autograd.grad((out * grad).sum(), [x, *params])
    return out.detach(), grads[0], list(grads[1:])


def _halo_worker(rank, world, ring):
    import torch.distributed as dist

    import ulysses_kernels as uk
    from ulysses_kernels.hf.context import SequenceParallelContext
    from ulysses_kernels.ring.layout import sp_lengths

    groups = uk.init_sequence_parallel(world, ring_size=ring)
    context = SequenceParallelContext(groups)
    errors = {}
    for index, (total, kernel, documents) in enumerate(CASES):
        x, weight, bias, grad = _inputs(total, kernel, seed=index)
        cu = torch.tensor(documents) if documents else None
        want_out, want_dx, want_dw, want_db = _one_process(x, weight, bias, grad, cu)
        layout = training_layout(context, sp_lengths(total, ring, world // ring))
        mine = layout.ranges[layout.mine]
        local = layout_part(x, mine).clone().requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        out, last = halo_conv(local, w, b, layout, cu_seqlens=cu, activation="silu")
        (out * layout_part(grad, mine)).sum().backward()
        dw, db = (t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in (w, b))   # no tokens: None
        dist.all_reduce(dw), dist.all_reduce(db)
        held = local.shape[1] > 0   # the 3-token case at 4 ranks: a rank holds none
        alone = causal_conv1d(local.detach(), weight, bias, None, "silu") if held else None   # the negative control
        errors[index] = dict(out=rel_err(out.detach(), layout_part(want_out, mine)) if held else 0.0,
                             dx=rel_err(local.grad, layout_part(want_dx, mine)) if held else 0.0,
                             dw=rel_err(dw, want_dw), db=rel_err(db, want_db),
                             last=rel_err(last.detach(), x[:, total - kernel + 1:]),
                             alone=rel_err(alone, layout_part(want_out, mine)) if held else 0.0)
        errors[("map", index)] = _stacked_errors(x, grad, documents, kernel, index, layout)
    return errors


def _stacked_errors(x, grad, documents, kernel, seed, layout):
    """halo_map with two stacked convolutions against each document alone on one process."""
    import torch.distributed as dist

    operator, params, reach = _stacked_convolutions(kernel, seed)
    want_out, want_dx, want_dparams = _stacked_one_process(operator, params, reach, x, grad, documents)
    mine = layout.ranges[layout.mine]
    local = layout_part(x, mine).clone().requires_grad_()
    out, last = halo_map(local, operator, reach, layout, cu_seqlens=torch.tensor(documents) if documents else None)
    dx, *dparams = torch.autograd.grad((out * layout_part(grad, mine)).sum(), [local, *params], allow_unused=True)
    dparams = [d if d is not None else torch.zeros_like(p) for d, p in zip(dparams, params)]
    for d in dparams:
        dist.all_reduce(d)
    held = local.shape[1] > 0
    return dict(out=rel_err(out.detach(), layout_part(want_out, mine)) if held else 0.0,
                dx=rel_err(dx, layout_part(want_dx, mine)) if held else 0.0,
                dw=max(rel_err(d, w) for d, w in zip(dparams, want_dparams)), db=0.0,
                last=rel_err(last.detach(), x[:, x.shape[1] - reach:]) if reach <= x.shape[1] else 0.0,
                alone=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("world,ring", [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2), (4, 4)])
def test_the_halo_convolution_equals_one_process(world, ring):
    per_rank = spawn(_halo_worker, world, args=(ring,), timeout=SPAWN_TIMEOUT)
    for rank, errors in enumerate(per_rank):
        for index, e in errors.items():
            case = (world, ring, rank, index, CASES[index[-1] if isinstance(index, tuple) else index])
            assert max(e["out"], e["dx"], e["dw"], e["db"]) < 1e-13, (case, e)
            assert e["last"] == 0.0, (case, e)   # the global sequence's last inputs, copied
    # on more than one rank, some rank's shard needs the history the halo brings
    if world > 1:
        assert max(e["alone"] for errors in per_rank for e in errors.values()) > 1e-2


def _chunk_worker(rank, world):
    """A sharded generation chunk (contiguous shards) after a state: each rank's output is the
    one-process convolution continuing from the state, and every rank holds the chunk's last
    inputs as the next state."""
    import torch.distributed as dist

    dist.barrier()
    errors = []
    for total, kernel in ((13, 4), (3, 4), (7, 6)):
        x, weight, bias, _ = _inputs(total, kernel, seed=total)
        before = torch.randn(2, kernel - 1, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        want = causal_conv1d(x, weight, bias, None, None, history=before)
        layout, mine = chunk_layout(total)
        out, last = halo_conv(layout_part(x, mine), weight, bias, layout, before=before)
        want_last = torch.cat([before, x], dim=1)[:, -(kernel - 1):]
        errors.append(sharded_chunk_error(out, want, mine, last, want_last))
        operator, _, reach = _stacked_convolutions(kernel, seed=total)   # halo_map after a state
        with torch.no_grad():
            before = torch.randn(2, reach, C, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
            want = operator(torch.cat([before, x], dim=1))
            out, last = halo_map(layout_part(x, mine), operator, reach, layout, before=before)
        want_last = torch.cat([before, x], dim=1)[:, -reach:]
        errors.append(sharded_chunk_error(out, want, mine, last, want_last))
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_sharded_chunk_continues_from_the_state(world):
    for errors in spawn(_chunk_worker, world, timeout=SPAWN_TIMEOUT):
        assert max(errors) < 1e-14, errors
