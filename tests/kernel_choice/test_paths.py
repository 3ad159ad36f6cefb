"""Every path runs the kernel the choice makes (ulysses_kernels/kernel_choice/): the fused
pipeline (chunked, its recorded graphs replayed in the backward), the Triton path (the
receive buffer read in place), the ring (the candidate's LSE pair) and single-device
`flash_attention`, with an external kernel stood in for by `testing.kernel_stand_in` (the
reference in torch, declared like an external kernel), against float64; and a forced kernel
that cannot compute a call is the same error on every rank."""

import math

import pytest
import torch
from helpers import (
    SLOW_SPAWN_TIMEOUT,
    brute_force_attention,
    make_qkv,
    needs_interpreter,
    rel_err,
    shard,
)

import ulysses_kernels as uk
from ulysses_kernels import env, fused, testing
from ulysses_kernels.launch import spawn

CASES = [
    dict(B=1, S=24, Hq=4, Hkv=2, chunks=2, causal=True),                          # GQA, two chunks
    dict(B=1, S=20, Hq=4, Hkv=1, chunks=4, causal=True),                          # one KV head shared by 4 chunks
    dict(B=2, S=18, Hq=4, Hkv=4, chunks=2, causal=False),                         # batch 2 on one rank
    dict(B=1, S=30, Hq=4, Hkv=2, chunks=2, causal=True, cu=[0, 7, 19, 30]),       # packed documents
    dict(B=1, S=26, Hq=4, Hkv=2, chunks=1, causal=True, window=(5, -1), softcap=4.0),
]


def _want(c, q, k, v, do):
    cu = torch.tensor(c["cu"], dtype=torch.int32) if c.get("cu") else None
    return brute_force_attention(q, k, v, do, causal=c["causal"], cu_seqlens=cu, window_size=c.get("window", (-1, -1)),
                                 softcap=c.get("softcap", 0.0))[:4], cu


def _options(c, cu):
    return dict(causal=c["causal"], cu_seqlens=cu, window_size=c.get("window", (-1, -1)),
                softcap=c.get("softcap", 0.0))


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"B{c['B']}-h{c['Hq']}/{c['Hkv']}-chunks{c['chunks']}"
                         + ("-packed" if c.get("cu") else "") + ("-window" if c.get("window") else ""))
def test_fused_pipeline_runs_the_chosen_kernel(c, monkeypatch):
    """One rank, the fused stand-ins: every chunk on the stand-in kernel (its graph recorded,
    replayed in the backward, shared KV heads' gradients summed over chunks)."""
    q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], 16, dtype=torch.float32, seed=c["S"])
    want, cu = _want(c, q, k, v, do)
    monkeypatch.setenv(env.NUM_CHUNKS.name, str(c["chunks"]))
    with testing.fused_stand_ins(), testing.kernel_stand_in() as calls:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = uk.ulysses_attention(*leaves, backend="fused", **_options(c, cu))
        assert calls["run"] == c["chunks"]
        out.backward(do)
        with torch.no_grad():
            again = uk.ulysses_attention(q, k, v, backend="fused", **_options(c, cu))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], want):
        assert rel_err(got, ref) < 1e-5, name
    assert torch.equal(again, out.detach())


def test_fused_retain_graph_with_the_chosen_kernel():
    """retain_graph=True: a second backward gives the same gradients again (the recorded graphs
    live as long as the call's node); without it, a third raises torch's usual error."""
    q, k, v, do = make_qkv(1, 12, 4, 2, 16, dtype=torch.float32, seed=3)
    with testing.fused_stand_ins(), testing.kernel_stand_in():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fused.ulysses_attention(*leaves, group=None, rank=0, seq_lens=[12], causal=True,
                                      softmax_scale=1 / math.sqrt(16), num_chunks=2)
        out.backward(do, retain_graph=True)
        first = [t.grad.clone() for t in leaves]
        out.backward(do)
        for t, g in zip(leaves, first):
            torch.testing.assert_close(t.grad, 2 * g, rtol=1e-6, atol=1e-6)
        with pytest.raises(RuntimeError, match="second time"):
            out.backward(do)


def test_flash_attention_asks_the_choice(monkeypatch):
    """Single-device `flash_attention` on the Triton path runs the chosen kernel."""
    import ulysses_kernels.api as api

    needs_interpreter()
    monkeypatch.setattr(api, "resolve_path", lambda *a, **kw: "triton")
    q, k, v, do = make_qkv(1, 21, 4, 2, 16, dtype=torch.float32, seed=4)
    with testing.kernel_stand_in() as calls:
        out = uk.flash_attention(q, k, v, causal=True)
        assert calls["run"] == 1
    assert rel_err(out, brute_force_attention(q, k, v, do, causal=True)[0]) < 1e-5


# ------------------------------------------------------------ process groups (gloo)

def path_worker(rank, world, backend, cases):
    """Every case through `backend` with the stand-in forced; returns each rank's out and
    grads (sequence shards), the stand-in's call counts, and the error of each refused case."""
    results = []
    restore = testing.enable_fused_stand_ins() if backend == "fused" else (lambda: None)
    try:
        with testing.kernel_stand_in() as calls:
            for c in cases:
                q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], 16, dtype=torch.float32, seed=c["S"])
                cu = torch.tensor(c["cu"], dtype=torch.int32) if c.get("cu") else None
                leaves = [shard(t, world, rank).requires_grad_(True) for t in (q, k, v)]
                try:
                    out = uk.ulysses_attention(*leaves, backend=backend, **_options(c, cu))
                except ValueError as exc:
                    results.append(str(exc))
                    continue
                out.backward(shard(do, world, rank))
                results.append([out.detach()] + [t.grad for t in leaves])
            counts = dict(calls)
    finally:
        restore()
    return dict(results=results, calls=counts)


PATH_CASES = [c for c in CASES if c["B"] == 1] + [dict(B=2, S=18, Hq=4, Hkv=2, chunks=1, causal=True)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "fused"])
@pytest.mark.parametrize("world", [2, 3])
def test_paths_run_the_chosen_kernel_on_every_rank(backend, world):
    """The Triton path (the receive buffer's `[1, S, h, D]` views, read in place) and the fused
    path at world 2 and 3 with uneven lengths; batch 2 across ranks is the buffer's block
    rows, which only our kernels read: the forced stand-in is refused there on every rank."""
    if backend == "triton":
        needs_interpreter()
    cases = [dict(c, Hq=2 * world, Hkv=(world if c["Hkv"] > 1 else 1)) for c in PATH_CASES]
    per_rank = spawn(path_worker, world, args=(backend, cases), timeout=SLOW_SPAWN_TIMEOUT)
    for i, c in enumerate(cases):
        q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], 16, dtype=torch.float32, seed=c["S"])
        if c["B"] > 1:
            errors = {r["results"][i] for r in per_rank}
            assert len(errors) == 1 and "cannot read the all-to-all buffer's block rows" in errors.pop()
            continue
        want, _ = _want(c, q, k, v, do)
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = torch.cat([r["results"][i][j] for r in per_rank], dim=1)
            assert rel_err(got, want[j]) < 1e-5, (c, name)
    assert all(r["calls"]["run"] >= len(cases) - 1 for r in per_rank)


def ring_worker(rank, world, cases):
    g = uk.init_sequence_parallel(world, ring_size=2)
    results = []
    with testing.kernel_stand_in() as calls:
        for c in cases:
            q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], 16, dtype=torch.float32, seed=c["S"])
            cu = torch.tensor(c["cu"], dtype=torch.int32) if c.get("cu") else None
            sharded = lambda t: uk.shard_sequence(t, g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
            leaves = [sharded(t).detach().requires_grad_(True) for t in (q, k, v)]
            out = uk.ulysses_attention(*leaves, group=g.ulysses_group, ring_group=g.ring_group, causal=c["causal"],
                                       cu_seqlens=cu, backend="triton")
            out.backward(sharded(do))
            gather = lambda t: uk.gather_sequence(t.detach(), g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
            results.append([gather(out)] + [gather(t.grad) for t in leaves])
        counts = dict(calls)
    return dict(results=results, calls=counts)


@pytest.mark.slow
def test_the_ring_runs_the_chosen_kernel_through_its_lse_pair():
    """2 x 2 (Ulysses 2, ring 2) on the Triton path: every block's forward and backward on
    the stand-in's LSE functions, merged by our merge kernel, equal to float64."""
    needs_interpreter()
    cases = [dict(B=1, S=37, Hq=4, Hkv=2, causal=True), dict(B=1, S=41, Hq=4, Hkv=2, causal=True, cu=[0, 9, 30, 41])]
    per_rank = spawn(ring_worker, 4, args=(cases,), timeout=SLOW_SPAWN_TIMEOUT)
    for i, c in enumerate(cases):
        q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], 16, dtype=torch.float32, seed=c["S"])
        want, _ = _want(c, q, k, v, do)
        for r in per_rank:
            for name, got, ref in zip(("out", "dq", "dk", "dv"), r["results"][i], want):
                assert rel_err(got, ref) < 1e-5, (c, name)
    assert all(r["calls"]["forward_lse"] > 0 and r["calls"]["backward_lse"] > 0 and r["calls"]["run"] == 0
               for r in per_rank)
