"""Shared test utilities: inputs, float64 references and error measures."""

import torch

from ulysses_kernels import reference_attention


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def make_qkv(seed, B, S, Hq, Hkv, D, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def reference_with_grads(q, k, v, do, causal, cu_seqlens=None, softmax_scale=None):
    """Float64 output and q/k/v gradients of full single-process attention."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = reference_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad
