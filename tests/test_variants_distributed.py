"""The attention variants over process groups (ulysses_kernels/variants.py through
api.py, distributed/validate.py, every path and ring/): `ulysses_attention` with
windows, softcap, sinks and a value head dim of its own on gloo groups of 1 to 4 ranks
and on Ulysses x Ring grids (2x2, 3x2), against the float64 brute force of
tests/helpers.py; the sinks' gradient summed over the group is the full gradient; ranks
that disagree on a variant, or one rank's bad value, raise the same error on every rank."""

import re

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, SPAWN_TIMEOUT, brute_force_attention, needs_interpreter, randn, rel_err

import ulysses_kernels as uk
from ulysses_kernels.launch import RankError, spawn

# world -> query heads and KV head counts: split, replicated (fewer than ranks), MQA.
HEADS = {1: (4, (2, 1)), 2: (4, (2, 1)), 3: (6, (3, 1)), 4: (8, (2, 1))}


def _inputs(c, device="cpu"):
    """Global q, k, v, dO and sinks of case `c` (fresh values per case seed)."""
    dtype = c["dtype"]
    dv = c.get("Dv", c["D"])
    shapes = [(c["B"], c["S"], c["Hq"], c["D"]), (c["B"], c["S"], c["Hkv"], c["D"]),
              (c["B"], c["S"], c["Hkv"], dv), (c["B"], c["S"], c["Hq"], dv)]
    q, k, v, do = (randn(*s, seed=c["seed"] + i, dtype=dtype, device=device) for i, s in enumerate(shapes))
    sinks = randn(c["Hq"], seed=c["seed"] + 9, dtype=dtype, device=device) if c.get("sinks") else None
    return q, k, v, do, sinks


def _options(c):
    cu = torch.tensor(c["cu"], dtype=torch.int32) if c.get("cu") else None
    return dict(causal=c["causal"], cu_seqlens=cu, window_size=c.get("window", (-1, -1)),
                softcap=c.get("softcap", 0.0))


def variant_cases(world):
    Hq, kv = HEADS[world]
    base = [
        dict(B=2, S=37, Hkv=kv[0], causal=True, window=(5, -1)),                      # uneven S, batch 2
        dict(B=1, S=41, Hkv=kv[1], causal=False, window=(3, 6)),                      # two-sided, MQA
        dict(B=1, S=40, Hkv=kv[0], causal=True, window=(4, -1), cu=[0, 9, 9, 26, 40]),  # documents
        dict(B=1, S=35, Hkv=kv[0], causal=False, softcap=6.0),
        dict(B=2, S=33, Hkv=kv[1], causal=True, sinks=True),
        dict(B=1, S=34, Hkv=kv[0], causal=True, D=24, Dv=8),                          # Dv != D (MLA-like)
        dict(B=2, S=39, Hkv=kv[1], causal=True, window=(6, -1), softcap=20.0, sinks=True, D=24, Dv=16),
    ]
    return [dict(dict(D=16, dtype=torch.float64, Hq=Hq, seed=1000 * world + 10 * i), **c)
            for i, c in enumerate(base)]


def run_cases(rank, world, cases, backend, ring_size=1):
    """Every case on this rank's shard: the gathered output and gradients, and this rank's
    share of the sinks' gradient."""
    g = uk.init_sequence_parallel(world, ring_size=ring_size) if ring_size > 1 else None
    group = g.ulysses_group if g else None
    ring = g.ring_group if g else None
    if backend == "fused":  # on CPU: the fused path's stand-ins (ulysses_kernels.testing)
        from ulysses_kernels import testing

        testing.enable_fused_stand_ins()
    results = []
    for c in cases:
        q, k, v, do, sinks = _inputs(c)
        shard = lambda t: uk.shard_sequence(t, group, ring_group=ring)  # noqa: E731
        local = [shard(t).detach().requires_grad_(True) for t in (q, k, v)]
        s = sinks.clone().requires_grad_(True) if sinks is not None else None
        out = uk.ulysses_attention(*local, group=group, ring_group=ring, backend=backend, sinks=s, **_options(c))
        out.backward(shard(do))
        gather = lambda t: uk.gather_sequence(t.detach(), group, ring_group=ring)  # noqa: E731
        results.append([gather(out)] + [gather(t.grad) for t in local] + [s.grad if s is not None else None])
    return results


def check(cases, per_rank, tol):
    failures = []
    for i, c in enumerate(cases):
        q, k, v, do, sinks = _inputs(c)
        want = brute_force_attention(q, k, v, do, sinks=sinks, **_options(c))
        for rank, got in enumerate(per_rank):
            for name, a, b in zip(("out", "dq", "dk", "dv"), got[i][:4], want[:4]):
                if not rel_err(a, b) < tol:
                    failures.append(f"case {i} {c} rank {rank} {name}: {rel_err(a, b):.2e}")
        if sinks is not None:  # each rank holds its share: their sum is the gradient
            total = sum(r[i][4] for r in per_rank)
            if not rel_err(total, want[4]) < tol:
                failures.append(f"case {i} {c} dsinks: {rel_err(total, want[4]):.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_variants_match_the_brute_force_on_the_reference_path(world):
    cases = variant_cases(world)
    check(cases, spawn(run_cases, world, args=(cases, "reference"), timeout=SPAWN_TIMEOUT), 1e-10)


def ring_cases(ulysses):
    """A portion of S = 48 over a ring of 2 is two chunks of 12: windows inside a chunk and
    across several."""
    hq = 2 * ulysses
    base = [
        dict(S=48, Hkv=1, causal=True, window=(5, -1)),
        dict(S=48, Hkv=1, causal=True, window=(30, -1), sinks=True),
        dict(S=47, Hkv=ulysses, causal=False, window=(4, 9), softcap=5.0),
        dict(S=50, Hkv=1, causal=True, window=(7, -1), cu=[0, 10, 31, 50], sinks=True, D=24, Dv=8),
    ]
    return [dict(dict(B=1, D=16, dtype=torch.float64, Hq=hq, seed=77 * ulysses + i), **c)
            for i, c in enumerate(base)]


@pytest.mark.slow
@pytest.mark.parametrize("world,ring", [(4, 2), (6, 2)], ids=["2x2", "3x2"])
def test_variants_with_a_ring_match_the_brute_force(world, ring):
    cases = ring_cases(world // ring)
    check(cases, spawn(run_cases, world, args=(cases, "reference", ring), timeout=SPAWN_TIMEOUT), 1e-10)


def _for_kernels(c):
    """Case `c` in float32 with head dims the kernels take (multiples of 16)."""
    dims = {k: -(-c[k] // 16) * 16 for k in ("D", "Dv") if k in c}
    return dict(c, dtype=torch.float32, **dims)


@pytest.mark.slow
def test_variants_on_the_triton_path():
    """The kernels in the interpreter read the all-to-all buffers with the variants (float32)."""
    needs_interpreter()
    cases = [_for_kernels(c) for c in variant_cases(3) if c.get("Dv")]  # all combined, and Dv != D
    check(cases, spawn(run_cases, 3, args=(cases, "triton"), timeout=SLOW_SPAWN_TIMEOUT), 2e-5)


@pytest.mark.slow
def test_variants_with_a_ring_on_the_triton_path():
    needs_interpreter()
    cases = [_for_kernels(c) for c in ring_cases(2)[2:]]  # two-sided + softcap; documents + sinks + Dv
    check(cases, spawn(run_cases, 4, args=(cases, "triton", 2), timeout=SLOW_SPAWN_TIMEOUT), 2e-5)


@pytest.mark.slow
def test_variants_on_the_fused_path_with_stand_ins():
    """The fused pipeline (chunks of heads, each with its sinks' slice) with the CPU
    stand-ins of its pack ops and transport; v with its own head dim is refused there."""
    needs_interpreter()
    cases = [_for_kernels(c) for c in variant_cases(2) if not c.get("Dv")][-2:]  # softcap; sinks at B = 2
    check(cases, spawn(run_cases, 2, args=(cases, "fused"), timeout=SLOW_SPAWN_TIMEOUT), 2e-5)


# ------------------------------------------------------------------------ errors

def disagreeing_calls(rank, world, whats):
    """Each disagreeing call in turn on one group (an error leaves it usable)."""
    return [disagreeing_call(rank, what) for what in whats]


def disagreeing_call(rank, what):
    q, k, v = (randn(1, 5, 4, 16, seed=rank + i) for i in range(3))
    options = dict(causal=True)
    if what == "window":
        options["window_size"] = (4, -1) if rank == 1 else (3, -1)
    elif what == "softcap":
        options["softcap"] = 30.0 + (rank == 2)
    elif what == "sinks":
        options["sinks"] = torch.zeros(4) + (rank == 0)
    elif what == "sinks shape":
        options["sinks"] = torch.zeros(4 if rank else 3)
    elif what == "bad window":
        options["window_size"] = (-3, 0) if rank == 2 else (3, 0)
    elif what == "value dims":
        v = randn(1, 5, 4, 8 if rank == 1 else 16, seed=3)
    try:
        uk.ulysses_attention(q, k, v, **options)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_disagreeing_or_bad_variants_raise_the_same_error_on_every_rank():
    expected = {"window": "ranks disagree on window_size", "softcap": "ranks disagree on softcap",
                "sinks": "ranks disagree on sinks", "sinks shape": r"sinks must have shape \[4\]",
                "bad window": "left side must be >= 0 or -1", "value dims": "ranks disagree on the value head dim"}
    try:
        per_rank = spawn(disagreeing_calls, 3, args=(list(expected),), timeout=SPAWN_TIMEOUT)
    except RankError as exc:  # a hang or a crash is a failure too
        pytest.fail(str(exc))
    for i, (what, message) in enumerate(expected.items()):
        messages = [r[i] for r in per_rank]
        assert len(set(messages)) == 1, (what, messages)
        assert re.search(message, messages[0]), (what, messages[0])
