"""Single-process semantics: the reference attention, flash_attention checks, backend rules."""

import math

import pytest
import torch

import ulysses_kernels as uk
from _helpers import make_qkv, rel_err


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
    q, k, v, do = make_qkv(0, 1, 9, 2, 2, 8)
    k, v = k[:, :4], v[:, :4]  # Sq=9 > Sk=4: the first 5 rows see no key when causal
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = uk.reference_attention(q, k, v, causal=True)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.isinf(lse[:, :, :5]).all()
    out.backward(do)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_packed_documents_with_empty_and_single_token_docs():
    cu = [0, 1, 1, 6, 13]
    q, k, v, _ = make_qkv(1, 1, 13, 4, 2, 8)
    for causal in (False, True):
        out = uk.flash_attention(q, k, v, causal=causal, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        ref, _ = naive_attention(q, k, v, causal, cu)
        assert rel_err(out, ref) < 1e-12
        # documents are independent: attention of a document alone gives the same rows
        alone = uk.flash_attention(q[:, 6:13], k[:, 6:13], v[:, 6:13], causal=causal)
        assert rel_err(out[:, 6:13], alone) < 1e-12


def test_ulysses_attention_single_process_equals_flash_attention():
    q, k, v, _ = make_qkv(2, 2, 11, 4, 2, 8)
    assert torch.equal(uk.ulysses_attention(q, k, v, causal=True), uk.flash_attention(q, k, v, causal=True))


def test_softmax_scale_is_used():
    q, k, v, _ = make_qkv(3, 1, 6, 2, 2, 8)
    out = uk.flash_attention(q, k, v, softmax_scale=0.1)
    ref, _ = naive_attention(q, k, v, False, scale=0.1)
    assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_inputs(dtype, tol):
    q, k, v, _ = make_qkv(4, 1, 16, 2, 1, 16)
    out = uk.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    assert out.dtype == dtype
    assert rel_err(out, uk.flash_attention(q, k, v, causal=True)) < tol


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
    q, k, v, _ = make_qkv(5, 1, 8, 2, 2, 8)
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


def test_backend_selection_rules(monkeypatch):
    from ulysses_kernels import _backend

    cpu = torch.device("cpu")
    assert _backend.resolve_backend(None, cpu, distributed=True) == "reference"
    monkeypatch.setenv("ULYSSES_KERNELS_BACKEND", "reference")
    assert _backend.resolve_backend(None, cpu, distributed=True) == "reference"
    monkeypatch.setenv("ULYSSES_KERNELS_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_BACKEND='nonsense' is not a backend"):
        _backend.resolve_backend(None, cpu, distributed=True)
    monkeypatch.delenv("ULYSSES_KERNELS_BACKEND")
    with pytest.raises(ValueError, match="backend='cuda' is not a backend"):
        _backend.resolve_backend("cuda", cpu, distributed=True)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        _backend.resolve_backend("fused", cpu, distributed=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _backend.resolve_backend("triton", cpu, distributed=False)


def test_forced_fused_on_cpu_is_a_clear_error_single_process():
    q, k, v, _ = make_qkv(6, 1, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="backend='fused' needs CUDA tensors"):
        uk.ulysses_attention(q, k, v, backend="fused")


def test_split_lengths_is_tensor_split():
    for total in range(0, 23):
        for parts in range(1, 6):
            expected = [len(c) for c in torch.tensor_split(torch.empty(total), parts)]
            assert uk.split_lengths(total, parts) == expected


def test_module_wraps_the_call():
    q, k, v, _ = make_qkv(7, 1, 10, 4, 2, 8)
    layer = uk.UlyssesAttention(causal=True)
    assert torch.equal(layer(q, k, v), uk.flash_attention(q, k, v, causal=True))
    assert "causal=True" in repr(layer)


def test_heads_to_seq_single_process_checks():
    x = torch.randn(2, 5, 3, 4)
    assert torch.equal(uk.heads_to_seq(x), x) and torch.equal(uk.heads_to_seq(x, seq_lens=[5]), x)
    with pytest.raises(ValueError, match="summing to the sequence length 5"):
        uk.heads_to_seq(x, seq_lens=[4])
    with pytest.raises(ValueError, match="must be a 4-D tensor"):
        uk.heads_to_seq(x[0])
