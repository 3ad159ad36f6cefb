"""ulysses_kernels/triton/merge.py: the fp32 log-sum-exp merge of attention partials (ring
attention), against attention over the union of the key sets, and against THE torch merge
(ulysses_kernels/ring/merge.py). Triton interpreter on CPU; the `gpu` test runs
the compiled kernel with bf16 partials."""

import pytest
import torch
from helpers import make_qkv, needs_interpreter, rel_err

from ulysses_kernels.reference import reference_attention
from ulysses_kernels.ring.merge import merge_partial


def _partials(device, dtype):
    """Attention of q over keys [0, 7) and over keys [7, 20), plus the float64 attention
    over all 20 keys."""
    q, k, v, _ = make_qkv(2, 12, 4, 2, 16, Sk=20, dtype=torch.float64, seed=3)
    full, _ = reference_attention(q, k, v)
    parts = []
    for lo, hi in ((0, 7), (7, 20)):
        out, lse = reference_attention(q, k[:, lo:hi], v[:, lo:hi])
        parts.append((out.to(device=device, dtype=dtype), lse.to(device=device, dtype=torch.float32)))
    return parts, full


def _merge_with(kernel, device, dtype):
    ((o1, l1), (o2, l2)), _ = _partials(device, dtype)
    B, n, H, D = o1.shape
    acc = torch.zeros(B, n, H, D, dtype=torch.float32, device=device)
    acc_lse = torch.full((B, H, n), float("-inf"), dtype=torch.float32, device=device)
    kernel(acc, acc_lse, o1, l1)
    kernel(acc, acc_lse, o2, l2)
    return acc, acc_lse


def test_merge_matches_attention_over_the_union():
    kernels = needs_interpreter()
    acc, acc_lse = _merge_with(kernels.merge_attention, "cpu", torch.float32)
    _, full = _partials("cpu", torch.float32)
    q, k, v, _ = make_qkv(2, 12, 4, 2, 16, Sk=20, dtype=torch.float64, seed=3)
    _, full_lse = reference_attention(q, k, v)
    assert rel_err(acc, full) < 1e-6
    assert rel_err(acc_lse, full_lse) < 1e-6


def test_merge_matches_the_torch_merge_on_row_slices_and_empty_rows():
    kernels = needs_interpreter()
    ((o1, l1), (o2, l2)), _ = _partials("cpu", torch.float32)
    l1[:, :, :3] = float("-inf")  # rows 0-2 saw no key in the first part
    o1[:, :3] = 0
    l1[:, 1, 5] = l2[:, 1, 5] = float("-inf")  # a row that sees no key at all
    o1[:, 5, 1] = o2[:, 5, 1] = 0
    results = []
    for merge in (kernels.merge_attention, merge_partial):
        acc = torch.zeros(2, 20, 4, 16)
        acc_lse = torch.full((2, 4, 20), float("-inf"))
        rows = slice(4, 16)  # a row slice of a larger accumulator, as the ring merges blocks
        merge(acc[:, rows], acc_lse[:, :, rows], o1, l1)
        merge(acc[:, rows], acc_lse[:, :, rows], o2, l2)
        results.append((acc, acc_lse))
    (a, al), (b, bl) = results
    assert torch.allclose(a, b, atol=1e-6) and torch.equal(torch.isinf(al), torch.isinf(bl))
    assert torch.allclose(al[~torch.isinf(al)], bl[~torch.isinf(bl)], atol=1e-6)
    assert torch.all(a[:, 9, 1] == 0) and torch.isneginf(al[:, 1, 9]).all()  # the empty row stays 0 / -inf
    assert torch.isfinite(a).all()


def test_merge_rejects_a_16_bit_accumulator():
    kernels = needs_interpreter()
    ((o1, l1), _), _ = _partials("cpu", torch.float32)
    with pytest.raises(ValueError, match="float32"):
        kernels.merge_attention(o1.bfloat16(), l1, o1, l1)


@pytest.mark.gpu
def test_merge_gpu_bf16_partials():
    from ulysses_kernels.extensions import triton_kernels

    kernels, _ = triton_kernels()
    acc, _ = _merge_with(kernels.merge_attention, "cuda", torch.bfloat16)
    _, full = _partials("cuda", torch.bfloat16)
    assert rel_err(acc, full) < 1e-2  # bf16 partials, fp32 merge
