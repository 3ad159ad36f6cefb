"""The public API (ulysses_kernels.api): `ulysses_attention` on the reference and Triton
paths over gloo process groups of 1 to 4 ranks against float64 single-process attention,
the exchanges on their own (bitwise round trips), sharding along the sequence, and the
single-process checks of `flash_attention` and friends."""

import pytest
import torch
from helpers import SPAWN_TIMEOUT, make_qkv, needs_interpreter, reference_with_grads, rel_err, seq_lens, shard

import ulysses_kernels as uk
from ulysses_kernels.launch import spawn

# world -> (query heads, kv head counts to try): MHA, GQA split, GQA replicate, MQA.
HEADS = {1: (4, [4, 2, 1]), 2: (4, [4, 2, 1]), 3: (6, [6, 3, 1]), 4: (8, [8, 4, 2, 1])}


# ------------------------------------------------------ run on every rank (spawned)

def attention_cases(rank, world, cases):
    """Run ulysses_attention fwd+bwd on this rank's shard of each case's global inputs."""
    results = []
    for case in cases:
        q, k, v, do = make_qkv(case["B"], case["S"], case["Hq"], case["Hkv"], case["D"], dtype=case["dtype"],
                               seed=case["seed"])
        ql, kl, vl = (shard(t, world, rank).requires_grad_(True) for t in (q, k, v))
        out = uk.ulysses_attention(ql, kl, vl, causal=case["causal"], cu_seqlens=case.get("cu_seqlens"),
                                   seq_lens=case.get("seq_lens"), backend=case.get("backend"))
        out.backward(shard(do, world, rank))
        results.append({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad})
    return results


# ----------------------------------------------------- attention over process groups

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
    # float32 and bfloat16 (torch SDPA on the reference path, reference/sdpa.py), packed documents included,
    # the seq_lens fast path, and fewer tokens than ranks (a rank with 0 tokens)
    cases.append(dict(B=2, S=37, Hq=Hq, Hkv=kv_options[1], D=16, causal=True, dtype=torch.float32))
    cases.append(dict(B=1, S=37, Hq=Hq, Hkv=kv_options[-1], D=16, causal=True, dtype=torch.float32, cu_seqlens=cu))
    cases.append(dict(B=2, S=37, Hq=Hq, Hkv=kv_options[1], D=16, causal=False, dtype=torch.bfloat16))
    cases.append(dict(B=1, S=29, Hq=Hq, Hkv=kv_options[0], D=8, causal=True, dtype=torch.float64,
                      seq_lens=seq_lens(29, world)))
    cases.append(dict(B=1, S=max(1, world - 1), Hq=Hq, Hkv=kv_options[-1], D=8, causal=False,
                      dtype=torch.float64))
    for i, c in enumerate(cases):
        c["seed"] = 100 * world + i
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_attention_matches_single_process(world):
    cases = _attention_cases(world)
    per_rank = spawn(attention_cases, world, args=(cases,), timeout=SPAWN_TIMEOUT)
    _check_against_reference(cases, per_rank, world)


def _check_against_reference(cases, per_rank, world):
    failures = []
    for i, case in enumerate(cases):
        q, k, v, do = make_qkv(case["B"], case["S"], case["Hq"], case["Hkv"], case["D"], dtype=case["dtype"],
                               seed=case["seed"])
        ref = reference_with_grads(q, k, v, do, case["causal"], case.get("cu_seqlens"))
        tol = {torch.float64: 1e-9, torch.float32: 1e-5}.get(case["dtype"], 1e-2)
        for name, r in zip(("out", "dq", "dk", "dv"), ref):
            got = torch.cat([per_rank[p][i][name] for p in range(world)], dim=1)
            assert got.dtype == case["dtype"]
            err = rel_err(got, r)
            if not err < tol:
                failures.append(f"case {i} {case} {name}: rel err {err:.3e} >= {tol}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_triton_path_matches_single_process(world):
    """backend="triton": the kernels (Triton interpreter on CPU) read the all-to-all receive
    buffer through two-level sequence addressing, B > 1 and uneven S included."""
    needs_interpreter()
    Hq, kv_options = HEADS[world]
    cu = torch.tensor([0, 1, 10, 10, 25, 37], dtype=torch.int32)
    cases = [dict(B=2, S=37, Hq=Hq, Hkv=kv_options[-1], D=16, causal=True, dtype=torch.float32),
             dict(B=1, S=37, Hq=Hq, Hkv=kv_options[1], D=16, causal=False, dtype=torch.float32, cu_seqlens=cu)]
    for i, c in enumerate(cases):
        c.update(seed=500 + 10 * world + i, backend="triton")
    per_rank = spawn(attention_cases, world, args=(cases,), timeout=SPAWN_TIMEOUT)
    _check_against_reference(cases, per_rank, world)


# -------------------------------------------------------------- the exchanges


# ------------------------------------------------------------ single process

def test_ulysses_attention_single_process_equals_flash_attention():
    q, k, v, _ = make_qkv(2, 11, 4, 2, 8, seed=2)
    assert torch.equal(uk.ulysses_attention(q, k, v, causal=True), uk.flash_attention(q, k, v, causal=True))


@pytest.mark.parametrize("args,message", [
    (dict(q=(1, 4, 3, 8), k=(1, 4, 2, 8)), "must be a multiple of key/value heads"),
    (dict(q=(1, 4, 2, 8), k=(1, 4, 2, 4)), "disagree on batch or head dim"),
    (dict(q=(2, 4, 2, 8), k=(1, 4, 2, 8)), "disagree on batch or head dim"),
    (dict(q=(4, 2, 8), k=(1, 4, 2, 8)), "q must be a 4-D tensor"),
])
def test_flash_attention_shape_errors(args, message):
    q = torch.randn(*args["q"])
    k = torch.randn(*args["k"])
    with pytest.raises(ValueError, match=message):
        uk.flash_attention(q, k, k.clone())


def test_flash_attention_rejects_bad_cu_seqlens_and_dtypes():
    q, k, v, _ = make_qkv(1, 8, 2, 2, 8, seed=5)
    with pytest.raises(ValueError, match="end at the global sequence length 8"):
        uk.flash_attention(q, k, v, cu_seqlens=[0, 4, 7])
    with pytest.raises(ValueError, match="non-decreasing"):
        uk.flash_attention(q, k, v, cu_seqlens=[0, 5, 3, 8])
    with pytest.raises(ValueError, match="dtype int64"):
        uk.flash_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="dtypes differ"):
        uk.flash_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="needs batch size 1"):
        uk.flash_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                           cu_seqlens=[0, 8])


def test_module_wraps_the_call():
    q, k, v, _ = make_qkv(1, 10, 4, 2, 8, seed=7)
    layer = uk.UlyssesAttention(causal=True)
    assert torch.equal(layer(q, k, v), uk.flash_attention(q, k, v, causal=True))
    assert "causal=True" in repr(layer)




def test_ring_documents_on_the_trusted_path():
    """With trusted seq_lens the ring's document boundaries are checked where they are read
    (api._ring_documents): rising from 0 to the global length, batch 1."""
    from ulysses_kernels import api

    assert api._ring_documents(None, 12, 2) is None
    assert api._ring_documents(torch.tensor([0, 5, 12], dtype=torch.int32), 12, 1) == (0, 5, 12)
    for bad in ([1, 5, 12], [0, 7, 5, 12], [0, 5, 11]):
        with pytest.raises(ValueError, match="must rise from 0 to the global length 12"):
            api._ring_documents(torch.tensor(bad, dtype=torch.int32), 12, 1)
    with pytest.raises(ValueError, match="needs batch size 1, got 2"):
        api._ring_documents(torch.tensor([0, 12], dtype=torch.int32), 12, 2)


def test_ring_documents_are_read_once_per_tensor(monkeypatch):
    """Every layer of a forward passes the same cu_seqlens tensor: its boundaries are read to
    the host once and kept on it until it changes; a host sequence is never read."""
    from ulysses_kernels import api

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert api._ring_documents(cu, 12, 1) == (0, 5, 12)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or original(self))
    for _ in range(3):
        assert api._ring_documents(cu, 12, 1) == (0, 5, 12)
    assert reads == []
    cu[1] = 7                                                # changed in place: read again
    assert api._ring_documents(cu, 12, 1) == (0, 7, 12) and reads == [1]
    assert api._ring_documents(torch.tensor([0, 12]), 12, 1, given=[0, 3, 12]) == (0, 3, 12) and reads == [1]
    with pytest.raises(ValueError, match="must rise from 0"):
        api._ring_documents(torch.tensor([0, 12]), 12, 1, given=[0, 13, 12])


def test_hf_without_transformers_says_how_to_install_it():
    """`import ulysses_kernels` works without transformers; `import ulysses_kernels.hf` raises an
    ImportError that names the extra and the checkout install (not a bare error from a file
    inside the package)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None\n"
            "import ulysses_kernels\n"
            "try:\n    import ulysses_kernels.hf\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ImportError: ulysses_kernels.hf needs Hugging Face transformers: pip install --no-build-isolation " \
           "-e '.[hf]' in the ulysses-kernels checkout" in out.stdout, out.stdout
