"""The Triton kernels' attention variants on a GPU (marked `gpu`; bench/gpu_check.sh's
`variant_tests` step): a sliding window, everything at once (a two-sided window, softcap,
sinks, v with its own head dim, GQA) and a window over packed documents, bf16 and fp32, in
both backward modes, against the float64 brute force of tests/helpers.py computed on the
CPU. The interpreter covers the same variants on CPU (test_triton_variants.py); here the
compiled code (wgmma tiles, the masked configs a window takes, exp2-built tanh) runs.
"""

import pytest
import torch
from helpers import brute_force_attention, param_id, randn, rel_err

from ulysses_kernels import env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or env.interpreting(),
                                 reason="needs a CUDA GPU and TRITON_INTERPRET unset/0")]

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}

# (name, B, S, Hq, Hkv, D, Dv, options): window_size in flash_attn's convention.
CASES = [
    ("sliding", 1, 2048, 8, 2, 128, 128, dict(causal=True, window_size=(255, -1))),
    ("combined", 2, 1000, 8, 2, 128, 64, dict(causal=False, window_size=(300, 40), softcap=30.0, sinks=True)),
    ("documents", 1, 1500, 4, 1, 64, 64, dict(causal=True, window_size=(100, -1), cu=[0, 300, 301, 1100, 1500])),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=param_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_variants_on_the_gpu_match_float64(case, dtype, deterministic):
    from ulysses_kernels.triton import flash_attention

    _, B, S, Hq, Hkv, D, Dv, options = case
    options = dict(options)
    shapes = [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, Dv), (B, S, Hq, Dv)]
    q, k, v, do = (randn(*s, seed=i + S) for i, s in enumerate(shapes))
    sinks = randn(Hq, seed=7) if options.pop("sinks", False) else None
    cu = options.pop("cu", None)
    cu = torch.tensor(cu, dtype=torch.int32) if cu else None
    want = brute_force_attention(q, k, v, do, cu_seqlens=cu, sinks=sinks, **options)

    device = torch.device("cuda")
    leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.to(device).requires_grad_() if sinks is not None else None
    out = flash_attention(*leaves, sinks=sink_leaf, deterministic=deterministic,
                          cu_seqlens=cu.to(device) if cu is not None else None, **options)
    out.backward(do.to(device, dtype))
    got = [out] + [t.grad for t in leaves] + ([sink_leaf.grad] if sinks is not None else [])
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert not torch.isnan(g).any(), name
        assert rel_err(g.float().cpu(), w) < TOL[dtype], (name, rel_err(g.float().cpu(), w))
