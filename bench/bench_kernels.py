"""Kernel microbenchmarks for pytest-benchmark (`pytest bench/`, see bench/pytest.ini).

Each case times one kernel on the GPU timeline (CUDA events) and records the bytes or
FLOPs it moves in `extra_info`, so a run's JSON gives GB/s and TFLOP/s and two runs
compare with `--benchmark-compare`. The baselines are measured the same way in the same
run: a device-to-device copy of the same bytes for the pack/unpack kernels, torch SDPA
(cuDNN and flash backends) for the attention. Random bf16 data, never zeros.

The throughput tables with ratios come from bench_a2a.py and bench_attention.py; these
cases are for tracking one kernel across commits.
"""

import math

import pytest
import torch

from ulysses_kernels import HeadPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPE = torch.bfloat16
LAYOUTS = {  # (P, B, S_local, Hq, Hkv, D), the P = 8 layouts of bench_a2a.py
    "gqa_split": (8, 1, 8192, 32, 8, 128),
    "gqa_replicated": (8, 1, 8192, 32, 2, 128),
}
ATTENTION = {"S8k_causal": (1, 8192, 32, 8, 128, True), "S16k_causal": (1, 16384, 32, 8, 128, True)}


def _rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def _fused_ops():
    from ulysses_kernels import fused
    from ulysses_kernels.fused import ops

    why = fused.problem(torch.device("cuda"), ())
    if why:
        pytest.skip(f"the fused path {why}")
    return ops


def _record(benchmark, **info):
    benchmark.extra_info.update(info)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_copy_baseline(benchmark, layout):
    P, B, Sp, Hq, Hkv, D = LAYOUTS[layout]
    n = P * B * Sp * HeadPlan(P, Hq, Hkv).channels * D
    src, dst = _rand(n), torch.empty(n, device="cuda", dtype=DTYPE)
    _record(benchmark, bytes=2 * n * src.element_size())
    benchmark(dst.copy_, src)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pack_qkv(benchmark, layout):
    ops = _fused_ops()
    P, B, Sp, Hq, Hkv, D = LAYOUTS[layout]
    heads = HeadPlan(P, Hq, Hkv)
    q, k, v = _rand(B, Sp, Hq, D), _rand(B, Sp, Hkv, D), _rand(B, Sp, Hkv, D)
    send = ops.pack([q, k, v], P)
    counts = [heads.local_q_heads, heads.local_kv_heads, heads.local_kv_heads]
    _record(benchmark, bytes=2 * send.numel() * send.element_size())
    benchmark(ops.pack_into, [q, k, v], send, [0, 0, 0], counts)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unpack_grads(benchmark, layout):
    ops = _fused_ops()
    P, B, Sp, Hq, Hkv, D = LAYOUTS[layout]
    heads = HeadPlan(P, Hq, Hkv)
    recv = _rand(P, B, Sp, heads.channels, D)
    outs = [torch.empty(B, Sp, h, D, device="cuda", dtype=DTYPE) for h in (Hq, Hkv, Hkv)]
    counts = [heads.local_q_heads, heads.local_kv_heads, heads.local_kv_heads]
    moved = recv.numel() + sum(o.numel() for o in outs)
    _record(benchmark, bytes=moved * recv.element_size())
    benchmark(ops.unpack_into, recv, outs, [0, 0, 0], counts)


def _attention_inputs(case):
    B, S, Hq, Hkv, D, causal = ATTENTION[case]
    q, k, v = _rand(B, S, Hq, D), _rand(B, S, Hkv, D), _rand(B, S, Hkv, D)
    flops = 4 * B * Hq * S * S * D * (0.5 if causal else 1.0)
    return q, k, v, causal, flops


@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_triton_attention_forward(benchmark, case):
    from ulysses_kernels.triton import flash_attention_forward

    q, k, v, causal, flops = _attention_inputs(case)
    out = torch.empty_like(q)
    _record(benchmark, flops=flops)
    benchmark(flash_attention_forward, q, k, v, causal=causal, softmax_scale=1 / math.sqrt(q.shape[-1]), out=out)


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_sdpa_forward_baseline(benchmark, case, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, causal, flops = _attention_inputs(case)
    group = q.shape[2] // k.shape[2]
    # SDPA's native layout [B, H, S, D], GQA expanded (what a caller of SDPA does).
    qt = q.transpose(1, 2).contiguous()
    kt, vt = (t.repeat_interleave(group, dim=2).transpose(1, 2).contiguous() for t in (k, v))
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    _record(benchmark, flops=flops)

    def run():
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    try:
        run()
    except RuntimeError as exc:
        pytest.skip(f"SDPA {backend} unavailable: {exc}")
    benchmark(run)
