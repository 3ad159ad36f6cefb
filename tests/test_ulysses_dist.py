"""Multi-process (gloo, CPU) tests of the reference path against full single-process attention."""

import pytest
import torch

import _dist_cases
from _helpers import make_qkv, reference_with_grads, rel_err
from ulysses_kernels.launch import spawn

TIMEOUT = 180  # seconds per spawn: a hang fails the test instead of blocking CI

# world -> (query heads, kv head counts to try): MHA, GQA split, GQA replicate, MQA.
HEADS = {1: (4, [4, 2, 1]), 2: (4, [4, 2, 1]), 3: (6, [6, 3, 1]), 4: (8, [8, 4, 2, 1])}


def _attention_cases(world):
    Hq, kv_options = HEADS[world]
    cases = []
    for Hkv in kv_options:
        for causal in (False, True):
            cases.append(dict(B=2, S=37, Hq=Hq, Hkv=Hkv, D=8, causal=causal, dtype=torch.float64))
    # packed documents, including an empty and a length-1 document
    cu = torch.tensor([0, 1, 10, 10, 25, 37], dtype=torch.int32)
    for causal in (False, True):
        cases.append(dict(B=1, S=37, Hq=Hq, Hkv=kv_options[-1], D=8, causal=causal, dtype=torch.float64,
                          cu_seqlens=cu))
    # float32, the seq_lens fast path, and fewer tokens than ranks (a rank with 0 tokens)
    cases.append(dict(B=2, S=37, Hq=Hq, Hkv=kv_options[1], D=16, causal=True, dtype=torch.float32))
    lens = [len(c) for c in torch.tensor_split(torch.empty(29), world)]
    cases.append(dict(B=1, S=29, Hq=Hq, Hkv=kv_options[0], D=8, causal=True, dtype=torch.float64, seq_lens=lens))
    cases.append(dict(B=1, S=max(1, world - 1), Hq=Hq, Hkv=kv_options[-1], D=8, causal=False,
                      dtype=torch.float64))
    for i, c in enumerate(cases):
        c["seed"] = 100 * world + i
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_attention_matches_single_process(world):
    cases = _attention_cases(world)
    per_rank = spawn(_dist_cases.attention_cases, world, args=(cases,), timeout=TIMEOUT)
    _check_against_reference(cases, per_rank, world)


def _check_against_reference(cases, per_rank, world):
    failures = []
    for i, case in enumerate(cases):
        q, k, v, do = make_qkv(case["seed"], case["B"], case["S"], case["Hq"], case["Hkv"], case["D"],
                               case["dtype"])
        ref = reference_with_grads(q, k, v, do, case["causal"], case.get("cu_seqlens"))
        tol = 1e-9 if case["dtype"] == torch.float64 else 1e-5
        for name, r in zip(("out", "dq", "dk", "dv"), ref):
            got = torch.cat([per_rank[p][i][name] for p in range(world)], dim=1)
            assert got.dtype == case["dtype"]
            err = rel_err(got, r)
            if not err < tol:
                failures.append(f"case {i} {case} {name}: rel err {err:.3e} >= {tol}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_triton_path_matches_single_process(world):
    """backend="triton": the kernels (Triton interpreter on CPU) read the all-to-all receive
    buffer through two-level sequence addressing, B > 1 and uneven S included."""
    Hq, kv_options = HEADS[world]
    cu = torch.tensor([0, 1, 10, 10, 25, 37], dtype=torch.int32)
    cases = [dict(B=2, S=37, Hq=Hq, Hkv=kv_options[-1], D=16, causal=True, dtype=torch.float32),
             dict(B=1, S=37, Hq=Hq, Hkv=kv_options[1], D=16, causal=False, dtype=torch.float32, cu_seqlens=cu)]
    for i, c in enumerate(cases):
        c.update(seed=500 + 10 * world + i, backend="triton")
    per_rank = spawn(_dist_cases.attention_cases, world, args=(cases,), timeout=TIMEOUT)
    _check_against_reference(cases, per_rank, world)


ERROR_SCENARIOS = {
    "self_attention_bad_hidden": "rank {last}: x must be [batch, seq_local, 16]",
    "heads_to_seq_lengths_differ": "ranks disagree on the sequence length",
    "heads_to_seq_heads_differ": "ranks disagree on the number of x heads",
    "cu_seqlens_unreadable": "cu_seqlens could not be read",
    "q_not_a_tensor": "rank 0: q is not a tensor",
    "q_heads_not_divisible": "must be divisible by the sequence-parallel size",
    "kv_heads_incompatible": "key/value heads",
    "head_dim_mismatch_one_rank": "rank 1: head dims differ",
    "dtype_differs_between_ranks": "ranks disagree on dtype",
    "dtype_differs_q_v": "dtypes differ",
    "device_differs": "rank 1: devices differ",
    "heads_differ_between_ranks": "ranks disagree on the number of q heads",
    "batch_differs": "ranks disagree on batch size",
    "lengths_not_tensor_split": "are not the torch.tensor_split of the global length",
    "not_4d": "rank 0: q must be 4-D",
    "cu_seqlens_does_not_cover": "must start at 0 and end at the global sequence length",
    "cu_seqlens_decreasing": "non-decreasing",
    "cu_seqlens_differ_between_ranks": "ranks disagree on cu_seqlens",
    "cu_seqlens_float": "integer tensor",
    "causal_differs": "ranks disagree on causal",
    "bad_backend_one_rank": "rank 1: backend='bogus' is not a backend",
    "forced_fused_on_cpu": "backend='fused' needs CUDA tensors",
    "different_ops": "which operation they are calling",
    "seq_lens_wrong_size": "seq_lens has",
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bad_input_raises_on_every_rank_without_hanging(world):
    scenarios = list(ERROR_SCENARIOS)
    reports = spawn(_dist_cases.error_cases, world, args=(scenarios,), timeout=TIMEOUT)
    problems = []
    for name, expected in ERROR_SCENARIOS.items():
        for rank, report in enumerate(reports):
            err = report[name]["error"]
            expected_here = expected.format(last=world - 1)
            if err is None or expected_here not in err:
                problems.append(f"{name}: rank {rank} got {err!r}, expected a ValueError containing {expected_here!r}")
            if not report[name]["recovery"] < 1e-9:
                problems.append(f"{name}: rank {rank}: the group is not usable after the error")
        # the same words on every rank (the prefix names the op each rank called)
        messages = {(report[name]["error"] or "").split(": ", 1)[-1] for report in reports}
        if len(messages) != 1:
            problems.append(f"{name}: ranks raised different messages: {messages}")
    assert not problems, "\n".join(problems)


def test_error_messages_name_the_numbers():
    reports = spawn(_dist_cases.error_cases, 3, args=(["lengths_not_tensor_split", "q_heads_not_divisible"],),
                    timeout=TIMEOUT)
    msg = reports[0]["lengths_not_tensor_split"]["error"]
    assert "[6, 2, 4]" in msg and "expected [4, 4, 4]" in msg and "12" in msg, msg
    msg = reports[2]["q_heads_not_divisible"]["error"]
    assert "(7)" in msg and "(3)" in msg, msg


def test_non_member_group_raises_and_members_proceed():
    reports = spawn(_dist_cases.non_member_group, 4, timeout=TIMEOUT)
    for rank, report in enumerate(reports):
        if rank < 2:
            assert report["error"] is None
        else:
            assert report["error"] and "not a member" in report["error"], report
        assert report["recovery"] < 1e-9


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_seq_heads_round_trip_is_bitwise(world):
    B, S, H, D = 2, 4 * world + 3, 2 * world, 4
    reports = spawn(_dist_cases.roundtrip_cases, world, args=(B, S, H, D), timeout=TIMEOUT)
    b, s, h, d = torch.meshgrid(torch.arange(B), torch.arange(S), torch.arange(H), torch.arange(D), indexing="ij")
    code = (((b * S + s) * H + h) * D + d).double()
    hl = H // world
    for rank, rep in enumerate(reports):
        assert torch.equal(rep["heads"], code[:, :, rank * hl:(rank + 1) * hl]), f"rank {rank}"
        assert rep["back_equal"] and rep["bf16_back_equal"], f"rank {rank}"
        assert torch.equal(rep["q_h"], code[:, :, rank * hl:(rank + 1) * hl])
        assert torch.equal(rep["k_rep"], code[:, :, :1] + 0.5)  # one kv head replicated everywhere
        assert torch.equal(rep["k_split"], code[:, :, rank:rank + 1] + 0.25)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_gather_sequence(world):
    S = 3 * world + 2
    reports = spawn(_dist_cases.shard_gather_cases, world, args=(S,), timeout=TIMEOUT)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(2, S, 3, generator=g, dtype=torch.float64)
    weights = torch.arange(1, S + 1, dtype=torch.float64).view(1, S, 1).expand(2, S, 3)
    for rank, rep in enumerate(reports):
        assert torch.equal(rep["local"], torch.tensor_split(full, world, dim=1)[rank])
        assert torch.equal(rep["shard_grad"], weights)
        assert torch.equal(rep["gathered"], full)
        assert torch.equal(rep["gather_grad"], torch.tensor_split(weights, world, dim=1)[rank])


def test_dp_x_sp_groups_compute_their_own_batches():
    reports = spawn(_dist_cases.dp_sp_cases, 4, args=(2, 19), timeout=TIMEOUT)
    assert [r["sp_ranks"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in reports] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(r["dp_rank"], r["sp_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["err"] < 1e-9 for r in reports), [r["err"] for r in reports]


@pytest.mark.parametrize("world", [2, 3])
def test_self_attention_module_matches_single_process(world):
    """UlyssesSelfAttention (reference path, and the Triton path in the interpreter at
    world 2) equals the same module run on one process over the whole sequence."""
    Hq = 2 * world
    cases = [dict(seed=11, B=2, S=4 * world + 3, hidden=24, Hq=Hq, Hkv=world, D=8, causal=True),
             dict(seed=12, B=1, S=4 * world + 1, hidden=24, Hq=Hq, Hkv=1, D=8, causal=False)]
    if world == 2:
        cases.append(dict(seed=13, B=1, S=9, hidden=32, Hq=4, Hkv=2, D=16, causal=True, backend="triton",
                          dtype=torch.float32))
    reports = spawn(_dist_cases.self_attention_cases, world, args=(cases,), timeout=TIMEOUT)
    single = _dist_cases.self_attention_cases(0, 1, [dict(c, backend="reference") for c in cases])
    for i, (case, ref) in enumerate(zip(cases, single)):
        tol = 1e-9 if case.get("backend") is None else 1e-5
        y = torch.cat([r[i]["y"] for r in reports], dim=1)
        dx = torch.cat([r[i]["dx"] for r in reports], dim=1)
        assert rel_err(y, ref["y"]) < tol and rel_err(dx, ref["dx"]) < tol, case
        for j, g in enumerate(ref["grads"]):
            assert rel_err(sum(r[i]["grads"][j] for r in reports), g) < tol, (case, j)
