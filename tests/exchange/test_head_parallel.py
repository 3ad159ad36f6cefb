"""`ulysses_head_parallel` (api.py): named per-head tensors of several head dims go to the
head layout in one exchange, a token mixer runs over the whole sequence of this rank's
heads, its output comes back; tensors with fewer heads than ranks are replicated and their
gradients summed back; uneven lengths; the checked exchange refuses bad inputs on every
rank; a ring is refused.

The token mixer of these tests mixes tokens within a head (a decayed running sum along the
sequence, so every output position depends on every earlier one) and heads with their
group (each head scaled by its group's mean), the shape of a Mamba2 layer's x and B.
"""

import pytest
import torch
from helpers import SPAWN_TIMEOUT, randn, rel_err, seq_lens, shard

import ulysses_kernels as uk
from ulysses_kernels.launch import RankError, spawn

B, S, D_X, D_G = 2, 11, 3, 5


def mixer_reference(x, g):
    """x `[B, S, H, Dx]`, g `[B, S, G, Dg]` (head h in group h // (H / G)) -> `[B, S, H, Dx]`."""
    heads, groups = x.shape[2], g.shape[2]
    scale = g.mean(-1).repeat_interleave(heads // groups, dim=2).unsqueeze(-1)  # [B, S, H, 1]
    decay = 0.9 ** torch.arange(x.shape[1], dtype=x.dtype)
    weights = torch.tril(decay[:, None] / decay[None, :])                      # [S, S]: earlier tokens decayed
    return torch.einsum("ts,bshd->bthd", weights, x * scale)


def local_mixer(local, heads):
    """The same mixer on this rank's heads over the whole sequence (the heads must match)."""
    x, g = local["x"], local["g"]
    assert x.shape[1] == sum(heads.seq_lens)
    return mixer_reference(x, g)


def inputs(heads, groups, seed=0, g_dtype=torch.float64):
    x = randn(B, S, heads, D_X, dtype=torch.float64, seed=seed).requires_grad_()
    g = randn(B, S, groups, D_G, dtype=g_dtype, seed=seed + 1).requires_grad_()
    dout = randn(B, S, heads, D_X, dtype=torch.float64, seed=seed + 2)
    return x, g, dout


def test_one_process_is_the_mixer():
    x, g, dout = inputs(4, 2)
    out = uk.ulysses_head_parallel(local_mixer, {"x": x, "g": g})
    ref = mixer_reference(x, g)
    assert rel_err(out, ref) < 1e-15
    (dx, dg) = torch.autograd.grad(out, (x, g), dout)
    (rx, rg) = torch.autograd.grad(ref, (x, g), dout)
    assert rel_err(dx, rx) < 1e-15 and rel_err(dg, rg) < 1e-15


def test_tensors_of_several_dtypes_each_keep_theirs():
    """A float32 tensor beside a float64 one (one exchange per dtype): each reaches `fn` in its
    own dtype, bit for bit, and its gradient comes back in it."""
    x, g, dout = inputs(4, 2, g_dtype=torch.float32)
    seen = {}

    def mixer(local, held):
        seen.update(x=local["x"].dtype, g=local["g"].dtype, g_values=local["g"].detach().clone())
        return local_mixer(local, held)
    out = uk.ulysses_head_parallel(mixer, {"x": x, "g": g})
    assert seen["x"] == torch.float64 and seen["g"] == torch.float32 and torch.equal(seen["g_values"], g.detach())
    (dx, dg) = torch.autograd.grad(out, (x, g), dout)
    (rx, rg) = torch.autograd.grad(mixer_reference(x, g), (x, g), dout)
    assert dg.dtype == torch.float32 and rel_err(dx, rx) < 1e-15 and rel_err(dg, rg) < 1e-7


def test_several_outputs_come_back_as_they_were_returned():
    """fn may return a dict or a tuple of outputs (each `[B, S, H_out / P, D]`)."""
    x, g, _ = inputs(4, 2)
    ref = mixer_reference(x, g)
    as_dict = uk.ulysses_head_parallel(lambda local, held: {"y": local_mixer(local, held), "x": local["x"]},
                                       {"x": x, "g": g})
    assert set(as_dict) == {"y", "x"} and rel_err(as_dict["y"], ref) < 1e-15 and torch.equal(as_dict["x"], x)
    y, same = uk.ulysses_head_parallel(lambda local, held: (local_mixer(local, held), local["x"]), {"x": x, "g": g})
    assert rel_err(y, ref) < 1e-15 and torch.equal(same, x)


def test_output_heads_must_split():
    from ulysses_kernels.layout import LocalHeads, place_heads

    held = LocalHeads(1, 2, (6, 5), {"x": place_heads(4, 2), "g": place_heads(1, 2)})
    assert held.heads("x") == range(2, 4) and held.heads("g") == range(0, 1)
    assert held.output_heads(6) == range(3, 6)
    with pytest.raises(ValueError, match="heads \\(3\\) must be divisible"):
        held.output_heads(3)


def test_one_process_checks_its_inputs():
    x, g, _ = inputs(4, 2)
    with pytest.raises(ValueError, match="4-D"):
        uk.ulysses_head_parallel(local_mixer, {"x": x, "g": g[0]})
    with pytest.raises(ValueError, match="positions"):
        uk.ulysses_head_parallel(local_mixer, {"x": x, "g": g[:, :5]})
    with pytest.raises(ValueError, match="seq_lens"):
        uk.ulysses_head_parallel(local_mixer, {"x": x, "g": g}, seq_lens=[S + 1])


def _cases_worker(rank, world, cases):
    results = []
    for index, (heads, groups, *g_dtype) in enumerate(cases):
        x, g, dout = inputs(heads, groups, g_dtype=getattr(torch, *g_dtype) if g_dtype else torch.float64)
        ref = mixer_reference(x, g)
        rx, rg = torch.autograd.grad(ref, (x, g), dout)
        xs = shard(x.detach(), world, rank).requires_grad_()
        gs = shard(g.detach(), world, rank).requires_grad_()
        seen = {}

        def mixer(local, held):
            seen.update(x=list(held.heads("x")), g=list(held.heads("g")), out=list(held.output_heads(heads)))
            return local_mixer(local, held)
        trusted = index % 2 == 1   # the checked exchange, then the trusted lengths (the same on every rank)
        out = uk.ulysses_head_parallel(mixer, {"x": xs, "g": gs}, seq_lens=seq_lens(S, world) if trusted else None)
        dx, dg = torch.autograd.grad(out, (xs, gs), shard(dout, world, rank))
        full = uk.gather_sequence(out.detach())
        dx_full = uk.gather_sequence(dx)
        dg_full = uk.gather_sequence(dg)
        results.append(dict(out=rel_err(full, ref), dx=rel_err(dx_full, rx), dg=rel_err(dg_full, rg),
                            shape=tuple(out.shape), heads=seen))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [
    (2, [(4, 2), (4, 1), (4, 2, "float32")]),   # split groups, one group replicated; g in its own dtype
    (3, [(6, 3), (3, 1)]),            # uneven shards (11 = 4 + 4 + 3)
    (4, [(8, 2), (4, 1), (4, 4)]),    # more ranks than groups: 2 groups on 4 ranks
])
def test_many_ranks_equal_one(world, cases):
    per_rank = spawn(_cases_worker, world, args=(cases,), timeout=SPAWN_TIMEOUT)
    for rank, results in enumerate(per_rank):
        for (heads, groups, *_), r in zip(cases, results):
            assert r["out"] < 1e-14 and r["dx"] < 1e-14 and r["dg"] < 1e-14, (world, heads, groups, rank, r)
            assert r["shape"] == (B, seq_lens(S, world)[rank], heads, D_X)
            local = heads // world
            assert r["heads"]["out"] == list(range(rank * local, (rank + 1) * local))
            assert r["heads"]["x"] == r["heads"]["out"]
            group = rank // (world // groups) if groups < world else rank * (groups // world)
            assert r["heads"]["g"][0] == group


def _bad_inputs_worker(rank, world, what):
    x, g, _ = inputs(4 if what != "heads" or rank == 0 else 2, 2)
    xs, gs = shard(x.detach(), world, rank), shard(g.detach(), world, rank)
    if what == "names" and rank == 1:
        gs = {"h": gs}
    tensors = {"x": xs, **(gs if isinstance(gs, dict) else {"g": gs})}
    if what == "placement":
        tensors = {"x": shard(inputs(3, 1)[0].detach(), world, rank)}
    ring = uk.init_sequence_parallel(world, ring_size=2) if what == "ring" else None
    try:
        uk.ulysses_head_parallel(local_mixer, tensors, ring.ulysses_group if ring else None,
                                 ring_group=ring.ring_group if ring else None)
    except ValueError as error:
        # the group stays usable after a refusal
        back = uk.gather_sequence(shard(torch.arange(S, dtype=torch.float64)[None], world, rank))
        return str(error), back.shape[1]
    return None, None


@pytest.mark.slow
@pytest.mark.parametrize("what,match", [("heads", "disagree on x"), ("names", "different tensors"),
                                        ("placement", "3 heads"), ("ring", "ring_group")])
def test_bad_inputs_raise_the_same_error_on_every_rank(what, match):
    try:
        per_rank = spawn(_bad_inputs_worker, 4 if what == "ring" else 2, args=(what,), timeout=SPAWN_TIMEOUT)
    except RankError as error:   # pragma: no cover - a rank that did not raise the error above
        raise AssertionError(f"a rank raised something else: {error}") from error
    messages = {m for m, _ in per_rank}
    assert len(messages) == 1 and None not in messages, per_rank
    assert match in messages.pop()
    if what != "ring":
        assert {n for _, n in per_rank} == {S}
