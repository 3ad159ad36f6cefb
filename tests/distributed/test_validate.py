"""Cross-rank validation (ulysses_kernels/distributed/validate.py): bad inputs on any rank raise the same
ValueError on every rank instead of a hang, the message names the numbers, and the group
is usable afterwards. Gloo process groups at world sizes 2, 3 and 4."""

import pytest
import torch
import torch.distributed as dist
from helpers import SPAWN_TIMEOUT, make_qkv, reference_with_grads, rel_err, seq_lens

import ulysses_kernels as uk
from ulysses_kernels.launch import spawn

# ------------------------------------------------------ run on every rank (spawned)

def _expect_error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _recovery_check(rank, world, group=None):
    """A valid call after an error: the group must still work and be exact."""
    q, k, v, do = make_qkv(1, 4 * world + 1, 2 * world, world, 8, seed=123)
    mine = lambda t: torch.tensor_split(t, world, dim=1)[rank]  # noqa: E731
    out = uk.ulysses_attention(mine(q), mine(k), mine(v), causal=True, group=group)
    ref, *_ = reference_with_grads(q, k, v, do, True)
    return rel_err(out, mine(ref))


def error_cases(rank, world, scenarios):
    """For each named scenario, build this rank's (bad) inputs, call, record the error."""
    report = {}
    for name in scenarios:
        call = _SCENARIOS[name](rank, world)
        report[name] = {"error": _expect_error(call), "recovery": _recovery_check(rank, world)}
    return report


def _inputs(rank, world, B=1, S_local=None, Hq=None, Hkv=None, D=8, dtype=torch.float64, S=None):
    Hq = Hq if Hq is not None else 2 * world
    Hkv = Hkv if Hkv is not None else world
    S = S if S is not None else 4 * world + 1
    n = S_local if S_local is not None else seq_lens(S, world)[rank]
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, n, Hq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, n, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, k.clone()


def _bad_q_heads(rank, world):
    q, k, v = _inputs(rank, world, Hq=2 * world + 1, Hkv=1)
    return lambda: uk.ulysses_attention(q, k, v)


def _bad_kv_heads(rank, world):
    # world 3: 6 query heads, 2 kv heads (2 does not divide 3 and 3 does not divide 2)
    # world 4: 12 query heads, 3 kv heads.
    Hkv = {2: 3, 3: 2, 4: 3}[world]
    q, k, v = _inputs(rank, world, Hq=Hkv * world, Hkv=Hkv)
    return lambda: uk.ulysses_attention(q, k, v)


def _head_dim_mismatch_one_rank(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 1:
        k = torch.randn(*k.shape[:3], 16, dtype=k.dtype)
    return lambda: uk.ulysses_attention(q, k, v)


def _dtype_mismatch_between_ranks(rank, world):
    q, k, v = _inputs(rank, world, dtype=torch.float32 if rank == 0 else torch.float64)
    return lambda: uk.ulysses_attention(q, k, v)


def _dtype_mismatch_qv(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == world - 1:
        v = v.float()
    return lambda: uk.ulysses_attention(q, k, v)


def _device_mismatch(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 1:
        v = v.to("meta")
    return lambda: uk.ulysses_attention(q, k, v)


def _heads_differ_between_ranks(rank, world):
    q, k, v = _inputs(rank, world, Hq=2 * world if rank else 4 * world)
    return lambda: uk.ulysses_attention(q, k, v)


def _batch_differs(rank, world):
    q, k, v = _inputs(rank, world, B=2 if rank == 0 else 1)
    return lambda: uk.ulysses_attention(q, k, v)


def _lengths_not_tensor_split(rank, world):
    # tensor_split of 4*world gives 4 each; rank 0 has 6 and rank 1 has 2.
    n = {0: 6, 1: 2}.get(rank, 4)
    q, k, v = _inputs(rank, world, S_local=n)
    return lambda: uk.ulysses_attention(q, k, v)


def _not_4d(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 0:
        q = q[0]
    return lambda: uk.ulysses_attention(q, k, v)


def _cu_seqlens_short(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=torch.tensor([0, 3, S - 1], dtype=torch.int32))


def _cu_seqlens_decreasing(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 2, S], dtype=torch.int32))


def _cu_seqlens_differ(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    cu = torch.tensor([0, 3 + rank, S], dtype=torch.int32)
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=cu)


def _cu_seqlens_float(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=torch.tensor([0.0, float(S)]))


def _causal_differs(rank, world):
    q, k, v = _inputs(rank, world)
    return lambda: uk.ulysses_attention(q, k, v, causal=rank == 0)


def _bad_backend_one_rank(rank, world):
    q, k, v = _inputs(rank, world)
    return lambda: uk.ulysses_attention(q, k, v, backend="bogus" if rank == 1 else None)


def _forced_fused_on_cpu(rank, world):
    q, k, v = _inputs(rank, world)
    return lambda: uk.ulysses_attention(q, k, v, backend="fused")


def _different_ops(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 0:
        return lambda: uk.seq_to_heads(q)
    return lambda: uk.ulysses_attention(q, k, v)


def _seq_lens_wrong_size(rank, world):
    q, k, v = _inputs(rank, world)
    lens = [q.shape[1]] * (world + 1)
    return lambda: uk.ulysses_attention(q, k, v, seq_lens=lens)


def _cu_seqlens_unreadable(rank, world):
    q, k, v = _inputs(rank, world)
    S = 4 * world + 1
    cu = ["zero", S] if rank == world - 1 else [0, S]
    return lambda: uk.ulysses_attention(q, k, v, cu_seqlens=cu)


def _q_not_a_tensor(rank, world):
    q, k, v = _inputs(rank, world)
    if rank == 0:
        q = q.numpy()
    return lambda: uk.ulysses_attention(q, k, v)


def _seq_to_heads_heads_not_divisible(rank, world):
    x, _, _ = _inputs(rank, world, Hq=2 * world + 1, Hkv=1)
    return lambda: uk.seq_to_heads(x)


def _seq_to_heads_heads_not_divisible_trusted(rank, world):
    x, _, _ = _inputs(rank, world, Hq=2 * world + 1, Hkv=1)
    return lambda: uk.seq_to_heads(x, seq_lens=seq_lens(4 * world + 1, world))


def _heads_to_seq_lengths_differ(rank, world):
    # Each rank holds a head shard of the whole sequence: rank 0 believes it is one longer.
    x = torch.randn(1, 4 * world + 1 + (rank == 0), 2, 8, dtype=torch.float64)
    return lambda: uk.heads_to_seq(x)


def _heads_to_seq_heads_differ(rank, world):
    x = torch.randn(2, 4 * world + 1, 2 + (rank == world - 1), 8, dtype=torch.float64)
    return lambda: uk.heads_to_seq(x)


def _self_attention_bad_hidden(rank, world):
    layer = uk.UlyssesSelfAttention(16, 2 * world, world, 8, dtype=torch.float64)
    x = torch.randn(1, 5, 16 + (rank == world - 1), dtype=torch.float64)
    return lambda: layer(x)


_SCENARIOS = {
    "seq_to_heads_heads_not_divisible": _seq_to_heads_heads_not_divisible,
    "seq_to_heads_heads_not_divisible_trusted": _seq_to_heads_heads_not_divisible_trusted,
    "self_attention_bad_hidden": _self_attention_bad_hidden,
    "heads_to_seq_lengths_differ": _heads_to_seq_lengths_differ,
    "heads_to_seq_heads_differ": _heads_to_seq_heads_differ,
    "cu_seqlens_unreadable": _cu_seqlens_unreadable,
    "q_not_a_tensor": _q_not_a_tensor,
    "q_heads_not_divisible": _bad_q_heads,
    "kv_heads_incompatible": _bad_kv_heads,
    "head_dim_mismatch_one_rank": _head_dim_mismatch_one_rank,
    "dtype_differs_between_ranks": _dtype_mismatch_between_ranks,
    "dtype_differs_q_v": _dtype_mismatch_qv,
    "device_differs": _device_mismatch,
    "heads_differ_between_ranks": _heads_differ_between_ranks,
    "batch_differs": _batch_differs,
    "lengths_not_tensor_split": _lengths_not_tensor_split,
    "not_4d": _not_4d,
    "cu_seqlens_does_not_cover": _cu_seqlens_short,
    "cu_seqlens_decreasing": _cu_seqlens_decreasing,
    "cu_seqlens_differ_between_ranks": _cu_seqlens_differ,
    "cu_seqlens_float": _cu_seqlens_float,
    "causal_differs": _causal_differs,
    "bad_backend_one_rank": _bad_backend_one_rank,
    "forced_fused_on_cpu": _forced_fused_on_cpu,
    "different_ops": _different_ops,
    "seq_lens_wrong_size": _seq_lens_wrong_size,
}


def non_member_group(rank, world):
    """Ranks outside a subgroup get a ValueError; members use it normally."""
    sub = dist.new_group([0, 1])
    others = dist.new_group([2, 3])
    if rank in (0, 1):
        return {"error": None, "recovery": _recovery_check(rank, 2, group=sub)}
    q, k, v = _inputs(rank, world)
    return {"error": _expect_error(lambda: uk.ulysses_attention(q, k, v, group=sub)),
            "recovery": _recovery_check(rank - 2, 2, group=others)}


# ------------------------------------------------------------------------- tests

ERROR_SCENARIOS = {
    "seq_to_heads_heads_not_divisible": "must be divisible by the sequence-parallel size",
    "seq_to_heads_heads_not_divisible_trusted": "must be divisible by the sequence-parallel size",
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


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bad_input_raises_on_every_rank_without_hanging(world):
    scenarios = list(ERROR_SCENARIOS)
    reports = spawn(error_cases, world, args=(scenarios,), timeout=SPAWN_TIMEOUT)
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


@pytest.mark.slow
def test_error_messages_name_the_numbers():
    reports = spawn(error_cases, 3, args=(["lengths_not_tensor_split", "q_heads_not_divisible"],),
                    timeout=SPAWN_TIMEOUT)
    msg = reports[0]["lengths_not_tensor_split"]["error"]
    assert "[6, 2, 4]" in msg and "expected [4, 4, 4]" in msg and "12" in msg, msg
    msg = reports[2]["q_heads_not_divisible"]["error"]
    assert "(7)" in msg and "(3)" in msg, msg


@pytest.mark.slow
def test_non_member_group_raises_and_members_proceed():
    reports = spawn(non_member_group, 4, timeout=SPAWN_TIMEOUT)
    for rank, report in enumerate(reports):
        if rank < 2:
            assert report["error"] is None
        else:
            assert report["error"] and "not a member" in report["error"], report
        assert report["recovery"] < 1e-9


def test_descriptor_options_are_one_field_table():
    """OPTION_FIELDS writes and reads every option: two ranks that differ in exactly one
    option get an error naming that field and both ranks' values (no process group: the
    table check is a pure function)."""
    from ulysses_kernels.distributed import validate
    from ulysses_kernels.variants import Variant

    q = torch.randn(1, 4, 2, 8)
    base = dict(causal=True, softmax_scale=0.25, backend=None, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32),
                variant=Variant(window=(3, None), softcap=5.0), sinks=torch.tensor([0.5, -1.0]))
    other = dict(causal=False, softmax_scale=0.5, backend="reference",
                 cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32), variant=Variant(window=(2, None), softcap=5.0),
                 sinks=torch.tensor([0.5, -2.0]))
    assert sum(f.width for f in validate.OPTION_FIELDS) + 4 + 3 * 8 == validate.DESCRIPTOR_LEN
    assert [f.name for f in validate.OPTION_FIELDS] == list(validate.CallOptions._fields[:4]) + [
        "window_size", "softcap", "sinks"]
    for name, value in other.items():
        rows = [validate.build_descriptor("seq_to_heads", [q], **base),
                validate.build_descriptor("seq_to_heads", [q], **dict(base, **{name: value}))]
        err = validate.check_table("seq_to_heads", rows, ["x"])
        field = "window_size" if name == "variant" else name
        assert err is not None and field in err, (name, err)
    softcap_only = dict(base, variant=Variant(window=(3, None), softcap=4.0))
    rows = [validate.build_descriptor("seq_to_heads", [q], **base),
            validate.build_descriptor("seq_to_heads", [q], **softcap_only)]
    assert "softcap" in validate.check_table("seq_to_heads", rows, ["x"])
    assert validate.check_table("seq_to_heads", [rows[0], rows[0]], ["x"]) is None
