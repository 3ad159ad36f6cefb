"""The reference path's fast attention (ulysses_kernels/reference/sdpa.py): torch SDPA for the
calls it computes with the reference's semantics, against the float64 brute force written
out in helpers.py; the calls it cannot express keep the reference attention, and say why."""

import pytest
import torch
from helpers import brute_force_attention, make_qkv, param_id, rel_err

from ulysses_kernels.reference import PATH
from ulysses_kernels.reference.attention import attend
from ulysses_kernels.reference.sdpa import sdpa_attention, sdpa_problem
from ulysses_kernels.variants import Variant, make_variant

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}

# (B, Sq, Sk, Hq, Hkv, causal, window_size, cu_seqlens)
CASES = [
    (2, 61, 61, 4, 4, True, (-1, -1), None),            # causal, SDPA's own is_causal
    (2, 61, 61, 6, 2, False, (-1, -1), None),           # GQA, no mask
    (1, 45, 61, 4, 1, True, (-1, -1), None),            # MQA, bottom-right causal, fewer queries than keys
    (1, 61, 45, 4, 2, False, (-1, -1), None),           # more queries than keys without a mask
    (2, 61, 61, 4, 2, False, (7, 3), None),             # a window band
    (1, 61, 61, 4, 2, True, (9, -1), None),             # a causal window
    (1, 61, 61, 4, 1, True, (-1, -1), [0, 1, 20, 20, 47, 61]),   # packed documents (empty, length 1)
    (1, 61, 61, 6, 3, False, (4, 4), [0, 30, 61]),      # a window inside documents
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=param_id)
@pytest.mark.parametrize("case", CASES, ids=param_id)
def test_sdpa_equals_the_float64_brute_force(case, dtype):
    B, Sq, Sk, Hq, Hkv, causal, window_size, documents = case
    q, k, v, do = make_qkv(B, Sq, Hq, Hkv, 16, dtype=dtype, seed=Sq + Hq, Sk=Sk)
    cu_seqlens = torch.tensor(documents, dtype=torch.int32) if documents else None
    variant = make_variant(window_size, 0.0, causal=causal)
    assert sdpa_problem(q, k, v, causal=causal, variant=variant) is None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sdpa_attention(*leaves, causal=causal, softmax_scale=None, cu_seqlens=cu_seqlens, variant=variant)
    out.backward(do)
    ref = brute_force_attention(q, k, v, do, causal=causal, cu_seqlens=cu_seqlens, window_size=window_size)
    assert out.dtype == dtype and out.shape == (B, Sq, Hq, 16)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), ref):
        assert rel_err(got, want) < TOLERANCE[dtype], name


def test_the_path_runs_sdpa_for_plain_calls_and_the_reference_for_the_rest():
    q, k, v, do = make_qkv(1, 33, 4, 2, 16, dtype=torch.float32, seed=3)
    plain, _ = PATH.attention(q.requires_grad_(True), k, v, causal=True, softmax_scale=None)
    assert "ScaledDotProduct" in type(plain.grad_fn.next_functions[0][0]).__name__
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    for label, kwargs, tensors in [
            ("float64", {}, (q64, k64, v64)),
            ("softcap", {"variant": Variant(softcap=5.0)}, (q, k, v)),
            ("sinks", {"sinks": torch.zeros(4)}, (q, k, v)),
            ("value head dim", {}, (q, k, v[..., :8])),
            ("lse", {"with_lse": True}, (q, k, v)),
            ("rows without keys", {}, (q, k[:, :20], v[:, :20])),
            ("deterministic off the CPU", {"deterministic": True}, (q, k, v))]:
        with_lse = kwargs.pop("with_lse", False)
        deterministic = kwargs.pop("deterministic", False)
        problem = sdpa_problem(*tensors, causal=True, with_lse=with_lse, **kwargs)
        if label == "deterministic off the CPU":
            assert problem is None          # the CPU flash kernel's backward is reproducible
            meta = tuple(t.to("meta") for t in tensors)
            assert "deterministic" in sdpa_problem(*meta, causal=True, deterministic=deterministic)
            continue
        assert problem, label
        out, lse = PATH.attention(*tensors, causal=True, softmax_scale=None, with_lse=with_lse, **kwargs)
        want, want_lse = attend(*tensors, causal=True, softmax_scale=None, **kwargs)
        assert torch.equal(out, want), label           # the reference attention itself ran
        assert (lse is not None) == with_lse
    banded = make_variant((3, 3), 0.0)
    assert "shifted band" in sdpa_problem(q, k, v, causal=False, variant=Variant(window=(-2, 5)))
    assert sdpa_problem(q, k, v, causal=False, variant=banded) is None


def test_the_cpu_backward_is_reproducible():
    q, k, v, do = make_qkv(2, 200, 4, 2, 32, dtype=torch.float32, seed=9)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        sdpa_attention(*leaves, causal=True, softmax_scale=None).backward(do)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
