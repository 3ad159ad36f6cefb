"""The reference attention (ulysses_kernels.reference.attention): the semantics every path is
tested against, checked against a loop-per-row float64 definition."""

import math

import pytest
import torch
from helpers import make_qkv, param_id, rel_err

import ulysses_kernels as uk


def naive_attention(q, k, v, causal, cu_seqlens=None, scale=None):
    """Loop-per-row float64 definition, independent of the vectorised reference."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1 / math.sqrt(D)
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float64)
    doc = None
    if cu_seqlens is not None:
        doc = [next(i for i in range(len(cu_seqlens) - 1) if cu_seqlens[i] <= s < cu_seqlens[i + 1])
               for s in range(Sk)]
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(Sq):
                keys = [j for j in range(Sk) if (not causal or j <= i + Sk - Sq) and (doc is None or doc[i] == doc[j])]
                if not keys:
                    continue
                s = torch.stack([q[b, i, h].double() @ k[b, j, kh].double() for j in keys]) * scale
                p = torch.softmax(s, 0)
                out[b, i, h] = sum(pj * v[b, j, kh].double() for pj, j in zip(p, keys))
                lse[b, h, i] = torch.logsumexp(s, 0)
    return out, lse


@pytest.mark.parametrize("Sq,Sk,causal", [(7, 7, False), (7, 7, True), (5, 9, True), (9, 5, True), (9, 5, False)])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
def test_reference_matches_naive_definition(Sq, Sk, causal, Hq, Hkv):
    g = torch.Generator().manual_seed(Sq * 31 + Sk)
    q = torch.randn(2, Sq, Hq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, Sk, Hkv, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, Sk, Hkv, 8, generator=g, dtype=torch.float64)
    out, lse = uk.reference_attention(q, k, v, causal=causal)
    ref_out, ref_lse = naive_attention(q, k, v, causal)
    assert rel_err(out, ref_out) < 1e-12
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-12
    assert not torch.isnan(out).any()


def test_fully_masked_rows_give_zeros_and_finite_grads():
    q, k, v, do = make_qkv(1, 9, 2, 2, 8, seed=0)
    k, v = k[:, :4], v[:, :4]  # Sq=9 > Sk=4: the first 5 rows see no key when causal
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = uk.reference_attention(q, k, v, causal=True)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.isinf(lse[:, :, :5]).all()
    out.backward(do)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_packed_documents_with_empty_and_single_token_docs():
    cu = [0, 1, 1, 6, 13]
    q, k, v, _ = make_qkv(1, 13, 4, 2, 8, seed=1)
    for causal in (False, True):
        out = uk.flash_attention(q, k, v, causal=causal, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        ref, _ = naive_attention(q, k, v, causal, cu)
        assert rel_err(out, ref) < 1e-12
        # documents are independent: attention of a document alone gives the same rows
        alone = uk.flash_attention(q[:, 6:13], k[:, 6:13], v[:, 6:13], causal=causal)
        assert rel_err(out[:, 6:13], alone) < 1e-12


def test_softmax_scale_is_used():
    q, k, v, _ = make_qkv(1, 6, 2, 2, 8, seed=3)
    out = uk.flash_attention(q, k, v, softmax_scale=0.1)
    ref, _ = naive_attention(q, k, v, False, scale=0.1)
    assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)],
                         ids=param_id)
def test_low_precision_inputs(dtype, tol):
    q, k, v, _ = make_qkv(1, 16, 2, 1, 16, seed=4)
    out = uk.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    assert out.dtype == dtype
    assert rel_err(out, uk.flash_attention(q, k, v, causal=True)) < tol
