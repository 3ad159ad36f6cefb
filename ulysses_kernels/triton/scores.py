"""The score arithmetic the attention kernels share: exp2 units (LOG2E, LN2), the dots'
input precision, the interpreter's fp32 dots and the softcap's tanh (docs/architecture.md,
"Attention variants")."""

import torch
import triton
import triton.language as tl

from ..env import interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
TWO_LOG2E = 2.0 * LOG2E


def dot_precision(dtype: torch.dtype, head_dim: int = 128) -> str:
    """tl.dot input precision. 16-bit inputs ignore it ("tf32").

    fp32 inputs: exact "ieee" products in the interpreter (tests). On the GPU "ieee" means
    no tensor cores: the sm_90 build of a 64x32 tile already needs kilobytes of local
    memory per thread and a minute to compile. "tf32x3" (three tf32 wgmmas, about fp32
    accuracy) is used instead, and plain "tf32" for head dims above 128, where the tf32x3
    tiles no longer fit in shared memory.
    """
    if dtype != torch.float32:
        return "tf32"
    if interpreting():
        return "ieee"
    return "tf32x3" if head_dim <= 128 else "tf32"


@triton.jit
def maybe_fp32(x, FP32_DOT: tl.constexpr):
    """The interpreter's tl.dot is wrong on bf16: compute in fp32 there (only there)."""
    if FP32_DOT:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def capped_tanh(qk, softcap_in):
    """``t = tanh(scale * qk / softcap)`` of raw dot products (SOFTCAP), the score being
    ``softcap * t``; ``softcap_in = 2 * log2(e) * scale / softcap``. Built from exp2 (no
    libdevice tanh on every Triton): ``tanh(x) = 1 - 2 / (e^(2x) + 1)``, exactly +-1
    where exp2 overflows or underflows. Each score pays one more exp2 and a reciprocal
    (two MUFU ops; the forward's main loop: status.md rows `fwd plain` and `fwd softcap`,
    D = 128, bench/sass_report.py)."""
    return 1.0 - 2.0 / (tl.math.exp2(qk * softcap_in) + 1.0)
