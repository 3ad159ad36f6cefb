"""On a GPU (bench/gpu_check.sh runs it): every candidate installed there against float64
for every call class its capability table claims on that GPU, forward and backward, in
bfloat16 (the external runners' first real run: FlashAttention 2/3/4, torch varlen_attn,
compiled FlexAttention, SDPA pinned to cuDNN and flash), and the choice with the real timer
on one class. A candidate that is not installed is reported as skipped, never passed."""

import pytest
import torch
from helpers import brute_force_attention, make_qkv, rel_err
from test_candidates import CASES, _inputs

from ulysses_kernels import env, kernel_choice
from ulysses_kernels.variants import make_variant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or env.interpreting(),
                                                  reason="needs a CUDA GPU and TRITON_INTERPRET unset/0")]
GPU_CASES = {name: dict(spec, S=spec["S"] * 8, Sk=spec["Sk"] * 8 if spec.get("Sk") else None,
                        documents=tuple(8 * d for d in spec["documents"]) if spec.get("documents") else None,
                        D=max(64, spec["D"] * 4), Dv=spec["Dv"] * 4 if spec.get("Dv") else None)
             for name, spec in CASES.items()}


def _cuda_inputs(spec):
    q, k, v, do, cu, sinks = _inputs({k: v for k, v in spec.items() if v is not None}, dtype=torch.float32)
    move = lambda t: t.cuda().to(torch.bfloat16) if t is not None else None  # noqa: E731
    return move(q), move(k), move(v), move(do), cu.cuda() if cu is not None else None, \
        sinks.cuda() if sinks is not None else None


@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("name", [n for n in kernel_choice.CANDIDATES])
def test_installed_candidate_matches_float64_on_the_gpu(name, case):
    candidate = kernel_choice.CANDIDATES[name]
    ok, version = candidate.importable()
    if not ok:
        pytest.skip(f"{name} is not installed here: {version}")
    spec = GPU_CASES[case]
    q, k, v, do, cu, sinks = _cuda_inputs(spec)
    variant = make_variant(spec.get("window") or (-1, -1), spec.get("softcap") or 0.0,
                           causal=spec.get("causal", False))
    call = kernel_choice.call_of(q, k, v, causal=spec.get("causal", False), packed=cu is not None, variant=variant,
                                 sinks=sinks is not None, grad=True)
    why = kernel_choice.excluded(candidate.table(), call)
    if why:
        pytest.skip(f"{name} does not claim {case}: {why}")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_(True) if sinks is not None else None
    out = kernel_choice.run(name, *leaves, causal=spec.get("causal", False), softmax_scale=spec.get("scale"),
                            cu_seqlens=cu, variant=variant, sinks=sink_leaf)
    out.backward(do)
    want = brute_force_attention(q.cpu(), k.cpu(), v.cpu(), do.cpu(), causal=spec.get("causal", False),
                                 cu_seqlens=cu.cpu() if cu is not None else None,
                                 window_size=spec.get("window") or (-1, -1), softcap=spec.get("softcap") or 0.0,
                                 sinks=sinks.cpu() if sinks is not None else None, softmax_scale=spec.get("scale"))
    for label, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], want):
        assert got.dtype == torch.bfloat16 and rel_err(got.float().cpu(), ref) < 2e-2, (name, case, label)


def test_the_choice_times_on_the_gpu(tmp_path, monkeypatch):
    """The real timer on a plain bf16 class: every eligible candidate timed, the fastest
    chosen, the timings cached on disk and reused."""
    monkeypatch.setenv(env.CACHE_DIR.name, str(tmp_path))
    monkeypatch.delenv(env.ATTENTION.name, raising=False)
    kernel_choice.clear_memory_cache()
    q, k, v, _ = make_qkv(1, 2048, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    call = kernel_choice.call_of(q, k, v, causal=True, grad=True)
    decision = kernel_choice.choose(call, device=q.device)
    assert decision.how == "timed" and set(decision.ms) <= set(decision.eligible)
    assert decision.choice == min(decision.ms, key=decision.ms.get)
    kernel_choice.clear_memory_cache()
    assert kernel_choice.choose(call, device=q.device).how == "cached"
